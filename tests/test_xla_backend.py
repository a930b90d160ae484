"""backend="xla" beyond the shared accuracy matrix (tests/test_prefill_matrix.py runs that on every
backend, this one included): what only the XLA path serves (any K and V, fp32 and fp16 inputs, its
own 64-token chunks), against the float64 token recurrence."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_kda
from jax_kda import gold
from jax_kda.testing import ERR_RATIO_BAR, Workload, as_numpy64, check_against_gold, gold_kwargs, make_inputs

FP32_BAR = 1e-5  # fp32 inputs: the chunked path must match the recurrence to fp32 rounding

W = Workload
CASES = [
    # Sequence lengths around the XLA path's 64-token chunks.
    W("t63", seqlen=63),
    W("t64", seqlen=64),
    W("t65_batch3", batch=3, seqlen=65),
    W("softplus_extreme", seqlen=130, gate="softplus", long_memory=True),
    W("long_memory_pre", seqlen=2048, heads=1, gate="preactivated", decay_floor=-30.0, long_memory=True),
    # Head sizes the kernels do not take.
    W("h12_d16", seqlen=40, heads=12, head_k=16, head_v=16),
    W("gqa", seqlen=70, heads=2, v_heads=6),
    W("k_ne_v", seqlen=50, head_k=48, head_v=24),
    W("packed_one", seqlens=(77,), state_v_first=True),
    W("packed_gqa_h12", seqlens=(16, 33, 15), heads=3, v_heads=12, head_k=16, head_v=16),
    W("packed_long_memory", seqlens=(700, 3, 0, 1100), heads=1, gate="preactivated", decay_floor=-30.0,
      long_memory=True),
]


def _check(w: Workload, seed: int, bar: float):
    args, kwargs = make_inputs(w, np.random.default_rng(seed))
    o, final = jax_kda.prefill(*args, backend="xla", **kwargs)
    check_against_gold(w.name, w, args, kwargs, o, final, bar)


@pytest.mark.parametrize("w", CASES, ids=lambda w: w.name)
def test_bf16_inputs_match_float64_recurrence(w, fresh_seed):
    _check(w, fresh_seed, ERR_RATIO_BAR)


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
