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


BLOCK_CASES = [
    W("dense_blocks", batch=2, seqlen=300, gate="softplus", dtype="float32"),
    W("packed_blocks", seqlens=(100, 0, 130, 3, 64, 1, 250), state_v_first=True, dtype="float32"),
    W("packed_blocks_gqa_pre", seqlens=(70, 0, 190), heads=1, v_heads=3, gate="preactivated", decay_floor=-30.0,
      dtype="float32"),
]


@pytest.mark.parametrize("per_block", [1, 3])
@pytest.mark.parametrize("w", BLOCK_CASES, ids=lambda w: w.name)
def test_many_blocks_match_float64_recurrence_and_one_block(w, per_block, fresh_seed, monkeypatch):
    """The scan over blocks of chunks (the XLA path's memory bound), forced to blocks of 1 and 3
    chunks: the state and each packed sequence carry across blocks, a last block that runs past the
    end drops its extra tokens, and the result is the gold's and the one-block call's."""
    from jax_kda import xla_backend

    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    one_block = jax_kda.prefill(*args, backend="xla", **kwargs)
    monkeypatch.setattr(xla_backend, "chunks_per_block", lambda *_: per_block)
    jax.clear_caches()
    o, final = jax_kda.prefill(*args, backend="xla", **kwargs)
    check_against_gold(w.name, w, args, kwargs, o, final, FP32_BAR)
    for got, want in zip((o, final), one_block):
        assert gold.err_ratio(np.asarray(got, np.float64), np.asarray(want, np.float64)) <= 1e-6


@pytest.mark.parametrize("w", BLOCK_CASES[:2], ids=lambda w: w.name)
def test_chunk_steps_unrolled_give_the_same_result(w, fresh_seed, monkeypatch):
    """Several chunk steps per loop iteration (a tuning knob, CHUNK_STEPS_PER_ITERATION; 3 does not
    divide the chunk counts, so the loop has a remainder) compute what one step does."""
    from jax_kda import xla_backend

    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    want = jax_kda.prefill(*args, backend="xla", **kwargs)
    monkeypatch.setattr(xla_backend, "CHUNK_STEPS_PER_ITERATION", 3)
    monkeypatch.setattr(xla_backend, "chunks_per_block", lambda num_chunks, *_: max(num_chunks, 1))
    jax.clear_caches()
    got = jax_kda.prefill(*args, backend="xla", **kwargs)
    for a, b in zip(got, want):
        assert gold.err_ratio(np.asarray(a, np.float64), np.asarray(b, np.float64)) <= 1e-6
    # The knob reaches the chunk loop (seen in jax.jvp's trace, which holds the XLA path's scans).
    jaxpr = jax.make_jaxpr(lambda q: jax.jvp(lambda x: jax_kda.prefill(x, *args[1:], backend="xla", **kwargs),
                                             (q,), (q,)))(args[0])
    assert 3 in set(_scan_unrolls(jaxpr.jaxpr))


