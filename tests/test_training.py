"""A training step through `prefill` with no backend argument: a small KDA layer (projections, the
prefill, an output projection) under `jax.jit(jax.value_and_grad(...))` and plain SGD, as a Flax
module's step would run it. On a CPU it is the XLA path (CI); on a Hopper GPU the forward is the
kernel (fp32 g and beta from fp32 projections, bf16 q, k, v), with the XLA path's gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kda
from jax_kda import contract, gold

HIDDEN, HEADS, D, T = 64, 2, contract.HEAD_DIM, 48


def _init(rng: np.random.Generator) -> dict:
    def dense(n_in, n_out):
        return jnp.asarray(rng.standard_normal((n_in, n_out)) / np.sqrt(n_in), jnp.float32)

    return dict(q=dense(HIDDEN, HEADS * D), k=dense(HIDDEN, HEADS * D), v=dense(HIDDEN, HEADS * D),
                g=dense(HIDDEN, HEADS * D), beta=dense(HIDDEN, HEADS), out=dense(HEADS * D, HIDDEN),
                A_log=jnp.zeros((HEADS,), jnp.float32), dt_bias=jnp.zeros((HEADS, D), jnp.float32))


def _layer(params: dict, x: jax.Array, backend: str | None) -> jax.Array:
    """x [B, T, HIDDEN] -> [B, T, HIDDEN]: bf16 q, k, v; the gate and beta logits in fp32."""
    b = x.shape[0]

    def heads(name, dtype):
        return (x @ params[name]).astype(dtype).reshape(b, T, HEADS, D)

    q, k, v = (heads(n, jnp.bfloat16) for n in ("q", "k", "v"))
    g = heads("g", jnp.float32)
    beta = x @ params["beta"]
    extra = {} if backend is None else dict(backend=backend)
    o, _ = jax_kda.prefill(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                           A_log=params["A_log"], dt_bias=params["dt_bias"], lower_bound=-5.0,
                           use_beta_sigmoid_in_kernel=True, **extra)
    return o.astype(jnp.float32).reshape(b, T, HEADS * D) @ params["out"]


def _step(backend: str | None = None, lr: float = 0.05):
    def loss(params, x, y):
        return jnp.mean((_layer(params, x, backend) - y) ** 2)

    @jax.jit
    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return value, grads, jax.tree.map(lambda p, d: p - lr * d, params, grads)

    return step


def _data(rng: np.random.Generator):
    x = jnp.asarray(rng.standard_normal((2, T, HIDDEN)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((2, T, HIDDEN)), jnp.float32)
    return x, y


def test_a_training_step_with_no_backend_argument_learns(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    params, (x, y) = _init(rng), _data(rng)
    step = _step()
    losses = []
    for _ in range(4):
        value, grads, params = step(params, x, y)
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
        losses.append(float(value))
    assert losses[-1] < losses[0], losses


def _hopper() -> bool:
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return False
    return d.platform == "gpu" and getattr(d, "compute_capability", None) == "9.0"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a compute capability 9.0 GPU")
def test_on_hopper_the_training_step_runs_the_kernel_forward_with_the_xla_paths_gradients(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    params, (x, y) = _init(rng), _data(rng)
    step, reference = _step(), _step("xla")
    assert f"stablehlo.custom_call @{contract.FFI_TARGET}" in step.lower(params, x, y).as_text()
    value, grads, _ = step(params, x, y)
    want_value, want_grads, _ = reference(params, x, y)
    # The layer's output, not the loss: y dominates the loss (a zero o moved it by 0.02 %), so a
    # relative bar on the loss could not fail.
    pred, want_pred = (jax.jit(lambda p, x, b=b: _layer(p, x, b))(params, x) for b in (None, "xla"))
    err = gold.err_ratio(np.asarray(pred, np.float64), np.asarray(want_pred, np.float64))
    print(f"training step layer output: err_ratio vs the XLA path {err:.2e}; loss {float(value):.6g} "
          f"(XLA path {float(want_value):.6g})")
    assert err < 1e-2, f"layer output: {err:.2e}"
    for name in grads:
        err = gold.err_ratio(np.asarray(grads[name], np.float64), np.asarray(want_grads[name], np.float64))
        print(f"training step d/d{name}: err_ratio vs the XLA path {err:.2e}")
        assert err < 1e-2, f"d/d{name}: {err:.2e}"
