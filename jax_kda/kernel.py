"""The prefill primitive in one place: its lowering per platform, the segmented pair of kernel
calls, partitioning over devices, batching and differentiation.

`prefill_p` is bound with the call's `Operands` (flattened; absent optional arrays are simply not
there), the validated `PrefillConfig`, the `contract.Kernels` request (None: the XLA path on every
platform), the SM count the kernels' plan is sized for and an optional forced segment count, as
static parameters. Its results are o and, with `output_final_state`, the final state. Every backend
goes through it, so they all partition the same way: the lowering wraps the local computation in
`sharding.partitioned` (over batch and heads, the plan made for the per-device shapes).

Lowering, decided per platform when the program is lowered, not when it is traced:
  * CUDA: the custom call `contract.FFI_TARGET` (XLA FFI, typed attributes that carry the flags,
    the plan and the request). Which compiled object runs (Hopper or Blackwell) is resolved by the
    FFI handler on the device the program runs on. So a program exported for CUDA from a CPU host
    carries the kernels.
  * Any other platform: the XLA path (`xla_backend`), for `Kernels.FOR_DEVICE` (backend="auto");
    an explicit kernel backend lowered for another platform is an error.

A plan with `num_segments` S > 1 (intracard context parallelism) lowers to two custom calls over the
N * S segments as one packed batch (segment j of sequence i covers tokens
`[bos_i + min(j L, len_i), bos_i + min((j + 1) L, len_i))`, L = `plan.segment_len`, a multiple of 16
tokens, so prepare's chunks are those of the unsegmented call; segments past a short sequence's end
are empty):
  1. **Summary** (`Phase.SUMMARY`): prepare over all segments; every segment's zero-start state B
     and transition M (the recurrence is affine in the state: s_end = M s_start + B); then a small
     fp32 kernel walks each sequence's segments, start_0 = initial_state, start_{j+1} = M_j start_j +
     B_j. Everything stays in the call's workspace; no o.
  2. **Apply** (`Phase.APPLY`): on that workspace (aliased), the recurrence alone from every
     segment's start state, writing o and each segment's final state; a sequence's is its last
     segment's.

The workspace is an extra result of each custom call (XLA allocates it; the primitive drops it).
With `state_in_place` (`PrefillConfig`), an unsegmented call aliases the initial and final states
(`operand_output_aliases`), so a donated initial state is updated in place; a state that is not
donated would first be copied by XLA, so by default the final state is a new buffer. The pieces of a
call cut along T always update the carried state in place (it is an intermediate of the program).

Differentiation: the forward is the kernel; tangents and cotangents are the XLA path's
(`_jvp`: `jax.jvp` of `xla_backend.prefill`, which recomputes its forward). A backward kernel
would replace `_jvp` alone. vmap: the XLA path batches natively, the kernels run one call per
element.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch as jax_dispatch
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_kda import contract, planner, sharding, xla_backend
from jax_kda.config import Operands, PrefillConfig
from jax_kda.contract import Kernels, Phase
from jax_kda.planner import RecurrencePlan

prefill_p = Primitive("jax_kda_prefill")
prefill_p.multiple_results = True

# Operand positions of the custom call (csrc/ffi_prefill.cc binds them in this order).
_CALL_OPERANDS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "initial_state", "workspace")
_INITIAL_STATE, _WORKSPACE_IN = _CALL_OPERANDS.index("initial_state"), _CALL_OPERANDS.index("workspace")
_FINAL_STATE, _WORKSPACE_OUT = 1, 2


def prefill(ops: Operands, cfg: PrefillConfig, kernels: Kernels | None, num_sms: int = planner.DEFAULT_NUM_SMS,
            num_segments: int | None = None):
    """The prefill of `ops` through the primitive. `kernels`: the kernels' request (lowered for CUDA;
    the XLA path elsewhere for FOR_DEVICE), or None for the XLA path on every platform. `num_sms`
    sizes the kernels' plan; `num_segments` overrides its segments (tests). Returns
    (o, final_state or None)."""
    leaves, tree = jax.tree.flatten(ops)
    out = bind(leaves, tree, cfg, kernels, num_sms, num_segments)
    return out[0], (out[1] if cfg.output_final_state else None)


def fields_of(ops: Operands) -> tuple[str, ...]:
    """The names of the arrays present in `ops`, in the order of its leaves."""
    return tuple(f.name for f in dataclasses.fields(ops) if getattr(ops, f.name) is not None)


def bind(leaves, tree, cfg, kernels, num_sms, num_segments=None):
    """prefill_p on the flattened operands; returns the list of results."""
    fields = fields_of(jax.tree.unflatten(tree, [0] * len(leaves)))
    return prefill_p.bind(*leaves, tree=tree, fields=fields, cfg=cfg,
                          kernels=None if kernels is None else Kernels(kernels), num_sms=num_sms,
                          num_segments=num_segments)


# --- The custom calls ---------------------------------------------------------------------------------


def segment_offsets(cu_seqlens, num_segments: int, segment_len: int):
    """cu_seqlens [N + 1] -> the packed offsets [N * num_segments + 1] of the segments."""
    xp = np if isinstance(cu_seqlens, np.ndarray) else jnp
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
    offsets = xp.arange(num_segments, dtype=starts.dtype) * segment_len
    seg_starts = starts[:, None] + xp.minimum(offsets[None, :], (ends - starts)[:, None])
    return xp.concatenate([xp.reshape(seg_starts, (-1,)), cu_seqlens[-1:]]).astype(xp.int32)


def _dt_bias_operand(cfg: PrefillConfig, dt_bias):
    """dt_bias as `[HV * K]` fp32; zeros when absent but the gate reads it, empty when it doesn't."""
    if cfg.gate_mode not in contract.GATE_MODES_WITH_DT_BIAS:
        return jnp.zeros((0,), jnp.float32)
    if dt_bias is None:
        return jnp.zeros((cfg.num_v_heads * cfg.head_k,), jnp.float32)
    return jnp.reshape(jnp.asarray(dt_bias, jnp.float32), (-1,))


