"""Device time of the sm90 kernels per forced segment count (intracard context parallelism), next to
what the planner's wave model predicts and picks: the data behind `jax_kda/planner.py`'s constants.

    python benchmarks/sweep_segments.py h32_fixed32k:1,2,4,8 h12_fixed8k:1,4,8,16

Each CASE:N1,N2,... is a benchmark-grid case and the segment counts to force. Timing is
bench_prefill.py's (K calls on K distinct input sets in one jitted program, CUPTI device time via
torch.profiler, median); the per-kernel split sums the GPU activities of one profiled run by name
(prepare, the recurrence passes, the combine kernel, everything else: XLA's own ops) per call.
"""

from __future__ import annotations

import math
import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_prefill as bp  # noqa: E402

from jax_kda import planner  # noqa: E402
from jax_kda.config import validate  # noqa: E402
from jax_kda.primitive import FFI_TARGETS  # noqa: E402
from jax_kda.testing import BENCHMARK_GRID, make_inputs, prefill_on_target  # noqa: E402


def split_by_kernel(run, calls: int) -> dict:
    """Microseconds per call of one profiled `run()`, summed by kernel kind."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    out = dict(prepare=0.0, recurrence=0.0, combine=0.0, other=0.0)
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = next((k for k, key in (("prepare", "prepare"), ("recurrence", "ecurrence"),
                                      ("combine", "combine_segments")) if key in e.name), "other")
        out[kind] += (e.time_range.end - e.time_range.start) / calls
    return out


def sweep(name: str, segment_counts: list[int], reps: int = 3):
    w = {w.name: w for w in BENCHMARK_GRID}[name]
    args, kwargs = make_inputs(w, np.random.default_rng())
    k = min(max(8, math.ceil(4 * bp.L2_BYTES / bp.input_bytes(args, kwargs))), 16)
    sets = [(args, kwargs)] + [bp.derived_set(args, kwargs, i) for i in range(1, k)]
    static = bp.split_kwargs(kwargs)[1]
    sets = [(a, bp.split_kwargs(kw)[0]) for a, kw in sets]
    cfg = validate(*args, **kwargs)
    chosen = planner.plan_prefill(cfg).num_segments
    for n in segment_counts:

        @jax.jit
        def many(all_sets, n=n):
            return [prefill_on_target(FFI_TARGETS["sm90"], *a, num_segments=n, **kw, **static) for a, kw in all_sets]

        run = lambda: jax.block_until_ready(many(sets))  # noqa: E731
        timing = bp.measure(run, len(sets), reps)
        parts = split_by_kernel(run, len(sets))
        model = planner.recurrence_us(cfg, n, planner.DEFAULT_NUM_SMS)
        print(f"{name:14s} segments={n:3d}{' (planner)' if n == chosen else '          '} "
              f"device {timing['device'] * 1e6:8.0f} us | prepare {parts['prepare']:7.0f} "
              f"recurrence {parts['recurrence']:7.0f} combine {parts['combine']:5.0f} other {parts['other']:6.0f} | "
              f"model recurrence+combine {model:7.0f} us", flush=True)


def main():
    print(f"method: {bp.METHOD}")
    for spec in sys.argv[1:]:
        name, counts = spec.split(":")
        sweep(name, [int(c) for c in counts.split(",")])


if __name__ == "__main__":
    main()
