"""tests/steps.sh, the steps of the GPU scripts (run_gpu.sh, run_multi_gpu.sh), against a stand-in
compute-sanitizer, so they are tested without a GPU: a sanitizer run that stops without its summary
line is run once more, and a run with a summary (findings or none) decides at once."""

from __future__ import annotations

import os
import pathlib
import stat
import subprocess

import pytest

STEPS = pathlib.Path(__file__).resolve().parent / "steps.sh"

# A stand-in compute-sanitizer: its behaviour on call n (1, 2, ...) is word n of $FAKE_RUNS: "clean"
# (summary, exit 0), "finding" (summary with errors, exit 1), "crash" (no summary, exit 139) or
# "broken" (it never starts: no banner, exit 127).
FAKE = """#!/usr/bin/env bash
n=$(( $(cat "$FAKE_COUNT" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$FAKE_COUNT"
set -- $FAKE_RUNS; shift $(( n - 1 ))
[ "$1" = broken ] && { echo "error while loading shared libraries"; exit 127; }
echo "========= COMPUTE-SANITIZER"; echo "case 1: ran"
case "$1" in
  clean) echo "========= ERROR SUMMARY: 0 errors"; exit 0 ;;
  finding) echo "========= Invalid __global__ read of size 4"; echo "========= ERROR SUMMARY: 1 error"; exit 1 ;;
  crash) exit 139 ;;
esac
"""


def _sanitize(tmp_path: pathlib.Path, runs: str) -> tuple[int, int, str]:
    """(status after `sanitize memcheck`, how many times the tool ran, what the step printed)."""
    bin_dir, logs = tmp_path / "bin", tmp_path / "logs"
    bin_dir.mkdir()
    logs.mkdir()
    tool = bin_dir / "compute-sanitizer"
    tool.write_text(FAKE)
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_RUNS=runs,
               FAKE_COUNT=str(tmp_path / "count"))
    script = f'logs={logs}; status=0; source {STEPS}; sanitize memcheck --error-exitcode 1 true; echo "status=$status"'
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    status = int(out.strip().splitlines()[-1].removeprefix("status="))
    return status, int((tmp_path / "count").read_text()), out


@pytest.mark.parametrize("runs, status, calls", [
    ("clean", 0, 1),            # no findings: once
    ("finding", 1, 1),          # a finding is a failure, never rerun
    ("crash clean", 0, 2),      # the tool stopped: once more, and the clean rerun decides
    ("crash finding", 1, 2),    # ... or the rerun's finding
    ("crash crash", 1, 2),      # stopped twice: a failure, no third run
    ("broken", 1, 1),           # never started (no banner): nothing a rerun would change
])
def test_sanitize_reruns_only_a_run_the_tool_did_not_complete(tmp_path, runs, status, calls):
    got_status, got_calls, out = _sanitize(tmp_path, runs)
    assert (got_status, got_calls) == (status, calls), out
    logs = tmp_path / "logs"
    assert (logs / "sanitizer-memcheck.log").is_file()
    incomplete = logs / "sanitizer-memcheck.incomplete.log"
    assert incomplete.is_file() == runs.startswith("crash"), out
    if runs.startswith("crash"):
        assert "stopped without its summary" in out and "SUMMARY" not in incomplete.read_text()


def test_step_records_a_failure_and_keeps_going(tmp_path):
    script = f'logs={tmp_path}; status=0; source {STEPS}; step a false; step b true; echo "status=$status"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert "== a\n   FAILED" in out and "== b\n   ok" in out and out.strip().endswith("status=1")


def test_two_wheels_are_refused_before_anything_is_installed(tmp_path):
    """`run_gpu.sh dist/jax_kda-*.whl` after build/wheel.sh expands to two wheels: the second must
    not be taken for the log folder."""
    steps = STEPS.parent / "gpu_steps.sh"
    wheels = [str(tmp_path / "jax_kda-0.1.0-cp312-abi3-manylinux_2_34_x86_64.whl"),
              str(tmp_path / "jax_kda-0.1.0-py3-none-any.whl")]
    run = subprocess.run(["bash", "-c", f'source {steps} "$@"; echo installed', "run_gpu.sh", *wheels],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2 and "installed" not in run.stdout, run
    assert "got two wheels" in run.stderr and "linux" in run.stderr
    assert not any(tmp_path.glob("*.whl/"))  # no log folder made from a wheel's name


@pytest.mark.parametrize("steps, ran", [
    (None, "tests memcheck racecheck demo"),  # unset: every step
    ("memcheck demo", "memcheck demo"),
    ("demo  tests", "tests demo"),           # the script's order, whatever the variable's
])
def test_gpu_steps_selects_steps(steps, ran):
    env = {k: v for k, v in os.environ.items() if k != "GPU_STEPS"}
    if steps is not None:
        env["GPU_STEPS"] = steps
    script = (f"source {STEPS}; wanted_steps tests memcheck racecheck demo || exit 9; "
              "for s in tests memcheck racecheck demo; do wanted $s && echo $s; done")
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ran.split()


def test_an_unknown_gpu_step_is_refused_before_anything_runs(tmp_path):
    """A misspelt step would otherwise run nothing and pass: run_gpu.sh exits 2 before it installs."""
    run = subprocess.run(["bash", str(STEPS.parent / "run_gpu.sh"), str(tmp_path / "jax_kda.whl")],
                         env=dict(os.environ, GPU_STEPS="tests racechek"), capture_output=True, text=True,
                         cwd=tmp_path)
    assert run.returncode == 2 and "unknown step 'racechek'" in run.stderr, run
    assert not (tmp_path / "gpu-logs").exists()


def test_checkout_paths_are_made_absolute():
    script = f'here=/checkout; source {STEPS}; checkout_paths "tests/a.py tests"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["/checkout/tests/a.py", "/checkout/tests"]
