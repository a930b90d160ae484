"""The kernel backends as a JAX primitive: abstract evaluation, CUDA lowering, batching.

`prefill_p` is bound with every operand present (optional ones as empty arrays, so the FFI
handler's signature never changes) and with the validated `PrefillConfig`, the planner's
`RecurrencePlan` and the custom-call target as static parameters. Its lowering emits one
`stablehlo.custom_call` (XLA FFI, API version 4) whose typed attributes carry the flags and the
plan; the handler reads them and launches the ahead-of-time compiled kernels.

Results: o `[B, T, HV, V]` (q's dtype), the final state (`[N, HV, K, V]` or `[N, HV, V, K]`, fp32;
shape `[0]` when not requested) and the kernels' workspace (uint8, `plan.workspace_bytes`; XLA
allocates it, and `prefill` drops it). When an initial state is given and the final state is
requested, the two share a buffer (`operand_output_aliases`), so a donated initial state is updated
in place.

`phase` (static) is what one call does: `PHASE_WHOLE` the whole prefill; `PHASE_SUMMARY` and
`PHASE_APPLY` the two calls of a segmented prefill (jax_kda/context_parallel.py), whose config
counts segments as sequences. A summary call returns an empty o and an empty final state: it leaves
every segment's start state in its workspace, and takes the sequences' initial state (one entry per
sequence, K-first fp32) when there is one. An apply call takes that call's workspace as its last
operand (aliased to its own workspace result) and runs only the recurrence, from those starts; the
recurrence reads v from its own operand, so it must be given the summary call's v (and its
cu_seqlens).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_kda.config import GateMode, PrefillConfig
from jax_kda.planner import RecurrencePlan

# Kernel target per backend. One target per architecture, so the HLO says which kernels run.
FFI_TARGETS = {"sm90": "jax_kda_prefill_sm90", "sm100": "jax_kda_prefill_sm100"}

OPERANDS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "initial_state", "workspace")
_INITIAL_STATE = OPERANDS.index("initial_state")
_WORKSPACE_IN = OPERANDS.index("workspace")
_FINAL_STATE = 1
_WORKSPACE_OUT = 2

PHASE_WHOLE, PHASE_SUMMARY, PHASE_APPLY = 0, 1, 2

prefill_p = Primitive("jax_kda_prefill")
prefill_p.multiple_results = True


def kernel_operands(cfg: PrefillConfig, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state,
                    workspace=None):
    """Puts the arrays in the form the kernels take; absent optional operands become empty arrays."""
    f32 = jnp.float32
    empty = lambda dtype: jnp.zeros((0,), dtype)  # noqa: E731
    return (
        q,
        k,
        v,
        g,
        beta,
        empty(f32) if A_log is None else jnp.asarray(A_log, f32),
        dt_bias_operand(cfg, dt_bias),
        empty(jnp.int32) if cu_seqlens is None else jnp.asarray(cu_seqlens).astype(jnp.int32),
        empty(f32) if initial_state is None else jnp.asarray(initial_state, f32),
        empty(jnp.uint8) if workspace is None else workspace,
    )


def dt_bias_operand(cfg: PrefillConfig, dt_bias):
    """dt_bias as `[HV * K]` fp32; zeros when absent but the gate reads it, empty when it doesn't."""
    if cfg.gate_mode == GateMode.PREACTIVATED:
        return jnp.zeros((0,), jnp.float32)
    if dt_bias is None:
        return jnp.zeros((cfg.num_v_heads * cfg.head_k,), jnp.float32)
    return jnp.reshape(jnp.asarray(dt_bias, jnp.float32), (-1,))


def prefill_call(cfg: PrefillConfig, plan: RecurrencePlan, target: str, *operands):
    """Binds the primitive for a whole prefill. Returns (o, final_state or None)."""
    o, final_state, _workspace = prefill_p.bind(*operands, cfg=cfg, plan=plan, target=target, phase=PHASE_WHOLE)
    return o, (final_state if cfg.output_final_state else None)


def _result_avals(cfg: PrefillConfig, plan: RecurrencePlan, phase: int):
    o_shape = (cfg.batch, cfg.seqlen, cfg.num_v_heads, cfg.head_v)
    state_shape = cfg.state_shape if cfg.output_final_state else (0,)
    if phase == PHASE_SUMMARY:
        o_shape, state_shape = (0, 0, 0, 0), (0,)
    o = jax.core.ShapedArray(o_shape, jnp.dtype(cfg.dtype))
    final_state = jax.core.ShapedArray(state_shape, jnp.float32)
    workspace = jax.core.ShapedArray((plan.workspace_bytes,), jnp.uint8)
    return o, final_state, workspace


