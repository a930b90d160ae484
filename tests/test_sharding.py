"""Partitioning over devices on 4 and 8 fake CPU devices (tests/conftest.py): batch and head
sharding under jax.jit with NamedSharding (custom_partitioning), in explicit sharding mode and
inside jax.shard_map (check_vma on); results equal to the unsharded call; no collective in the
compiled program; the kernels' plan made for each device's shapes.

The kernel-eligible cases (K = V = 128, bf16) go through the kernel primitive, which lowers to the
XLA path on CPU: the same partitioning code the GPUs run, around a different local computation.
"""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_kda
from jax_kda import _native, gold
from jax_kda.testing import Workload, make_inputs

COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")
W = Workload
# The kernels' head size, in fp32: on CPU every backend lowers to the XLA path (the kernels' plan is
# made only when lowering for CUDA), so fp32 loses nothing here, and the sharded-vs-whole comparison
# then sees only XLA's fp32 reordering, not bf16 roundings of it flipping (which made a 1e-4 bar on
# bf16 o fail about one run in three; the XLA-path cases at other head sizes below take fp32 for the
# same reason: in bf16 one run of them gave 1.2e-4). The bf16 kernel calls under sharding are checked
# by the lowering and export tests below.
KDA = dict(head_k=128, head_v=128, dtype="float32")

needs_devices = pytest.mark.skipif(len(jax.devices("cpu")) < 8, reason="needs 8 CPU devices (tests/conftest.py)")
pytestmark = needs_devices


def _mesh(shape, names, kind=AxisType.Auto, count=None):
    devices = np.array(jax.devices("cpu")[: count or int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(kind,) * len(names))


def _in_mesh(mesh):
    """The context that makes `mesh` current (explicit sharding): jax.set_mesh, or use_mesh where
    this jax still has it."""
    return jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else jax.set_mesh(mesh)


def _split(kwargs):
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    return arrays, {k: v for k, v in kwargs.items() if k not in arrays}


def _specs(w: Workload, batch, heads):
    """PartitionSpecs of (q, k, v, g, beta) and of the keyword arrays for a batch/head split."""
    b = None if w.seqlens is not None else batch
    token = P(b, None, heads, None)
    keyword = {"initial_state": P(b, heads), "A_log": P(heads), "dt_bias": P(heads), "cu_seqlens": P()}
    return [token] * 4 + [P(b, None, heads)], keyword


def _run_sharded(f, mesh, args, arrays, arg_specs, kw_specs):
    """f(args, arrays) on inputs placed with these specs: (the results, the compiled program's text)."""
    sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, arg_specs)]
    kw = {k: jax.device_put(v, NamedSharding(mesh, kw_specs[k])) for k, v in arrays.items()}
    return f(sharded, kw), f.lower(sharded, kw).compile().as_text()


def _assert_close(got, want):
    """Equal up to float rounding: on CPU the XLA path's fp32 reductions are fused and ordered by
    XLA per shape, so a shard's sums can round differently from the whole call's (err_ratio ~1e-6
    with fp32 inputs; the kernels compute every (sequence, head) the same way in both)."""
    for a, b in zip(got, want):
        if b is None:
            assert a is None
            continue
        err = gold.err_ratio(np.asarray(jnp.asarray(a, jnp.float32), np.float64),
                             np.asarray(jnp.asarray(b, jnp.float32), np.float64))
        assert err <= 1e-4, err


CASES = [
    # (workload, backend, mesh shape, mesh axes, batch axis, head axis)
    (W("batch_sharded", batch=4, seqlen=40, heads=2, **KDA), "auto", (4,), ("data",), "data", None),
    (W("head_sharded", batch=1, seqlen=40, heads=8, **KDA), "auto", (4,), ("model",), None, "model"),
    (W("both_2d", batch=2, seqlen=33, heads=4, **KDA), "auto", (2, 4), ("data", "model"), "data", "model"),
    (W("packed_head_sharded", seqlens=(10, 0, 30, 17), heads=4, **KDA), "auto", (4,), ("model",), None, "model"),
    (W("packed_no_initial_state", seqlens=(10, 0, 30, 17), heads=4, initial_state=False, **KDA), "auto", (4,),
     ("model",), None, "model"),
    (W("gqa_head_sharded", batch=2, seqlen=40, heads=4, v_heads=8, **KDA), "auto", (2, 4), ("data", "model"),
     "data", "model"),
    (W("no_initial_state", batch=4, seqlen=40, heads=4, initial_state=False, **KDA), "auto", (2, 4),
     ("data", "model"), "data", "model"),
    (W("xla_both_2d", batch=2, seqlen=40, heads=4, v_heads=8, head_k=32, head_v=16, dtype="float32"), "xla",
     (2, 4), ("data", "model"), "data", "model"),
    (W("xla_packed_v_first", seqlens=(5, 30, 0), heads=8, state_v_first=True, dtype="float32"), "xla", (8,),
     ("model",), None, "model"),
]


