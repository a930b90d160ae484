"""The XLA path under jax.jit, jax.vmap and jax.grad."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_kda
from jax_kda import gold
from jax_kda.testing import Workload, as_numpy64, gold_kwargs, make_inputs


def _token_scan(q, k, v, g, beta, state):
    """A plain token-by-token lax.scan (fp32, pre-activated gates): the grad oracle."""

    def step(s, x):
        qt, kt, vt, gt, bt = x
        s = jnp.exp(gt)[..., None] * s
        s = s + bt[..., None, None] * kt[..., :, None] * (vt - jnp.einsum("...kv,...k->...v", s, kt))[..., None, :]
        return s, jnp.einsum("...kv,...k->...v", s, qt) * q.shape[-1] ** -0.5

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    final, o = lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), final


def test_jit_with_static_argnames(fresh_seed):
    w = Workload("jit", seqlen=40, gate="softplus")
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    f = jax.jit(jax_kda.prefill, static_argnames=jax_kda.STATIC_ARGNAMES)
    o, final = f(*args, backend="xla", **kwargs)
    gold_o, gold_final = gold.recurrence(*as_numpy64(args), **gold_kwargs(kwargs))
    assert gold.err_ratio(np.asarray(o, np.float32), gold_o) < 5e-3
    assert gold.err_ratio(np.asarray(final), gold_final) < 5e-3


def test_traced_cu_seqlens_inside_jit(fresh_seed):
    """cu_seqlens is device data: one compiled function serves different packings."""
    w = Workload("packed", seqlens=(10, 30, 0, 24), dtype="float32")
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    run = jax.jit(lambda cu, *a: jax_kda.prefill(*a, **{**kwargs, "cu_seqlens": cu}, backend="xla"))
    for cu in ([0, 10, 40, 40, 64], [0, 0, 1, 50, 64], [0, 64, 64, 64, 64]):
        cu = np.asarray(cu, np.int32)
        o, final = run(jnp.asarray(cu), *args)
        gold_o, gold_final = gold.recurrence(*as_numpy64(args), **gold_kwargs({**kwargs, "cu_seqlens": cu}))
        assert gold.err_ratio(np.asarray(o), gold_o) < 1e-5
        assert gold.err_ratio(np.asarray(final), gold_final) < 1e-5
    assert run._cache_size() == 1


def test_vmap_over_a_leading_axis(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    w = Workload("vmap", seqlen=20, gate="lower_bound", dtype="float32")
    draws = [make_inputs(w, rng) for _ in range(3)]
    stacked = [jnp.stack([d[0][i] for d in draws]) for i in range(5)]
    state = jnp.stack([d[1]["initial_state"] for d in draws])
    static = {k: v for k, v in draws[0][1].items() if k != "initial_state"}
    f = jax.vmap(lambda q, k, v, g, b, s: jax_kda.prefill(q, k, v, g, b, initial_state=s, backend="xla", **static))
    o, final = f(*stacked, state)
    for i, (a, kw) in enumerate(draws):
        o1, f1 = jax_kda.prefill(*a, backend="xla", **{**static, "initial_state": kw["initial_state"]})
        np.testing.assert_allclose(np.asarray(o[i]), np.asarray(o1), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(final[i]), np.asarray(f1), rtol=1e-5, atol=1e-6)


def test_vmap_of_the_kernel_primitive(fresh_seed, monkeypatch):
    """vmap of a call "auto" gives to the kernels: the primitive's batching rule (one call per element,
    by lax.map; some operands unmapped) on a CPU host lowers to the XLA path, which must agree with
    vmap of backend="xla". As if the extension were installed, so the rule is exercised anywhere."""
    from jax_kda import dispatch

    monkeypatch.setattr(dispatch, "build_limits", lambda: [])
    rng = np.random.default_rng(fresh_seed)
    n, b, t, h, d = 3, 2, 20, 2, 128
    q, k, v = (jnp.asarray(rng.standard_normal((n, b, t, h, d)) / np.sqrt(d), jnp.bfloat16) for _ in range(3))
    g = jnp.asarray(-rng.uniform(0.0, 0.5, (b, t, h, d)), jnp.bfloat16)   # unmapped
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (b, t, h)), jnp.bfloat16)    # unmapped
    state = jnp.asarray(rng.standard_normal((b, h, d, d)), jnp.float32)   # unmapped
    x = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    assert jax_kda.explain(x, x, x, x, jax.ShapeDtypeStruct((b, t, h), jnp.bfloat16), device="cpu").kernels is not None

    def call(backend, in_axes, out_axes, q, k, v):
        f = lambda q, k, v: jax_kda.prefill(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                            backend=backend)
        return jax.jit(jax.vmap(f, in_axes, out_axes))(q, k, v)

    def ratio(a, ref):  # relative L2 error; an o computed from zero values is ~2.5e-2
        a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
        return np.linalg.norm(a - ref) / np.linalg.norm(ref)

    # Mapped along axis 0, and along inner axes (v's mapped axis between T and the heads; o's out
    # axis 3): the rule must move each operand's mapped axis to the front and the outputs' back.
    for in_axes, out_axes in ((0, 0), ((0, 1, 2), (3, 0))):
        args = [jnp.moveaxis(x, 0, ax) for x, ax in zip((q, k, v), (in_axes,) * 3 if isinstance(in_axes, int)
                                                          else in_axes)]
        (o, final), (o_xla, final_xla) = (call(be, in_axes, out_axes, *args) for be in ("auto", "xla"))
        o_axis, final_axis = (out_axes, out_axes) if isinstance(out_axes, int) else out_axes
        assert jnp.moveaxis(o, o_axis, 0).shape == (n, b, t, h, d)
        assert jnp.moveaxis(final, final_axis, 0).shape == (n, b, h, d, d)
        assert ratio(o, o_xla) <= 1e-3 and ratio(final, final_xla) <= 1e-5, (in_axes, out_axes)


def test_grad_matches_a_token_scan(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    b, t, h, kd, vd = 2, 37, 2, 8, 8
    q, k = (jnp.asarray(rng.standard_normal((b, t, h, kd)) / np.sqrt(kd), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, t, h, vd)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0.0, 2.0, (b, t, h, kd)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (b, t, h)), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((b, h, kd, vd)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((b, t, h, vd)), jnp.float32)

    def loss_chunked(*xs):
        o, f = jax_kda.prefill(*xs[:5], initial_state=xs[5], output_final_state=True, backend="xla")
        return jnp.sum(o * weights) + jnp.sum(f**2)

    def loss_scan(*xs):
        o, f = _token_scan(*xs)
        return jnp.sum(o * weights) + jnp.sum(f**2)

    argnums = tuple(range(6))
    got = jax.grad(loss_chunked, argnums)(q, k, v, g, beta, s0)
    want = jax.grad(loss_scan, argnums)(q, k, v, g, beta, s0)
    for name, a, e in zip(("q", "k", "v", "g", "beta", "initial_state"), got, want):
        err = gold.err_ratio(np.asarray(a), np.asarray(e))
        assert err < 1e-4, f"d/d{name}: err_ratio {err:.2e}"


def test_chunk_size_does_not_change_the_answer(fresh_seed):
    """The chunked form is exact for any power-of-two chunk, here 1 (a pure recurrence) to 128."""
    from jax_kda import xla_backend
    from jax_kda.config import Operands, validate

    w = Workload("chunks", seqlen=150, gate="preactivated", decay_floor=-60.0, dtype="float32")
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    cfg = validate(*args, backend="xla", **kwargs)
    run = functools.partial(xla_backend.prefill, cfg, Operands(*args, initial_state=kwargs["initial_state"]))
    o_ref, f_ref = run(chunk_size=1)
    for c in (2, 16, 128):
        o, f = run(chunk_size=c)
        assert gold.err_ratio(np.asarray(o), np.asarray(o_ref)) < 1e-5
        assert gold.err_ratio(np.asarray(f), np.asarray(f_ref)) < 1e-5
