"""The XLA path (backend="xla", and the backward pass of every backend) on one device: time and
temporary memory of its forward call and of jax.grad, at the default block size and at others.

    python benchmarks/xla_path.py [--cases h32_fixed8k,h8_fixed64k,h32_128x128] [--blocks default,one,16384]
                                  [--unroll 1] [--grad-cases h32_fixed8k] [--reps 3] [--out DIR]

Cases are benchmark grid names (`harness.workload`: the grid's flags, bf16, fp32 states). Block
settings: `default` (the block size jax_kda ships for the device's platform), `one` (the whole call
one block: the temporaries of every chunk at once, as before the blocks), or a number: the least
token x value heads of a block (`xla_backend.min_block_token_heads`; a block is still at most
1/BLOCKS_PER_CALL of the call). `--unroll` times each setting with that many chunk steps per
iteration of the chunk loops too (`xla_backend.CHUNK_STEPS_PER_ITERATION`). Per case and setting: the number of blocks; the compiled program's
temporary bytes (`memory_analysis()`) next to the inputs' bytes; the time per call (harness.measure:
device time where torch with CUDA is there, else wall); and o and the final state of each setting
against the first's (err_ratio; the blocks change only where the chunks' work is cut, so they agree
to rounding). With `--grad-cases`, the same for jax.grad of sum(o^2) + sum(final^2) with respect to
q, k, v, g, beta, A_log, dt_bias and the initial state. Writes DIR/xla_path.json and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402

import jax_kda  # noqa: E402
from jax_kda import gold, xla_backend  # noqa: E402

SHIPPED = xla_backend.chunks_per_block, xla_backend.min_block_token_heads
SHIPPED_UNROLL = xla_backend.CHUNK_STEPS_PER_ITERATION


def use_setting(setting: str, unroll: int = SHIPPED_UNROLL) -> None:
    """Make the XLA path cut its calls as `setting` says (see the module docstring)."""
    xla_backend.chunks_per_block, xla_backend.min_block_token_heads = SHIPPED
    xla_backend.CHUNK_STEPS_PER_ITERATION = unroll
    if setting == "one":
        xla_backend.chunks_per_block = lambda num_chunks, *_: max(num_chunks, 1)
    elif setting != "default":
        xla_backend.min_block_token_heads = lambda platform: int(setting)


def recording_blocks(blocks: list) -> None:
    """Wrap the XLA path's block rule (as set now) so that each call appends the call's block count
    to `blocks`: what the traced program does, not a second copy of its arithmetic."""
    rule = xla_backend.chunks_per_block

    def recorded(num_chunks, *rest):
        per_block = rule(num_chunks, *rest)
        blocks.append(-(-num_chunks // per_block))
        return per_block

    xla_backend.chunks_per_block = recorded


METHOD_NOTE = (f"one call per run after a warm-up; device time: the median CUPTI span of {harness.PROFILED_RUNS} "
               "profiled runs (harness.measure; wall clock where torch with CUDA is absent); temp: "
               "memory_analysis() of the compiled program")


def forward_fn(static):
    return lambda a, kw: jax_kda.prefill(*a, **kw, **static, backend="xla")


def grad_fn(static):
    def loss(a, kw):
        o, final = jax_kda.prefill(*a, **kw, **static, backend="xla")
        return jnp.sum(jnp.square(o.astype(jnp.float32))) + jnp.sum(jnp.square(final))
    return jax.grad(loss, argnums=(0, 1))


def run(name: str, setting: str, unroll: int, kind: str, reps: int, rng) -> tuple[dict, object]:
    w = harness.workload(name)
    inputs = harness.input_sets(w, rng, 1)
    (a, kw), static = inputs.sets[0], inputs.static
    row = dict(case=name, kind=kind, setting=setting, unroll=unroll, tokens=w.total_tokens, heads=w.heads,
               input_bytes=harness.input_bytes(a, kw))
    use_setting(setting, unroll)
    blocks = []
    recording_blocks(blocks)
    jax.clear_caches()
    try:
        fn = jax.jit(forward_fn(static) if kind == "forward" else grad_fn(static))
        try:
            compiled = fn.lower(a, kw).compile()
            row["blocks"] = max(blocks)
            memory = compiled.memory_analysis()
            row["temp_bytes"] = getattr(memory, "temp_size_in_bytes", None)
            out = jax.block_until_ready(compiled(a, kw))
            timing = harness.measure(lambda: jax.block_until_ready(compiled(a, kw)), 1, reps)
        except jax.errors.JaxRuntimeError as e:
            row["skipped"] = str(e).splitlines()[0][:200]
            return row, None
        row["us"] = harness.best_us(timing)
        row["timing"] = "device" if timing["device_us"] is not None else "wall"
        return row, jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64), out)
    finally:
        use_setting("default")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="h32_fixed8k,h8_fixed64k,h32_128x128")
    parser.add_argument("--grad-cases", default="h32_fixed8k")
    parser.add_argument("--blocks", default="default,one,16384")
    parser.add_argument("--unroll", default=str(SHIPPED_UNROLL), help="chunk steps per loop iteration, a list")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh draw, printed")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}; {jax.devices()[0].device_kind}", flush=True)
    rows = []
    jobs = [(c, "forward") for c in args.cases.split(",") if c] + [(c, "grad") for c in args.grad_cases.split(",") if c]
    for name, kind in jobs:
        reference = None
        for setting, unroll in itertools.product(args.blocks.split(","), map(int, args.unroll.split(","))):
            # The same inputs for every setting of a case: a generator seeded alike.
            row, out = run(name, setting, unroll, kind, args.reps, np.random.default_rng(seed))
            if out is not None:
                if reference is None:
                    reference = (f"{setting}/{unroll}", out)
                else:
                    row["vs"] = reference[0]
                    row["max_err_ratio"] = max(gold.err_ratio(x, y) for x, y in
                                               zip(jax.tree.leaves(out), jax.tree.leaves(reference[1])))
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = []
    for r in rows:
        temp = r.get("temp_bytes")
        lines.append([r["case"], r["kind"], f"{r['setting']}/{r.get('unroll', 1)}", str(r.get("blocks", "—")), f"{r['us'] / 1e3:.1f}" if "us" in r else r.get("skipped", "—"),
                      "—" if temp is None else f"{temp / 1e9:.2f}", f"{r['input_bytes'] / 1e9:.2f}",
                      "—" if temp is None else f"{temp / r['input_bytes']:.2f}",
                      f"{r['max_err_ratio']:.1e} vs {r['vs']}" if "vs" in r else ""])
    harness.print_table(METHOD_NOTE, ["case", "call", "blocks / unroll", "blocks", "ms per call", "temp GB", "inputs GB",
                                      "temp / inputs", "agreement"], lines)
    harness.save_rows(args.out, "xla_path.json", rows, METHOD_NOTE)


if __name__ == "__main__":
    main()