@pytest.mark.parametrize("w,backend,shape,names,batch,heads", CASES, ids=lambda c: getattr(c, "name", None))
def test_jit_with_named_shardings_runs_one_local_call_per_device(w, backend, shape, names, batch, heads, fresh_seed):
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    arrays, static = _split(kwargs)
    f = jax.jit(lambda a, kw: jax_kda.prefill(*a, **kw, **static, backend=backend))
    want = f(args, arrays)
    mesh = _mesh(shape, names)
    arg_specs, kw_specs = _specs(w, batch, heads)
    got, compiled = _run_sharded(f, mesh, args, arrays, arg_specs, kw_specs)
    _assert_close(got, want)
    assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, arg_specs[2]), 4), got[0].sharding
    assert not [c for c in COLLECTIVES if c in compiled], [c for c in COLLECTIVES if c in compiled]
    # Each device computes its own shard: the compiled program holds q's local shape.
    local = [d // mesh.shape[a] if a else d for d, a in zip(args[0].shape, arg_specs[0])]
    dtype = {"bfloat16": "bf16", "float32": "f32"}[w.dtype]
    assert f"{dtype}[{','.join(map(str, local))}]" in compiled


@pytest.mark.parametrize("backend,dims", [("auto", KDA), ("xla", dict(head_k=32, head_v=32, dtype="float32"))])
@pytest.mark.parametrize("initial_state", [True, False])
def test_shard_map_with_check_vma_on_every_backend(backend, dims, initial_state, fresh_seed):
    w = W("shard_map", batch=4, seqlen=40, heads=4, initial_state=initial_state, **dims)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    arrays, static = _split(kwargs)
    mesh = _mesh((2, 2), ("data", "model"), count=4)
    arg_specs, kw_specs = _specs(w, "data", "model")
    out_specs = (arg_specs[2], kw_specs["initial_state"])
    run = jax.shard_map(lambda a, kw: jax_kda.prefill(*a, **kw, **static, backend=backend), mesh=mesh,
                        in_specs=(tuple(arg_specs), {k: kw_specs[k] for k in arrays}), out_specs=out_specs)
    got = jax.jit(run)(args, arrays)
    want = jax_kda.prefill(*args, **arrays, **static, backend=backend)
    _assert_close(got, want)


@pytest.mark.parametrize("varying", ["initial_state", "dt_bias", "cu_seqlens"])
def test_shard_map_where_only_a_state_parameter_or_cu_seqlens_varies(varying, fresh_seed):
    """Tokens the same on every device while the initial state (one per device), dt_bias or a packed
    batch's cu_seqlens differ: the XLA path's scan carries vary over the mesh axis as the result
    does, and each device's result is the unsharded call's with its own operand."""
    packed = varying == "cu_seqlens"
    w = W("shard_map_varying", seqlens=(10, 30) if packed else None, seqlen=40, heads=2, gate="softplus",
          head_k=32, head_v=32, dtype="float32")
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    arrays, static = _split(kwargs)
    rng = np.random.default_rng(fresh_seed + 1)
    second = {"initial_state": arrays["initial_state"] + rng.standard_normal(arrays["initial_state"].shape),
              "dt_bias": arrays["dt_bias"] + rng.standard_normal(arrays["dt_bias"].shape),
              "cu_seqlens": np.array([0, 25, 40], np.int32)}[varying]
    per_device = [dict(arrays), dict(arrays, **{varying: jnp.asarray(second, arrays[varying].dtype)})]
    stacked = jnp.concatenate([d[varying] for d in per_device])
    mesh = _mesh((2,), ("x",), count=2)
    kw_specs = {k: (P("x") if k == varying else P()) for k in arrays}
    out_specs = (P("x"), P("x"))

    def local(a, kw):
        return jax_kda.prefill(*a, **kw, **static, backend="xla")

    run = jax.shard_map(local, mesh=mesh, in_specs=(tuple(P() for _ in args), kw_specs), out_specs=out_specs)
    o, final = jax.jit(run)(args, dict(arrays, **{varying: stacked}))
    for i, kw in enumerate(per_device):
        want_o, want_final = jax_kda.prefill(*args, **kw, **static, backend="xla")
        n = want_final.shape[0]
        _assert_close((o[i : i + 1], final[i * n : (i + 1) * n]), (want_o, want_final))


@pytest.mark.parametrize("wrap", ["jit", "checkpoint"])
def test_grad_of_a_jitted_shard_map_and_its_output_type(wrap, fresh_seed):
    """Inside shard_map the results are typed as varying over the operands' manual axes, as values
    computed from them are: with a plain type, shard_map added a pvary after the call, and the
    gradient of a jit (or checkpoint) of the shard_map failed ("pvary is a invariant->variant
    collective"); and out_specs=P(), which claims o is the same on every device, was accepted."""
    w = W("shard_map_grad", batch=2, seqlen=32, heads=4, initial_state=True, head_k=32, head_v=32,
          dtype="float32")
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    arrays, static = _split(kwargs)
    mesh = _mesh((2, 2), ("data", "model"), count=4)
    arg_specs, kw_specs = _specs(w, "data", "model")
    in_specs = (tuple(arg_specs), {k: kw_specs[k] for k in arrays})

    def loss(run):
        wrapped = {"jit": jax.jit, "checkpoint": jax.checkpoint}[wrap](run)
        return lambda a, kw: sum(jnp.sum(x ** 2) for x in wrapped(a, kw))

    sharded = jax.shard_map(lambda a, kw: jax_kda.prefill(*a, **kw, **static), mesh=mesh, in_specs=in_specs,
                            out_specs=(arg_specs[2], kw_specs["initial_state"]))
    got = jax.jit(jax.grad(loss(sharded)))(args, arrays)
    want = jax.grad(loss(lambda a, kw: jax_kda.prefill(*a, **kw, **static)))(args, arrays)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)
    replicated = jax.shard_map(lambda a, kw: jax_kda.prefill(*a, **kw, **static)[0], mesh=mesh,
                               in_specs=in_specs, out_specs=P())
    with pytest.raises(ValueError, match="out_specs"):
        jax.jit(replicated)(args, arrays)