def _scan_unrolls(jaxpr):
    """The `unroll` of every scan in `jaxpr` and the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn.params["unroll"]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _scan_unrolls(inner)


def test_block_size_follows_the_call_size_and_the_platform():
    from jax_kda.xla_backend import BLOCKS_PER_CALL, MIN_BLOCK_TOKEN_HEADS, MIN_BLOCK_TOKEN_HEADS_CPU, chunks_per_block

    for platform, least in (("cpu", MIN_BLOCK_TOKEN_HEADS_CPU), ("cuda", MIN_BLOCK_TOKEN_HEADS),
                            ("gpu", MIN_BLOCK_TOKEN_HEADS), ("tpu", MIN_BLOCK_TOKEN_HEADS)):
        assert chunks_per_block(4, 64, platform) == 4  # a small call is one block
        assert chunks_per_block(0, 64, platform) == 1
        assert chunks_per_block(100_000, least, platform) == -(-100_000 // BLOCKS_PER_CALL)
        assert chunks_per_block(10_000, 64, platform) == least // 64
    assert MIN_BLOCK_TOKEN_HEADS > MIN_BLOCK_TOKEN_HEADS_CPU  # fewer, larger blocks where each costs launches


def test_the_block_size_is_the_lowering_platforms(fresh_seed, monkeypatch):
    """A call asks for the floor of the platform it is lowered for, whatever the host: exported for
    CUDA from this host it gets the GPU's; jax.grad's trace, which has no platform yet, asks for the
    default device's."""
    import jax.numpy as jnp
    from jax_kda import dispatch, xla_backend

    seen = []
    shipped = xla_backend.min_block_token_heads
    monkeypatch.setattr(xla_backend, "min_block_token_heads", lambda platform: seen.append(platform) or shipped(platform))
    jax.clear_caches()
    w = W("platform", seqlen=40, heads=2)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    fn = jax.jit(lambda *a: jax_kda.prefill(*a, backend="xla", **kwargs))
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
    # ("cpu", "cuda"): each platform's own rule, each with its floor; ("cpu", "tpu"): one rule for
    # both, with the floor of the platform that is not the CPU.
    for platforms, want in ((("cuda",), ["cuda"]), (("cpu",), ["cpu"]), (("cpu", "cuda"), ["cpu", "cuda"]),
                            (("cpu", "tpu"), ["tpu"])):
        seen.clear()
        jax.export.export(fn, platforms=platforms)(*shapes)
        assert sorted(seen) == want, platforms
    assert xla_backend.min_block_token_heads("cuda") == xla_backend.MIN_BLOCK_TOKEN_HEADS
    assert xla_backend.min_block_token_heads("cpu") == xla_backend.MIN_BLOCK_TOKEN_HEADS_CPU
    seen.clear()
    jax.grad(lambda q: jnp.sum(jax_kda.prefill(q, *args[1:], backend="xla", **kwargs)[0]))(args[0])
    assert None in seen
    assert shipped(None) == shipped(dispatch.default_device().platform)


def _long_call(t: int, h: int):
    """(prefill of a bf16 call of t tokens x h heads, K = V = 128, with the grid's flags, as a function
    of (q, k, v, g, beta, initial_state); its arguments' shapes; their bytes)."""
    import jax.numpy as jnp

    d = 128
    x, beta = jax.ShapeDtypeStruct((1, t, h, d), jnp.bfloat16), jax.ShapeDtypeStruct((1, t, h), jnp.bfloat16)
    state = jax.ShapeDtypeStruct((1, h, d, d), jnp.float32)

    def call(q, k, v, g, b, s):
        return jax_kda.prefill(q, k, v, g, b, initial_state=s, output_final_state=True, backend="xla",
                               use_gate_in_kernel=True, A_log=jnp.zeros((h,), jnp.float32), lower_bound=-5.0,
                               use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)

    return call, (x, x, x, x, beta, state), 4 * t * h * d * 2 + t * h * 2 + h * d * d * 4


def _temporary_bytes(fn, shapes) -> int:
    return jax.jit(fn).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def test_temporary_memory_is_a_small_fraction_of_a_long_calls_inputs():
    """The contract's bound on long contexts: 65 536 tokens x 16 heads (1.1 GB of bf16 inputs),
    compiled for this host; the XLA path's temporaries are a block's (about 13 %), not about 8x the
    inputs as when every chunk's fp32 tensors were made at once."""
    call, shapes, inputs = _long_call(65536, 16)
    temp = _temporary_bytes(call, shapes)
    assert temp <= 0.2 * inputs, (temp, inputs)


