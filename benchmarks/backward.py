"""The backward under backend="auto" against the forward: time and device memory per call.

    python benchmarks/backward.py [--cases h32_8k,h32_8x1k] [--reps 5] [--out DIR]

Through the kernel primitive the forward values are the kernels' and the derivatives the XLA
path's, which recomputes its own forward for them (there is no backward kernel yet). This measures
what that costs, per case (the benchmark grid's flags: lower-bound gate -5 with A_log, gate, beta
sigmoid and l2norm in the kernel, an fp32 initial state, the final state out):

  forward             jit(prefill)                                   backend="auto" (the kernels)
  forward + backward  jit(value_and_grad(loss)) w.r.t. q, k, v, g, beta and the initial state
                      (loss = sum(o * w) + sum(final_state * w_s), fixed random cotangents)
  and both again with backend="xla".

Time: device time where torch with CUDA is there (harness.measure: median CUPTI span), else wall
clock. Memory: the compiled program's temporary bytes (`memory_analysis()`), next to the inputs'
bytes. Agreement: the gradients under "auto" against those under "xla" (err_ratio, worst over the
arguments). Writes DIR/backward.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402

import jax_kda  # noqa: E402
from jax_kda import gold  # noqa: E402

# name: (sequence lengths, heads); one entry: a dense B = 1 call, several: one packed call.
CASES = {"h32_8k": ((8192,), 32), "h32_8x1k": ((1024,) * 8, 32)}
FLAGS = dict(output_final_state=True, **harness.GRID_FLAGS)
WRT = ("q", "k", "v", "g", "beta", "initial_state")
METHOD_NOTE = (f"one call per run, after a warm-up; device time: the median CUPTI span of {harness.PROFILED_RUNS} "
               "profiled runs (wall clock without torch); temp: the compiled program's memory_analysis()")


def inputs(seqlens: tuple[int, ...], h: int, key):
    t, n = sum(seqlens), len(seqlens)
    draw_key, cot_key = jax.random.split(key)
    (q, k, v, g, beta), fixed = harness.device_inputs(draw_key, t, h, num_states=n)
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=fixed.pop("initial_state"))
    if n > 1:
        fixed["cu_seqlens"] = jnp.asarray(np.concatenate([[0], np.cumsum(seqlens)]), jnp.int32)
    ko, ks = jax.random.split(cot_key)
    cotangents = (jax.random.normal(ko, v.shape), jax.random.normal(ks, arrays["initial_state"].shape))
    return arrays, fixed, cotangents


def programs(backend: str):
    def forward(arrays, fixed):
        return jax_kda.prefill(**arrays, **fixed, **FLAGS, backend=backend)

    def loss(arrays, fixed, cotangents):
        o, final = forward(arrays, fixed)
        return jnp.sum(o.astype(jnp.float32) * cotangents[0]) + jnp.sum(final * cotangents[1])

    return jax.jit(forward), jax.jit(jax.value_and_grad(loss))


def timed(fn, args, reps: int) -> dict:
    compiled = fn.lower(*args).compile()
    temp = getattr(compiled.memory_analysis(), "temp_size_in_bytes", None)
    timing = harness.measure(lambda: jax.block_until_ready(compiled(*args)), 1, reps)
    return dict(us=harness.best_us(timing), temp_bytes=temp, **timing)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    rows = []
    for i, name in enumerate(args.cases.split(",")):
        seqlens, h = CASES[name]
        arrays, fixed, cot = inputs(seqlens, h, jax.random.key(i))
        row = dict(case=name, tokens=sum(seqlens), sequences=len(seqlens), heads=h,
                   backend=jax_kda.explain(**arrays, **fixed, **FLAGS).backend,
                   input_bytes=sum(x.nbytes for x in (*arrays.values(), *fixed.values())))
        grads = {}
        for backend in ("auto", "xla"):
            forward, step = programs(backend)
            row[f"{backend}_forward"] = timed(forward, (arrays, fixed), args.reps)
            row[f"{backend}_forward_backward"] = timed(step, (arrays, fixed, cot), args.reps)
            grads[backend] = step(arrays, fixed, cot)[1]
        f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
        row["grad_err_vs_xla"] = {n: gold.err_ratio(f64(grads["auto"][n]), f64(grads["xla"][n])) for n in WRT}
        rows.append(row)
        print(json.dumps(row), flush=True)
    gb = lambda r: "—" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 1e9:.2f}"  # noqa: E731
    lines = []
    for r in rows:
        af, ab, xf, xb = (r[k] for k in ("auto_forward", "auto_forward_backward", "xla_forward", "xla_forward_backward"))
        lines.append([r["case"], f"{r['tokens']} x {r['heads']}", f"{af['us']:.0f}", f"{ab['us']:.0f}",
                      f"{(ab['us'] - af['us']) / af['us']:.1f}x", f"{gb(af)} / {gb(ab)}", f"{xf['us']:.0f}",
                      f"{xb['us']:.0f}", f"{gb(xf)} / {gb(xb)}", f"{r['input_bytes'] / 1e9:.2f}",
                      f"{max(r['grad_err_vs_xla'].values()):.1e}"])
    harness.print_table(METHOD_NOTE, ["case", "tokens x heads", "auto forward µs", "auto fwd + bwd µs", "bwd / fwd",
                                      "auto temp GB (fwd / fwd + bwd)", "xla forward µs", "xla fwd + bwd µs",
                                      "xla temp GB (fwd / fwd + bwd)", "inputs GB", "worst grad err vs xla"], lines)
    harness.save_rows(args.out, "backward.json", rows, METHOD_NOTE)

if __name__ == "__main__":
    main()