@pytest.mark.skipif(_native.unavailable_reason() is not None, reason="kernels not built")
def test_shard_map_lowered_for_cuda_plans_for_the_local_heads():
    """96 heads x 8K tokens at 8-way tensor parallelism: each device's kernel call is the 12-head call,
    with the 12-head plan (8 segments: intracard context parallelism), not the 96-head one."""
    S = jax.ShapeDtypeStruct
    x, beta = S((1, 8192, 96, 128), jnp.bfloat16), S((1, 8192, 96), jnp.bfloat16)
    local = jax_kda.explain(S((1, 8192, 12, 128), jnp.bfloat16), *[S((1, 8192, 12, 128), jnp.bfloat16)] * 3,
                            S((1, 8192, 12), jnp.bfloat16), device="9.0")
    whole = jax_kda.explain(x, x, x, x, beta, device="9.0")
    assert local.plan.num_segments > 1 and whole.plan.num_segments == 1
    mesh = jax.sharding.AbstractMesh((8,), ("model",), axis_types=(AxisType.Auto,))
    spec = P(None, None, "model", None)
    run = jax.shard_map(lambda *a: jax_kda.prefill(*a), mesh=mesh, in_specs=(spec,) * 4 + (P(None, None, "model"),),
                        out_specs=(spec, P()))
    text = jax.jit(run).trace(x, x, x, x, beta).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @jax_kda_prefill" in line]
    assert len(calls) == 2  # the summary and apply calls of the 12-head plan
    assert all(f"num_segments = {local.plan.num_segments} : i32" in c for c in calls)
    assert "tensor<1x8192x12x128xbf16>" in calls[1]


