"""Long contexts on the kernels: time per call, device memory beyond inputs and outputs, and agreement
with the XLA path on a sampled head.

    python benchmarks/long_context.py [--cases h32_1m,h96_256k,h8_2m] [--reps 3] [--out DIR]

Cases (the benchmark grid's flags: lower-bound gate -5 with A_log, gate, beta sigmoid and l2norm in
the kernel, fp32 state in and out): 1M tokens x 32 heads, 256K x 96 and 2M x 8, one sequence each.
Each is past the workspace limit of one kernel call, so the call is cut along T into pieces
(jax_kda/planner.py). Inputs are drawn on the device (jax.random). Time: wall clock per call
(median of --reps after a warm-up; device time too where torch with CUDA is there, via
harness.measure). Memory: the compiled program's temporary bytes (`memory_analysis()`), next to the
inputs' bytes. Agreement: o and the final state of head 0 against the XLA path run on that head
alone (err_ratio). Writes DIR/long_context.json and prints a table.
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

CASES = {"h32_1m": (1 << 20, 32), "h96_256k": (1 << 18, 96), "h8_2m": (1 << 21, 8)}
FLAGS = dict(output_final_state=True, state_v_first=True, **harness.GRID_FLAGS)
METHOD_NOTE = (f"one call per run after a warm-up; wall clock: the median of --reps runs; device time: the median "
               f"CUPTI span of {harness.PROFILED_RUNS} profiled runs (harness.measure); temp: memory_analysis()")


def inputs(t: int, h: int, key):
    return harness.device_inputs(key, t, h, num_states=1)


def head0(args, arrays):
    one = lambda x: x[:, :, :1]  # noqa: E731
    return tuple(map(one, args)), dict(A_log=arrays["A_log"][:1], dt_bias=arrays["dt_bias"][:1],
                                       initial_state=arrays["initial_state"][:, :1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    rows = []
    for name in args.cases.split(","):
        t, h = CASES[name]
        a, kw = inputs(t, h, jax.random.key(len(rows)))
        call = jax.jit(lambda a, kw: jax_kda.prefill(*a, **kw, **FLAGS))
        decision = jax_kda.explain(*a, **kw, **FLAGS)
        compiled = call.lower(a, kw).compile()
        memory = compiled.memory_analysis()
        temp = getattr(memory, "temp_size_in_bytes", None)
        in_bytes = sum(x.nbytes for x in (*a, *kw.values()))
        o, final = call(a, kw)
        timing = harness.measure(lambda: jax.block_until_ready(call(a, kw)), 1, args.reps)
        a1, kw1 = head0(a, kw)
        o_x, final_x = jax.jit(lambda a, kw: jax_kda.prefill(*a, **kw, **FLAGS, backend="xla"))(a1, kw1)
        f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
        plan = decision.plan
        row = dict(case=name, tokens=t, heads=h, backend=decision.backend, piece_len=plan and plan.piece_len,
                   segments=plan and plan.num_segments, us=harness.best_us(timing), temp_bytes=temp,
                   input_bytes=in_bytes, temp_over_inputs=None if temp is None else temp / in_bytes,
                   err_o_head0=gold.err_ratio(f32(o[:, :, :1]), f32(o_x)),
                   err_state_head0=gold.err_ratio(f32(final[:, :1]), f32(final_x)), **timing)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del a, kw, o, final, o_x, final_x
    lines = []
    for r in rows:
        temp = "—" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 1e9:.2f}"
        ratio = "—" if r["temp_over_inputs"] is None else f"{100 * r['temp_over_inputs']:.1f}%"
        lines.append([r["case"], str(r["tokens"]), str(r["heads"]), str(r["piece_len"]), str(r["segments"]),
                      f"{r['us']:.0f}", temp, f"{r['input_bytes'] / 1e9:.1f}", ratio, f"{r['err_o_head0']:.2e}",
                      f"{r['err_state_head0']:.2e}"])
    harness.print_table(METHOD_NOTE, ["case", "tokens", "heads", "pieces of", "segments", "µs per call", "temp GB",
                                      "inputs GB", "temp / inputs", "err o (head 0 vs XLA)", "err state"], lines)
    harness.save_rows(args.out, "long_context.json", rows, METHOD_NOTE)

if __name__ == "__main__":
    main()
