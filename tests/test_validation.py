"""Every error rule of the contract (docs/prefill.md, "Errors"): raised at trace time, naming argument, expectation, value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kda

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
    q = jnp.asarray(np.random.default_rng(fresh_seed).standard_normal((1, 12, 1, 8)), jnp.float32)
    o, _ = jax_kda.prefill(q, q, q, -jnp.abs(q), q[..., 0] * 0 + 0.5, cu_seqlens=[0, 5, 12], backend="xla")
    assert o.shape == (1, 12, 1, 8) and bool(jnp.all(jnp.isfinite(o)))