def _custom_call(cfg: PrefillConfig, plan: RecurrencePlan, kernels: Kernels, phase: Phase, operands: dict, *,
                 varlen: bool, state_v_first: bool, has_initial_state: bool, output_final_state: bool,
                 state_in_place: bool = False):
    """One custom call over `operands` (by name; absent ones empty); `state_in_place` aliases the initial
    and final states (a WHOLE call with both). Returns (o, final_state, workspace).

    The kernels run the units longest first (`order_units`) when the caller's input is packed: a
    segmented call of dense input is packed too (`varlen`), but its segments have one length (each
    sequence's last may be shorter), which no order helps, so it keeps the plain recurrence."""
    empty = {"cu_seqlens": jnp.int32, "workspace": jnp.uint8}
    args = [operands[name] if operands.get(name) is not None else jnp.zeros((0,), empty.get(name, jnp.float32))
            for name in _CALL_OPERANDS]
    q, v = operands["q"], operands["v"]
    units = cfg.num_seqs * plan.num_segments
    o_shape = (0, 0, 0, 0) if phase == Phase.SUMMARY else v.shape
    state = (cfg.head_v, cfg.head_k) if state_v_first else (cfg.head_k, cfg.head_v)
    # [units, HV, ...] whenever the call returns states (units may be 0: cu_seqlens = [0]), else empty.
    returns_states = phase != Phase.SUMMARY and output_final_state
    final_shape = (units, cfg.num_v_heads, *state) if returns_states else (0,)
    aliases = {}
    if state_in_place:
        aliases[_INITIAL_STATE] = _FINAL_STATE
    if phase == Phase.APPLY:
        aliases[_WORKSPACE_IN] = _WORKSPACE_OUT
    call = jax.ffi.ffi_call(
        contract.FFI_TARGET,
        (jax.ShapeDtypeStruct(o_shape, q.dtype), jax.ShapeDtypeStruct(final_shape, jnp.float32),
         jax.ShapeDtypeStruct((plan.workspace_bytes,), jnp.uint8)),
        input_output_aliases=aliases,
    )
    return call(*args, **call_attributes(
        gate_mode=cfg.gate_mode,
        lower_bound=cfg.lower_bound,
        scale=cfg.scale,
        use_qk_l2norm=cfg.use_qk_l2norm,
        use_beta_sigmoid=cfg.use_beta_sigmoid,
        state_v_first=state_v_first,
        has_initial_state=has_initial_state,
        output_final_state=output_final_state,
        varlen=varlen,
        order_units=cfg.varlen,
        chunk_size=plan.chunk_size,
        v_split=plan.v_split,
        num_sequences=cfg.num_seqs,
        num_segments=plan.num_segments,
        phase=phase,
        kernels=kernels,
    ))


