"""One machine visit's benchmark table, in as many calls as the machine's limit per command needs.

    python benchmarks/visit_table.py --out /tmp/visit --seconds 580 --commit abc1234 \
        --flashkda-build "cd /tmp/FlashKDA && python3 setup.py build_ext --inplace" --flashkda-path /tmp/FlashKDA \
        --flashkda-source "commit <FlashKDA's commit>, sm_90a"

with the jax_kda wheel to time installed and first on PYTHONPATH (as `tests/run_gpu.sh` does). Run the
same command again, in the same visit, until it prints "table complete" (exit status 0; 3 while
something is left): each call does what is left, in this order, and stops before `--seconds` have
passed (OUT must outlive the calls: on a machine that returns only a folder, copy OUT there after each
call):

1. FLA (`bench_prefill.py --peers-only`) on the cases that no earlier call's FLA run has, while
   FlashKDA builds in the background (`--flashkda-build`, a shell command; skipped once `flash_kda`
   imports from `--flashkda-path`), for at most `--fla-first` seconds: FLA's autotuning (50-100 s per
   group of cases) overlaps the build. The build loads the host's CPUs; FLA's figure in the table is
   its GPU busy time where that is its least (bench_prefill), which host load does not stretch.
2. The main run (`bench_prefill.py --no-fla --xla`: jax_kda, FlashKDA in the same process, the XLA
   path, every case) into OUT/main, if no call has completed it. It is started only with at least
   `--main-seconds` left; a run cut short is done again whole by the next call, so that the table
   stays one run.
3. FLA on the cases still missing, with the time left.
4. The merge (`bench_prefill.py --redraw --peer-results ...`): OUT/main's table and the report
   (`--report`, default OUT/BENCHMARK.md) with every FLA run's rows.

FLA's rows are merged only from runs of the same build, GPU and day (bench_prefill's checks), so every
call of one table belongs to one machine visit. To commit the table, copy OUT/main to
benchmarks/results/<gpu>/ and OUT/fla_*/peers.json beside it, and draw the report there with the
`--redraw --peer-results` command this script prints last.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MARGIN_S = 20  # kept back from every step for the steps after it (the merge takes a few seconds)


def rows_of(path: pathlib.Path) -> list[dict]:
    """The rows of a results.json or peers.json; none where the file is missing or unreadable (a run
    killed while writing it)."""
    try:
        return json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return []


def fla_runs(out: pathlib.Path) -> list[pathlib.Path]:
    """The peers.json of every FLA run so far, in the order they ran."""
    return sorted(out.glob("fla_*/peers.json"), key=lambda p: int(p.parent.name.removeprefix("fla_")))


def fla_cases_left(out: pathlib.Path, cases: list[str]) -> list[str]:
    done = {r["case"] for path in fla_runs(out) for r in rows_of(path)}
    return [c for c in cases if c not in done]


def main_complete(out: pathlib.Path, cases: list[str]) -> bool:
    return {r["case"] for r in rows_of(out / "main" / "results.json")} >= set(cases)


class Visit:
    def __init__(self, args):
        self.args = args
        self.deadline = time.monotonic() + args.seconds
        self.out = args.out
        self.cases = args.cases.split(",")
        self.log = []
        fla = args.fla is not False and self.imports("fla")
        if args.fla and not fla:
            raise SystemExit("--fla: fla does not import (pip install fla-core)")
        if not fla:
            self.say("FLA not timed" + (" (--no-fla)" if args.fla is False else ": fla does not import"))
        self.fla_cases = self.cases if fla else []


    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, line: str):
        print(line, flush=True)
        self.log.append(line)

    def bench(self, name: str, extra: list[str], seconds: float, env: dict | None = None) -> int:
        """One bench_prefill.py run, its output into OUT/NAME.log; its exit status (124: cut at `seconds`)."""
        cmd = [sys.executable, str(self.args.bench)] + extra
        start = time.monotonic()
        with open(self.out / f"{name}.log", "w") as log:
            log.write("$ " + shlex.join(cmd) + "\n")
            log.flush()
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    timeout=max(seconds, 1)).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        self.say(f"{name}: rc {rc} in {time.monotonic() - start:.0f} s")
        if rc not in (0, 124):  # failed, not cut short: running it again would fail again
            raise SystemExit(f"{name} failed (exit status {rc}): {self.out / f'{name}.log'}")
        return rc

    def fla(self, seconds: float) -> None:
        left = fla_cases_left(self.out, self.fla_cases)
        if not left or seconds < self.args.fla_min:
            return
        n = len(fla_runs(self.out)) + 1
        while (self.out / f"fla_{n}").exists():
            n += 1
        self.bench(f"fla_{n}", ["--peers-only", "--no-flashkda", "--reps", str(self.args.reps), "--commit",
                                self.args.commit, "--cases", ",".join(left), "--out", str(self.out / f"fla_{n}")],
                   seconds)
        self.say(f"FLA: {len(fla_cases_left(self.out, self.fla_cases))} of {len(self.fla_cases)} cases left")

    def flashkda_env(self) -> dict:
        env = dict(os.environ)
        if self.args.flashkda_path:
            paths = (env.get("PYTHONPATH"), str(self.args.flashkda_path))
            env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        return env

    def imports(self, module: str, env: dict | None = None) -> bool:
        return subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True).returncode == 0

    def run(self) -> bool:
        self.out.mkdir(parents=True, exist_ok=True)
        build = None
        if (not main_complete(self.out, self.cases) and self.args.flashkda_build
                and not self.imports("flash_kda", self.flashkda_env())):
            self.say(f"FlashKDA: building ({self.args.flashkda_build})")
            with open(self.out / "flashkda_build.log", "w") as log:
                build = subprocess.Popen(self.args.flashkda_build, shell=True, stdout=log, stderr=subprocess.STDOUT)
        self.fla(min(self.args.fla_first, self.left() - MARGIN_S) if build else 0)
        if build:
            rc = build.wait()
            self.say(f"FlashKDA build: rc {rc}")
            if rc:
                raise SystemExit(f"the FlashKDA build failed: {self.out / 'flashkda_build.log'}")
        if not main_complete(self.out, self.cases):
            if self.left() - MARGIN_S < self.args.main_seconds:
                self.say(f"main run: not started, {self.left():.0f} s left (--main-seconds {self.args.main_seconds})")
            else:
                extra = ["--no-fla", "--reps", str(self.args.reps), "--commit", self.args.commit, "--cases",
                         self.args.cases, "--out", str(self.out / "main")] + (["--xla"] if self.args.xla else [])
                extra += ["--flashkda"] if self.args.flashkda_build or self.args.flashkda_path else []
                extra += ["--flashkda-source", self.args.flashkda_source] if self.args.flashkda_source else []
                self.bench("main", extra, self.left() - MARGIN_S, env=self.flashkda_env())
        self.fla(self.left() - MARGIN_S)
        complete = main_complete(self.out, self.cases)
        left = fla_cases_left(self.out, self.fla_cases)
        if complete:
            merge = ["--redraw", "--out", str(self.out / "main"), "--report", str(self.args.report)]
            for path in fla_runs(self.out):
                if rows_of(path):
                    merge += ["--peer-results", str(path)]
            self.bench("merge", merge, max(self.left(), 60))
            self.say("merged: " + shlex.join(["python", "benchmarks/bench_prefill.py"] + merge))
        self.say(("table complete" if complete and not left else "table not complete: run again") +
                 f" (main run {'done' if complete else 'not done'}; FLA missing {len(left)}: {','.join(left) or '-'})")
        return complete and not left


def main():
    from harness import COMMIT_ENV
    from jax_kda.testing import BENCHMARK_CASES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the visit's folder (same in every call)")
    parser.add_argument("--seconds", type=float, default=580, help="stop before this many seconds (default 580)")
    parser.add_argument("--cases", default=",".join(BENCHMARK_CASES))
    parser.add_argument("--commit", default=os.environ.get(COMMIT_ENV, "unknown"),
                        help=f"the build's commit (default ${COMMIT_ENV})")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--xla", action=argparse.BooleanOptionalAction, default=True, help="time the XLA path too")
    parser.add_argument("--flashkda-build", help="shell command that builds FlashKDA (run in the background)")
    parser.add_argument("--flashkda-path", type=pathlib.Path, help="folder flash_kda imports from once built")
    parser.add_argument("--flashkda-source", help="which FlashKDA source is built (bench_prefill's --flashkda-source)")
    parser.add_argument("--fla", action=argparse.BooleanOptionalAction, default=None,
                        help="time FLA (default: when fla imports)")
    parser.add_argument("--fla-first", type=float, default=170,
                        help="seconds of FLA while FlashKDA builds (default 170, about its build)")
    parser.add_argument("--fla-min", type=float, default=40, help="no FLA run with less time than this")
    parser.add_argument("--main-seconds", type=float, default=320,
                        help="start the main run only with this many seconds left (default 320)")
    parser.add_argument("--report", type=pathlib.Path, help="the report (default OUT/BENCHMARK.md)")
    parser.add_argument("--bench", type=pathlib.Path, default=HERE / "bench_prefill.py", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.report = args.report or args.out / "BENCHMARK.md"
    sys.exit(0 if Visit(args).run() else 3)


if __name__ == "__main__":
    main()
