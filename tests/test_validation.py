"""Every error rule of the contract (docs/prefill.md, "Errors"): raised at trace time, naming argument, expectation, value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kda
from jax_kda import gold

B, T, H, HV, K, V = 2, 8, 2, 4, 16, 8


def _inputs(**over):
    s = jax.ShapeDtypeStruct
    base = dict(
        q=s((B, T, H, K), jnp.bfloat16),
        k=s((B, T, H, K), jnp.bfloat16),
        v=s((B, T, HV, V), jnp.bfloat16),
        g=s((B, T, HV, K), jnp.float32),
        beta=s((B, T, HV), jnp.float32),
    )
    base.update(over)
    return base


def _trace(kwargs=None, **arrays):
    """Traces prefill on abstract inputs: validation happens before anything runs."""
    a = _inputs(**arrays)
    kwargs = dict(kwargs or {})
    dynamic = {n: kwargs.pop(n) for n in ("initial_state", "cu_seqlens", "A_log", "dt_bias") if n in kwargs}

    def f(q, k, v, g, beta, dyn):
        return jax_kda.prefill(q, k, v, g, beta, backend="xla", **dyn, **kwargs)

    return jax.jit(f).trace(a["q"], a["k"], a["v"], a["g"], a["beta"], dynamic)


S = jax.ShapeDtypeStruct
ERRORS = [
    ("q_rank", dict(q=S((B, T, H * K), jnp.bfloat16)), {}, r"q must have rank 4 \(\[B, T, H, K\]\), got shape \(2, 8, 32\)"),
    ("k_shape", dict(k=S((B, T, H, K + 1), jnp.bfloat16)), {}, r"k must have the shape of q"),
    ("v_rank", dict(v=S((B, T, HV), jnp.bfloat16)), {}, r"v must have rank 4"),
    ("v_batch", dict(v=S((B + 1, T, HV, V), jnp.bfloat16)), {}, r"v must have B, T = \(2, 8\)"),
    ("t_mismatch", dict(v=S((B, T + 1, HV, V), jnp.bfloat16)), {}, r"v must have B, T"),
    ("hv_not_multiple", dict(v=S((B, T, 3, V), jnp.bfloat16)), {}, r"HV must be a positive multiple of H=2, got HV=3"),
    ("g_shape", dict(g=S((B, T, H, K), jnp.float32)), {}, r"g must have shape \[B, T, HV, K\] = \(2, 8, 4, 16\), got \(2, 8, 2, 16\)"),
    ("beta_shape", dict(beta=S((B, T, H), jnp.float32)), {}, r"beta must have shape \[B, T, HV\]"),
    ("q_int", dict(q=S((B, T, H, K), jnp.int32), k=S((B, T, H, K), jnp.int32)), {}, r"q must have a floating-point dtype, got int32"),
    ("v_dtype", dict(v=S((B, T, HV, V), jnp.float32)), {}, r"v must have the dtype of q \(bfloat16\), got float32"),
    ("g_int", dict(g=S((B, T, HV, K), jnp.int8)), {}, r"g must have a floating-point dtype"),
    ("scale_nan", {}, dict(scale=float("nan")), r"scale must be finite, got nan"),
    ("scale_inf", {}, dict(scale=float("inf")), r"scale must be finite, got inf"),
    ("cu_batch", {}, dict(cu_seqlens=S((3,), jnp.int32)), r"cu_seqlens \(packed sequences\) requires B == 1, got B=2"),
    ("lower_bound_high", {}, dict(use_gate_in_kernel=True, lower_bound=0.0), r"lower_bound must be in \[-5, 0\), got 0.0"),
    ("lower_bound_low", {}, dict(use_gate_in_kernel=True, lower_bound=-5.5), r"lower_bound must be in \[-5, 0\), got -5.5"),
    ("gate_without_params", {}, dict(use_gate_in_kernel=True), r"use_gate_in_kernel=True needs A_log \(softplus gate\) or lower_bound"),
    ("a_log_shape", {}, dict(use_gate_in_kernel=True, A_log=S((H,), jnp.float32)), r"A_log must have shape \[HV\] = \(4,\), got \(2,\)"),
    ("dt_bias_shape", {}, dict(use_gate_in_kernel=True, lower_bound=-5.0, dt_bias=S((HV, K + 1), jnp.float32)), r"dt_bias must have shape \[HV, K\]"),
    ("a_log_without_gate", {}, dict(A_log=S((HV,), jnp.float32)), r"A_log is only used with use_gate_in_kernel=True"),
    ("state_shape", {}, dict(initial_state=S((B, HV, V, K), jnp.float32)), r"initial_state must have shape \[N, HV, K, V\] = \(2, 4, 16, 8\) \(N=2 = B\), got \(2, 4, 8, 16\)"),
    ("in_place_without_state", {}, dict(state_in_place=True, output_final_state=True), r"state_in_place=True .* needs initial_state and output_final_state=True; got initial_state=None"),
    ("in_place_without_final", {}, dict(state_in_place=True, initial_state=S((B, HV, K, V), jnp.float32)), r"state_in_place=True .* got initial_state=an array, output_final_state=False"),
    ("state_shape_v_first", {}, dict(state_v_first=True, initial_state=S((B, HV, K, V), jnp.float32)), r"initial_state must have shape \[N, HV, V, K\] = \(2, 4, 8, 16\)"),
]


@pytest.mark.parametrize("arrays,kwargs,message", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_bad_arguments_raise_naming_argument_and_values(arrays, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _trace(kwargs, **arrays)


def test_packed_sequences_checks():
    a = _inputs(
        q=S((1, T, H, K), jnp.bfloat16),
        k=S((1, T, H, K), jnp.bfloat16),
        v=S((1, T, HV, V), jnp.bfloat16),
        g=S((1, T, HV, K), jnp.float32),
        beta=S((1, T, HV), jnp.float32),
    )
    with pytest.raises(ValueError, match=r"cu_seqlens must be int32 or int64, got float32"):
        _trace(dict(cu_seqlens=S((3,), jnp.float32)), **a)
    with pytest.raises(ValueError, match=r"cu_seqlens must have shape \[N\+1\] with N >= 0, got shape \(3, 1\)"):
        _trace(dict(cu_seqlens=S((3, 1), jnp.int32)), **a)
    with pytest.raises(ValueError, match=r"\(N=2 sequences in cu_seqlens\), got \(1, 4, 16, 8\)"):
        _trace(dict(cu_seqlens=S((3,), jnp.int32), initial_state=S((1, HV, K, V), jnp.float32)), **a)
    _trace(dict(cu_seqlens=S((3,), jnp.int32), initial_state=S((2, HV, K, V), jnp.float32)), **a)


def test_traced_static_argument_is_a_clear_type_error():
    a = _inputs()
    with pytest.raises(TypeError, match=r"scale must be a static Python float.*STATIC_ARGNAMES"):
        jax.jit(lambda s: jax_kda.prefill(a["q"], a["k"], a["v"], a["g"], a["beta"], scale=s)).trace(1.0)
    with pytest.raises(TypeError, match=r"output_final_state must be a bool, got int 1"):
        _trace(dict(output_final_state=1))


def test_explicit_kernel_backend_that_cannot_serve_raises_value_error():
    """Through prefill: the message names the backend and why (the build or the argument; each
    reason is tested in test_dispatch.py)."""
    a = _inputs()
    for backend in ("sm90", "sm100"):
        with pytest.raises(ValueError, match=rf"^backend='{backend}': the kernels need K == V == 128, got K=16, V=8"):
            jax_kda.prefill(a["q"], a["k"], a["v"], a["g"], a["beta"], backend=backend)


def test_unknown_backend_name():
    a = _inputs()
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'xla', 'sm90', 'sm100'\), got 'cuda'"):
        jax_kda.prefill(a["q"], a["k"], a["v"], a["g"], a["beta"], backend="cuda")


def test_python_list_cu_seqlens_is_accepted(fresh_seed):
    """A list is the same offsets as an array: two sequences, the second starting from a zero state
    (not the 12 tokens as one sequence)."""
    q = jnp.asarray(np.random.default_rng(fresh_seed).standard_normal((1, 12, 1, 8)), jnp.float32)
    args = (q, q, q, -jnp.abs(q), q[..., 0] * 0 + 0.5)
    o, _ = jax_kda.prefill(*args, cu_seqlens=[0, 5, 12], backend="xla")
    o_array, _ = jax_kda.prefill(*args, cu_seqlens=jnp.asarray([0, 5, 12], jnp.int32), backend="xla")
    second, _ = jax_kda.prefill(*(a[:, 5:] for a in args), backend="xla")
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_array))
    np.testing.assert_allclose(np.asarray(o[:, 5:]), np.asarray(second), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kdim,vdim", [(0, 8), (8, 0)])
def test_empty_head_dims_are_an_error(kdim, vdim):
    q = jnp.zeros((1, 4, 2, kdim))
    v = jnp.zeros((1, 4, 2, vdim))
    with pytest.raises(ValueError, match=rf"head dims K \(q's last\) and V \(v's last\) must be positive, got K={kdim}, V={vdim}"):
        jax_kda.prefill(q, q, v, jnp.zeros((1, 4, 2, kdim)), jnp.zeros((1, 4, 2)))


def test_zero_heads_is_an_error():
    x = jnp.zeros((1, 4, 0, 8))
    with pytest.raises(ValueError, match=r"positive multiple of H=0"):
        jax_kda.prefill(x, x, x, x, jnp.zeros((1, 4, 0)))


def test_lists_and_float64_numpy_inputs_are_canonicalised(fresh_seed):
    """Lists and numpy arrays go through jnp.asarray: float64 becomes float32 with x64 off, so o and
    the state are float32, and the result equals the same call on jax arrays."""
    rng = np.random.default_rng(fresh_seed)
    q = rng.standard_normal((1, 6, 1, 4)) * 0.5
    g = -np.abs(rng.standard_normal((1, 6, 1, 4))) * 0.1
    beta = rng.uniform(0.1, 0.9, (1, 6, 1))
    o, final = jax_kda.prefill(q.tolist(), q, q, g, beta, output_final_state=True, backend="xla")
    assert o.dtype == jnp.float32 and final.dtype == jnp.float32
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    o2, final2 = jax_kda.prefill(f32(q), f32(q), f32(q), f32(g), f32(beta), output_final_state=True, backend="xla")
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2))
    np.testing.assert_array_equal(np.asarray(final), np.asarray(final2))


def test_float64_inputs_with_x64_give_float64_outputs(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    with jax.enable_x64(True):
        q = jnp.asarray(rng.standard_normal((1, 6, 1, 4)) * 0.5)
        g = -jnp.abs(q) * 0.1
        beta = jnp.full((1, 6, 1), 0.5)
        o, final = jax_kda.prefill(q, q, q, g, beta, output_final_state=True)
        assert q.dtype == jnp.float64 and o.dtype == jnp.float64 and final.dtype == jnp.float64
        want_o, want_final = gold.recurrence(*(np.asarray(x) for x in (q, q, q, g, beta)))
        assert gold.err_ratio(np.asarray(o), want_o) < 1e-12
        assert gold.err_ratio(np.asarray(final), want_final) < 1e-12


def _debug_call(g, cu):
    from jax.experimental import checkify

    q = jnp.ones((1, 8, 1, 4)) * 0.1
    with jax_kda.debug_checks():
        err, _ = checkify.checkify(jax.jit(lambda g, cu: jax_kda.prefill(q, q, q, g, q[..., 0], cu_seqlens=cu,
                                                                        backend="xla")))(g, cu)
    return err.get()


def test_debug_checks_report_positive_log_decays_and_malformed_cu_seqlens():
    g = -jnp.ones((1, 8, 1, 4)) * 0.1
    good = jnp.array([0, 3, 8], jnp.int32)
    assert _debug_call(g, good) is None
    assert "positive log-decays" in _debug_call(g.at[0, 5, 0, 1].set(0.5), good)
    assert "cu_seqlens decreases (first at index 2)" in _debug_call(g, jnp.array([0, 5, 3, 8], jnp.int32))
    assert "exceeds T = 8" in _debug_call(g, jnp.array([0, 3, 9], jnp.int32))
    assert "is negative" in _debug_call(g, jnp.array([-1, 3, 8], jnp.int32))


def test_without_debug_checks_nothing_is_added():
    q = jnp.ones((1, 8, 1, 4)) * 0.1
    def f(g):
        return jax_kda.prefill(q, q, q, g, q[..., 0], backend="xla")

    with jax_kda.debug_checks():
        assert " check[" in str(jax.make_jaxpr(lambda g: f(g))(q))
    assert " check[" not in str(jax.make_jaxpr(lambda g: f(g))(q))  # a new trace, outside the context
    o, _ = f(q)  # positive g: not checked, runs
    assert o.shape == (1, 8, 1, 4)