_ATTRIBUTE_TYPES = {"i32": np.int32, "f32": np.float32}  # numpy scalars: each gets an exact MLIR type


def call_attributes(**values) -> dict:
    """The custom call's static attributes: exactly contract.CALL_ATTRIBUTES, in its order, each a numpy
    scalar of its type (what the FFI handler decodes by name)."""
    names = [name for name, _ in contract.CALL_ATTRIBUTES]
    if sorted(values) != sorted(names):
        raise ValueError(f"custom call attributes {sorted(values)} are not contract.CALL_ATTRIBUTES {sorted(names)}")
    return {name: _ATTRIBUTE_TYPES[kind](values[name]) for name, kind in contract.CALL_ATTRIBUTES}


def _kernel_calls(*leaves, tree, cfg: PrefillConfig, plan: RecurrencePlan, kernels: Kernels, num_sms: int):
    """The custom call(s) of one prefill: what the CUDA lowering emits."""
    ops = jax.tree.unflatten(tree, leaves)
    if plan.piece_len:
        def piece(piece_ops, piece_cfg):
            piece_plan = planner.plan_prefill(piece_cfg, num_sms=num_sms, num_segments=plan.num_segments)
            piece_leaves, piece_tree = jax.tree.flatten(piece_ops)
            return _kernel_calls(*piece_leaves, tree=piece_tree, cfg=piece_cfg, plan=piece_plan, kernels=kernels,
                                 num_sms=num_sms)

        return in_pieces(ops, cfg, plan.piece_len, piece)
    operands = dict(q=ops.q, k=ops.k, v=ops.v, g=ops.g, beta=ops.beta,
                    A_log=None if ops.A_log is None else jnp.asarray(ops.A_log, jnp.float32),
                    dt_bias=_dt_bias_operand(cfg, ops.dt_bias),
                    cu_seqlens=None if ops.cu_seqlens is None else jnp.asarray(ops.cu_seqlens).astype(jnp.int32),
                    initial_state=None if ops.initial_state is None else jnp.asarray(ops.initial_state, jnp.float32))
    flags = dict(has_initial_state=cfg.has_initial_state, output_final_state=cfg.output_final_state)
    if plan.num_segments == 1:
        o, final, _ = _custom_call(cfg, plan, kernels, Phase.WHOLE, operands, varlen=cfg.varlen,
                                   state_v_first=cfg.state_v_first, state_in_place=cfg.state_in_place, **flags)
        return [o, final] if cfg.output_final_state else [o]

    # Segmented: both calls see the N * S segments as one packed batch, states K-first.
    b, t, n, s = cfg.batch, cfg.seqlen, cfg.num_seqs, plan.num_segments
    tokens = b * t
    cu = operands["cu_seqlens"] if cfg.varlen else np.arange(b + 1, dtype=np.int32) * t
    flat = {name: jnp.reshape(operands[name], (1, tokens) + operands[name].shape[2:])
            for name in ("q", "k", "v", "g", "beta")}
    initial = operands["initial_state"]
    if initial is not None and cfg.state_v_first:
        initial = jnp.swapaxes(initial, -1, -2)
    seg = dict(operands, **flat, cu_seqlens=jnp.asarray(segment_offsets(cu, s, plan.segment_len)), initial_state=initial)
    _, _, workspace = _custom_call(cfg, plan, kernels, Phase.SUMMARY, seg, varlen=True, state_v_first=False,
                                   has_initial_state=cfg.has_initial_state, output_final_state=False)
    o, finals, _ = _custom_call(cfg, plan, kernels, Phase.APPLY, dict(seg, initial_state=None, workspace=workspace),
                                varlen=True, state_v_first=False, has_initial_state=False,
                                output_final_state=cfg.output_final_state)
    o = jnp.reshape(o, (b, t) + o.shape[2:])
    if not cfg.output_final_state:
        return [o]
    final = jnp.reshape(finals, (n, s) + finals.shape[1:])[:, -1]
    return [o, jnp.swapaxes(final, -1, -2) if cfg.state_v_first else final]


