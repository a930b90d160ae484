"""Time per call of the sharded prefill at 1 and N GPUs, and agreement with the 1-GPU result.

    python benchmarks/scaling.py [--gpus N] [--reps R] [--out DIR]

Two cases: tensor parallel over heads (h96_fixed8k: 96 heads x 8192 tokens, split over the GPUs'
heads; at 8 GPUs that is 12 heads each) and data parallel over the batch (32 heads, B = 8 dense
sequences of 4096 tokens, split over B). For each GPU count (1 and N, default every GPU), the inputs
are placed with NamedSharding on a mesh of that many GPUs and timed as harness.measure does (K
back-to-back calls on K distinct input sets in one jitted program): wall time per call, and CUPTI
device time (first to last GPU activity of any device, / K) where torch with CUDA is there. The
outputs are compared with the 1-GPU outputs (err_ratio of o and of the final state) before timing.
Writes DIR/scaling.json and prints a table.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402

import jax_kda  # noqa: E402
from jax_kda import gold  # noqa: E402
from jax_kda.testing import BENCHMARK_CASES, Workload  # noqa: E402

CASES = {
    "tp_h96_fixed8k": (BENCHMARK_CASES["h96_fixed8k"], None, "x"),
    "dp_h32_8x4k": (Workload("dp_h32_8x4k", batch=8, seqlen=4096, heads=32, head_k=128, head_v=128,
                             gate="lower_bound", lower_bound=-5.0, state_v_first=True), "x", None),
}


def _place(x, name, mesh, batch, heads):
    spec = {"q": P(batch, None, heads), "k": P(batch, None, heads), "v": P(batch, None, heads),
            "g": P(batch, None, heads), "beta": P(batch, None, heads), "initial_state": P(batch, heads),
            "A_log": P(heads), "dt_bias": P(heads)}[name]
    return jax.device_put(x, NamedSharding(mesh, spec))


def time_on(sets: harness.InputSets, gpus, batch, heads, reps: int):
    """(the first set's outputs, harness.measure's timing) on a mesh of `gpus`."""
    mesh = jax.sharding.Mesh(np.array(gpus), ("x",), axis_types=(AxisType.Auto,))
    names = ("q", "k", "v", "g", "beta")
    placed = [([_place(x, n, mesh, batch, heads) for x, n in zip(a, names)],
               {k: _place(v, k, mesh, batch, heads) for k, v in kw.items()}) for a, kw in sets.sets]
    static = sets.static

    @jax.jit
    def many(all_sets):
        return [jax_kda.prefill(*a, **kw, **static) for a, kw in all_sets]

    first = jax.jit(lambda a, kw: jax_kda.prefill(*a, **kw, **static))(*placed[0])
    timing = harness.measure(lambda: jax.block_until_ready(many(placed)), len(placed), reps)
    return first, timing


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None, help="the larger GPU count (default: every GPU)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    gpus = jax.devices("gpu")
    n = args.gpus or len(gpus)
    rows = []
    for name, (w, batch, heads) in CASES.items():
        sets = harness.input_sets(w, np.random.default_rng())
        base, base_timing = time_on(sets, gpus[:1], batch, heads, args.reps)
        row = dict(case=name, gpus=1, us=harness.best_us(base_timing), **base_timing)
        rows.append(row)
        if n > 1:
            out, timing = time_on(sets, gpus[:n], batch, heads, args.reps)
            err = [gold.err_ratio(np.asarray(jnp.asarray(a, jnp.float32)), np.asarray(jnp.asarray(b, jnp.float32)))
                   for a, b in zip(out, base) if b is not None]
            rows.append(dict(case=name, gpus=n, us=harness.best_us(timing), err_vs_1gpu=err,
                             speedup=row["us"] / harness.best_us(timing), **timing))
    lines = [[r["case"], str(r["gpus"]), f"{r['us']:.0f}", f"{r.get('speedup', 1.0):.2f}x",
              ", ".join(f"{e:.1e}" for e in r.get("err_vs_1gpu", ())) or "—"] for r in rows]
    harness.print_table(harness.METHOD, ["case", "GPUs", "µs per call", "speed-up vs 1 GPU",
                                         "err_ratio vs 1 GPU (o, state)"], lines)
    harness.save_rows(args.out, "scaling.json", rows)

if __name__ == "__main__":
    main()
