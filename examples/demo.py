"""A Kimi-Linear-style KDA prefill through jax_kda, checked against the float64 recurrence.

    python examples/demo.py                 # picks sizes for the device it finds
    python examples/demo.py --tokens 8192 --heads 32 --backend xla

It generates its own inputs (packed prompts of mixed lengths, 128-dim heads, the softplus gate of
Kimi-Linear-48B, l2norm and beta sigmoid in the kernel, an fp32 initial state), prints which
backend ran and why, the time per call, and the error of o and of the final state against the
float64 token recurrence (the metric of FLA and FlashKDA: RMS(err) / RMS(gold)).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_kda
from jax_kda import gold
from jax_kda.testing import Workload, as_numpy64, gold_kwargs, make_inputs


def main():
    on_gpu = jax.devices()[0].platform == "gpu"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096 if on_gpu else 512, help="total prompt tokens")
    parser.add_argument("--heads", type=int, default=32, help="KDA heads (Kimi-Linear-48B: 32)")
    parser.add_argument("--backend", default="auto", choices=["auto", "xla", "sm90", "sm100"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    # Four prompts of mixed lengths packed into one row, as a serving prefill batch.
    t = args.tokens
    lengths = (t // 2, t // 4, t // 8, t - t // 2 - t // 4 - t // 8)
    workload = Workload(
        "demo", seqlens=lengths, heads=args.heads, head_k=128, head_v=128, gate="softplus", dtype="bfloat16"
    )
    inputs, kwargs = make_inputs(workload, np.random.default_rng())
    kwargs["backend"] = args.backend

    print(f"jax {jax.__version__}, device: {jax.devices()[0].device_kind}")
    if not on_gpu and os.path.exists("/dev/nvidiactl"):
        print("note: this machine has an NVIDIA GPU, but this jax has no CUDA backend, so everything runs on "
              "the CPU; install jax with CUDA (pip install 'jax[cuda13]', or '.[cuda]' from the checkout)")
    print(f"prefill: {len(lengths)} packed prompts {lengths}, {args.heads} heads x 128, softplus gate, bf16")
    print(f"decision: {jax_kda.explain(*inputs, **kwargs)}")

    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    run = jax.jit(lambda a, kw: jax_kda.prefill(*a, **kw, **static))
    out = jax.block_until_ready(run(inputs, arrays))  # compile + warm up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(run(inputs, arrays))
        times.append(time.perf_counter() - start)
    o, final = out
    print(f"time: {np.median(times) * 1e3:.2f} ms per call (median of {args.repeats}, wall clock after warm-up)")

    gold_o, gold_final = gold.recurrence(*as_numpy64(inputs), **gold_kwargs(kwargs))
    o_err = gold.err_ratio(np.asarray(jnp.asarray(o, jnp.float32)), gold_o)
    s_err = gold.err_ratio(np.asarray(final), gold_final)
    print(f"error vs float64 recurrence: o {o_err:.2e}, final state {s_err:.2e} (bar 5e-3)")


if __name__ == "__main__":
    main()