def in_pieces(ops: Operands, cfg: PrefillConfig, piece_len: int, run_piece):
    """A call cut along T into pieces of `piece_len` tokens, run in order by `run_piece(ops, cfg)`
    (which returns [o] or [o, final state]), each from the state the one before left
    (planner.piece_length). Dense: tokens [a, b) of every sequence; packed: packed tokens [a, b),
    every sequence clipped to them (empty outside, which keeps its state). Returns [o(, state)]."""
    t = cfg.seqlen
    state = ops.initial_state
    outputs = []
    for a in range(0, t, piece_len):
        b = min(a + piece_len, t)
        cut = lambda x: None if x is None else x[:, a:b]  # noqa: E731
        cu = None if ops.cu_seqlens is None else jnp.clip(jnp.asarray(ops.cu_seqlens).astype(jnp.int32), a, b) - a
        carries = cfg.output_final_state or b < t
        # A later piece's initial state is the one before's result, read by this piece alone: updating
        # it in place costs no copy. The first piece's is the caller's, in place only on request.
        piece_cfg = dataclasses.replace(cfg, seqlen=b - a, has_initial_state=state is not None,
                                        initial_state_dtype=None if state is None else cfg.state_dtype,
                                        output_final_state=carries,
                                        state_in_place=carries and (cfg.state_in_place if a == 0 else True))
        out = run_piece(Operands(cut(ops.q), cut(ops.k), cut(ops.v), cut(ops.g), cut(ops.beta), ops.A_log,
                                 ops.dt_bias, cu, state), piece_cfg)
        outputs.append(out[0])
        state = out[1] if len(out) > 1 else None
    o = jnp.concatenate(outputs, axis=1)
    return [o, state] if cfg.output_final_state else [o]


def _xla_calls(*leaves, tree, cfg: PrefillConfig, platform: str | None = None):
    o, final = xla_backend.prefill(cfg, jax.tree.unflatten(tree, leaves), platform=platform)
    return [o, final] if cfg.output_final_state else [o]


# --- The primitive's rules -------------------------------------------------------------------------------


def _abstract_eval(*avals, tree, fields, cfg: PrefillConfig, kernels, num_sms, num_segments):
    ops = jax.tree.unflatten(tree, avals)
    expected = {"q": (cfg.batch, cfg.seqlen, cfg.num_qk_heads, cfg.head_k),
                "v": (cfg.batch, cfg.seqlen, cfg.num_v_heads, cfg.head_v)}
    for name, shape in expected.items():
        if tuple(getattr(ops, name).shape) != shape:
            raise ValueError(f"jax_kda prefill: operand {name} has shape {getattr(ops, name).shape}, "
                             f"the config says {shape}")
    o = _result_aval(avals, (cfg.batch, cfg.seqlen, cfg.num_v_heads, cfg.head_v), jnp.dtype(cfg.dtype))
    if not cfg.output_final_state:
        return [o]
    return [o, _result_aval(avals, cfg.state_shape, jnp.dtype(cfg.state_dtype))]


def _result_aval(avals, shape, dtype) -> jax.core.ShapedArray:
    """A result's type: varying over every manual mesh axis any operand varies over, as values
    computed from them are. A plain type would make jax.shard_map mark the result varying after the
    call (pvary), and differentiating a jit or checkpoint of that shard_map then fails."""
    varying = [a for a in avals if xla_backend.varying_axes(a)]
    if not varying:
        return jax.core.ShapedArray(shape, dtype)
    base, axes = varying[0], frozenset().union(*map(xla_backend.varying_axes, varying))
    sharding = base.sharding.update(spec=jax.sharding.PartitionSpec(*[None] * len(shape)))
    return base.update(shape=shape, dtype=dtype, weak_type=False, sharding=sharding,
                       manual_axis_type=base.mat.update(varying=axes))