def test_explicit_sharding_mode_splits_batch_and_heads(fresh_seed):
    w = W("explicit", batch=2, seqlen=40, heads=4, **KDA)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    arrays, static = _split(kwargs)
    want = jax_kda.prefill(*args, **arrays, **static)
    mesh = _mesh((2, 4), ("data", "model"), kind=AxisType.Explicit)
    arg_specs, kw_specs = _specs(w, "data", "model")
    with _in_mesh(mesh):
        f = jax.jit(lambda a, kw: jax_kda.prefill(*a, **kw, **static))
        got, compiled = _run_sharded(f, mesh, args, arrays, arg_specs, kw_specs)
    _assert_close(got, want)
    assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, arg_specs[2]), 4), got[0].sharding
    assert not [c for c in COLLECTIVES if c in compiled]


@pytest.mark.parametrize("batch,heads", [("data", None), (None, "model"), ("data", "model")])
def test_explicit_sharding_reshards_replicated_parameters_and_states(batch, heads, fresh_seed):
    """Under explicit sharding the split is q's: A_log, dt_bias and the initial state given replicated
    (as parameters usually are) are resharded to it, and the result is the unsharded call's."""
    w = W("explicit_replicated", batch=2, seqlen=40, heads=4, gate="softplus", **KDA)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    arrays, static = _split(kwargs)
    assert {"A_log", "dt_bias", "initial_state"} <= set(arrays)
    want = jax_kda.prefill(*args, **arrays, **static)
    mesh = _mesh((2, 4), ("data", "model"), kind=AxisType.Explicit)
    arg_specs, _ = _specs(w, batch, heads)
    with _in_mesh(mesh):
        f = jax.jit(lambda a, kw: jax_kda.prefill(*a, **kw, **static))
        got, compiled = _run_sharded(f, mesh, args, arrays, arg_specs, {k: P() for k in arrays})
    _assert_close(got, want)
    # Each device computed its shard only: o comes out split as v is, and no collective gathered it.
    assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, arg_specs[2]), 4), got[0].sharding
    assert not [c for c in COLLECTIVES if c in compiled]


@pytest.mark.parametrize("axis,specs,match", [
    # T split: the recurrence needs whole sequences.
    ("seq", [P(None, "seq")] * 5, r"cannot split T, K or V across devices \(q is sharded"),
    # q replicated while v, g and beta are split over heads: which split was meant is ambiguous.
    ("model", [P()] * 2 + [P(None, None, "model")] * 3, r"v is sharded .* but q is replicated"),
], ids=["token_axis", "q_replicated"])
def test_explicit_shardings_the_call_cannot_honour_are_errors(axis, specs, match):
    w = W("explicit_error", batch=1, seqlen=64, heads=4, **KDA)
    args, kwargs = make_inputs(w, np.random.default_rng(0))
    arrays, static = _split(kwargs)
    mesh = _mesh((4,), (axis,), kind=AxisType.Explicit, count=4)
    with _in_mesh(mesh):
        sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        with pytest.raises(ValueError, match=match):
            jax.jit(lambda a: jax_kda.prefill(*a, **arrays, **static))(sharded)


def test_a_token_sharded_input_is_gathered_with_the_reason_logged(fresh_seed, caplog):
    """Under jit with a T sharding the call cannot honour, the partition callback keeps the batch
    split, gathers T and logs why; the result is still right."""
    w = W("t_auto", batch=2, seqlen=64, heads=4, **KDA)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    arrays, static = _split(kwargs)
    want = jax_kda.prefill(*args, **arrays, **static)
    mesh = _mesh((2, 4), ("data", "seq"))
    sharded = [jax.device_put(x, NamedSharding(mesh, P("data", "seq"))) for x in args]
    with caplog.at_level(logging.WARNING, logger="jax_kda"):
        got = jax.jit(lambda a, kw: jax_kda.prefill(*a, **kw, **static))(sharded, arrays)
    _assert_close(got, want)
    assert "cannot split T over 'seq' (q, k, v, g, beta): those inputs are gathered" in caplog.text


def _placed_inputs(w, mesh, name, spec, seed):
    """Inputs of `w` on `mesh`: operand `name` sharded `spec`, the token inputs and the state split
    over the batch axis "data", the rest replicated. (args, arrays, static kwargs, placed by name)."""
    args, kwargs = make_inputs(w, np.random.default_rng(seed))
    arrays, static = _split(kwargs)
    inputs = dict(zip(("q", "k", "v", "g", "beta"), args), **arrays)
    placed = {n: jax.device_put(x, NamedSharding(mesh, spec if n == name else P("data") if n in
                                                 ("q", "k", "v", "g", "beta", "initial_state") else P()))
              for n, x in inputs.items()}
    return args, arrays, static, placed


