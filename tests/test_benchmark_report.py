"""benchmarks/harness.py's report parts that need no GPU: the clock sentence under the table and the
GPU settings line."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import harness  # noqa: E402


def _clock(median, low, reasons=()):
    return dict(samples=10, busy_samples=8, sm_mhz_median=median, sm_mhz_min=low, power_w_max=600.0,
                reasons=list(reasons))


def test_render_clocks():
    rows = [dict(case="h96_fixed8k", jax_kda_clock=_clock(1980.0, 1965.0)),
            dict(case="h32_fixed32k", jax_kda_clock=_clock(1950.0, 1800.0, ["software power cap"])),
            dict(case="h8_fixed64k", jax_kda_clock=None),
            dict(case="h12_fixed8k")]
    assert harness.render_clocks(rows) == (
        "SM clock during jax_kda's profiled runs (nvidia-smi every 20 ms, samples while busy): median "
        "1950-1980 MHz across the cases, lowest sample 1800 MHz (h32_fixed32k); throttle reasons seen: "
        "software power cap (h32_fixed32k).")
    assert harness.render_clocks(rows[:1]).startswith(
        "SM clock during jax_kda's profiled runs (nvidia-smi every 20 ms, samples while busy): median 1980 MHz "
        "across the cases, lowest sample 1965 MHz (h96_fixed8k)")
    assert harness.render_clocks(rows[2:]) is None


def test_report_states_the_gpu_settings_and_the_clock():
    meta = dict(date="2026-12-01", commit="abc1234", device="NVIDIA H200", platform="gpu", sms=132,
                compute_capability="9.0", versions={"jax": "0.11.2"}, command="python benchmarks/bench_prefill.py",
                method="how", plot=False,
                gpu=dict(uuid="GPU-1", power_limit_w=700.0, max_sm_mhz=1980.0, driver="580.95"))
    row = dict(case="h96_fixed8k", tokens=8192, sequences=1, heads=96, backend="sm90", timing="device",
               plan=dict(v_split=2, num_segments=1, segment_len=8192, chunk=16), hbm_floor_us=237.0,
               jax_kda_us=905.0, kernels=dict(prepare=477.0, recurrence=428.0, combine=0.0, other=0.0),
               jax_kda_clock=_clock(1980.0, 1965.0))
    text = harness.render_report([row], meta)
    assert "- GPU settings: power limit 700 W, highest SM clock 1980 MHz, driver 580.95" in text
    assert "lowest sample 1965 MHz (h96_fixed8k)." in text
    del meta["gpu"]
    assert "GPU settings" not in harness.render_report([row], meta)


def test_goals_do_not_round_a_miss_up_to_the_goal():
    def row(case, heads, ours, theirs):
        return dict(case=case, tokens=8192, sequences=1, heads=heads, jax_kda_us=ours, flashkda_us=theirs,
                    hbm_floor_us=100.0)

    text = harness.render_goals([row("h64_fixed8k", 64, 604.0, 1206.0), row("h64_fixed1k", 64, 87.0, 192.0),
                                 row("h96_fixed8k", 96, 883.0, 1413.0)])
    assert "| h64_fixed8k | 1.997x | no (1.002x short) |" in text
    assert "| h64_fixed1k | 2.21x | yes |" in text
    assert "| h96_fixed8k | 1.60x | no (1.25x short) |" in text