def _lowering(ctx, *leaves, tree, fields, cfg, kernels, num_sms, num_segments, cuda: bool):
    """The local computation for the lowering's platform, partitioned over batch and heads
    (jax_kda/sharding.py; inlined on one device)."""
    if kernels is not None and kernels != Kernels.FOR_DEVICE and not cuda:
        backend = {v: k for k, v in contract.BACKEND_KERNELS.items()}.get(kernels, kernels.name)
        raise ValueError(
            f"backend={backend!r} runs only on CUDA GPUs, but this computation is being lowered for "
            f"{', '.join(ctx.module_context.platforms)}; use backend='auto' (the kernels on CUDA, the XLA path "
            "elsewhere) or backend='xla'")
    if kernels is not None and cuda:
        def local(local_cfg, *xs):
            plan = planner.plan_prefill(local_cfg, num_sms=num_sms, num_segments=num_segments)
            return _kernel_calls(*xs, tree=tree, cfg=local_cfg, plan=plan, kernels=kernels, num_sms=num_sms)
    else:
        platform = xla_backend.block_platform(ctx.platforms or ctx.module_context.platforms)

        def local(local_cfg, *xs):
            return _xla_calls(*xs, tree=tree, cfg=local_cfg, platform=platform)
    if sharding.can_partition(ctx.module_context.axis_context):
        call = sharding.partitioned(local, cfg, fields, tuple(len(a.shape) for a in ctx.avals_in))
    else:
        call = functools.partial(local, cfg)
    return mlir.lower_fun(lambda *xs: list(call(*xs)), multiple_results=True)(ctx, *leaves)


def _batch(args, dims, *, tree, fields, cfg, kernels, num_sms, num_segments):
    """vmap: the XLA path batches natively; the kernels run one call per batch element."""
    if kernels is None:
        out = jax.vmap(functools.partial(_xla_calls, tree=tree, cfg=cfg), in_axes=tuple(dims))(*args)
        return out, [0] * len(out)
    # An operand vmap does not map has dimension None (jax >= 0.12 no longer names it not_mapped): it
    # is passed to every call as it is, not copied per element.
    mapped = [i for i, d in enumerate(dims) if d is not None]
    params = dict(tree=tree, fields=fields, cfg=cfg, kernels=kernels, num_sms=num_sms, num_segments=num_segments)

    def one_call(xs):
        operands = list(args)
        for i, x in zip(mapped, xs):
            operands[i] = x
        return prefill_p.bind(*operands, **params)

    results = jax.lax.map(one_call, [jnp.moveaxis(args[i], dims[i], 0) for i in mapped])
    return results, [0] * len(results)


def _jvp(primals, tangents, *, tree, fields, cfg, kernels, num_sms, num_segments):
    """The kernels' results with the XLA path's tangents (recomputed from the same inputs); for the
    XLA path, its own results and tangents."""
    differentiable = [i for i, x in enumerate(primals) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]

    def xla_path(*floats):
        leaves = list(primals)
        for i, x in zip(differentiable, floats):
            leaves[i] = x
        return _xla_calls(*leaves, tree=tree, cfg=cfg)

    out, tangents_out = jax.jvp(xla_path, [primals[i] for i in differentiable],
                                [ad.instantiate_zeros(tangents[i]) for i in differentiable])
    if kernels is not None:
        out = prefill_p.bind(*primals, tree=tree, fields=fields, cfg=cfg, kernels=kernels, num_sms=num_sms,
                             num_segments=num_segments)
    return out, list(tangents_out)


@functools.lru_cache(maxsize=None)
def _compiled_bind(**params):
    """One jitted bind per static configuration, so eager calls compile once, not every call."""
    return jax.jit(functools.partial(prefill_p.bind, **params))


prefill_p.def_impl(lambda *leaves, **params: _compiled_bind(**params)(*leaves))
prefill_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(prefill_p, functools.partial(_lowering, cuda=False))
mlir.register_lowering(prefill_p, functools.partial(_lowering, cuda=True), platform="cuda")
batching.primitive_batchers[prefill_p] = _batch
ad.primitive_jvps[prefill_p] = _jvp
# The lowering partitions the call with custom_partitioning, which needs the program's concrete
# devices: jax passes them to the lowering only for primitives in this set (custom_partitioning's
# own primitive is there too). A jit holding a prefill then lowers with its devices, so it cannot
# be lowered on an AbstractMesh alone (jax.export of a shard_map over a concrete mesh is fine).
jax_dispatch.prim_requires_devices_during_lowering.add(prefill_p)