# One operand other than q sharded over a dim the call keeps whole (q itself is split over the
# batch): (operand, its PartitionSpec, the dim as the log names it). State layout [N, HV, K, V].
OTHER_OPERAND_SPLITS = [
    ("v", P("data", None, None, "x"), "V"),
    ("g", P("data", None, None, "x"), "K"),
    ("beta", P("data", "x"), "T"),
    ("k", P("data", "x"), "T"),
    ("initial_state", P("data", None, "x"), "K"),
    ("initial_state", P("data", None, None, "x"), "V"),
    ("dt_bias", P(None, "x"), "K"),
]


@pytest.mark.parametrize("name,spec,dim", OTHER_OPERAND_SPLITS,
                         ids=[f"{n}_{d}" for n, _, d in OTHER_OPERAND_SPLITS])
def test_under_jit_any_operand_split_the_call_keeps_whole_is_gathered_and_logged(name, spec, dim, fresh_seed, caplog):
    """Not only q's sharding is read: any operand sharded over T, K or V is gathered along it with
    the reason logged, while the call keeps q's batch split; the result is the unsharded call's."""
    w = W("other_operand_auto", batch=2, seqlen=32, heads=4, gate="softplus", **KDA)
    mesh = _mesh((2, 4), ("data", "x"))
    args, arrays, static, placed = _placed_inputs(w, mesh, name, spec, fresh_seed)
    want = jax_kda.prefill(*args, **arrays, **static)
    f = jax.jit(lambda kw: jax_kda.prefill(**kw, **static))
    with caplog.at_level(logging.WARNING, logger="jax_kda"):
        got = f(placed)
    _assert_close(got, want)
    assert f"cannot split {dim} over 'x' ({name}): those inputs are gathered" in caplog.text, caplog.text
    assert "B over" not in caplog.text  # q's batch split is kept


TOKEN_SPLITS = [s for s in OTHER_OPERAND_SPLITS if s[0] in ("v", "g", "beta", "k")]
STATE_AND_PARAMETER_SPLITS = [s for s in OTHER_OPERAND_SPLITS if s[0] in ("initial_state", "dt_bias")]


@pytest.mark.parametrize("name,spec,dim", TOKEN_SPLITS, ids=[f"{n}_{d}" for n, _, d in TOKEN_SPLITS])
def test_under_explicit_sharding_a_token_input_split_over_t_k_or_v_is_an_error(name, spec, dim):
    w = W("other_operand_explicit", batch=2, seqlen=32, heads=4, gate="softplus", **KDA)
    mesh = _mesh((2, 4), ("data", "x"), kind=AxisType.Explicit)
    with _in_mesh(mesh):
        _, _, static, placed = _placed_inputs(w, mesh, name, spec, 0)
        with pytest.raises(ValueError, match=rf"cannot split T, K or V across devices \({name} is sharded .*"
                                             rf"{dim} over 'x'.*reshard {name} first"):
            jax.jit(lambda kw: jax_kda.prefill(**kw, **static))(placed)


@pytest.mark.parametrize("name,spec,dim", STATE_AND_PARAMETER_SPLITS,
                         ids=[f"{n}_{d}" for n, _, d in STATE_AND_PARAMETER_SPLITS])
def test_under_explicit_sharding_a_state_or_parameter_split_over_k_or_v_is_resharded_with_a_log(
        name, spec, dim, fresh_seed, caplog):
    """States and parameters may be stored split over K or V (FSDP): they are resharded to q's split,
    and the log says so; the result is the unsharded call's."""
    w = W("state_param_explicit", batch=2, seqlen=32, heads=4, gate="softplus", **KDA)
    mesh = _mesh((2, 4), ("data", "x"), kind=AxisType.Explicit)
    with _in_mesh(mesh):
        args, arrays, static, placed = _placed_inputs(w, mesh, name, spec, fresh_seed)
        with caplog.at_level(logging.WARNING, logger="jax_kda"):
            got = jax.jit(lambda kw: jax_kda.prefill(**kw, **static))(placed)
    _assert_close(got, jax_kda.prefill(*args, **arrays, **static))
    assert f"{dim} over 'x' ({name}) resharded to q's split" in caplog.text, caplog.text


