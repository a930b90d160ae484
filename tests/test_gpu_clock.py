"""benchmarks/gpu_clock.py: reading nvidia-smi's samples and facts (the sampling itself runs against a
stand-in nvidia-smi, so it is tested without a GPU)."""

import importlib.util
import os
import pathlib
import stat
import sys

_path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_clock.py"
_spec = importlib.util.spec_from_file_location("gpu_clock", _path)
gpu_clock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_clock)


def test_reason_names():
    assert gpu_clock.reason_names(0) == []
    assert gpu_clock.reason_names(0x5) == ["idle", "software power cap"]
    assert gpu_clock.reason_names(0x1000 | 0x40) == ["hardware thermal slowdown", "0x1000"]


def test_parse_sample():
    assert gpu_clock.parse_sample("1980, 121.25, 0x0000000000000000") == (1980.0, 121.25, 0)
    assert gpu_clock.parse_sample("1965, [N/A], 0x0000000000000004") == (1965.0, None, 4)
    for bad in ("clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active", "[N/A], 1, 0x0",
                "Failed to initialize NVML: Unknown Error", ""):
        assert gpu_clock.parse_sample(bad) is None


def test_summary_keeps_idle_samples_out_of_the_clock():
    lines = ["345, 80.0, 0x0000000000000001",  # idle: counted, but not in the clock figures
             "1980, 400.5, 0x0000000000000000",
             "1965, 650.0, 0x0000000000000004",
             "1980, 610.0, 0x0000000000000000",
             "not a sample"]
    s = gpu_clock.summarize(lines)
    assert s == dict(samples=4, busy_samples=3, sm_mhz_median=1980.0, sm_mhz_min=1965.0, power_w_max=650.0,
                     reasons=["software power cap"])
    idle_only = gpu_clock.summarize(["345, 80.0, 0x1"])
    assert idle_only["busy_samples"] == 0 and idle_only["sm_mhz_median"] is None
    assert gpu_clock.summarize(["garbage"]) is None


def _fake_smi(tmp_path, body: str) -> str:
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!{sys.executable}\n{body}")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_clock_log_samples_while_the_block_runs(tmp_path):
    # A stand-in that prints a sample every 10 ms until it is terminated, and records its arguments.
    smi = _fake_smi(tmp_path, f"""
import sys, time
open({str(tmp_path / 'args')!r}, 'w').write(' '.join(sys.argv[1:]))
while True:
    print('1980, 300.0, 0x0000000000000000', flush=True)
    time.sleep(0.01)
""")
    with gpu_clock.ClockLog(interval_ms=10, smi=smi) as log:
        assert log.lines, "the block starts after the first sample"
    s = log.summary()
    assert s["busy_samples"] >= 1 and s["sm_mhz_median"] == 1980.0
    args = (tmp_path / "args").read_text()
    assert "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active" in args and "--loop-ms=10" in args


def test_clock_log_without_nvidia_smi_is_a_no_op(tmp_path):
    with gpu_clock.ClockLog(smi="") as log:
        pass
    assert log.summary() is None
    failing = _fake_smi(tmp_path, "import sys; sys.exit(9)\n")
    with gpu_clock.ClockLog(smi=failing) as log:
        pass
    assert log.summary() is None


def test_gpu_facts(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    smi = _fake_smi(tmp_path, "import sys; assert '--id=3' in sys.argv; "
                              "print('GPU-1234abcd, 700.00, 1980, 580.95')\n")
    assert gpu_clock.gpu_facts(smi) == dict(uuid="GPU-1234abcd", power_limit_w=700.0, max_sm_mhz=1980.0,
                                            driver="580.95")
    assert gpu_clock.gpu_facts(_fake_smi(tmp_path, "import sys; sys.exit(6)\n")) is None
    assert gpu_clock.gpu_facts("") is None
