"""jax_kda prefill next to FlashKDA and FLA's chunk_kda, over the benchmark grid, in one process.

    JAX_KDA_COMMIT=<commit> python benchmarks/bench_prefill.py --xla \
        --out benchmarks/results/h200 --report benchmarks/BENCHMARK_H200.md   # the H200 report
    python benchmarks/bench_prefill.py --cases h96_fixed8k,h64_mixed --out /tmp/run
    python benchmarks/bench_prefill.py --backend xla --no-fla --no-flashkda --cases h2_fixed256 --out /tmp/cpu

Writes OUT/results.json (the run's facts and every row), OUT/table.md and OUT/prefill.png; with
`--report PATH` also the markdown report (benchmarks/BENCHMARK_H200.md is this, on the H200), whose
links point into OUT relative to PATH: run it in the checkout with OUT under benchmarks/results/ as
above, then take both back (on a machine that returns only a folder, copy them there). Every number
in them comes from this run of one build: record the build's commit with `--commit` or the
JAX_KDA_COMMIT environment variable (the installed wheel has no .git; "unknown" otherwise).

FLA autotunes its kernels on its first calls, for 50-100 s (H100, 2026-12-06), once per process for each
value of its tuning keys (heads, packed or not, dtypes), not per length: a case that shares them with an
earlier one of the same process took 3-20 s. `--peers-only` therefore runs its cases grouped that way
(`harness.by_tuning_group`). It may so be timed by a command of its own in the same machine visit,
with the same build, and merged into the table:

    python benchmarks/bench_prefill.py --peers-only --no-flashkda --out /tmp/fla     # writes /tmp/fla/peers.json
    python benchmarks/bench_prefill.py --no-fla --peer-results /tmp/fla/peers.json --xla --out ... --report ...

`--peers-only` times only the peers (jax_kda runs each case once, untimed, for the comparison of
outputs); `--peer-results` takes their rows when the build, the GPU (its UUID) and the day match, and the
report names that command beside its own. A peers-only run of the same visit may also come after the
main run: `--redraw --peer-results` merges it into the saved rows (same checks; the report names the
merge command too, and the plot is drawn again where matplotlib imports):

    python benchmarks/bench_prefill.py --no-fla --xla --out OUT --report REPORT                 # jax_kda, FlashKDA
    python benchmarks/bench_prefill.py --peers-only --no-flashkda --out /tmp/fla                # FLA, same visit
    python benchmarks/bench_prefill.py --redraw --peer-results /tmp/fla/peers.json --out OUT --report REPORT

`visit_table.py` runs those steps for one visit, each call within a time limit, until the table is complete.

`--redraw` times nothing: it draws OUT/table.md, the report and (where matplotlib imports) the plot
again from OUT/results.json (the same run's rows; their derived figures, such as the floors and
ratios, recomputed), after a change to how they are drawn, with no GPU:

    python benchmarks/bench_prefill.py --redraw --out benchmarks/results/h200 --report benchmarks/BENCHMARK_H200.md

Cases (`--cases`, default all of `jax_kda.testing.BENCHMARK_CASES`: the grid, EXTRA_CASES and
GATE_DTYPE_CASES, grid shapes with fp32 g and beta), or
any name of the grid's form such as h2_fixed256, h4_3x1k or h8_mixed (see harness.workload).

How it measures (harness.METHOD, printed with the results): for each implementation, K back-to-back
calls on K distinct input sets (at least 8, and enough that they exceed 4x the 60 MB L2), one
synchronisation; device time from CUPTI through torch.profiler (the span of the calls' GPU
activity / K, median of 3), wall time also recorded. jax_kda runs as one jitted program of the K
calls, the peers as K eager torch calls (a peer is charged the least of its device time, its wall
time and its GPU busy time, its kernels' durations summed, which leaves out the gaps its host leaves
between them). The peers get the same arrays (DLPack; one cu_seqlens tensor for all K calls), and their outputs
(o and the final state) are compared with jax_kda's before anything is timed. Without torch with
CUDA (e.g. `--backend xla` on a CPU) only wall time is taken. Where nvidia-smi is there, each
measurement also keeps the SM clock, power and throttle reasons it reported during the profiled runs
(`*_clock` in the rows, `gpu_clock.py`), and the run's facts the GPU's UUID and power limit.

The peers are optional, each used when it imports (`--fla/--no-fla`, `--flashkda/--no-flashkda`):
  * FLA: `fla.ops.kda.chunk_kda` (Triton), `pip install fla-core==0.6.0` on top of torch and triton.
    `FLA_FLASH_KDA=0` is set so that it does not hand off to another library.
  * FlashKDA: MoonshotAI's CUTLASS kernels (`flash_kda.fwd`), from the FlashKDA repository
    (https://github.com/MoonshotAI/FlashKDA), built from source on the GPU machine (it needs nvcc and
    torch with CUDA; put the built folder on PYTHONPATH). It serves only the lower-bound gate with
    A_log, with gate, beta sigmoid and l2norm always applied, K = V = 128, as many value heads as q/k
    heads, states [N, H, V, K]: the benchmark grid's flags. Other cases skip it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

# JAX takes 75 % of the GPU's memory at its first use unless told otherwise, which would leave the
# torch peers the rest: their allocator might then free and retry (a synchronisation) inside their
# timed calls. So XLA allocates as it goes here (its allocator grows to the program's needs in the
# warm-up): jax_kda's kernels took the same time under XLA's default, platform and cuda_async
# allocators (benchmarks/results/h200/allocator_ab.txt).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402

import jax_kda  # noqa: E402
from jax_kda import gold  # noqa: E402
from jax_kda.testing import BENCHMARK_CASES, Workload  # noqa: E402

AGREEMENT_BAR = 2e-2  # a peer whose o or final state differs more from jax_kda's stops the run


# --- The peers ----------------------------------------------------------------------------------------------


def importable(module: str) -> str | None:
    """None if `module` imports and torch has a CUDA device; else why not."""
    try:
        __import__(module)
        import torch
    except Exception as e:  # noqa: BLE001 (any import failure means: not available)
        return f"cannot import {module}: {e}"
    return None if torch.cuda.is_available() else "torch has no CUDA device"


class Fla:
    """flash-linear-attention's chunk_kda (Triton)."""

    key, label, module = "fla", "FLA", "fla"

    @staticmethod
    def unsupported(w: Workload) -> str | None:
        return None

    @staticmethod
    def calls(torch_sets, static, w: Workload):
        from fla.ops.kda import chunk_kda

        def call(a, kw):
            o, state = chunk_kda(
                *a,
                scale=static.get("scale"),
                initial_state=kw.get("initial_state"),
                output_final_state=static["output_final_state"],
                use_qk_l2norm_in_kernel=static["use_qk_l2norm_in_kernel"],
                use_gate_in_kernel=static.get("use_gate_in_kernel", False),
                use_beta_sigmoid_in_kernel=static["use_beta_sigmoid_in_kernel"],
                safe_gate=static.get("lower_bound") is not None,
                lower_bound=static.get("lower_bound"),
                A_log=kw.get("A_log"),
                dt_bias=kw.get("dt_bias"),
                state_v_first=static["state_v_first"],
                cu_seqlens=kw.get("cu_seqlens"),
                cu_seqlens_cpu=kw.get("cu_seqlens_cpu"),
            )
            return o, state

        return [lambda a=a, kw=kw: call(a, kw) for a, kw in torch_sets]


