"""Device time of the sm90 kernels per forced segment count (intracard context parallelism), next to
what the planner's wave model predicts and picks: the data behind `jax_kda/planner.py`'s constants.

    python benchmarks/sweep_segments.py h32_fixed32k:1,2,4,8 h12_fixed8k:1,4,8,16

Each CASE:N1,N2,... is a benchmark case (harness.workload: the grid, EXTRA_CASES or a name of the
grid's form) and the segment counts to force, through
`jax_kda.testing.prefill_with_kernels(Kernels.SM90, ..., num_segments=n)`. Timing is the harness's
(bench_prefill.py's): K calls on K distinct input sets in one jitted program, CUPTI device time via
torch.profiler, median; the per-kernel split sums the GPU activities of the same profiled runs by
name (prepare_chunks, the recurrence passes, combine_segments, everything else: XLA's own ops) per
call. Needs a Hopper GPU and torch with CUDA (for CUPTI); without them only wall time is printed.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402

from jax_kda import planner  # noqa: E402
from jax_kda.config import validate  # noqa: E402
from jax_kda.contract import Kernels  # noqa: E402
from jax_kda.testing import prefill_with_kernels  # noqa: E402


def parse_spec(spec: str) -> tuple[str, list[int]]:
    name, _, counts = spec.partition(":")
    if not counts:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected CASE:N1,N2,...")
    return name, [int(c) for c in counts.split(",")]


def sweep(name: str, segment_counts: list[int], reps: int, kernels: Kernels):
    inputs = harness.input_sets(harness.workload(name), np.random.default_rng())
    static = inputs.static
    cfg = validate(*inputs.args, **inputs.kwargs)
    num_sms = getattr(jax.devices()[0], "core_count", None) or planner.DEFAULT_NUM_SMS
    chosen = planner.plan_prefill(cfg, num_sms=num_sms).num_segments
    for n in segment_counts:

        @jax.jit
        def many(all_sets, n=n):
            return [prefill_with_kernels(kernels, *a, num_segments=n, **kw, **static) for a, kw in all_sets]

        t = harness.measure(lambda: jax.block_until_ready(many(inputs.sets)), len(inputs), reps)
        model = planner.recurrence_us(cfg, n, num_sms)
        tag = " (planner)" if n == chosen else "          "
        if t["device_us"] is None:
            print(f"{name:14s} segments={n:3d}{tag} wall {t['wall_us']:8.0f} us (no CUPTI: no device time) | "
                  f"model recurrence+combine {model:7.0f} us", flush=True)
            continue
        parts = t["kernels"]
        print(f"{name:14s} segments={n:3d}{tag} device {t['device_us']:8.0f} us | prepare {parts['prepare']:7.0f} "
              f"recurrence {parts['recurrence']:7.0f} combine {parts['combine']:5.0f} other {parts['other']:6.0f} | "
              f"model recurrence+combine {model:7.0f} us", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("specs", nargs="+", type=parse_spec, metavar="CASE:N1,N2,...")
    parser.add_argument("--reps", type=int, default=3, help="wall-time repetitions per measurement")
    parser.add_argument("--kernels", default="SM90", choices=[k.name for k in Kernels if k != Kernels.FOR_DEVICE],
                        help="the contract.Kernels request to force the segments on (default SM90)")
    args = parser.parse_args()
    device = jax.devices()[0]
    if device.platform != "gpu":
        sys.exit(f"sweep_segments.py runs the kernels: it needs a CUDA GPU (the default device is {device.platform})")
    print(f"method: {harness.METHOD}")
    for name, counts in args.specs:
        sweep(name, counts, args.reps, Kernels[args.kernels])


if __name__ == "__main__":
    main()
