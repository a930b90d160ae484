"""benchmarks/gpu_clock.py: reading nvidia-smi's samples and facts (the sampling itself runs against a
stand-in nvidia-smi, so it is tested without a GPU)."""

import importlib.util
import os
import pathlib
import stat
import sys
import time

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


def test_clock_logs_share_one_sampler_and_keep_their_own_window(tmp_path):
    # A stand-in that notes each start, then prints a sample every 10 ms, its SM clock counting up.
    smi = _fake_smi(tmp_path, f"""
import sys, time
with open({str(tmp_path / 'starts')!r}, 'a') as f:
    f.write(' '.join(sys.argv[1:]) + chr(10))
i = 0
while True:
    print(f'{{1000 + i}}, 300.0, 0x0000000000000000', flush=True)
    i += 1
    time.sleep(0.01)
""")
    with gpu_clock.ClockLog(interval_ms=10, smi=smi) as first:
        time.sleep(0.05)
    time.sleep(0.05)
    with gpu_clock.ClockLog(interval_ms=10, smi=smi) as second:
        time.sleep(0.05)
    a, b = first.summary(), second.summary()
    assert a["busy_samples"] >= 2 and b["busy_samples"] >= 2
    clocks_a = [gpu_clock.parse_sample(line)[0] for line in first.lines]
    clocks_b = [gpu_clock.parse_sample(line)[0] for line in second.lines]
    assert max(clocks_a) < min(clocks_b), "each block sees only the samples of its own window"
    starts = (tmp_path / "starts").read_text().splitlines()
    assert len(starts) == 1, "one nvidia-smi process for both blocks"
    assert "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active" in starts[0]
    assert "--loop-ms=10" in starts[0]
    gpu_clock.sampler(smi, 10).stop()


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