class FlashKda:
    """MoonshotAI's FlashKDA (CUTLASS): flash_kda.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias,
    lower_bound, initial_state, final_state, cu_seqlens), writing o and the final state in place."""

    key, label, module = "flashkda", "FlashKDA", "flash_kda"

    unsupported = staticmethod(harness.flashkda_unsupported)

    @staticmethod
    def calls(torch_sets, static, w: Workload):
        import flash_kda
        import torch

        scale = static.get("scale") or w.head_k**-0.5
        v_first = static["state_v_first"]
        n, h = harness.num_sequences(w), w.heads
        calls = []
        for a, kw in torch_sets:
            q, k, v, g, beta = (x.contiguous() for x in a)
            g, beta = g.to(torch.bfloat16), beta.to(torch.bfloat16)  # it takes raw g and beta logits in bf16
            state = kw.get("initial_state")
            if state is not None and not v_first:  # its states are [N, H, V, K]; transposed once, untimed
                state = state.transpose(-1, -2).contiguous()
            final = (torch.empty((n, h, w.head_v, w.head_k), dtype=torch.float32, device=q.device)
                     if static["output_final_state"] else None)
            out = torch.empty_like(v)
            a_log = kw["A_log"].float().contiguous()
            dt_bias = kw["dt_bias"].float().reshape(h, w.head_k).contiguous()
            cu = kw.get("cu_seqlens")

            def call(q=q, k=k, v=v, g=g, beta=beta, out=out, a_log=a_log, dt_bias=dt_bias, state=state,
                     final=final, cu=cu):
                flash_kda.fwd(q, k, v, g, beta, scale, out, a_log, dt_bias, static["lower_bound"],
                              initial_state=state, final_state=final, cu_seqlens=cu)
                if final is not None and not v_first:
                    return out, final.transpose(-1, -2)
                return out, final

            calls.append(call)
        return calls


