"""Device timeline of K back-to-back jax_kda prefill calls (one jitted program, as bench_prefill.py
times them): every GPU activity with its duration and the idle gap before it.

    python benchmarks/timeline.py h96_fixed8k [--calls K] [--backend auto]

Uses the PyTorch profiler only as a CUPTI client (harness.gpu_activities: it records every kernel
and copy of the process, jax's included), so it needs torch with CUDA. Prints one line per activity
of the last call, then a summary: busy, idle and wall time per call, and the busy time per kernel
kind (prepare_chunks, the recurrence, combine_segments, other).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402

import jax_kda  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("case", help="a benchmark case (harness.workload)")
    parser.add_argument("--calls", type=int, default=8, help="calls (input sets) in the program (default 8)")
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()

    w = harness.workload(args.case)
    inputs = harness.input_sets(w, np.random.default_rng(), args.calls)
    static, k = inputs.static, len(inputs)

    @jax.jit
    def many(all_sets):
        return [jax_kda.prefill(*a, **kw, **static, backend=args.backend) for a, kw in all_sets]

    run = lambda: jax.block_until_ready(many(inputs.sets))  # noqa: E731
    for _ in range(3):
        run()
    events = harness.gpu_activities(run)
    if not events:
        sys.exit("no GPU activity recorded (torch with CUDA missing, or CUPTI unavailable)")
    busy = sum(e.duration for e in events)
    wall = harness.span_us(events)
    per_call = len(events) // k
    previous_end = None
    for e in events[-per_call:] if per_call else events:
        gap = 0 if previous_end is None else e.start - previous_end
        print(f"{e.duration:10.1f} us  gap {gap:8.1f} us  {e.name[:90]}")
        previous_end = e.end
    parts = harness.by_kernel(events, k)
    print(f"{w.name}: {len(events)} activities for {k} calls; per call: busy {busy / k:.1f} us, "
          f"idle {(wall - busy) / k:.1f} us, wall {wall / k:.1f} us; "
          + ", ".join(f"{kind} {us:.1f}" for kind, us in parts.items()))


if __name__ == "__main__":
    main()
