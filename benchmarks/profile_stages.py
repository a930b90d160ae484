"""Per-kernel device time of one jax_kda prefill call, for a per-stage breakdown under Nsight Compute.

    ncu --clock-control none -k regex:'prepare|Recurrence|recurrence' --metrics gpu__time_duration.sum \\
        python benchmarks/profile_stages.py h96_fixed8k

Runs the named benchmark-grid case twice (the first call compiles and warms up); ncu reports every
launch of the kernels the regex names, so the last prepare and recurrence rows are the timed call.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

import jax_kda
from jax_kda.testing import BENCHMARK_GRID, make_inputs


def main():
    by_name = {w.name: w for w in BENCHMARK_GRID}
    for name in sys.argv[1:]:
        args, kwargs = make_inputs(by_name[name], np.random.default_rng())
        for _ in range(2):
            jax.block_until_ready(jax_kda.prefill(*args, **kwargs, backend="sm90"))
        print(f"profiled {name}", flush=True)


if __name__ == "__main__":
    main()