PEERS = (FlashKda, Fla)


def time_peer(calls, reps: int) -> dict:
    import torch

    for call in calls:  # the first call per shape compiles or autotunes (FLA)
        call()
    torch.cuda.synchronize()

    def run():
        for call in calls:
            call()
        torch.cuda.synchronize()

    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    timing = harness.measure(run, len(calls), reps)
    # Each retry freed cached blocks and synchronised inside the timed calls: recorded, never expected.
    timing["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
    return timing


def err_ratios(ours, theirs) -> tuple[float, float | None]:
    o = gold.err_ratio(theirs[0].float().cpu().numpy(), ours[0])
    state = None if ours[1] is None else gold.err_ratio(theirs[1].float().cpu().numpy(), ours[1])
    return o, state


# --- jax_kda ------------------------------------------------------------------------------------------------


def time_jax(inputs: harness.InputSets, backend: str, reps: int) -> dict:
    """Per-call times of jax_kda.prefill over the input sets (one jitted program of the K calls)."""
    static = inputs.static

    @jax.jit
    def many(all_sets):
        return [jax_kda.prefill(*a, **kw, **static, backend=backend) for a, kw in all_sets]

    return harness.measure(lambda: jax.block_until_ready(many(inputs.sets)), len(inputs), reps)


XLA_SETS = 2  # input sets per timed XLA-path program


def run_case(w: Workload, args, rng, bandwidth: float) -> dict:
    inputs = harness.input_sets(w, rng, args.sets)
    decision = jax_kda.explain(*inputs.args, **inputs.kwargs, backend=args.backend)
    plan = decision.plan if decision.backend != "xla" else None  # the kernels' plan, when they run
    row = dict(case=w.name, tokens=w.total_tokens, sequences=harness.num_sequences(w), heads=w.heads,
               sets=len(inputs), backend=decision.backend,
               plan=None if plan is None else dict(v_split=plan.v_split, num_segments=plan.num_segments,
                                                   segment_len=plan.segment_len, chunk=plan.chunk_size),
               hbm_floor_us=harness.hbm_floor_us(w, bandwidth))
    print(f"{w.name}: {decision}", flush=True)

    o, state = jax_kda.prefill(*inputs.args, **inputs.kwargs, backend=args.backend)  # compared with the peers
    ours = (np.asarray(jnp.asarray(o, jnp.float32)), None if state is None else np.asarray(state))
    peers = [p for p in PEERS if getattr(args, p.key)]
    if peers:
        import torch

        torch_sets = harness.to_torch(inputs.sets)
        for peer in peers:
            reason = peer.unsupported(w)
            if reason:
                print(f"{w.name}: {peer.label} skipped: {reason}", flush=True)
                row[f"{peer.key}_skipped"] = reason
                continue
            calls = peer.calls(torch_sets, inputs.static, w)
            err_o, err_state = err_ratios(ours, calls[0]())
            row[f"{peer.key}_err_o"], row[f"{peer.key}_err_state"] = err_o, err_state
            print(f"{w.name}: {peer.label} vs jax_kda err_ratio o {err_o:.2e}, state "
                  f"{'—' if err_state is None else format(err_state, '.2e')}", flush=True)
            if err_o > AGREEMENT_BAR or (err_state or 0.0) > AGREEMENT_BAR:
                raise SystemExit(f"{w.name}: jax_kda and {peer.label} disagree (err_ratio > {AGREEMENT_BAR}): {row}")
            t = time_peer(calls, args.reps)
            row[f"{peer.key}_us"], row[f"{peer.key}_wall_us"] = harness.best_us(t), t["wall_us"]
            row[f"{peer.key}_timing"] = "device" if t["device_us"] is not None else "wall"
            if t["busy_us"] is not None:
                row[f"{peer.key}_busy_us"] = t["busy_us"]
            row[f"{peer.key}_alloc_retries"] = t["alloc_retries"]
            if t["alloc_retries"]:
                print(f"{w.name}: {peer.label}'s allocator retried {t['alloc_retries']} times in its timed "
                      "calls (each a synchronisation): its figure is not its kernels' alone", flush=True)
            row[f"{peer.key}_clock"] = t["gpu_clock"]
            del calls
        del torch_sets
        torch.cuda.empty_cache()
    if args.peers_only:
        return row

    t = time_jax(inputs, args.backend, args.reps)
    row["timing"] = "device" if t["device_us"] is not None else "wall"
    row["jax_kda_us"], row["jax_kda_wall_us"] = harness.best_us(t), t["wall_us"]
    row["jax_kda_clock"] = t["gpu_clock"]
    if t["kernels"] is not None and decision.backend != "xla":
        row["kernels"] = t["kernels"]
    if args.xla:
        # The XLA path takes milliseconds a call: two input sets are enough to keep L2 out of it,
        # and they keep its program (and its memory, which K sets of a 96-head 32K call exceed on
        # an H200) small. A case it cannot run is recorded with the reason, not a crash of the run.
        few = dataclasses.replace(inputs, sets=inputs.sets[:XLA_SETS])
        try:
            x = time_jax(few, "xla", max(args.reps // 4, 3))
            row["xla_us"] = harness.best_us(x)
        except jax.errors.JaxRuntimeError as e:
            row["xla_skipped"] = str(e).splitlines()[0][:200]
            print(f"{w.name}: XLA path not timed: {row['xla_skipped']}", flush=True)
    return row


def write_report(args, rows: list[dict], meta: dict) -> None:
    """The markdown report at --report (when given), its links relative to it."""
    if not args.report:
        return
    try:
        results_dir = os.path.relpath(args.out.resolve(), args.report.resolve().parent)
    except ValueError:
        results_dir = str(args.out.resolve())
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(harness.render_report(rows, meta, results_dir))


def write_all(args, rows: list[dict], meta: dict) -> str:
    """OUT/results.json, table.md and the plot, and the report with --report; returns the table."""
    table = harness.write_results(args.out, rows, meta)
    write_report(args, rows, meta)
    return table


def redraw(args) -> str:
    """--redraw: OUT/table.md and the --report page drawn again from OUT/results.json, the same run's
    rows and facts, and the rows' derived figures in results.json recomputed from their measured ones
    (nothing timed; the plot drawn again where matplotlib imports, else kept); returns the table. With
    --peer-results, the peers-only runs are merged into the saved rows first (same build, GPU and day,
    as at run time): so a peer that autotunes for minutes may be timed after the main run of the
    visit, not only before it."""
    path = args.out / "results.json"
    if not path.is_file():
        raise SystemExit(f"--redraw: no {path} (a run's --out folder holds one)")
    saved = json.loads(path.read_text())
    rows = saved.pop("rows")
    if args.peer_results:
        try:
            rows, saved = harness.merge_saved_peer_runs(rows, saved, [json.loads(p.read_text()) for p in args.peer_results],
                                                        harness.run_command())
        except harness.PeerRunMismatch as e:
            raise SystemExit(f"--peer-results: {e}") from None
    # The derived figures (floors, ratios, a peer's table time) follow the current rules: written back too.
    rows = [harness.with_ratios(harness.with_floor(r, saved)) for r in rows]
    if saved.get("method"):
        saved["method"] = harness.with_current_floor_sentence(saved["method"])
    saved["drawn_by"] = harness.run_command()  # the report names the command that drew it last
    if harness.write_plot(rows, args.out / "prefill.png", saved["device"]):
        saved["plot"] = True
    path.write_text(json.dumps(dict(saved, rows=rows), indent=1) + "\n")
    table = harness.render_table(rows)
    (args.out / "table.md").write_text(table + "\n")
    write_report(args, rows, saved)
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--cases", default=",".join(BENCHMARK_CASES),
                        help="comma-separated case names (default: all of testing.BENCHMARK_CASES)")
    parser.add_argument("--backend", default="auto", help="jax_kda's backend (default auto)")
    parser.add_argument("--reps", type=int, default=20, help="wall-time repetitions per measurement")
    parser.add_argument("--sets", type=int, default=None, help="input sets per timed program (default: by size)")
    parser.add_argument("--fla", action=argparse.BooleanOptionalAction, default=None,
                        help="time FLA's chunk_kda (default: when it imports and CUDA is there)")
    parser.add_argument("--flashkda", action=argparse.BooleanOptionalAction, default=None,
                        help="time FlashKDA (default: when flash_kda imports and CUDA is there)")
    parser.add_argument("--flashkda-source", default=None,
                        help="which FlashKDA source a source build is (e.g. 'commit 1ce47ea, CUTLASS 4.2, "
                             "sm_90a'), recorded with the run's versions beside its extension's sha256")
    parser.add_argument("--xla", action="store_true", help="also time backend='xla'")
    parser.add_argument("--out", type=pathlib.Path, required=True,
                        help="folder for results.json, table.md, prefill.png")
    parser.add_argument("--report", type=pathlib.Path, help="also write the markdown report here")
    parser.add_argument("--commit", default=None,
                        help=f"the jax_kda build's git commit (default ${harness.COMMIT_ENV}, else 'unknown')")
    parser.add_argument("--peers-only", action="store_true",
                        help="time only the peers (jax_kda runs once a case, untimed, for the comparison) into "
                             "OUT/peers.json, for --peer-results")
    parser.add_argument("--peer-results", type=pathlib.Path, action="append", default=[], metavar="PEERS_JSON",
                        help="the peers.json of a --peers-only run of the same build, GPU and day: its peers' "
                             "columns go into this run's table (repeatable; a later file wins per case)")
    parser.add_argument("--redraw", action="store_true",
                        help="time nothing: draw OUT/table.md and the --report page again from OUT/results.json "
                             "(after a change to how they are drawn; the plot is kept)")
    args = parser.parse_args()
    if args.redraw:
        print(redraw(args))
        return

    if args.peers_only and (args.peer_results or args.report or args.xla):
        raise SystemExit("--peers-only times only the peers: no --peer-results, --report or --xla with it")
    peer_runs = [json.loads(path.read_text()) for path in args.peer_results]
    cases = [harness.workload(name) for name in args.cases.split(",") if name]
    if args.peers_only:
        cases = harness.by_tuning_group(cases)
    if args.fla is not False or args.flashkda is not False:
        os.environ.setdefault("FLA_FLASH_KDA", "0")
    for peer in PEERS:
        wanted = getattr(args, peer.key)
        reason = importable(peer.module) if wanted is not False else None
        if reason and wanted:
            raise SystemExit(f"--{peer.key}: {reason}")
        if reason:
            print(f"{peer.label} not timed: {reason}")
        setattr(args, peer.key, wanted is not False and reason is None)

    timed_peers = [peer.key for peer in PEERS if getattr(args, peer.key)]
    if args.peers_only and not timed_peers:
        raise SystemExit("--peers-only: no peer to time (see above why each is not)")
    meta = harness.run_metadata(args.commit)
    meta["peers"] = timed_peers
    # This GPU's copy bandwidth, measured here before anything else runs: the floors and rates use it.
    meta["copy_bandwidth"] = harness.measure_copy_bandwidth()
    bandwidth, source = harness.copy_bandwidth(meta)
    if args.flashkda:
        digest = harness.module_file_digest("flash_kda_C")  # the compiled extension of a source build
        meta["versions"]["flash_kda"] = harness.package_version("flash_kda") or ", ".join(
            part for part in ("source build", args.flashkda_source,
                              digest and f"flash_kda_C sha256 {digest}") if part)
    if peer_runs:
        # Checked before anything is timed: a run that cannot be merged stops here, not after the grid.
        try:
            harness.merge_peer_runs([], meta, peer_runs, set(timed_peers))
        except harness.PeerRunMismatch as e:
            raise SystemExit(f"--peer-results: {e}") from None
        for run in peer_runs:
            meta["versions"].update({k: v for k, v in run["meta"].get("versions", {}).items()
                                     if k not in meta["versions"]})
    print(f"jax_kda build {meta['commit']} on {meta['device']}, {meta['date']}; copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s ({source})", flush=True)
    rng = np.random.default_rng()
    rows = []
    table = ""
    for w in cases:
        start = time.monotonic()
        row = run_case(w, args, rng, bandwidth)
        rows.append(row)
        print(json.dumps(row), flush=True)
        print(f"{w.name}: {time.monotonic() - start:.0f} s", flush=True)  # for planning a visit's time
        # Written after every case, so that a run cut short keeps what it measured.
        if args.peers_only:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "peers.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
            continue
        merged, merged_meta = harness.merge_peer_runs(rows, meta, peer_runs, set(timed_peers))
        table = write_all(args, merged, merged_meta)
    if args.peers_only:
        print(f"peers-only run: {args.out / 'peers.json'}")
        return
    if args.report:
        print(f"report: {args.report}")
    print(f"\nmethod: {harness.METHOD}\ndevice: {meta['device']}, {meta['date']}, "
          f"jax_kda build {meta['commit']}\n")
    print(table)


if __name__ == "__main__":
    main()
