"""Runs jax_kda prefill calls of named benchmark cases, for a per-kernel breakdown under Nsight Compute.

    ncu --clock-control none -k regex:'prepare_chunks|Recurrence|combine_segments' \\
        --metrics gpu__time_duration.sum python benchmarks/profile_stages.py h96_fixed8k

Runs each case (harness.workload) `--calls` times (default 2: the first call compiles and warms
up); ncu reports every launch of the kernels the regex names, so the last rows of each kernel are
the last call's.
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
from jax_kda.testing import make_inputs  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("cases", nargs="+", help="benchmark cases (harness.workload)")
    parser.add_argument("--backend", default="sm90")
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args()
    for name in args.cases:
        a, kw = make_inputs(harness.workload(name), np.random.default_rng())
        for _ in range(args.calls):
            jax.block_until_ready(jax_kda.prefill(*a, **kw, backend=args.backend))
        print(f"profiled {name}", flush=True)


if __name__ == "__main__":
    main()
