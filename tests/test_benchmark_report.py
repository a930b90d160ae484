"""benchmarks/harness.py's report parts that need no GPU: the clock sentence under the table, the
GPU settings line, the goals and the GPU time per chunk."""

import importlib.util
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


def test_goals_name_the_goal_cases_a_run_did_not_measure():
    """A run cut short (or one of a few cases) lists every other goal as not in the run, and a goal row
    without FlashKDA as such, instead of leaving them out; a run that bears on no goal has none."""
    def row(case, heads, ours, theirs=None, sequences=1):
        return dict(case=case, tokens=8192, sequences=sequences, heads=heads, jax_kda_us=ours,
                    flashkda_us=theirs, hbm_floor_us=100.0)

    rows = [row("h64_fixed8k", 64, 557.0, 1198.0), row("h64_mixed", 64, 508.0, sequences=6),
            row("h96_fixed8k_f32gates", 96, 855.0), row("h12_fixed8k", 12, 224.0, 867.0)]
    text = harness.render_goals(rows)
    assert "| >= 2x FlashKDA (N x H >= 64) | h64_fixed8k | 2.15x | yes |" in text
    assert "| >= 2x FlashKDA (N x H >= 64) | h64_mixed | — | FlashKDA not run |" in text
    assert "| <= 700 µs | h96_fixed8k | — | not in this run |" in text
    assert "| >= 2x FlashKDA (N x H >= 64) | h96_fixed32k | — | not in this run |" in text
    assert "f32gates" not in text and "h12_fixed8k" not in text  # FlashKDA has no fp32 gates; no goal at 12 heads
    listed = [line.split(" | ")[1] for line in text.splitlines()[2:]]
    assert sorted(set(listed)) == sorted(harness.flashkda_goal_cases())
    assert "700" not in harness.render_goals(rows, "NVIDIA H100 80GB HBM3")
    assert harness.render_goals(rows[3:]) is None


def test_goal_bytes_say_how_many_bytes_a_goal_leaves():
    """Per goal case: the kernels' fewest bytes at the copy rate against the goal's time, and the share
    of the bytes that must go where the goal allows fewer; segmented and goal-less cases left out."""
    def row(case, heads, ours, flashkda, sequences=1, segments=1):
        return dict(case=case, tokens=8192, sequences=sequences, heads=heads, jax_kda_us=ours, flashkda_us=flashkda,
                    hbm_floor_us=100.0, plan=dict(num_segments=segments))

    rows = [row("h32_128x128", 32, 749.0, 1139.0, sequences=128), row("h64_fixed8k", 64, 600.0, 1250.0),
            row("h32_fixed8k", 32, 436.0, 1013.0), row("h12_fixed8k", 12, 231.0, 857.0, segments=8)]
    rate = 2.98e12
    text = harness.render_goal_bytes(rows, rate, "NVIDIA H100 80GB HBM3")
    moved = sum(harness.kernel_bytes("h32_128x128").values())
    allowed = 1139.0 / 2 * 1e-6 * rate
    assert (f"| h32_128x128 | {moved / 1e6:.0f} | {moved / rate * 1e6:.0f} | 570 | {moved / allowed:.0%} | "
            f"{allowed / 1e6:.0f} | {1 - allowed / moved:.0%} |") in text
    assert "| h64_fixed8k | " in text and text.splitlines()[-1].endswith("| none |")  # 625 µs leave room
    assert "h32_fixed8k" not in text and "h12_fixed8k" not in text
    assert harness.render_goal_bytes(rows[2:], rate) is None
    rows_, meta = _main_run()
    report = harness.render_report(rows_, meta)
    assert "What the goals leave for bytes" in report and "at the 4.30 TB/s copy rate" in report


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


