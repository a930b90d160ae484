"""Whether a call run as a sequence of smaller calls keeps the workspace in the L2: the same tokens as
one prefill call and as W calls in sequence, inside one jitted program, per kernel.

    python benchmarks/windows.py [--cases packed,dense] [--windows 1,4,8,16] [--out DIR]

The workspace (896 B a token-head) makes a round trip through HBM between prepare and the
recurrence; a call of fewer tokens has a smaller one, and XLA gives consecutive calls' workspaces
the same temporary buffer, so W calls of 1/W of the tokens each may find their workspace still in
the 60 MB L2 when their recurrence reads it. Cases (the benchmark grid's flags: lower-bound gate -5
with A_log, gate, beta sigmoid and l2norm in the kernel, fp32 states in the [N, H, V, K] layout):

    packed   --prompts prompts of --prompt-len tokens at --packed-heads heads, states in and out
             (h32_128x128), cut into W calls of prompts / W prompts, each with its own states
    dense    one sequence of --dense-tokens tokens at --dense-heads heads, a state in and out
             (h96_fixed8k), cut along T into W calls, the state carried from call to call

Each window's inputs are arrays of their own (drawn on the device), so that no slicing copy enters
the timing. Before timing, each W's outputs are compared with W = 1's (max |difference| relative to
the largest |o| and |state|). Timing: harness.measure over two input sets (each larger than the
L2), device time (CUPTI span) and per-kernel sums per call. Writes DIR/windows.json and prints a
table.
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

FLAGS = dict(harness.GRID_FLAGS, state_v_first=True)
SETS = 2
METHOD_NOTE = (f"one jitted program per run on each of {SETS} input sets (each larger than the L2), after a "
               f"warm-up; device time (CUPTI span) and per-kernel sums: the median of {harness.PROFILED_RUNS} "
               "profiled runs (harness.measure), per call of the whole program")


def draw_windows(key, windows: int, tokens: int, heads: int, states_per_window: int):
    """W windows of `tokens` tokens each: [((q, k, v, g, beta), initial_state or None)], with A_log
    and dt_bias shared by all of them."""
    keys = jax.random.split(key, windows + 1)
    out = []
    params = None
    for w in range(windows):
        arrays, p = harness.device_inputs(keys[w], tokens, heads, states_per_window)
        params = params or dict(A_log=p["A_log"], dt_bias=p["dt_bias"])
        out.append((arrays, p.get("initial_state")))
    return out, params


def packed_program(prompts_per_window: int, prompt_len: int):
    cu = jnp.arange(prompts_per_window + 1, dtype=jnp.int32) * prompt_len

    def program(windows, params):
        outs = []
        for arrays, state in windows:
            outs.append(jax_kda.prefill(*arrays, cu_seqlens=cu, initial_state=state, output_final_state=True,
                                        **params, **FLAGS))
        return ([o for o, _ in outs], [s for _, s in outs])

    return jax.jit(program)


def dense_program():
    def program(windows, params):
        state = windows[0][1]
        outs = []
        for arrays, _ in windows:
            o, state = jax_kda.prefill(*arrays, initial_state=state, output_final_state=True, **params, **FLAGS)
            outs.append(o)
        return outs, [state]

    return jax.jit(program)


def joined(outs):
    """(o of every window along T, final states of every window along N), as float32."""
    o, states = outs
    return jnp.concatenate(o, axis=1).astype(jnp.float32), jnp.concatenate(states, axis=0)


def relative_difference(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def program_for(case: str, args, windows: int):
    if case == "packed":
        return packed_program(args.prompts // windows, args.prompt_len)
    return dense_program()


def case_inputs(case: str, args, windows: int, set_index: int):
    """Input set `set_index` of `case` cut into `windows` calls: (windows, params)."""
    key = jax.random.fold_in(jax.random.key(args.seed), set_index)
    if case == "packed":
        per = args.prompts // windows
        return draw_windows(key, windows, per * args.prompt_len, args.packed_heads, per)
    wins, params = draw_windows(key, windows, args.dense_tokens // windows, args.dense_heads, 1)
    # Only the first window's state is an input; the others come from the call before.
    return [(a, s if i == 0 else None) for i, (a, s) in enumerate(wins)], params


def same_tokens(case: str, wins_w):
    """Window set W's arrays rearranged as W = 1's: the concatenation of its windows (the reference
    run takes exactly these tokens and states)."""
    arrays = tuple(jnp.concatenate([a[i] for a, _ in wins_w], axis=1) for i in range(5))
    if case == "packed":
        state = jnp.concatenate([s for _, s in wins_w], axis=0)
    else:
        state = wins_w[0][1]
    return [(arrays, state)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="packed,dense")
    parser.add_argument("--windows", default="1,4,8,16")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--packed-heads", type=int, default=32)
    parser.add_argument("--dense-tokens", type=int, default=8192)
    parser.add_argument("--dense-heads", type=int, default=96)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    rows = []
    for case in args.cases.split(","):
        if case not in ("packed", "dense"):
            raise SystemExit(f"unknown case {case!r}: packed or dense")
        for windows in map(int, args.windows.split(",")):
            whole = args.prompts if case == "packed" else args.dense_tokens
            if windows < 1 or whole % windows:
                raise SystemExit(f"{case}: {whole} {'prompts' if case == 'packed' else 'tokens'} do not cut into "
                                 f"{windows} equal calls")
            sets = [case_inputs(case, args, windows, i) for i in range(SETS)]
            program = program_for(case, args, windows)
            # The same tokens and states in one call: the reference for this W's outputs.
            wins0, params0 = sets[0]
            ref = joined(program_for(case, args, 1)(same_tokens(case, wins0), params0))
            got = joined(program(wins0, params0))
            diff = dict(o=relative_difference(got[0], ref[0]), state=relative_difference(got[1], ref[1]))
            del ref, got

            def run():
                jax.block_until_ready([program(w, p) for w, p in sets])

            timing = harness.measure(run, SETS, args.reps)
            row = dict(case=case, windows=windows, us=harness.best_us(timing), difference=diff, **timing)
            rows.append(row)
            print(json.dumps(row), flush=True)
    nan = float("nan")
    lines = []
    for r in rows:
        kern = r["kernels"] or {}
        lines.append([r["case"], str(r["windows"]), f"{r['us']:.0f}", f"{kern.get('prepare', nan):.0f}",
                      f"{kern.get('recurrence', nan):.0f}", f"{kern.get('other', nan):.1f}",
                      f"{r['difference']['o']:.1e} / {r['difference']['state']:.1e}"])
    harness.print_table(METHOD_NOTE, ["case", "calls", "µs per program", "prepare µs", "recurrence µs", "other µs",
                                      "o / state vs one call"], lines)
    harness.save_rows(args.out, "windows.json", rows, METHOD_NOTE)


if __name__ == "__main__":
    main()
