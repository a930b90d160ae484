"""benchmarks/harness.py's report parts that need no GPU: the clock sentence under the table, the
GPU settings line, the goals and the GPU time per chunk."""

import json
import os
import pathlib
import subprocess
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


def test_gpu_time_per_chunk_and_the_goal_budget():
    def row(case, heads, prepare, recurrence, flashkda=None, sequences=1):
        return dict(case=case, tokens=8192, sequences=sequences, heads=heads, jax_kda_us=prepare + recurrence,
                    flashkda_us=flashkda, hbm_floor_us=100.0,
                    kernels=dict(prepare=prepare, recurrence=recurrence, combine=0.0, other=0.0))

    # 8192 tokens at 96 heads: 512 chunks x 96; the 128-token prompts: 128 x 8 chunks x 32 heads.
    assert harness.chunk_heads("h96_fixed8k") == 512 * 96
    assert harness.chunk_heads("h32_128x128") == 128 * 8 * 32
    assert harness.chunk_heads("h96_mixed") == sum(-(-n // 16) for n in harness.MIXED_SEQLENS) * 96
    assert harness.chunk_heads("not_a_case") is None
    # h96_fixed8k: the 700 µs goal is below half of FlashKDA's 1415; h64_fixed8k: half of FlashKDA's;
    # h32_fixed8k (one sequence x 32 heads): no goal.
    assert harness.goal_time_us(row("h96_fixed8k", 96, 416.0, 432.0, 1415.0)) == 700.0
    assert harness.goal_time_us(row("h64_fixed8k", 64, 275.0, 298.0, 1203.0)) == 601.5
    assert harness.goal_time_us(row("h32_fixed8k", 32, 142.0, 296.0, 996.0)) is None
    rows = [row("h96_fixed8k", 96, 416.0, 432.0, 1415.0), row("h32_fixed8k", 32, 142.0, 296.0, 996.0),
            row("not_a_case", 8, 1.0, 1.0)]
    text = harness.render_gpu_time_per_chunk(rows, 132)
    # 416 x 132 / 49152 = 1.117, 432 x 132 / 49152 = 1.160; budget 700 x 132 / 49152 = 1.880.
    assert "| h96_fixed8k | 49152 | 1.12 | 1.16 | 0.00 | 2.28 | 1.88 | 59% |" in text
    assert "| h32_fixed8k | 16384 | 1.14 | 2.38 | 0.00 | 3.53 | — | — |" in text
    assert "not_a_case" not in text
    assert harness.render_gpu_time_per_chunk(rows, None) is None
    meta = dict(date="2026-12-03", commit="abc1234", device="NVIDIA H200", platform="gpu", sms=132,
                versions={}, command="c", method="how", plot=False)
    assert "## GPU time per chunk" in harness.render_report(rows, meta)
    assert "## GPU time per chunk" not in harness.render_report(rows, dict(meta, sms=None))


def test_redraw_draws_the_report_again_from_results_json(tmp_path):
    """`bench_prefill.py --redraw`: table.md and the report from OUT/results.json, nothing timed: the
    same text as the run's own write_all, the plot left alone."""
    meta = dict(date="2026-12-03", commit="abc1234", device="NVIDIA H200", platform="gpu", sms=132,
                versions={"jax": "0.11.2"}, command="python benchmarks/bench_prefill.py", method="how", plot=True)
    rows = [dict(case="h96_fixed8k", tokens=8192, sequences=1, heads=96, backend="sm90", timing="device",
                 plan=dict(v_split=2, num_segments=1, segment_len=0, chunk=16), hbm_floor_us=237.0,
                 jax_kda_us=848.0, flashkda_us=1415.0,
                 kernels=dict(prepare=416.0, recurrence=432.0, combine=0.0, other=0.0))]
    out = tmp_path / "results"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(dict(meta, rows=rows)))
    (out / "prefill.png").write_bytes(b"the run's plot")
    report = tmp_path / "REPORT.md"
    script = pathlib.Path(harness.__file__).parent / "bench_prefill.py"
    subprocess.run([sys.executable, str(script), "--redraw", "--out", str(out), "--report", str(report)],
                   check=True, capture_output=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert report.read_text() == harness.render_report(rows, meta, "results")
    assert (out / "table.md").read_text() == harness.render_table(rows) + "\n"
    assert (out / "prefill.png").read_bytes() == b"the run's plot"
    assert "| h96_fixed8k | 49152 | 1.12 | 1.16 | 0.00 | 2.28 | 1.88 | 59% |" in report.read_text()


def test_redraw_without_results_json_says_so(tmp_path):
    script = pathlib.Path(harness.__file__).parent / "bench_prefill.py"
    done = subprocess.run([sys.executable, str(script), "--redraw", "--out", str(tmp_path)], capture_output=True,
                          text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode != 0
    assert f"--redraw: no {tmp_path / 'results.json'}" in done.stderr
