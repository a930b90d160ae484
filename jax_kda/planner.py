"""The trace-time planner: static facts of a call (+ the SM count) -> a frozen `RecurrencePlan`.

The plan is passed to the kernel custom call as static attributes, so it is visible in the HLO and
replayed unchanged by CUDA graphs. It must depend only on static shapes, flags and the target GPU.

What it decides today:
  * `v_split`: the recurrence is independent across the V columns of the state, so splitting V
    over CTAs is exact. The SM90 recurrence kernel holds a 64-column slice of the state per
    CTA (its warpgroup MMA accumulator), so for V = 128 the split is 2: N*HV*2 CTAs.
  * `workspace_bytes`: the prepare -> recurrence hand-off, sized in whole 16-token chunk slots.
  * intracard context parallelism (segments of one long sequence run in parallel) is not
    implemented yet: `num_segments` is always 1 and the plan says so.
"""

from __future__ import annotations

import dataclasses

from jax_kda.config import PrefillConfig

DEFAULT_NUM_SMS = 132  # H200 / H100 SXM; used when lowering without a device (e.g. on a CPU box)
KERNEL_CHUNK_SIZE = 16


@dataclasses.dataclass(frozen=True)
class RecurrencePlan:
    """How the kernels split one call. Every field becomes a custom-call attribute."""

    chunk_size: int  # tokens per chunk in the kernels
    v_split: int  # CTAs per (sequence, value head), each owning head_v / v_split state columns
    num_segments: int  # segments per sequence for intracard context parallelism (1 = off)
    segment_len: int  # tokens per segment (0 when num_segments == 1)
    workspace_bytes: int  # scratch the kernels need, allocated by XLA as an extra result

    def __post_init__(self):
        if self.chunk_size <= 0 or self.v_split <= 0 or self.num_segments <= 0:
            raise ValueError(f"invalid plan {self}")


# Bytes per (16-token chunk slot, value head) the SM90 prepare kernel hands to the recurrence:
# neg_kw, qd, kr (bf16 16x128 each), vw (fp32 16x128), mqk (bf16 16x16), decay (fp32 128).
WORKSPACE_BYTES_PER_SLOT = 3 * 4096 + 8192 + 512 + 512
# The kernels index the workspace regions with 32-bit element offsets: slots * HV < 2**20.
MAX_WORKSPACE_ROWS = 1 << 20
V_PER_CTA = 64


def workspace_rows(cfg: PrefillConfig) -> int:
    """Chunk slots x value heads. Sequence n owns slots bos // 16 + n + c (c < ceil(len / 16)), so
    (B*T) // 16 + N slots cover every sequence of any packing, tails included."""
    return ((cfg.batch * cfg.seqlen) // KERNEL_CHUNK_SIZE + cfg.num_seqs) * cfg.num_v_heads


def plan_prefill(cfg: PrefillConfig, *, num_sms: int = DEFAULT_NUM_SMS) -> RecurrencePlan:
    """Chooses the kernel plan for `cfg` on a GPU with `num_sms` multiprocessors.

    `num_sms` does not change today's plan (one kernel variant, no context parallelism); it is an
    input because the segment count of intracard context parallelism will depend on it.
    """
    del num_sms
    return RecurrencePlan(
        chunk_size=KERNEL_CHUNK_SIZE,
        v_split=max(cfg.head_v // V_PER_CTA, 1),
        num_segments=1,
        segment_len=0,
        workspace_bytes=workspace_rows(cfg) * WORKSPACE_BYTES_PER_SLOT,
    )