def test_kernel_bytes_and_the_rate_they_give():
    # h32_128x128: 16384 tokens, 32 heads, 128 sequences of 8 chunks; bf16 q, k, v, g, beta, fp32 states
    # in and out. Prepare: q, k 2 x 128 x 2 B, g 128 x 2 B, beta 2 B a token-head, then the workspace
    # (14336 B a chunk-head); the recurrence: the workspace, v and o (2 x 256 B a token-head), and
    # 2 x 128 x 32 states of 64 KiB.
    th, ch = 16384 * 32, 128 * 8 * 32
    moved = harness.kernel_bytes("h32_128x128")
    assert moved == {"prepare": th * (512 + 256 + 2) + ch * 14336,
                     "recurrence": ch * 14336 + th * 512 + 2 * 128 * 32 * 128 * 128 * 4}
    # fp32 g and beta: 256 + 2 B more a token-head for prepare, the recurrence unchanged.
    f32 = harness.kernel_bytes("h96_fixed8k_f32gates")
    bf16 = harness.kernel_bytes("h96_fixed8k")
    assert f32["prepare"] - bf16["prepare"] == 8192 * 96 * (256 + 2) and f32["recurrence"] == bf16["recurrence"]
    assert harness.kernel_bytes("not_a_case") is None

    def row(case, prepare, recurrence, segments=1):
        return dict(case=case, plan=dict(num_segments=segments),
                    kernels=dict(prepare=prepare, recurrence=recurrence, combine=0.0, other=0.0))

    rows = [row("h32_128x128", 283.0, 339.0), row("h12_fixed8k", 57.0, 141.0, segments=8)]
    text = harness.render_kernel_bandwidth(rows, 4.3e12)
    rec = moved["recurrence"]
    prep = moved["prepare"]
    assert (f"| h32_128x128 | {prep / 1e6:.0f} | {prep / 283e-6 / 1e12:.2f} | {prep / 283e-6 / 4.3e12:.0%} | "
            f"{rec / 1e6:.0f} | {rec / 339e-6 / 1e12:.2f} | {rec / 339e-6 / 4.3e12:.0%} |") in text
    assert "h12_fixed8k" not in text  # segmented: the recurrence runs twice, not modelled
    assert harness.render_kernel_bandwidth([row("h12_fixed8k", 57.0, 141.0, segments=8)], 4.3e12) is None


def test_copy_bandwidth_is_the_runs_own_else_its_gpus_else_the_reference_gpus_said_so():
    """The HBM floor and the kernels' rates are held to the run's GPU: its copy bandwidth measured in the
    run, else the figure measured before on that GPU model, else the reference GPU's, and the report
    says which; a redraw puts the floors at that figure."""
    assert harness.copy_bandwidth(dict(device="NVIDIA H200", copy_bandwidth=4.1e12)) == (4.1e12, "measured in this run")
    rate, source = harness.copy_bandwidth(dict(device="NVIDIA H200", copy_bandwidth=None))
    assert rate == harness.COPY_BANDWIDTHS["NVIDIA H200"] and source.startswith("measured on the NVIDIA H200")
    rate, source = harness.copy_bandwidth(dict(device="Some GPU"))
    assert rate == harness.COPY_BANDWIDTHS[harness.REFERENCE_GPU] and "none measured on this device" in source
    w = harness.workload("h96_fixed8k")
    row = dict(case="h96_fixed8k", hbm_floor_us=1.0)
    assert harness.with_floor(row, dict(copy_bandwidth=2e12))["hbm_floor_us"] == harness.hbm_floor_bytes(w) / 2e12 * 1e6
    assert harness.hbm_floor_us(w, 4e12) == harness.hbm_floor_bytes(w) / 4e12 * 1e6
    rows, meta = _main_run()
    meta["copy_bandwidth"] = 3.25e12
    assert "- Copy bandwidth (the HBM floor's and the kernels' rates' yardstick): 3.25 TB/s, measured in this run" \
        in harness.render_report(rows, meta)
    assert harness._FLOOR_SENTENCE in harness.METHOD
    old = "HBM floor: the fewest bytes ... over 4.3 TB/s, the copy bandwidth measured on the H200. The XLA path"
    assert harness.with_current_floor_sentence(old) == f"HBM floor: the fewest bytes ... {harness._FLOOR_SENTENCE} The XLA path"


