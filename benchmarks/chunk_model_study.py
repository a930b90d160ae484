"""Accuracy of chunk-size and kr-storage designs on the kernels' numpy model, against float64 (CPU only).

    python benchmarks/chunk_model_study.py [--seeds 3]

The recurrence's serial steps are one per chunk; 32-token chunks would halve them, and a recurrence one
chunk ahead (tests/kda_chunk_model.py `lookahead_chunk`) would take the state update off each step's
chain. This prints, for the kernels' design (16-token chunks, kr in bf16, the serial recurrence) and the
studied ones (32-token chunks, kr in bf16 or in fp16 with a per-token power-of-two scale:
tests/kda_chunk_model.py KR_FORMATS; the lookahead recurrence, its 16 x 16 cross products in bf16 or
as hi + lo pairs), the worst o and
final-state err_ratio over seeds of each case of tests/test_kernel_algorithm.py that runs long enough
to hold two or more 32-token chunks (with and without the in-kernel l2 norm, raw keys scaled by
1/sqrt(K) as the test does), then the same for keys far below fp16's normal range (x 1e-4, x 1e-6,
no l2 norm, no initial state), where an unscaled fp16 kr ("fp16") would lose them in its subnormals,
and last a lower-bound gate saturated at -5 a token on half of the channels, with the share of chunks
whose pair products stay on the fast path (whole-chunk products at 32 tokens leave it; products by
16-token halves, PAIR_PRODUCTS "halves", do not).
The kernels' accuracy on the long-memory cases, which a new design must keep, is
tests/test_kernel_algorithm.py LONG_MEMORY_O_BAR / LONG_MEMORY_STATE_BAR. Nothing here runs a kernel.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
import kda_chunk_model as model  # noqa: E402
import test_kernel_algorithm as tka  # noqa: E402

# (tokens a chunk, kr storage, pair products: over the whole chunk, or by 16-token halves plus the
# cross block, the recurrence: serial or one chunk ahead; tests/kda_chunk_model.py KR_FORMATS,
# PAIR_PRODUCTS, RECURRENCES). The first is the kernels'.
DESIGNS = ((16, "bf16", "chunk", "serial"), (32, "bf16", "chunk", "serial"), (32, "fp16_scaled", "chunk", "serial"),
           (32, "fp16_scaled", "halves", "serial"), (16, "bf16", "chunk", "lookahead"),
           (16, "bf16", "chunk", "lookahead_hi_lo"))


def label(design):
    chunk, kr_format, pairs, recurrence = design
    return (f"C={chunk} kr {kr_format}" + (" by halves" if pairs == "halves" else "")
            + ("" if recurrence == "serial" else f" {recurrence.replace('_', ' ')}"))


def design_args(design):
    chunk, kr_format, pairs, recurrence = design
    return dict(chunk=chunk, kr_format=kr_format, pair_products=pairs, recurrence=recurrence)


def errors(case_args, seed, l2, design, key_scale=None, gold_cache=None):
    name, t_len, h_q, hv, gate, extra = case_args
    if key_scale is not None:  # no initial state: the keys' writes are all the state holds
        extra = dict(extra, with_state=False)
    case = tka.make_case(np.random.default_rng(seed), t_len, h_q, hv, gate, **extra)
    if not l2:
        case["q"], case["k"] = tka.bf16(case["q"] / np.sqrt(tka.K)), tka.bf16(case["k"] / np.sqrt(tka.K))
    if key_scale is not None:
        case["k"] = tka.bf16(case["k"] * key_scale)
    flags = dict(scale=tka.K ** -0.5, gate_mode=gate, a_log=case["a_log"], dt_bias=case["dt_bias"],
                 lower_bound=-5.0, use_qk_l2norm=l2, use_beta_sigmoid=True)
    args = (case["q"], case["k"], case["v"], case["g"], case["beta"])
    key = (name, seed, l2, key_scale)
    if key not in gold_cache:
        gold_cache[key] = tka.token_recurrence_f64(*args, initial_state=case["initial_state"], **flags)
    o_gold, s_gold = gold_cache[key]
    o, s = model.chunked_prefill(*args, initial_state=case["initial_state"], **design_args(design), **flags)
    return tka.err_ratio(o, o_gold), tka.err_ratio(s, s_gold)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    seeds = range(1, parser.parse_args().seeds + 1)
    gold = {}
    print("case | l2 norm | " + " | ".join(f"{label(d)}: o / state" for d in DESIGNS))
    for case in (c for c in tka.CASES if c[1] >= 64):
        for l2 in (True, False):
            cells = []
            for design in DESIGNS:
                worst = np.max([errors(case, s, l2, design, gold_cache=gold) for s in seeds], axis=0)
                cells.append(f"{worst[0]:.2e} / {worst[1]:.2e}")
            print(f"{case[0]} | {l2} | " + " | ".join(cells))
    long_memory = next(c for c in tka.CASES if c[0] == "preact_long_memory")
    for key_scale in (1e-4, 1e-6):
        cells = []
        for design in DESIGNS + ((32, "fp16", "chunk", "serial"),):
            worst = np.max([errors(long_memory, s, False, design, key_scale, gold) for s in seeds], axis=0)
            cells.append(f"{label(design)}: {worst[0]:.2e} / {worst[1]:.2e}")
        print(f"preact_long_memory, keys x {key_scale:g}, no l2 norm, no initial state | " + " | ".join(cells))
    # A lower-bound gate saturated at -5 a token on half of the channels: 32 tokens of it are
    # -231 (log2), past the fast path's -200, so whole-chunk pair products go element-wise.
    for design in DESIGNS:
        worst, fast = [0.0, 0.0], []
        for s in seeds:
            args, flags, init = tka.saturated_lower_bound_case(np.random.default_rng(s))
            o_gold, s_gold = tka.token_recurrence_f64(*args, initial_state=init, **flags)
            o, st = model.chunked_prefill(*args, initial_state=init, **design_args(design), **flags)
            worst = np.maximum(worst, (tka.err_ratio(o, o_gold), tka.err_ratio(st, s_gold)))
            fast += tka.fast_path_per_chunk(args, flags, chunk=design[0], kr_format=design[1],
                                            pair_products=design[2])
        print(f"lower bound saturated (-5 a token) on half the channels | {label(design)}: "
              f"{worst[0]:.2e} / {worst[1]:.2e}, pair products on the fast path in {np.mean(fast):.0%} of the chunks")


if __name__ == "__main__":
    with np.errstate(over="ignore", invalid="ignore"):
        main()
