"""Alternating A/B runs of jax_kda builds on one GPU, written to one text file.

    python benchmarks/ab.py --build main=dist_main/jax_kda-0.1.0-cp312-abi3-linux_x86_64.whl \\
        --build exp=dist_exp/jax_kda-0.1.0-cp312-abi3-linux_x86_64.whl \\
        --cases h96_fixed8k,h32_128x128 --rounds 2 \\
        --predict "prepare 3-6 % faster everywhere, the recurrence unchanged" \\
        --out benchmarks/results/h200/my_change_ab.txt

Each build is a wheel. It is installed with pip into its own directory (no dependencies: jax and the
rest come from the environment) and put first on the PYTHONPATH of its runs. The runs alternate
(main, exp, main, exp, ...): a drift of the GPU's clocks or temperature then shows up as a difference
between rounds, not between builds. Each run is `bench_prefill.py --no-fla --no-flashkda` on the
cases, so the times are device times as in the benchmark table (CUPTI span over K back-to-back calls
on distinct input sets). Write the prediction before the runs: the file keeps it above the results.

The file lists, per run, each case's time per call and its prepare and recurrence times (and the
combine kernel's, where the plan is segmented), in µs, and the SM clock nvidia-smi reported during
its profiled runs (median and lowest busy sample, and any throttle reason), and ends with each
build's median over its rounds. It is rewritten after every run, so an A/B cut short (a time limit)
keeps the runs it finished.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent


def parse_build(text: str) -> tuple[str, pathlib.Path]:
    """`NAME=WHEEL` -> (name, wheel path)."""
    name, sep, wheel = text.partition("=")
    if not sep or not name or not wheel:
        raise argparse.ArgumentTypeError(f"--build takes NAME=WHEEL, got {text!r}")
    if not name.replace("_", "").replace("-", "").isalnum():
        raise argparse.ArgumentTypeError(f"build name {name!r}: letters, digits, '-' and '_' only")
    return name, pathlib.Path(wheel)


def install(wheel: pathlib.Path, target: pathlib.Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                    str(target), str(wheel)], check=True)


def site_env(site: pathlib.Path) -> dict:
    """The environment of a run of the build installed in `site`: it first on the PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(site)] + ([os.environ["PYTHONPATH"]]
                                                                        if os.environ.get("PYTHONPATH") else [])))


def run_bench(site: pathlib.Path, name: str, cases: str, reps: int, out_dir: pathlib.Path,
              log: pathlib.Path, timeout_s: float) -> list[dict]:
    """One bench_prefill.py run of the build installed in `site`; its result rows."""
    env = site_env(site)
    command = [sys.executable, str(HERE / "bench_prefill.py"), "--no-fla", "--no-flashkda", "--reps", str(reps),
               "--cases", cases, "--commit", name, "--out", str(out_dir)]
    with open(log, "w") as f:
        subprocess.run(command, env=env, stdout=f, stderr=subprocess.STDOUT, check=True, timeout=timeout_s,
                       cwd=tempfile.gettempdir())  # not the checkout: the installed build, not the sources
    return json.loads((out_dir / "results.json").read_text())["rows"]


def row_times(row: dict) -> dict:
    """A result row's call time and per-kernel times (µs), None where not measured."""
    kernels = row.get("kernels") or {}
    segmented = (row.get("plan") or {}).get("num_segments", 1) > 1
    return {"call": row.get("jax_kda_us"), "prepare": kernels.get("prepare"),
            "recurrence": kernels.get("recurrence"), "combine": kernels.get("combine") if segmented else None}


def _median(times: list[dict], key: str):
    values = [t[key] for t in times if t[key] is not None]
    return statistics.median(values) if values else None


def _us(value) -> str:
    return "—" if value is None else f"{value:.0f}"