def test_the_700_us_goal_is_the_reference_gpus_alone():
    """h96_fixed8k's time bound is set for the H200: another GPU's report checks the 2x FlashKDA goals
    only, and its per-chunk budget is half of FlashKDA's time there."""
    rows, _ = _main_run()
    h100 = "NVIDIA H100 80GB HBM3"
    assert harness.goal_time_us(rows[0]) == 700.0
    assert harness.goal_time_us(rows[0], h100) == 1416.0 / 2
    assert "| <= 700 µs | h96_fixed8k |" in harness.render_goals(rows)
    text = harness.render_goals(rows, h100)
    assert "700" not in text and "| >= 2x FlashKDA (N x H >= 64) | h96_fixed8k | 1.70x | no (1.18x short) |" in text


def test_redraw_draws_the_report_again_from_results_json(tmp_path):
    """`bench_prefill.py --redraw`: table.md and the report from OUT/results.json, nothing timed: the
    same text as the run's own write_all, the plot drawn again only where matplotlib imports."""
    meta = dict(date="2026-12-03", commit="abc1234", device="NVIDIA H200", platform="gpu", sms=132,
                versions={"jax": "0.11.2"}, command="python benchmarks/bench_prefill.py", method="how", plot=True)
    floor = harness.hbm_floor_us(harness.workload("h96_fixed8k"), harness.COPY_BANDWIDTHS["NVIDIA H200"])
    rows = [dict(case="h96_fixed8k", tokens=8192, sequences=1, heads=96, backend="sm90", timing="device",
                 plan=dict(v_split=2, num_segments=1, segment_len=0, chunk=16), hbm_floor_us=floor,
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
    drawn_by = json.loads((out / "results.json").read_text())["drawn_by"]  # the command, as it ran
    assert "--redraw" in drawn_by and str(report) in drawn_by
    assert report.read_text() == harness.render_report(rows, dict(meta, drawn_by=drawn_by), "results")
    assert f"- This report drawn from the saved rows (nothing timed): `{drawn_by}`" in report.read_text()
    assert (out / "table.md").read_text() == harness.render_table(rows) + "\n"
    plot = (out / "prefill.png").read_bytes()  # drawn again where matplotlib imports, else kept
    assert plot.startswith(b"\x89PNG") if importlib.util.find_spec("matplotlib") else plot == b"the run's plot"
    assert "| h96_fixed8k | 49152 | 1.12 | 1.16 | 0.00 | 2.28 | 1.88 | 59% |" in report.read_text()


def test_redraw_without_results_json_says_so(tmp_path):
    script = pathlib.Path(harness.__file__).parent / "bench_prefill.py"
    done = subprocess.run([sys.executable, str(script), "--redraw", "--out", str(tmp_path)], capture_output=True,
                          text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode != 0
    assert f"--redraw: no {tmp_path / 'results.json'}" in done.stderr


def _peer_run(commit="abc1234", uuid="GPU-1", date="2026-12-04", peers=("fla",), cases=("h96_fixed8k",), us=2700.0):
    meta = dict(date=date, commit=commit, gpu=dict(uuid=uuid), peers=list(peers), versions={"fla-core": "0.6.0"},
                command="python benchmarks/bench_prefill.py --peers-only --no-flashkda --out /tmp/fla")
    rows = [dict(case=c, fla_us=us, fla_wall_us=us + 10, fla_timing="device", fla_err_o=4.6e-3, fla_err_state=2.6e-3,
                 flashkda_us=1.0) for c in cases]
    return dict(meta=meta, rows=rows)


def _main_run():
    meta = dict(date="2026-12-04", commit="abc1234", device="NVIDIA H200", platform="gpu", sms=132,
                gpu=dict(uuid="GPU-1", power_limit_w=700.0, max_sm_mhz=1980.0, driver="580"),
                versions={"jax": "0.11.2"}, command="python benchmarks/bench_prefill.py --no-fla", method="how")
    rows = [dict(case=c, tokens=8192, sequences=1, heads=96, backend="sm90", timing="device", hbm_floor_us=237.0,
                 plan=dict(v_split=2, num_segments=1, segment_len=0, chunk=16), jax_kda_us=834.0, flashkda_us=1416.0)
            for c in ("h96_fixed8k", "h64_fixed8k")]
    return rows, meta


def test_peer_results_fill_the_peer_columns_and_the_report_names_their_command():
    """`--peer-results`: a peers-only run's FLA fields go into the rows it shares with this run (only
    the peers that run timed: its stray flashkda_us is not taken), a later run wins on a case, and the
    report names the command beside its own (facts, provenance, reproduce)."""
    rows, meta = _main_run()
    first = _peer_run(cases=("h96_fixed8k", "h64_fixed8k", "h8_fixed64k"), us=2700.0)
    later = _peer_run(cases=("h64_fixed8k",), us=1800.0)
    merged, merged_meta = harness.merge_peer_runs(rows, meta, [first, later], {"flashkda"})
    assert [r["fla_us"] for r in merged] == [2700.0, 1800.0]
    assert [r["flashkda_us"] for r in merged] == [1416.0, 1416.0]
    assert merged[0]["fla_err_state"] == 2.6e-3 and merged[0]["fla_timing"] == "device"
    assert "fla_us" not in rows[0]  # the caller's rows are left as they were
    assert merged_meta["peer_runs"][0]["cases"] == ["h96_fixed8k", "h64_fixed8k"]
    table = harness.render_table(merged)
    assert "| h96_fixed8k | 8192 | 96 | 2 / 1 | 834 | 1416 | 2700 | 1.70x | 3.24x |" in table
    report = harness.render_report(merged, merged_meta, "results")
    assert "The FLA column comes from a command of its own in the same machine visit" in report
    assert ("- FLA: timed by its own command on the same GPU and build, the same visit (2 cases, each peer's "
            "outputs compared with jax_kda's first), merged with `--peer-results`: "
            f"`{first['meta']['command']}`") in report
    reproduce = report.split("## Reproduce")[1]
    assert reproduce.index(first["meta"]["command"]) < reproduce.index(meta["command"])
    assert "| h96_fixed8k | 4.60e-03 | 2.60e-03 |" in report.split("## Agreement")[1].replace(" — | — |", "")


def test_peer_results_of_another_build_gpu_or_day_or_of_a_peer_timed_here_are_refused():
    rows, meta = _main_run()
    for bad, fact in ((_peer_run(commit="fffffff"), "build"), (_peer_run(uuid="GPU-2"), "GPU"),
                      (_peer_run(date="2026-12-03"), "day")):
        try:
            harness.merge_peer_runs(rows, meta, [bad], set())
        except harness.PeerRunMismatch as e:
            assert f"another {fact}" in str(e)
        else:
            raise AssertionError(f"a peers-only run of another {fact} was merged")
    try:
        harness.merge_peer_runs(rows, meta, [_peer_run()], {"fla"})
    except harness.PeerRunMismatch as e:
        assert "timed fla, which this run times too" in str(e)
    else:
        raise AssertionError("a peer timed in both runs was merged")


def _bench(*args):
    script = pathlib.Path(harness.__file__).parent / "bench_prefill.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_bench_refuses_peer_results_of_another_build_before_timing(tmp_path):
    peers = tmp_path / "peers.json"
    peers.write_text(json.dumps(_peer_run(commit="fffffff", uuid=None)))
    done = _bench("--backend", "xla", "--no-fla", "--no-flashkda", "--cases", "h2_fixed256", "--commit", "abc1234",
                  "--peer-results", str(peers), "--out", str(tmp_path / "out"))
    assert done.returncode != 0
    assert "--peer-results: peers-only run" in done.stderr and "another build (fffffff)" in done.stderr
    assert not (tmp_path / "out").exists()


def test_peers_only_needs_a_peer_and_takes_no_report(tmp_path):
    done = _bench("--peers-only", "--no-fla", "--no-flashkda", "--out", str(tmp_path / "out"))
    assert done.returncode != 0 and "--peers-only: no peer to time" in done.stderr
    done = _bench("--peers-only", "--report", str(tmp_path / "r.md"), "--out", str(tmp_path / "out"))
    assert done.returncode != 0 and "no --peer-results, --report or --xla with it" in done.stderr


def test_bench_merges_a_peers_only_run_into_its_table_and_report(tmp_path):
    """The CLI end to end on the CPU (XLA path, no peers importable): a peers.json of the same build and day
    (no GPU on either side) fills the FLA column of table.md, results.json and the report."""
    import time

    run = _peer_run(uuid=None, date=time.strftime("%Y-%m-%d", time.gmtime()), cases=("h2_fixed256",), us=99.0)
    run["meta"]["gpu"] = None
    peers = tmp_path / "peers.json"
    peers.write_text(json.dumps(run))
    out, report = tmp_path / "out", tmp_path / "REPORT.md"
    done = _bench("--backend", "xla", "--no-fla", "--no-flashkda", "--cases", "h2_fixed256", "--commit", "abc1234",
                  "--reps", "2", "--peer-results", str(peers), "--out", str(out), "--report", str(report))
    assert done.returncode == 0, done.stderr
    saved = json.loads((out / "results.json").read_text())
    assert saved["rows"][0]["fla_us"] == 99.0 and saved["peer_runs"][0]["cases"] == ["h2_fixed256"]
    assert "| 99 |" in (out / "table.md").read_text()
    assert "(1 case, each peer's outputs compared" in report.read_text()


def test_redraw_merges_peers_only_runs_timed_after_the_main_run(tmp_path):
    """`--redraw --peer-results`: a peers-only run of the same build, GPU and day, timed after the main
    run, fills the FLA column of results.json, table.md and the report, which names the merge command
    beside the run's own; a second merge keeps the first's runs; one of another day is refused and
    leaves results.json as it was."""
    rows, meta = _main_run()
    meta["peers"] = ["flashkda"]
    out = tmp_path / "results"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(dict(meta, rows=rows)))
    report = tmp_path / "REPORT.md"
    first, second = tmp_path / "fla1.json", tmp_path / "fla2.json"
    first.write_text(json.dumps(_peer_run(cases=("h96_fixed8k",), us=2700.0)))
    second.write_text(json.dumps(_peer_run(cases=("h64_fixed8k",), us=1800.0)))
    done = _bench("--redraw", "--peer-results", str(first), "--out", str(out), "--report", str(report))
    assert done.returncode == 0, done.stderr
    done = _bench("--redraw", "--peer-results", str(second), "--out", str(out), "--report", str(report))
    assert done.returncode == 0, done.stderr
    saved = json.loads((out / "results.json").read_text())
    assert [r.get("fla_us") for r in saved["rows"]] == [2700.0, 1800.0]
    assert [r["flashkda_us"] for r in saved["rows"]] == [1416.0, 1416.0]  # the run's own peer, untouched
    assert [run["cases"] for run in saved["peer_runs"]] == [["h96_fixed8k"], ["h64_fixed8k"]]
    assert saved["versions"]["fla-core"] == "0.6.0" and len(saved["merge_commands"]) == 2
    # The same merge again (visit_table.py's merge step in a later call) records nothing twice.
    done = _bench("--redraw", "--peer-results", str(second), "--out", str(out), "--report", str(report))
    assert done.returncode == 0, done.stderr
    again = json.loads((out / "results.json").read_text())
    assert again["peer_runs"] == saved["peer_runs"] and again["merge_commands"] == saved["merge_commands"]
    assert "| h96_fixed8k | 8192 | 96 | 2 / 1 | 834 | 1416 | 2700 | 1.70x | 3.24x |" in (out / "table.md").read_text()
    text = report.read_text()
    assert text.count("- Merged into this run's rows after it (nothing timed): `python ") == 2
    reproduce = text.split("## Reproduce")[1]
    assert reproduce.index(meta["command"]) < reproduce.index(f"--peer-results {second}")

    before = (out / "results.json").read_text()
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps(_peer_run(date="2026-12-03")))
    done = _bench("--redraw", "--peer-results", str(stale), "--out", str(out))
    assert done.returncode != 0 and "--peer-results: peers-only run" in done.stderr and "another day" in done.stderr
    assert (out / "results.json").read_text() == before


def test_a_peers_table_time_is_the_smaller_of_its_device_and_wall_time():
    """The profiler can widen an eager peer's device span past its wall time: the table, the ratio, the
    goal's budget and results.json's `*_best_us` take the smaller; jax_kda keeps its device time."""
    rows, meta = _main_run()
    row = dict(rows[1], case="h64_mixed", sequences=6, heads=64, flashkda_us=1018.0, flashkda_wall_us=1015.0,
               fla_us=6092.0, fla_wall_us=2976.0, jax_kda_us=520.0, jax_kda_wall_us=629.0)
    full = harness.with_ratios(row)
    assert (full["fla_best_us"], full["flashkda_best_us"]) == (2976.0, 1015.0)
    assert abs(full["speedup_vs_fla"] - 2976.0 / 520.0) < 1e-12
    assert harness.goal_time_us(row) == 1015.0 / 2
    assert "| 520 | 1015 | 2976 | 1.95x | 5.72x |" in harness.render_table([row])
    assert harness.peer_us(dict(fla_us=10.0), "fla") == 10.0 and harness.peer_us({}, "fla") is None


def test_a_peers_table_time_is_its_busy_time_where_that_is_the_least():
    """A host-bound eager peer leaves gaps between its kernels in its span and its wall time alike; its
    GPU busy time (`*_busy_us`) leaves them out, and the table charges it that where recorded."""
    rows, meta = _main_run()
    row = dict(rows[1], case="h64_mixed", sequences=6, heads=64, flashkda_us=1018.0, flashkda_wall_us=1015.0,
               flashkda_busy_us=990.0, fla_us=6092.0, fla_wall_us=2976.0, fla_busy_us=2100.0,
               jax_kda_us=520.0, jax_kda_wall_us=629.0)
    full = harness.with_ratios(row)
    assert (full["fla_best_us"], full["flashkda_best_us"]) == (2100.0, 990.0)
    assert harness.goal_time_us(row) == 990.0 / 2
    assert harness.peer_us(dict(fla_us=10.0, fla_wall_us=12.0, fla_busy_us=11.0), "fla") == 10.0


def test_the_peers_get_one_cu_seqlens_tensor_for_all_sets(monkeypatch):
    """FLA caches what it derives from cu_seqlens by the tensor's identity: the K calls must pass the
    same tensor (as a model's layers do), converted once per JAX array, not one per input set."""
    import types

    class Tensor:
        def __init__(self, source):
            self.source = source

        def long(self):
            return Tensor(("long", self.source))

        def cpu(self):
            return Tensor(("cpu", self.source))

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(from_dlpack=Tensor))
    cu, other_cu = object(), object()
    sets = [(("q1",), dict(cu_seqlens=cu, initial_state="s1")), (("q2",), dict(cu_seqlens=cu)),
            (("q3",), dict(cu_seqlens=other_cu))]
    out = harness.to_torch(sets)
    assert out[0][1]["cu_seqlens"] is out[1][1]["cu_seqlens"]
    assert out[0][1]["cu_seqlens_cpu"] is out[1][1]["cu_seqlens_cpu"]
    assert out[2][1]["cu_seqlens"] is not out[0][1]["cu_seqlens"]
    assert out[0][1]["cu_seqlens"].source == ("long", cu)
    assert out[0][1]["cu_seqlens_cpu"].source == ("cpu", ("long", cu))
    assert out[0][1]["initial_state"].source == "s1" and [t.source for t in out[1][0]] == ["q2"]


def test_a_source_builds_extension_is_named_by_its_digest(tmp_path, monkeypatch):
    (tmp_path / "fake_ext.py").write_bytes(b"x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import hashlib

    assert harness.module_file_digest("fake_ext") == hashlib.sha256(b"x = 1\n").hexdigest()[:12]
    assert harness.module_file_digest("no_such_module_here") is None


def test_peers_only_runs_cases_that_share_flas_tuning_together():
    names = ["h96_fixed8k", "h64_mixed", "h96_fixed32k", "h64_8x1k", "h96_mixed", "h96_8x1k",
             "h96_fixed8k_f32gates", "h64_fixed8k"]
    ordered = [w.name for w in harness.by_tuning_group([harness.workload(n) for n in names])]
    assert ordered == ["h96_fixed8k", "h96_fixed32k", "h64_mixed", "h64_8x1k", "h96_mixed", "h96_8x1k",
                       "h96_fixed8k_f32gates", "h64_fixed8k"]
