"""benchmarks/visit_table.py, one visit's table over several calls, against a stand-in bench_prefill.py
(no GPU): which runs each call starts, what the next call still does, and the merge's arguments."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "visit_table.py"

# Writes the files bench_prefill.py would: a peers-only run only $FAKE_FLA_PER_RUN of its cases (as if
# its time ran out), a main run all of them unless $FAKE_MAIN_CUT; every call's arguments and whether
# flash_kda imports go to $FAKE_LOG.
FAKE = r"""
import json, os, pathlib, sys
argv = sys.argv[1:]
def value(flag):
    return argv[argv.index(flag) + 1] if flag in argv else None
try:
    import flash_kda  # noqa: F401
    fk = True
except ImportError:
    fk = False
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps({"argv": argv, "flash_kda": fk}) + "\n")
if "--redraw" in argv:
    sys.exit(0)
if os.environ.get("FAKE_FAIL") and "--peers-only" not in argv:
    sys.exit(1)
out = pathlib.Path(value("--out")); out.mkdir(parents=True, exist_ok=True)
cases = value("--cases").split(",")
if "--peers-only" in argv:
    rows = [{"case": c} for c in cases[:int(os.environ["FAKE_FLA_PER_RUN"])]]
    (out / "peers.json").write_text(json.dumps({"meta": {}, "rows": rows}))
else:
    rows = [{"case": c} for c in cases[:-1 if os.environ.get("FAKE_MAIN_CUT") else None]]
    (out / "results.json").write_text(json.dumps({"rows": rows}))
"""

CASES = "h96_fixed8k,h96_mixed,h64_fixed8k,h32_128x128,h12_fixed8k"


def _visit(tmp_path, *extra, per_run=2, main_cut=False, fla=True, fail=False):
    fake = tmp_path / "fake_bench.py"
    fake.write_text(FAKE)
    log = tmp_path / "calls.jsonl"
    log.unlink(missing_ok=True)
    modules = tmp_path / "modules"  # a stand-in `fla` package: FLA is timed where it imports
    modules.mkdir(exist_ok=True)
    (modules / "fla.py").unlink(missing_ok=True)
    if fla:
        (modules / "fla.py").write_text("")
    path = os.pathsep.join(p for p in (str(modules), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, FAKE_LOG=str(log), FAKE_FLA_PER_RUN=str(per_run), PYTHONPATH=path)
    env.pop("FAKE_MAIN_CUT", None)
    env.pop("FAKE_FAIL", None)
    if fail:
        env["FAKE_FAIL"] = "1"
    if main_cut:
        env["FAKE_MAIN_CUT"] = "1"
    cmd = [sys.executable, str(SCRIPT), "--bench", str(fake), "--out", str(tmp_path / "visit"), "--cases", CASES,
           "--commit", "abc1234", "--seconds", "200", "--fla-first", "60", "--main-seconds", "1", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def _kind(call):
    argv = call["argv"]
    return "merge" if "--redraw" in argv else "fla" if "--peers-only" in argv else "main"


def _value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_a_visit_in_two_calls_builds_flashkda_once_runs_the_main_run_once_and_fla_on_what_is_left(tmp_path):
    fk = tmp_path / "fk"
    build = f"mkdir -p {fk} && echo 'x = 1' > {fk}/flash_kda.py"
    proc, calls = _visit(tmp_path, "--flashkda-build", build, "--flashkda-path", str(fk))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert [_kind(c) for c in calls] == ["fla", "main", "fla", "merge"], calls
    assert _value(calls[0]["argv"], "--cases") == CASES               # FLA first, on every case
    main = calls[1]
    assert main["flash_kda"] and "--flashkda" in main["argv"] and "--xla" in main["argv"]
    assert _value(main["argv"], "--cases") == CASES and "--no-fla" in main["argv"]
    assert _value(calls[2]["argv"], "--cases") == "h64_fixed8k,h32_128x128,h12_fixed8k"
    merge = calls[3]["argv"]
    assert [_value(merge[i:], "--peer-results") for i, a in enumerate(merge) if a == "--peer-results"] == [
        str(tmp_path / "visit" / "fla_1" / "peers.json"), str(tmp_path / "visit" / "fla_2" / "peers.json")]
    assert "table not complete: run again" in proc.stdout and "FLA missing 1: h12_fixed8k" in proc.stdout

    # The second call: the main run is done, FlashKDA is not built again, FLA takes the last case.
    proc, calls = _visit(tmp_path, "--flashkda-build", "exit 1", "--flashkda-path", str(fk))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [_kind(c) for c in calls] == ["fla", "merge"], calls
    assert _value(calls[0]["argv"], "--cases") == "h12_fixed8k"
    assert calls[0]["argv"][calls[0]["argv"].index("--out") + 1].endswith("fla_3")
    assert calls[1]["argv"].count("--peer-results") == 3
    assert "table complete" in proc.stdout


def test_a_main_run_cut_short_is_not_merged_and_runs_again_whole(tmp_path):
    proc, calls = _visit(tmp_path, "--no-xla", per_run=5, main_cut=True)
    assert proc.returncode == 3
    # No FlashKDA build asked for: the main run comes first; FLA after it finished every case.
    assert [_kind(c) for c in calls] == ["main", "fla"], calls
    assert "--xla" not in calls[0]["argv"]
    assert "main run not done" in proc.stdout
    proc, calls = _visit(tmp_path, per_run=5)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [_kind(c) for c in calls] == ["main", "merge"], calls
    assert _value(calls[0]["argv"], "--cases") == CASES


def test_a_failed_flashkda_build_stops_the_call(tmp_path):
    proc, calls = _visit(tmp_path, "--flashkda-build", "exit 7", "--flashkda-path", str(tmp_path / "none"))
    assert proc.returncode != 0 and "the FlashKDA build failed" in proc.stderr
    assert [_kind(c) for c in calls] == ["fla"], calls


def test_without_fla_the_main_run_alone_completes_the_table(tmp_path):
    proc, calls = _visit(tmp_path, fla=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [_kind(c) for c in calls] == ["main", "merge"], calls
    assert "--peer-results" not in calls[1]["argv"]
    assert "FLA not timed: fla does not import" in proc.stdout and "table complete" in proc.stdout
    proc, calls = _visit(tmp_path, "--fla", fla=False)
    assert proc.returncode != 0 and "--fla: fla does not import" in proc.stderr and not calls


def test_a_failed_main_run_stops_the_call(tmp_path):
    proc, calls = _visit(tmp_path, fail=True)
    assert proc.returncode not in (0, 3) and "main failed (exit status 1)" in proc.stderr
    assert [_kind(c) for c in calls] == ["main"], calls
