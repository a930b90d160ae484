"""jax_kda.testing.make_inputs: the host draws (numpy) and the device draws (jax.random, what the
benchmarks use) give arrays of the same shapes, dtypes and distributions, fresh on every call."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jax_kda.testing import ACCURACY_MATRIX, Workload, make_inputs

# Every gate form and draw option make_inputs has, at sizes whose moments are stable.
_BIG = dict(seqlen=512, heads=4, head_k=64, head_v=64)
CASES = (
    Workload("lower_bound", **_BIG),
    Workload("softplus_bf16_state_k_first", gate="softplus", dtype="bfloat16", **_BIG),
    Workload("lower_bound_no_a_log_f32", gate="lower_bound_no_a_log", dtype="float32", **_BIG),
    Workload("pre_long_memory", gate="preactivated", decay_floor=-30.0, long_memory=True, **_BIG),
    Workload("lower_bound_long_memory", long_memory=True, **_BIG),
    Workload("raw_beta_no_l2norm", beta_sigmoid=False, l2norm=False, **_BIG),
    Workload("packed", seqlens=(300, 0, 212), heads=4, head_k=64, head_v=64, state_v_first=True),
    Workload("grouped_fp32_gates", v_heads=8, g_dtype="float32", beta_dtype="float32", **_BIG),
)


def _split(inputs):
    """({name: array}, {name: static value}) of make_inputs' (args, kwargs)."""
    args, kwargs = inputs
    arrays = {f"arg{i}": a for i, a in enumerate(args)} | {k: v for k, v in kwargs.items() if hasattr(v, "shape")}
    return arrays, {k: v for k, v in kwargs.items() if k not in arrays}


@pytest.mark.parametrize("w", CASES, ids=lambda w: w.name)
def test_device_draws_match_the_host_draws_in_shape_dtype_and_distribution(w, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    host, host_static = _split(make_inputs(w, rng))
    device, device_static = _split(make_inputs(w, rng, on_device=True))
    assert host.keys() == device.keys() and host_static == device_static
    for name, h in host.items():
        d = device[name]
        assert (d.shape, d.dtype) == (h.shape, h.dtype), name
        if name == "cu_seqlens":
            np.testing.assert_array_equal(np.asarray(d), np.asarray(h))
            continue
        h64, d64 = np.asarray(h, np.float64), np.asarray(d, np.float64)
        assert np.all(np.isfinite(d64)) and np.count_nonzero(d64) > 0.99 * d64.size, name  # never zeros
        # Same distribution: the two-sample Kolmogorov-Smirnov statistic (largest gap between the two
        # empirical CDFs) under 2.5 sqrt(2 / n), which equal distributions exceed with probability ~1e-5;
        # long memory picks its channels by one draw per (head, channel), so n counts those.
        n = w.num_v_heads * w.head_k if name == "arg3" and w.long_memory else min(h64.size, d64.size)
        xs = np.sort(h64.ravel()), np.sort(d64.ravel())
        grid = np.concatenate(xs)
        gap = np.abs(np.searchsorted(xs[0], grid, "right") / xs[0].size
                     - np.searchsorted(xs[1], grid, "right") / xs[1].size).max()
        assert gap <= 2.5 * np.sqrt(2 / n), (name, gap)
        # The KS gap is weak on the small arrays (dt_bias, A_log): their spreads must agree too.
        if n >= 64:
            assert d64.std() == pytest.approx(h64.std(), rel=6 / np.sqrt(n)), (name, d64.std(), h64.std())


def test_device_draws_keep_the_gate_ranges(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    w = Workload("pre", gate="preactivated", decay_floor=-30.0, long_memory=True, seqlen=256, heads=4,
                 head_k=64, head_v=64)
    g = np.asarray(make_inputs(w, rng, on_device=True)[0][3], np.float64)
    assert g.max() < 0 and g.min() >= -30.0 * 1.01  # log-decays in [decay_floor, 0)
    w = dataclasses.replace(w, beta_sigmoid=False)
    beta = np.asarray(make_inputs(w, rng, on_device=True)[0][4], np.float64)
    assert beta.min() >= 0.05 - 1e-3 and beta.max() <= 1.0


def test_each_call_and_each_array_draws_fresh_values_on_the_device(fresh_seed):
    w = ACCURACY_MATRIX[4]  # 17 tokens
    rng = np.random.default_rng(fresh_seed)
    (q1, k1, *_), _ = make_inputs(w, rng, on_device=True)
    (q2, *_), _ = make_inputs(w, rng, on_device=True)
    assert q1.dtype == jnp.bfloat16
    assert not np.array_equal(np.asarray(q1, np.float32), np.asarray(q2, np.float32))  # a new seed a call
    assert not np.array_equal(np.asarray(q1, np.float32), np.asarray(k1, np.float32))  # a new key a draw
