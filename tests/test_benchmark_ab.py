"""benchmarks/ab.py, the alternating A/B runner: its argument parsing and the file it writes (the
runs themselves need a GPU)."""

import argparse
import importlib.util
import pathlib

import pytest

_spec = importlib.util.spec_from_file_location(
    "ab", pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "ab.py")
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)


def test_build_argument():
    assert ab.parse_build("exp-2=dist/x.whl") == ("exp-2", pathlib.Path("dist/x.whl"))
    for bad in ("dist/x.whl", "=x.whl", "main=", "a b=x.whl"):
        with pytest.raises(argparse.ArgumentTypeError):
            ab.parse_build(bad)


def _row(case, call, prepare, recurrence, combine=None, segments=1):
    kernels = None if prepare is None else dict(prepare=prepare, recurrence=recurrence, combine=combine or 0.0, other=0.0)
    return dict(case=case, jax_kda_us=call, kernels=kernels, plan=dict(num_segments=segments))


def test_render_lists_every_run_and_the_medians():
    runs = [("main", 1, [_row("h96", 903.2, 476.4, 426.6), _row("h32_32k", 1750, 679, 1040, 24.6, 4)]),
            ("exp", 1, [_row("h96", 890.0, 460.0, 427.0), _row("h32_32k", 1700, 633, 1041, 24.4, 4)]),
            ("main", 2, [_row("h96", 905.0, 477.0, 427.0), _row("h32_32k", 1752, 680, 1041, 25.0, 4)]),
            ("exp", 2, [_row("h96", 888.0, 458.0, 426.0), _row("h32_32k", None, None, None)])]
    header = dict(date="2026-12-01", device="NVIDIA H200", reps=3, cases="h96,h32_32k", prediction="exp 3 % faster",
                  builds=[("main", "a.whl"), ("exp", "b.whl")])
    text = ab.render(header, runs)
    lines = text.splitlines()
    assert lines[0] == "# A/B of jax_kda builds, 2026-12-01, NVIDIA H200: main = a.whl, exp = b.whl"
    assert "# Prediction before the runs: exp 3 % faster" in lines
    assert [line for line in lines if line.startswith("== ")] == ["== main1", "== exp1", "== main2", "== exp2"]
    # A run's rows in order; the combine column only where the plan is segmented; a missing time as a dash.
    first = lines.index("== main1")
    assert lines[first + 1:first + 3] == [" h96 | 903 | 476 | 427", " h32_32k | 1750 | 679 | 1040 | 25"]
    assert lines[lines.index("== exp2") + 2] == " h32_32k | — | — | —"
    # Medians per build over its rounds (missing values left out).
    assert " h96 | 904 / 477 / 427 | 889 / 459 / 426" in lines
    assert " h32_32k | 1751 / 680 / 1040 | 1700 / 633 / 1041" in lines


def test_render_shows_the_clock_where_one_was_sampled():
    clocked = _row("h96", 903.2, 476.4, 426.6)
    clocked["jax_kda_clock"] = dict(samples=9, busy_samples=7, sm_mhz_median=1980.0, sm_mhz_min=1965.0,
                                    power_w_max=512.0, reasons=["software power cap"])
    runs = [("main", 1, [clocked]), ("exp", 1, [_row("h96", 890.0, 460.0, 427.0)])]
    header = dict(date="2026-12-01", device="NVIDIA H200", reps=3, cases="h96", prediction="",
                  builds=[("main", "a.whl"), ("exp", "b.whl")])
    lines = ab.render(header, runs).splitlines()
    assert lines[lines.index("== main1") + 1] == " h96 | 903 | 476 | 427 | 1980 (1965) MHz, software power cap"
    assert lines[lines.index("== exp1") + 1] == " h96 | 890 | 460 | 427"


def test_a_cut_short_ab_keeps_the_runs_it_finished(tmp_path, monkeypatch):
    wheels = []
    for name in ("a", "b"):
        wheels.append(tmp_path / f"{name}.whl")
        wheels[-1].write_bytes(b"")
    out = tmp_path / "ab.txt"
    calls = []

    def run_bench(site, name, cases, reps, out_dir, log, timeout_s):
        calls.append(name)
        if len(calls) == 3:
            raise ab.subprocess.TimeoutExpired("bench_prefill.py", timeout_s)
        out_dir.mkdir(parents=True)
        (out_dir / "results.json").write_text('{"device": "NVIDIA H200"}')
        return [_row("h96", 900.0 + len(calls), 470.0, 430.0)]

    monkeypatch.setattr(ab, "install", lambda wheel, target: None)
    monkeypatch.setattr(ab, "run_bench", run_bench)
    monkeypatch.setattr(ab.sys, "argv", ["ab.py", "--build", f"a={wheels[0]}", "--build", f"b={wheels[1]}",
                                         "--cases", "h96", "--rounds", "2", "--out", str(out)])
    with pytest.raises(ab.subprocess.TimeoutExpired):
        ab.main()
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# A/B of jax_kda builds, ") and "NVIDIA H200" in lines[0]
    assert [line for line in lines if line.startswith("== ")] == ["== a1", "== b1"]
    assert " h96 | 901 | 470 | 430" in lines and " h96 | 902 | 470 | 430" in lines