def test_a_split_over_a_mesh_axis_of_size_one_splits_nothing(fresh_seed, caplog):
    """v 'split' over V along an axis of size 1 is whole: no error, no log."""
    w = W("size_one_axis", batch=2, seqlen=32, heads=4, **KDA)
    mesh = _mesh((2, 1), ("data", "x"), kind=AxisType.Explicit)
    with _in_mesh(mesh):
        args, arrays, static, placed = _placed_inputs(w, mesh, "v", P("data", None, None, "x"), fresh_seed)
        with caplog.at_level(logging.WARNING, logger="jax_kda"):
            got = jax.jit(lambda kw: jax_kda.prefill(**kw, **static))(placed)
    _assert_close(got, jax_kda.prefill(*args, **arrays, **static))
    assert "jax_kda" not in caplog.text


def test_under_explicit_sharding_an_operand_split_otherwise_than_q_is_resharded_with_a_log(fresh_seed, caplog):
    """v, g and beta split over heads while q and k are split over the batch: the call takes q's
    split and reshards the others to it, and says so."""
    w = W("explicit_mismatch", batch=2, seqlen=32, heads=4, **KDA)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    arrays, static = _split(kwargs)
    want = jax_kda.prefill(*args, **arrays, **static)
    mesh = _mesh((2, 4), ("data", "x"), kind=AxisType.Explicit)
    specs = [P("data")] * 2 + [P(None, None, "x")] * 2 + [P(None, None, "x")]
    with _in_mesh(mesh):
        sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        with caplog.at_level(logging.WARNING, logger="jax_kda"):
            got = jax.jit(lambda a: jax_kda.prefill(*a, **arrays, **static))(sharded)
    _assert_close(got, want)
    assert "HV over 'x' (v, g, beta) resharded to q's split (batch 'data', heads None)" in caplog.text, caplog.text


def test_shard_map_form_exports_for_cuda():
    """The sharded form that exports: a shard_map over heads, exported for CUDA from this CPU host
    and serialized."""
    S = jax.ShapeDtypeStruct
    x, beta = S((1, 512, 8, 128), jnp.bfloat16), S((1, 512, 8), jnp.bfloat16)
    mesh = _mesh((4,), ("model",), count=4)
    spec = P(None, None, "model", None)
    run = jax.shard_map(lambda *a: jax_kda.prefill(*a)[0], mesh=mesh, in_specs=(spec,) * 4 + (P(None, None, "model"),),
                        out_specs=spec)
    exported = jax.export.export(jax.jit(run), platforms=["cuda", "cpu"],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("jax_kda_prefill")])(
        x, x, x, x, beta)
    assert len(exported.serialize()) > 0
    text = exported.mlir_module()
    if _native.unavailable_reason() is None:
        assert re.search(r"stablehlo.custom_call @jax_kda_prefill\(.*tensor<1x512x2x128xbf16>", text)


def test_named_sharding_alone_does_not_export():
    """What docs/prefill.md says of the form that relies on NamedSharding alone: jax.export cannot
    serialize its custom_partitioning callback. If this starts to pass, jax learned to, and the docs'
    "Which forms export" should say so."""
    S = jax.ShapeDtypeStruct
    mesh = _mesh((4,), ("model",), count=4)
    x = S((1, 64, 8, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, None, "model", None)))
    beta = S((1, 64, 8), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, None, "model")))
    with pytest.raises(NotImplementedError, match="host_callbacks"):
        jax.export.export(jax.jit(lambda *a: jax_kda.prefill(*a)[0]), platforms=["cpu"])(x, x, x, x, beta)


def test_the_gspmd_partitioner_splits_the_same_way(fresh_seed):
    """With GSPMD instead of Shardy, the callbacks (not the sharding rule) partition the call."""
    from jax._src import config

    w = W("gspmd", batch=2, seqlen=40, heads=4, v_heads=8, **KDA)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    arrays, static = _split(kwargs)
    want = jax_kda.prefill(*args, **arrays, **static)
    mesh = _mesh((2, 4), ("data", "model"))
    arg_specs, kw_specs = _specs(w, "data", "model")
    with config.use_shardy_partitioner(False):
        f = jax.jit(lambda a, kw: jax_kda.prefill(*a, **kw, **static))
        got, compiled = _run_sharded(f, mesh, args, arrays, arg_specs, kw_specs)
    _assert_close(got, want)
    assert not [c for c in COLLECTIVES if c in compiled]
    assert "f32[1,40,1,128]" in compiled  # q's per-device shard