def render(header: dict, runs: list[tuple[str, int, list[dict]]]) -> str:
    """The A/B file: the header, then each run's rows, then each build's medians per case."""
    lines = [f"# A/B of jax_kda builds, {header['date']}, {header['device']}: "
             + ", ".join(f"{name} = {wheel}" for name, wheel in header["builds"]),
             f"# runs alternate {', '.join(name for name, _, _ in runs)}, each:",
             f"# python benchmarks/bench_prefill.py --no-fla --no-flashkda --reps {header['reps']} "
             f"--cases {header['cases']}",
             "# columns: case | jax_kda µs (device time; wall time where none can be taken) | prepare µs | "
             "recurrence µs [| combine µs] [| SM clock during the profiled runs: median (lowest) MHz]",
             f"# Prediction before the runs: {header['prediction'] or '(none given)'}", ""]
    per_build: dict[str, dict[str, list[dict]]] = {}
    for name, round_no, rows in runs:
        lines.append(f"== {name}{round_no}")
        for row in rows:
            t = row_times(row)
            cols = [t["call"], t["prepare"], t["recurrence"]] + ([t["combine"]] if t["combine"] is not None else [])
            clock = row.get("jax_kda_clock") or {}
            cells = [_us(v) for v in cols]
            if clock.get("sm_mhz_median") is not None:
                cells.append(f"{clock['sm_mhz_median']:.0f} ({clock['sm_mhz_min']:.0f}) MHz"
                             + "".join(f", {reason}" for reason in clock.get("reasons", [])))
            lines.append(f" {row['case']} | " + " | ".join(cells))
            per_build.setdefault(name, {}).setdefault(row["case"], []).append(t)
    lines += ["", "## median over rounds: case | " + " | ".join(per_build) + "  (call / prepare / recurrence µs)"]
    cases = list(dict.fromkeys(row["case"] for _, _, rows in runs for row in rows))
    for case in cases:
        cells = [" / ".join(_us(_median(per_build[name].get(case, []), key)) for key in ("call", "prepare", "recurrence"))
                 for name in per_build]
        lines.append(f" {case} | " + " | ".join(cells))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--build", type=parse_build, action="append", required=True,
                        help="NAME=WHEEL, twice or more; the runs alternate in this order")
    parser.add_argument("--cases", required=True, help="comma-separated jax_kda.testing.BENCHMARK_CASES names")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3, help="bench_prefill.py --reps (wall-time repetitions)")
    parser.add_argument("--predict", default="", help="the prediction, written before the runs")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the A/B text file to write")
    args = parser.parse_args()
    names = [name for name, _ in args.build]
    if len(args.build) < 2 or len(set(names)) != len(names):
        parser.error("give two or more --build entries with distinct names")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    for _, wheel in args.build:
        if not wheel.is_file():
            parser.error(f"no wheel at {wheel}")

    with tempfile.TemporaryDirectory(prefix="jax_kda_ab_") as tmp:
        work = pathlib.Path(tmp)
        sites = {}
        for name, wheel in args.build:
            sites[name] = work / f"site_{name}"
            install(wheel, sites[name])
        runs, device = [], "unknown GPU"
        args.out.parent.mkdir(parents=True, exist_ok=True)

        def write():  # after every run, so that a cut-short A/B keeps the runs it finished
            header = dict(date=datetime.date.today().isoformat(), device=device, reps=args.reps, cases=args.cases,
                          prediction=args.predict, builds=[(name, str(wheel)) for name, wheel in args.build])
            args.out.write_text(render(header, runs))

        for round_no in range(1, args.rounds + 1):
            for name in names:
                out_dir = work / f"{name}{round_no}"
                log = work / f"{name}{round_no}.log"
                try:
                    rows = run_bench(sites[name], name, args.cases, args.reps, out_dir, log, args.timeout)
                except subprocess.SubprocessError:
                    sys.stderr.write(log.read_text()[-4000:] if log.exists() else "")
                    raise
                device = json.loads((out_dir / "results.json").read_text()).get("device", device)
                runs.append((name, round_no, rows))
                write()
                print(f"== {name} round {round_no}: "
                      + ", ".join(f"{r['case']} {_us(r.get('jax_kda_us'))} µs" for r in rows), flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
