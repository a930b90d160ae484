"""jax_kda prefill vs FLA's chunk_kda (and the XLA path) over the grid of shared/BENCHMARKS.md.

    python benchmarks/bench_prefill.py --out results/          # every case, jax_kda + FLA
    python benchmarks/bench_prefill.py --cases h96_fixed8k --xla --out results/
    python benchmarks/bench_prefill.py --no-fla --cases h64_mixed,h64_8x1k --out results/   # testing.EXTRA_CASES
    python benchmarks/bench_prefill.py --merge a/results.json b/results.json --out merged/

How it measures (printed with the results): for each implementation, K back-to-back calls on K
different input sets (at least 8, and enough that they exceed 4x the 60 MB L2, so no call finds
its inputs in cache), one device synchronisation, wall-clock time / K; the median of `--reps` such
measurements after a warm-up. The same method times FLA (K eager torch calls) and jax_kda (one
jitted XLA program holding the K calls), so host dispatch is amortised the same way for both. The first set is a
fresh random draw (never zeros); the others are that set with every floating-point array rolled
along its longest axis (distinct buffers and values, made on the device in milliseconds instead
of minutes of host RNG). FLA and jax_kda get the same arrays (DLPack), and their outputs are
checked against each other before anything is timed.

FLA is optional: install `fla-core==0.6.0` (it needs torch and triton); `FLA_FLASH_KDA=0` is set so
it does not hand off to another library.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_kda
from jax_kda import gold, planner
from jax_kda.config import validate
from jax_kda.testing import BENCHMARK_CASES, BENCHMARK_GRID, Workload, hbm_floor_bytes, make_inputs

COPY_BANDWIDTH = 4.3e12  # bytes/s, device-to-device copy on the H200 (shared/GPU.md)
L2_BYTES = 60 * 2**20
# FlashKDA's times from shared/BENCHMARKS.md (same GPU model, NOT this run: it is a CUTLASS build we
# do not ship). Shown for reference next to the same-run FLA comparison.
FLASHKDA_US = dict(
    h96_fixed8k=1408, h96_mixed=1394, h96_8x1k=1194, h64_fixed8k=1190, h64_fixed1k=183,
    h32_fixed8k=985, h32_fixed32k=3794, h12_fixed8k=858, h8_fixed64k=6351, h16_8x4k=853,
)
METHOD = (
    "K >= 8 back-to-back calls on K distinct input sets (> 4x L2), one sync; device time = first GPU "
    "activity start to last activity end (CUPTI via torch.profiler) / K, median of 3; wall time / K, "
    "median of --reps, also recorded; same method for every implementation"
)


def derived_set(args, kwargs, i: int):
    """Input set i > 0: every floating-point array of the first set rolled along its longest axis
    by a shift that depends on i (integer arrays such as cu_seqlens are kept)."""

    def roll(x):
        if not isinstance(x, jax.Array) or not jnp.issubdtype(x.dtype, jnp.floating) or x.size < 2:
            return x
        axis = int(np.argmax(x.shape))
        return jnp.roll(x, max(1, (7919 * i) % x.shape[axis]), axis=axis)

    return tuple(roll(a) for a in args), {key: roll(v) for key, v in kwargs.items()}


def input_bytes(args, kwargs) -> int:
    arrays = list(args) + [v for v in kwargs.values() if hasattr(v, "nbytes")]
    return sum(int(a.nbytes) for a in arrays)


def split_kwargs(kwargs):
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    return arrays, static


def device_seconds(run, calls: int):
    """GPU time per call of `run()` (which makes `calls` calls and waits for them): from the start
    of its first GPU activity to the end of its last, recorded by CUPTI through the PyTorch
    profiler (it sees every kernel of the process, jax's included). Idle gaps between the calls'
    kernels count, as they do under CUDA events. None where torch with CUDA is unavailable."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    spans = [e.time_range for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not spans:
        return None
    return (max(s.end for s in spans) - min(s.start for s in spans)) * 1e-6 / calls


def measure(run, calls: int, reps: int) -> dict:
    """Median device time (when measurable) and wall time per call of `run`, after a warm-up."""
    run()
    wall = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        wall.append((time.perf_counter() - start) / calls)
    device = [device_seconds(run, calls) for _ in range(min(reps, 3))]
    return dict(wall=statistics.median(wall),
                device=statistics.median(device) if None not in device else None)


def time_jax(sets, static, backend, reps):
    """Per-call times of jax_kda.prefill over the K input sets (one jitted program of K calls)."""

    @jax.jit
    def many(all_sets):
        return [jax_kda.prefill(*a, **kw, **static, backend=backend) for a, kw in all_sets]

    return measure(lambda: jax.block_until_ready(many(sets)), len(sets), reps)


def fla_call(torch_sets_i, static):
    from fla.ops.kda import chunk_kda

    a, kw = torch_sets_i
    return chunk_kda(
        *a,
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


def to_torch(sets):
    import torch

    out = []
    for a, kw in sets:
        ta = [torch.from_dlpack(x) for x in a]
        tkw = {k: torch.from_dlpack(v) for k, v in kw.items()}
        if "cu_seqlens" in tkw:
            tkw["cu_seqlens"] = tkw["cu_seqlens"].long()
            tkw["cu_seqlens_cpu"] = tkw["cu_seqlens"].cpu()
        out.append((ta, tkw))
    return out


def time_fla(torch_sets, static, reps):
    import torch

    for t in torch_sets:  # the first call per shape autotunes
        fla_call(t, static)

    def run():
        for t in torch_sets:
            fla_call(t, static)
        torch.cuda.synchronize()

    return measure(run, len(torch_sets), reps)


def run_case(w: Workload, args, rng) -> dict:
    first_args, first_kwargs = make_inputs(w, rng)
    set_bytes = input_bytes(first_args, first_kwargs)
    k = min(max(8, math.ceil(4 * L2_BYTES / set_bytes)), 16)
    sets = [(first_args, first_kwargs)] + [derived_set(first_args, first_kwargs, i) for i in range(1, k)]
    static = split_kwargs(first_kwargs)[1]
    sets = [(a, split_kwargs(kw)[0]) for a, kw in sets]

    cfg = validate(*first_args, **first_kwargs)
    plan = planner.plan_prefill(cfg)
    decision = jax_kda.explain(*first_args, **first_kwargs, backend=args.backend)
    floor_s = hbm_floor_bytes(w) / COPY_BANDWIDTH
    row = dict(case=w.name, tokens=w.total_tokens, heads=w.heads, sets=k, backend=decision.backend,
               plan=dict(v_split=plan.v_split, num_segments=plan.num_segments, chunk=plan.chunk_size),
               hbm_floor_us=floor_s * 1e6)

    ours_o, ours_state = jax_kda.prefill(*first_args, **first_kwargs, backend=args.backend)
    if args.fla:
        os.environ.setdefault("FLA_FLASH_KDA", "0")
        torch_sets = to_torch(sets)
        fla_o, fla_state = fla_call(torch_sets[0], static)
        import torch

        row["agree_o"] = gold.err_ratio(np.asarray(jnp.asarray(ours_o, jnp.float32)), fla_o.float().cpu().numpy())
        row["agree_state"] = gold.err_ratio(np.asarray(ours_state), fla_state.float().cpu().numpy())
        if row["agree_o"] > 2e-2 or row["agree_state"] > 2e-2:
            raise SystemExit(f"{w.name}: jax_kda and FLA disagree: {row}")
        fla = time_fla(torch_sets, static, args.reps)
        row["fla_us"] = (fla["device"] or fla["wall"]) * 1e6
        row["fla_wall_us"] = fla["wall"] * 1e6
        del torch_sets
        torch.cuda.empty_cache()
    ours = time_jax(sets, static, args.backend, args.reps)
    row["timing"] = "device" if ours["device"] else "wall"
    row["jax_kda_us"] = (ours["device"] or ours["wall"]) * 1e6
    row["jax_kda_wall_us"] = ours["wall"] * 1e6
    if args.xla:
        xla = time_jax(sets, static, "xla", max(args.reps // 4, 3))
        row["xla_us"] = (xla["device"] or xla["wall"]) * 1e6
    return row


def with_ratios(row: dict) -> dict:
    """The row plus its derived ratios (recomputed, so merged rows stay consistent)."""
    out = dict(row, floor_fraction=row["hbm_floor_us"] / row["jax_kda_us"])
    out.pop("speedup_vs_fla", None)
    if "fla_us" in row:
        out["speedup_vs_fla"] = row["fla_us"] / row["jax_kda_us"]
    return out


def write_report(rows, out: pathlib.Path, device: str):
    rows = [with_ratios(r) for r in rows]
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(device=device, method=METHOD, rows=rows), indent=1))
    header = (
        "| case | tokens | H | plan (V-split, segments) | jax_kda µs | FLA µs | speedup vs FLA "
        "| FlashKDA µs (BENCHMARKS.md) | speedup vs FlashKDA | XLA path µs | HBM floor µs | floor / jax_kda |"
    )
    lines = [header, "|" + "---|" * 12]
    for r in rows:
        fmt = lambda key, spec=".0f": format(r[key], spec) if key in r else "—"  # noqa: E731
        lines.append(
            f"| {r['case']} | {r['tokens']} | {r['heads']} | {r['plan']['v_split']}, {r['plan']['num_segments']} "
            f"| {fmt('jax_kda_us')} | {fmt('fla_us')} | {fmt('speedup_vs_fla', '.2f')} "
            f"| {FLASHKDA_US.get(r['case'], '—')} "
            f"| {format(FLASHKDA_US[r['case']] / r['jax_kda_us'], '.2f') if r['case'] in FLASHKDA_US else '—'} "
            f"| {fmt('xla_us')} "
            f"| {fmt('hbm_floor_us')} | {fmt('floor_fraction', '.1%')} |"
        )
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(12, 4.5))
        x = np.arange(len(rows))
        series = [("jax_kda_us", "jax_kda"), ("fla_us", "FLA chunk_kda"), ("xla_us", "jax_kda XLA path")]
        present = [(key, label) for key, label in series if any(key in r for r in rows)]
        width = 0.8 / max(len(present), 1)
        for i, (key, label) in enumerate(present):
            ax.bar(x + i * width, [r.get(key, np.nan) for r in rows], width, label=label)
        ax.scatter(x + 0.4 - width / 2, [r["hbm_floor_us"] for r in rows], marker="_", s=400, c="k",
                   label="HBM floor", zorder=3)
        ax.scatter(x + 0.4 - width / 2, [FLASHKDA_US.get(r["case"], np.nan) for r in rows], marker="*", s=80,
                   c="crimson", label="FlashKDA (BENCHMARKS.md, not this run)", zorder=3)
        ax.set_yscale("log")
        ax.set_xticks(x + 0.4 - width / 2, [r["case"] for r in rows], rotation=30, ha="right")
        ax.set_ylabel("µs per call (log)")
        ax.set_title(f"KDA prefill on {device}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # beside the bars, not over them
        fig.tight_layout()
        fig.savefig(out / "prefill.png", dpi=110)
    except ImportError:
        print("matplotlib not installed: no plot")
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(w.name for w in BENCHMARK_GRID),
                        help="comma-separated names from the grid (default: all of it) or testing.EXTRA_CASES")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--fla", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--xla", action="store_true", help="also time backend='xla'")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--merge", nargs="+", type=pathlib.Path, help="only merge earlier results.json files")
    args = parser.parse_args()

    if args.merge:
        runs = [json.loads(p.read_text()) for p in args.merge]
        merged = {}
        for run in runs:  # a later file's row for a case (or a later field) wins
            for row in run["rows"]:
                merged[row["case"]] = {**merged.get(row["case"], {}), **row}
        order = list(BENCHMARK_CASES)
        rows = sorted(merged.values(), key=lambda r: order.index(r["case"]))
        print(write_report(rows, args.out, runs[-1]["device"]))
        return

    by_name = BENCHMARK_CASES
    device = jax.devices()[0].device_kind
    rng = np.random.default_rng()
    rows = []
    for name in args.cases.split(","):
        row = run_case(by_name[name], args, rng)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nmethod: {METHOD}\ndevice: {device}, {time.strftime('%Y-%m-%d')}\n")
    print(write_report(rows, args.out, device))


if __name__ == "__main__":
    main()
