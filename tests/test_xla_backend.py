"""backend="xla" against the float64 token recurrence over SPEC.md section 5's input matrix."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_kda
from jax_kda import gold
from jax_kda.testing import Workload, as_numpy64, gold_kwargs, make_inputs

BF16_BAR = 5e-3  # SPEC.md section 5, bf16 inputs
FP32_BAR = 1e-5  # fp32 inputs: the chunked path must match the recurrence to fp32 rounding

W = Workload
CASES = [
    # Sequence lengths around the chunk boundaries, including empty.
    W("t0", seqlen=0),
    W("t1", seqlen=1),
    W("t15", seqlen=15),
    W("t16", seqlen=16),
    W("t17", seqlen=17),
    W("t33", seqlen=33),
    W("t63", seqlen=63),
    W("t64", seqlen=64),
    W("t65_batch3", batch=3, seqlen=65),
    # The three gate forms and pre-activated gates down to -30 and -60 per token.
    W("softplus", seqlen=200, gate="softplus"),
    W("lower_bound", seqlen=200, gate="lower_bound"),
    W("lower_bound_no_a_log", seqlen=200, gate="lower_bound_no_a_log"),
    W("pre_minus30", seqlen=200, gate="preactivated", decay_floor=-30.0),
    W("pre_minus60", seqlen=200, gate="preactivated", decay_floor=-60.0),
    W("softplus_extreme", seqlen=130, gate="softplus", long_memory=True),
    # Long memory (decays near 0): the hard case for state precision.
    W("long_memory_pre", seqlen=2048, heads=1, gate="preactivated", decay_floor=-30.0, long_memory=True),
    W("long_memory_lb", seqlen=2048, heads=1, gate="lower_bound", long_memory=True, lower_bound=-1.0),
    # Heads: H not a multiple of 8, grouped value heads, state layouts, no initial state.
    W("h12", seqlen=40, heads=12, head_k=16, head_v=16),
    W("gqa", seqlen=70, heads=2, v_heads=6),
    W("v_first", seqlen=70, state_v_first=True),
    W("no_initial_state", seqlen=70, initial_state=False),
    W("no_final_state", seqlen=70, output_final_state=False),
    W("k_ne_v", seqlen=50, head_k=48, head_v=24),
    W("no_l2norm_no_sigmoid", seqlen=90, l2norm=False, beta_sigmoid=False),
    W("kda_dims_128", seqlen=100, heads=2, head_k=128, head_v=128),
    # Packed sequences of mixed lengths, zero-length ones among them.
    W("packed_mixed", seqlens=(13, 0, 64, 1, 100, 0, 31), gate="softplus"),
    W("packed_leading_empty", seqlens=(0, 0, 50, 17), gate="preactivated", decay_floor=-60.0),
    W("packed_one", seqlens=(77,), state_v_first=True),
    W("packed_gqa_h12", seqlens=(16, 33, 15), heads=3, v_heads=12, head_k=16, head_v=16),
    W("packed_long_memory", seqlens=(700, 3, 0, 1100), heads=1, gate="preactivated", decay_floor=-30.0,
      long_memory=True),
]


def _check(w: Workload, seed: int, bar: float):
    rng = np.random.default_rng(seed)
    args, kwargs = make_inputs(w, rng)
    o, final = jax_kda.prefill(*args, backend="xla", **kwargs)
    gold_o, gold_final = gold.recurrence(*as_numpy64(args), **gold_kwargs(kwargs))
    assert o.dtype == args[0].dtype and o.shape == gold_o.shape
    assert np.all(np.isfinite(np.asarray(o, np.float32)))
    o_err = gold.err_ratio(np.asarray(o, np.float32), gold_o)
    assert o_err <= bar, f"{w.name}: o err_ratio {o_err:.3e} > {bar}"
    if w.output_final_state:
        assert final.dtype == np.float32 and final.shape == gold_final.shape
        s_err = gold.err_ratio(np.asarray(final), gold_final)
        assert s_err <= bar, f"{w.name}: final state err_ratio {s_err:.3e} > {bar}"
    else:
        assert final is None


@pytest.mark.parametrize("w", CASES, ids=lambda w: w.name)
def test_bf16_inputs_match_float64_recurrence(w, fresh_seed):
    _check(w, fresh_seed, BF16_BAR)


FULL_PRECISION_CASES = [
    W("fp32_pre_minus60", seqlen=150, gate="preactivated", decay_floor=-60.0, dtype="float32"),
    W("fp32_softplus", seqlen=150, gate="softplus", dtype="float32"),
    W("fp32_lower_bound_long_memory", seqlen=1024, heads=1, long_memory=True, dtype="float32"),
    W("fp32_packed", seqlens=(40, 0, 90, 7), gate="lower_bound_no_a_log", dtype="float32"),
    W("fp16_gqa", seqlen=90, v_heads=4, dtype="float16"),
]


@pytest.mark.parametrize("w", FULL_PRECISION_CASES, ids=lambda w: w.name)
def test_full_precision_inputs_match_float64_recurrence(w, fresh_seed):
    # fp16 inputs still round o to fp16 (~5e-4); only fp32 is held to the fp32 bar.
    _check(w, fresh_seed, FP32_BAR if w.dtype == "float32" else 2e-3)


def test_empty_sequences_keep_their_initial_state(fresh_seed):
    w = W("all_empty", seqlens=(0, 0, 0))
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    o, final = jax_kda.prefill(*args, backend="xla", **kwargs)
    assert o.shape == (1, 0, 2, 32)
    np.testing.assert_array_equal(np.asarray(final), np.asarray(kwargs["initial_state"]))


def test_packed_matches_separate_calls(fresh_seed):
    """Each packed sequence gives what it gives alone: no state or tokens leak across boundaries."""
    rng = np.random.default_rng(fresh_seed)
    w = W("packed", seqlens=(20, 0, 45, 3), gate="softplus", dtype="float32")
    args, kwargs = make_inputs(w, rng)
    o, final = jax_kda.prefill(*args, backend="xla", **kwargs)
    cu = np.asarray(kwargs["cu_seqlens"])
    for n in range(len(w.seqlens)):
        a, b = int(cu[n]), int(cu[n + 1])
        if a == b:
            continue
        one = {**kwargs, "cu_seqlens": None, "initial_state": kwargs["initial_state"][n : n + 1]}
        o1, f1 = jax_kda.prefill(*(x[:, a:b] for x in args), backend="xla", **one)
        np.testing.assert_allclose(np.asarray(o[:, a:b]), np.asarray(o1), rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(np.asarray(final[n]), np.asarray(f1[0]), rtol=2e-5, atol=2e-6)


def test_int64_cu_seqlens_and_tokens_outside_every_sequence(fresh_seed):
    """int64 offsets are accepted; with cu_seqlens[0] > 0 and cu_seqlens[N] < T the tokens outside
    every sequence get o = 0 (the XLA path's documented behaviour) and the rest match the gold."""
    w = W("outside", seqlens=(90,), dtype="float32")
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    cu = np.array([7, 30, 30, 71], np.int64)
    kwargs = {**kwargs, "cu_seqlens": cu, "initial_state": np.zeros((3, 2, 32, 32), np.float32) + 0.1}
    o, final = jax_kda.prefill(*args, backend="xla", **kwargs)
    gold_o, gold_final = gold.recurrence(*as_numpy64(args), **gold_kwargs(kwargs))
    o = np.asarray(o)
    assert np.all(o[:, :7] == 0) and np.all(o[:, 71:] == 0)
    assert gold.err_ratio(o[:, 7:71], gold_o[:, 7:71]) <= FP32_BAR
    assert gold.err_ratio(np.asarray(final), gold_final) <= FP32_BAR


def test_unit_lower_inverse_matches_numpy(fresh_seed):
    from jax_kda.xla_backend import _unit_lower_inverse

    rng = np.random.default_rng(fresh_seed)
    lower = np.tril(rng.uniform(-0.5, 0.5, (3, 64, 64)), -1).astype(np.float32)
    got = np.asarray(_unit_lower_inverse(jax.numpy.asarray(lower)))
    want = np.linalg.inv(np.eye(64) + lower.astype(np.float64))
    assert gold.err_ratio(got, want) < 1e-5
    assert np.all(np.triu(got, 1) == 0) and np.all(np.diagonal(got, axis1=1, axis2=2) == 1)
