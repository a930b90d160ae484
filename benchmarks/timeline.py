"""Device timeline of K back-to-back jax_kda prefill calls (one jitted program, as bench_prefill.py
times them): every GPU activity with its duration and the idle gap before it.

    python benchmarks/timeline.py h96_fixed8k [K]

Uses the PyTorch profiler only as a CUPTI client (it records every kernel and copy of the process,
jax's included), so it needs torch with CUDA. Prints one line per activity of the last call and a
summary: busy time, idle time and wall time per call.
"""

from __future__ import annotations

import sys

import jax
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import jax_kda
from jax_kda.testing import BENCHMARK_CASES, make_inputs

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_prefill import derived_set, split_kwargs  # noqa: E402


def main():
    w = BENCHMARK_CASES[sys.argv[1]]
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    args, kwargs = make_inputs(w, np.random.default_rng())
    static = split_kwargs(kwargs)[1]
    sets = [(args, split_kwargs(kwargs)[0])]
    sets += [(a, split_kwargs(kw)[0]) for a, kw in (derived_set(args, kwargs, i) for i in range(1, k))]

    @jax.jit
    def many(all_sets):
        return [jax_kda.prefill(*a, **kw, **static) for a, kw in all_sets]

    for _ in range(3):
        jax.block_until_ready(many(sets))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        jax.block_until_ready(many(sets))
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    if not events:
        sys.exit("no GPU activity recorded (CUPTI unavailable?)")
    busy = sum(e.time_range.elapsed_us() for e in events)
    wall = events[-1].time_range.end - events[0].time_range.start
    per_call = len(events) // k
    previous_end = None
    for e in events[-per_call:] if per_call else events:
        gap = 0 if previous_end is None else e.time_range.start - previous_end
        print(f"{e.time_range.elapsed_us():10.1f} us  gap {gap:8.1f} us  {e.name[:90]}")
        previous_end = e.time_range.end
    print(f"{w.name}: {len(events)} activities for {k} calls; per call: busy {busy / k:.1f} us, "
          f"idle {(wall - busy) / k:.1f} us, wall {wall / k:.1f} us")


if __name__ == "__main__":
    main()
