"""The sharded prefill on every GPU of the machine (marked `gpu`; tests/run_multi_gpu.sh runs it):
head-sharded (tensor parallel: dense and packed) and batch-sharded (dense) calls, with and without
an initial state, under jax.jit with NamedSharding and inside jax.shard_map, against the same call
on one GPU and against the float64 gold; the compiled program holds no collective. On a machine
with one GPU the mesh has one device: the kernel path through the sharding machinery still has to
give the unsharded call's results, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_kda
from jax_kda import dispatch, planner, sharding
from jax_kda.config import validate
from jax_kda.testing import Workload, check_against_gold, make_inputs

pytestmark = pytest.mark.gpu

COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")
D = dict(head_k=128, head_v=128)


def _gpus():
    try:
        return [d for d in jax.devices("gpu") if getattr(d, "compute_capability", None) == "9.0"]
    except RuntimeError:
        return []


requires_hopper = pytest.mark.skipif(not _gpus(), reason="needs compute capability 9.0 GPUs")


def _case(kind: str, n: int, initial_state: bool) -> tuple[Workload, str | None, str | None]:
    """(workload, batch axis, head axis) with n-way splits."""
    if kind == "heads_dense":
        return Workload("tp_dense", batch=1, seqlen=700, heads=2 * n, initial_state=initial_state, **D), None, "x"
    if kind == "heads_packed":
        return (Workload("tp_packed", seqlens=(300, 0, 17, 250), heads=2 * n, initial_state=initial_state, **D),
                None, "x")
    return Workload("dp_dense", batch=2 * n, seqlen=300, heads=4, initial_state=initial_state, **D), "x", None


def _sharded_inputs(w, args, arrays, mesh, batch, heads):
    b = None if w.seqlens is not None else batch
    token, beta = P(b, None, heads, None), P(b, None, heads)
    keyword = {"initial_state": P(b, heads), "A_log": P(heads), "dt_bias": P(heads), "cu_seqlens": P()}
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    return ([put(x, token) for x in args[:4]] + [put(args[4], beta)],
            {k: put(v, keyword[k]) for k, v in arrays.items()}, (token, beta, keyword))


@requires_hopper
@pytest.mark.parametrize("initial_state", [True, False], ids=["state", "no_state"])
@pytest.mark.parametrize("kind", ["heads_dense", "heads_packed", "batch_dense"])
def test_sharded_calls_match_one_gpu_bit_for_bit(kind, initial_state, fresh_seed):
    gpus = _gpus()
    n = len(gpus)
    w, batch, heads = _case(kind, n, initial_state)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    f = jax.jit(lambda a, kw: jax_kda.prefill(*a, **kw, **static))
    with jax.default_device(gpus[0]):
        want = f(args, arrays)
    check_against_gold(f"{w.name} one GPU", w, args, kwargs, *want)
    mesh = jax.sharding.Mesh(np.array(gpus), ("x",), axis_types=(AxisType.Auto,))
    sharded, kw, (token, beta, keyword) = _sharded_inputs(w, args, arrays, mesh, batch, heads)

    got = f(sharded, kw)
    compiled = f.lower(sharded, kw).compile().as_text()
    assert not [c for c in COLLECTIVES if c in compiled], [c for c in COLLECTIVES if c in compiled]
    assert "jax_kda_prefill" in compiled
    in_specs = ((token,) * 4 + (beta,), {k: keyword[k] for k in arrays})
    out_specs = (token, keyword["initial_state"]) if w.output_final_state else (token, None)
    mapped = jax.jit(jax.shard_map(lambda a, kw: jax_kda.prefill(*a, **kw, **static), mesh=mesh,
                                   in_specs=in_specs, out_specs=out_specs))(tuple(sharded), kw)
    # Each device's call is the whole call's restricted to its heads or sequences, so the results are
    # the same bits, unless the planner segments the per-device call differently from the whole one
    # (fewer heads per device can make it cut sequences into segments): then both must meet the bar.
    cfg = validate(*args, **kwargs)
    num_sms = dispatch.num_sms_of(dispatch.default_device())
    whole = planner.plan_prefill(cfg, num_sms=num_sms)
    part = planner.plan_prefill(sharding.local_config(cfg, n if batch else 1, n if heads else 1), num_sms=num_sms)
    same_plan = (whole.num_segments, whole.segment_len) == (part.num_segments, part.segment_len)
    for label, result in (("jit", got), ("shard_map", mapped)):
        print(f"{w.name} on {n} GPU(s), {label}: {'bitwise' if same_plan else 'gold'} check")
        if same_plan:
            for a, b in zip(result, want):
                np.testing.assert_array_equal(np.asarray(jnp.asarray(a, jnp.float32)),
                                              np.asarray(jnp.asarray(b, jnp.float32)))
        else:
            check_against_gold(f"{w.name} {label} on {n} GPUs", w, args, kwargs, *result)
