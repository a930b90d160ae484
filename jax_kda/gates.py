"""The token-wise parts of KDA in JAX: gate activation, beta activation, L2 normalisation.

These are the "in kernel" options of the contract (docs/prefill.md). The XLA path uses them directly; the
kernels compute the same formulas on the device, and their tests compare against these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_kda.config import GateMode

L2NORM_EPS = 1e-6  # inside the square root, as FLA does


def l2_normalize(x: jax.Array) -> jax.Array:
    """x / sqrt(sum(x^2) + 1e-6) over the last axis."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def log_decay(
    g: jax.Array,
    gate_mode: GateMode,
    *,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    lower_bound: float = 0.0,
) -> jax.Array:
    """The natural-log decay per token, `[..., HV, K]`, from `g` of the same shape.

    Computed in g's dtype; pass float32 (or float64) inputs for an exact result. With
    `GateMode.PREACTIVATED`, g is returned unchanged.
    """
    if gate_mode == GateMode.PREACTIVATED:
        return g
    hv, kdim = g.shape[-2], g.shape[-1]
    x = g if dt_bias is None else g + jnp.reshape(dt_bias, (hv, kdim)).astype(g.dtype)
    if gate_mode == GateMode.SOFTPLUS:
        a = jnp.exp(A_log.astype(g.dtype))[:, None]
        return -a * jax.nn.softplus(x)
    if gate_mode == GateMode.LOWER_BOUND_A_LOG:
        x = jnp.exp(A_log.astype(g.dtype))[:, None] * x
    return lower_bound * jax.nn.sigmoid(x)


def beta_activation(beta: jax.Array, use_sigmoid: bool) -> jax.Array:
    return jax.nn.sigmoid(beta) if use_sigmoid else beta
