"""Where the time of many short prompts goes: the same tokens cut into prompts of every length,
with and without states, per kernel.

    python benchmarks/short_prompts.py [--tokens 16384] [--heads 32] [--lengths 64,128,...] [--out DIR]

One packed call of `--tokens` tokens at `--heads` heads (the benchmark grid's flags: lower-bound
gate -5 with A_log, gate, beta sigmoid and l2norm in the kernel), cut into tokens / L prompts of L
tokens for each L, run twice: with an fp32 initial state in and the final state out (what a
serving stack's prefill does), and with neither. Per kernel (harness.measure: CUPTI, median of
the profiled runs): prepare and the recurrence. The recurrence runs one CTA per (V slice, head,
prompt), two per SM, so the difference between the two runs is what the states cost, and the
growth of the stateless recurrence as L shrinks (same tokens, more CTAs) is the per-CTA fixed
cost (start-up, pipeline fill, drain) a persistent recurrence would hide. Writes
DIR/short_prompts.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402

import jax_kda  # noqa: E402
from jax_kda import contract  # noqa: E402

FLAGS = harness.GRID_FLAGS
METHOD_NOTE = (f"one call per run on one input set (larger than the L2), after a warm-up; device time and per-kernel "
               f"times: the median of {harness.PROFILED_RUNS} profiled runs (CUPTI, harness.measure)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--lengths", default="64,128,256,512,1024,4096,16384")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    t, h, d = args.tokens, args.heads, contract.HEAD_DIM
    arrays, fixed = harness.device_inputs(jax.random.key(0), t, h)
    state_key = jax.random.key(1)
    rows = []
    for length in map(int, args.lengths.split(",")):
        n = t // length
        cu = jnp.arange(n + 1, dtype=jnp.int32) * length
        state = 0.5 * jax.random.normal(state_key, (n, h, d, d))
        for with_state in (True, False):
            if with_state:
                call = jax.jit(lambda a, s: jax_kda.prefill(*a, cu_seqlens=cu, initial_state=s, output_final_state=True,
                                                            **fixed, **FLAGS))
                run = lambda: jax.block_until_ready(call(arrays, state))  # noqa: E731
            else:
                call = jax.jit(lambda a: jax_kda.prefill(*a, cu_seqlens=cu, **fixed, **FLAGS))
                run = lambda: jax.block_until_ready(call(arrays))  # noqa: E731
            plan = jax_kda.explain(*arrays, cu_seqlens=cu, **fixed, **FLAGS).plan
            timing = harness.measure(run, 1, args.reps)
            row = dict(prompt_len=length, prompts=n, heads=h, states=with_state, us=harness.best_us(timing),
                       segments=plan and plan.num_segments, **timing)
            rows.append(row)
            print(json.dumps(row), flush=True)
    nan = float("nan")
    lines = []
    for r in rows:
        kern = r["kernels"] or {}
        rec = kern.get("recurrence", nan)
        per = 1e3 * rec / (t // contract.CHUNK * h * contract.V_SPLIT)
        lines.append([str(r["prompt_len"]), str(r["prompts"]), "in + out" if r["states"] else "none", str(r["segments"]),
                      f"{r['us']:.0f}", f"{kern.get('prepare', nan):.0f}", f"{rec:.0f}", f"{per:.2f}",
                      f"{kern.get('other', nan):.1f}"])
    harness.print_table(METHOD_NOTE, ["prompt length", "prompts", "states", "segments", "µs per call", "prepare µs",
                                      "recurrence µs", "recurrence ns per (chunk, head, V slice)", "other µs"], lines)
    harness.save_rows(args.out, "short_prompts.json", rows, METHOD_NOTE)

if __name__ == "__main__":
    main()
