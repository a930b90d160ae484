"""Intracard context parallelism: one prefill call whose sequences are cut into segments that run
in parallel on one GPU, for calls with too few sequences x heads to fill it.

The recurrence is affine in the state. Over one segment, each column of the state evolves as
`s_end = M s_start + b`, with the segment's transition M [K, K] and its zero-start state b. Two
kernel calls, both over the N * S segments as one packed batch:

1. **Summary call** (`PHASE_SUMMARY`): prepare runs over all segments, and the recurrence runs every
   segment from a zero state (giving B [K, V]) and, in extra CTAs, from the identity with no values
   (giving M, the state of K "identity columns"). No o is written. Then a small kernel
   (csrc/kernels/sm90/combine_segments.py) walks each sequence's segments in order, in fp32:
   `start_0 = initial_state`, `start_{j+1} = M_j start_j + B_j`. B, M and the starts stay in the
   call's workspace.
2. **Apply call** (`PHASE_APPLY`): the recurrence alone, on the summary call's workspace, runs every
   segment from its start state and writes o and each segment's final state; a sequence's final
   state is that of its last segment.

Segments are chunk-aligned (`plan.segment_len` is a multiple of 16 tokens), so prepare's chunks are
the same as without segments. Sequence i's segment j covers tokens
`[bos_i + min(j L, len_i), bos_i + min((j + 1) L, len_i))` (the last one ends at eos_i); segments
past a short sequence's end are empty, which the kernels handle (M = I, B = 0).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jax_kda.config import PrefillConfig
from jax_kda.planner import RecurrencePlan
from jax_kda.primitive import PHASE_APPLY, PHASE_SUMMARY, kernel_operands, prefill_p


def segment_offsets(cu_seqlens, num_segments: int, segment_len: int):
    """cu_seqlens [N + 1] -> the packed offsets [N * num_segments + 1] of the segments."""
    xp = np if isinstance(cu_seqlens, np.ndarray) else jnp
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
    offsets = xp.arange(num_segments, dtype=starts.dtype) * segment_len
    seg_starts = starts[:, None] + xp.minimum(offsets[None, :], (ends - starts)[:, None])
    return xp.concatenate([xp.reshape(seg_starts, (-1,)), cu_seqlens[-1:]]).astype(xp.int32)


def segmented_prefill(cfg: PrefillConfig, plan: RecurrencePlan, target: str, q, k, v, g, beta, A_log,
                      dt_bias, cu_seqlens, initial_state):
    """The kernels' prefill with `plan.num_segments` > 1. Returns (o, final_state or None)."""
    n_seg, seg_len = plan.num_segments, plan.segment_len
    b, t, n = cfg.batch, cfg.seqlen, cfg.num_seqs
    tokens = b * t
    if cfg.varlen:
        cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    else:
        cu = np.arange(b + 1, dtype=np.int32) * t
    seg_cu = jnp.asarray(segment_offsets(cu, n_seg, seg_len))
    # Both calls see one packed batch of N * S segments, states K-first fp32.
    seg_cfg = dataclasses.replace(
        cfg, batch=1, seqlen=tokens, num_seqs=n * n_seg, varlen=True, cu_seqlens_dtype="int32",
        state_v_first=False, has_initial_state=False, initial_state_dtype=None, output_final_state=True)
    flat = lambda x: jnp.reshape(x, (1, tokens) + x.shape[2:])  # noqa: E731
    # The summary call takes the N sequences' initial state (it computes every segment's start).
    initial = None
    if cfg.has_initial_state:
        initial = jnp.asarray(initial_state, jnp.float32)
        if cfg.state_v_first:
            initial = jnp.swapaxes(initial, -1, -2)
    summary_cfg = dataclasses.replace(seg_cfg, has_initial_state=cfg.has_initial_state,
                                      initial_state_dtype="float32" if cfg.has_initial_state else None)
    operands = kernel_operands(summary_cfg, flat(q), flat(k), flat(v), flat(g), flat(beta), A_log,
                               dt_bias, seg_cu, initial)
    _, _, workspace = prefill_p.bind(*operands, cfg=summary_cfg, plan=plan, target=target,
                                     phase=PHASE_SUMMARY)
    # The apply call: no initial state operand (the starts are in the workspace).
    no_initial = jnp.zeros((0,), jnp.float32)
    o, finals, _ = prefill_p.bind(*operands[:-2], no_initial, workspace, cfg=seg_cfg, plan=plan,
                                  target=target, phase=PHASE_APPLY)
    o = jnp.reshape(o, (b, t) + o.shape[2:])
    if not cfg.output_final_state:
        return o, None
    final = jnp.reshape(finals, (n, n_seg) + finals.shape[1:])[:, -1]
    if cfg.state_v_first:
        final = jnp.swapaxes(final, -1, -2)
    return o, final