def _abstract_eval(*avals, cfg: PrefillConfig, plan: RecurrencePlan, target: str, phase: int):
    expected = {
        "q": (cfg.batch, cfg.seqlen, cfg.num_qk_heads, cfg.head_k),
        "k": (cfg.batch, cfg.seqlen, cfg.num_qk_heads, cfg.head_k),
        "v": (cfg.batch, cfg.seqlen, cfg.num_v_heads, cfg.head_v),
        "g": (cfg.batch, cfg.seqlen, cfg.num_v_heads, cfg.head_k),
        "beta": (cfg.batch, cfg.seqlen, cfg.num_v_heads),
    }
    for name, aval in zip(OPERANDS, avals):
        if name in expected and tuple(aval.shape) != expected[name]:
            raise ValueError(f"{target}: operand {name} has shape {aval.shape}, the config says {expected[name]}")
    workspace_len = plan.workspace_bytes if phase == PHASE_APPLY else 0
    if tuple(avals[_WORKSPACE_IN].shape) != (workspace_len,):
        raise ValueError(f"{target}: phase {phase} takes a workspace operand of {workspace_len} bytes, "
                         f"got shape {avals[_WORKSPACE_IN].shape}")
    return _result_avals(cfg, plan, phase)


def _attributes(cfg: PrefillConfig, plan: RecurrencePlan, phase: int) -> dict:
    """The custom call's static attributes; numpy scalars so each gets an exact MLIR type."""
    i32, f32 = np.int32, np.float32
    return dict(
        gate_mode=i32(cfg.gate_mode),
        lower_bound=f32(cfg.lower_bound),
        scale=f32(cfg.scale),
        use_qk_l2norm=i32(cfg.use_qk_l2norm),
        use_beta_sigmoid=i32(cfg.use_beta_sigmoid),
        state_v_first=i32(cfg.state_v_first),
        has_initial_state=i32(cfg.has_initial_state),
        output_final_state=i32(cfg.output_final_state),
        has_dt_bias=i32(cfg.has_dt_bias),
        varlen=i32(cfg.varlen),
        chunk_size=i32(plan.chunk_size),
        v_split=i32(plan.v_split),
        num_segments=i32(plan.num_segments),
        segment_len=i32(plan.segment_len),
        phase=i32(phase),
    )


def _lowering(ctx, *operands, cfg: PrefillConfig, plan: RecurrencePlan, target: str, phase: int):
    aliases = {}
    if cfg.has_initial_state and cfg.output_final_state and phase != PHASE_SUMMARY:
        aliases[_INITIAL_STATE] = _FINAL_STATE
    if phase == PHASE_APPLY:
        aliases[_WORKSPACE_IN] = _WORKSPACE_OUT
    rule = jax.ffi.ffi_lowering(target, operand_output_aliases=aliases)
    return rule(ctx, *operands, **_attributes(cfg, plan, phase))


def _batch(args, dims, *, cfg: PrefillConfig, plan: RecurrencePlan, target: str, phase: int):
    """vmap: one kernel call per batch element (correct for dense and packed calls alike)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not batching.not_mapped)
    moved = [
        jnp.broadcast_to(a, (size,) + a.shape) if d is batching.not_mapped else jnp.moveaxis(a, d, 0)
        for a, d in zip(args, dims)
    ]
    results = jax.lax.map(lambda xs: prefill_p.bind(*xs, cfg=cfg, plan=plan, target=target, phase=phase), moved)
    return results, (0, 0, 0)


def _no_jvp(primals, tangents, **params):
    raise NotImplementedError(
        "jax_kda prefill kernels are forward-only (prefill); differentiate through backend='xla' instead"
    )


@functools.lru_cache(maxsize=None)
def _compiled_bind(cfg: PrefillConfig, plan: RecurrencePlan, target: str, phase: int):
    """One jitted bind per static configuration, so eager calls compile once, not every call."""
    return jax.jit(functools.partial(prefill_p.bind, cfg=cfg, plan=plan, target=target, phase=phase))


def _impl(*operands, cfg, plan, target, phase):
    return _compiled_bind(cfg, plan, target, phase)(*operands)


prefill_p.def_impl(_impl)
prefill_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(prefill_p, _lowering, platform="cuda")
batching.primitive_batchers[prefill_p] = _batch
ad.primitive_jvps[prefill_p] = _no_jvp