def test_with_a_gpus_larger_blocks_memory_is_one_block_or_a_small_fraction(monkeypatch):
    """The block floor of GPUs and other accelerators (MIN_BLOCK_TOKEN_HEADS), compiled for this
    host: a call of 2^22 token-heads or more keeps the long-context bound (64 blocks, about 13 % of
    the inputs); a smaller one holds at most one block of the floor's size, about 9 KB a token-head."""
    from jax_kda import xla_backend

    monkeypatch.setattr(xla_backend, "min_block_token_heads", lambda platform: xla_backend.MIN_BLOCK_TOKEN_HEADS)
    jax.clear_caches()
    call, shapes, inputs = _long_call(262144, 16)
    assert _temporary_bytes(call, shapes) <= 0.2 * inputs
    for t in (16384, 65536):
        call, shapes, inputs = _long_call(t, 16)
        assert _temporary_bytes(call, shapes) <= 10_000 * xla_backend.MIN_BLOCK_TOKEN_HEADS


@pytest.mark.parametrize("w", BLOCK_CASES[:2], ids=lambda w: w.name)
def test_gradients_through_many_blocks_match_one_block(w, fresh_seed, monkeypatch):
    """The blocks are rematerialized in the backward pass (jax.checkpoint): gradients through blocks
    of one chunk equal the one-block call's."""
    import jax.numpy as jnp
    from jax_kda import xla_backend

    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array) and k != "cu_seqlens"}
    static = {k: v for k, v in kwargs.items() if k not in arrays}

    def loss(a, kw):
        o, final = jax_kda.prefill(*a, backend="xla", **kw, **static)
        return jnp.sum(o * o) + jnp.sum(final * final)

    want = jax.grad(loss, argnums=(0, 1))(args, arrays)
    monkeypatch.setattr(xla_backend, "chunks_per_block", lambda *_: 1)
    jax.clear_caches()
    got = jax.grad(loss, argnums=(0, 1))(args, arrays)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert gold.err_ratio(np.asarray(a, np.float64), np.asarray(b, np.float64)) <= 1e-5


def test_gradient_memory_is_a_few_times_the_inputs():
    """jax.grad through the XLA path (the backward of every backend) saves only each block's carries
    and recomputes the block: 32 768 tokens x 8 heads (0.27 GB of bf16 inputs) takes about 2.8x the
    inputs in temporaries, where keeping every chunk's tensors took 24x."""
    import jax.numpy as jnp

    call, shapes, inputs = _long_call(32768, 8)

    def loss(*args):
        o, final = call(*args)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

    temp = _temporary_bytes(jax.grad(loss, argnums=tuple(range(6))), shapes)
    assert temp <= 5 * inputs, (temp, inputs)


def test_bf16_gate_parameter_gradients_add_up_in_fp32_across_blocks(fresh_seed, monkeypatch):
    """A_log and dt_bias given in bf16 are cast once, outside the blocks, so their gradients add up
    over the blocks in fp32: through 16 blocks of one chunk they are the gradients of the same
    values cast to fp32 by the caller, rounded to bf16 (summed in bf16 block by block, dt_bias's was
    off by err_ratio 1e-2 here, and elements near zero by far more)."""
    import jax.numpy as jnp
    from jax_kda import xla_backend

    w = W("bf16_params", seqlen=1024, heads=2, gate="softplus", dtype="float32")
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    params = {k: jnp.asarray(kwargs[k], jnp.bfloat16) for k in ("A_log", "dt_bias")}
    static = {k: v for k, v in kwargs.items() if k not in params}

    def grads(dtype):
        def loss(p):
            o, final = jax_kda.prefill(*args, backend="xla", **{k: v.astype(dtype) for k, v in p.items()}, **static)
            return jnp.sum(o * o) + jnp.sum(final * final)
        return jax.grad(loss)(params)

    monkeypatch.setattr(xla_backend, "chunks_per_block", lambda *_: 1)
    jax.clear_caches()
    got, want = grads(jnp.bfloat16), grads(jnp.float32)
    for name in params:
        a, b = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
        assert gold.err_ratio(a, b) <= 1e-6, (name, gold.err_ratio(a, b))
