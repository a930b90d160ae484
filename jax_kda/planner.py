"""The trace-time planner: static facts of a call (+ the SM count) -> a frozen `RecurrencePlan`.

The plan is passed to the kernel custom call as static attributes, so it is visible in the HLO and
replayed unchanged by CUDA graphs. It must depend only on static shapes, flags and the target GPU.

What it decides today:
  * `v_split`: the recurrence is independent across the V columns of the state, so splitting V
    over CTAs is exact. The SM90 recurrence kernel holds a 64-column slice of the state per
    CTA (its warpgroup MMA accumulator), so for V = 128 the split is 2: N*HV*2 CTAs.
  * `workspace_bytes`: the prepare -> recurrence hand-off, sized in whole 16-token chunk slots.
  * `num_segments`, `segment_len`: intracard context parallelism. The recurrence is serial along
    a sequence, so a call with few sequences x heads leaves most SMs idle (h8 x 64K: 16 CTAs on
    132 SMs). With `num_segments` > 1 every sequence is cut into that many chunk-aligned segments
    of `segment_len` tokens (the last takes the rest) that run in parallel
    (jax_kda/kernel.py): one pass over all segments computes each one's zero-start state
    and transition, a small combine gives each segment its true start state, and a second pass
    writes o. It costs a second recurrence pass over twice the columns; `choose_segments` takes it
    only when a simple wave model of the recurrence says it pays.
"""

from __future__ import annotations

import dataclasses

from jax_kda import contract
from jax_kda.config import PrefillConfig

DEFAULT_NUM_SMS = 132  # H200 / H100 SXM; used when lowering without a device (e.g. on a CPU box)
KERNEL_CHUNK_SIZE = contract.CHUNK


@dataclasses.dataclass(frozen=True)
class RecurrencePlan:
    """How the kernels split one call. Every field becomes a custom-call attribute."""

    chunk_size: int  # tokens per chunk in the kernels
    v_split: int  # CTAs per (sequence, value head), each owning head_v / v_split state columns
    num_segments: int  # segments per sequence for intracard context parallelism (1 = off)
    segment_len: int  # tokens per segment (0 when num_segments == 1)
    workspace_bytes: int  # scratch the kernels need per call, allocated by XLA as an extra result
    piece_len: int = 0  # tokens of T per piece when the call is cut along T (0: one piece)

    def __post_init__(self):
        if self.chunk_size <= 0 or self.v_split <= 0 or self.num_segments <= 0:
            raise ValueError(f"invalid plan {self}")


# Long calls. A call whose workspace would exceed the kernels' 32-bit offsets (contract.
# MAX_WORKSPACE_ROWS) is cut along T into pieces, run one after the other with the state carried from
# each piece to the next (every sequence is in every piece, possibly empty, so packed calls cut the
# same way). A piece has at most MAX_PIECE_ROWS rows (2^18 x 14 336 B = 3.8 GB of workspace), which
# bounds the workspace and every offset inside a piece; more only when N x HV needs it. Calls under the
# limit run whole, as before (a piece costs a copy of its inputs and of its o).
MAX_PIECE_ROWS = 1 << 18


def piece_length(cfg: PrefillConfig) -> int:
    """Tokens of T per piece (a multiple of 16) when the call must be cut along T, else 0."""
    if workspace_rows(cfg) < contract.MAX_WORKSPACE_ROWS:
        return 0
    budget = min(max(MAX_PIECE_ROWS, (cfg.num_seqs + 16) * cfg.num_v_heads), contract.MAX_WORKSPACE_ROWS - 1)
    slots = budget // cfg.num_v_heads - cfg.num_seqs  # chunk slots per value head left for tokens
    rows_per_slot = 1 if cfg.varlen else cfg.batch  # 16 tokens of T are B slots when dense
    longest = max(slots // rows_per_slot, 1) * KERNEL_CHUNK_SIZE
    pieces = -(-cfg.seqlen // longest)
    return -(-cfg.seqlen // (pieces * KERNEL_CHUNK_SIZE)) * KERNEL_CHUNK_SIZE  # pieces of even length


def workspace_rows(cfg: PrefillConfig, num_segments: int = 1) -> int:
    """Workspace rows (chunk slots x value heads) of the kernels' call(s) for `cfg`."""
    return contract.workspace_rows(cfg.batch * cfg.seqlen, cfg.num_seqs, num_segments, cfg.num_v_heads)


# The recurrence wave model (measured on the H200, ncu): a 16-token chunk step takes ~0.66 us with
# one CTA per SM and ~0.78 us with two (~70-75 KB of shared memory each: at most two fit). The combine
# between the passes (csrc/kernels/common/combine_segments.py) is serial over segments, one step per
# segment boundary, an fp32 [128 x 128] x [128 x block] product per CTA. Its launcher takes 8-column
# blocks (16 CTAs per sequence and value head) when those fit at one CTA per SM, else 16-column
# blocks (8 CTAs). Measured per step (sweep_segments.py): 2.7 us with 8 columns, 3.7 us with 16
# columns at one CTA per SM, about proportionally longer with more CTAs per SM (HV = 32, 4 and 8
# segments: 8.3 and 7.1 us per step at two per SM).
RECURRENCE_CTAS_PER_SM = contract.RECURRENCE_CTAS_PER_SM
STEP_US_ALONE, STEP_US_SHARED = 0.66, 0.78
COMBINE_NARROW_CTAS, COMBINE_NARROW_STEP_US = 16, 2.7
COMBINE_WIDE_CTAS, COMBINE_WIDE_STEP_US = 8, 3.7
SEGMENT_CHOICES = (2, 4, 8, 16, 32, 64)
assert max(SEGMENT_CHOICES) == contract.MAX_SEGMENTS
# Take segments only when the model predicts less than 91 % of the unsegmented recurrence time. On
# the h32_fixed32k sweep the model's ratios (segmented / whole) were 0.903, 0.925, 0.968 for 4, 8, 16
# segments against 0.905, 0.911, 0.942 measured (4 segments: 2238 -> 2119 us end to end), while its
# absolute times ran ~5 % high on both sides; the margin covers the extra prepare work at the
# segment boundaries (3-15 us there).
CP_MIN_GAIN = 0.91


def longest_sequence(cfg: PrefillConfig) -> int:
    """Tokens of the longest sequence possible: T dense; every token of the batch when packed."""
    return cfg.batch * cfg.seqlen if cfg.varlen else cfg.seqlen


def segment_length(cfg: PrefillConfig, num_segments: int) -> int:
    """Chunk-aligned segment length whose `num_segments` segments cover the longest sequence."""
    tokens = -(-longest_sequence(cfg) // num_segments)
    return -(-tokens // KERNEL_CHUNK_SIZE) * KERNEL_CHUNK_SIZE


def recurrence_us(cfg: PrefillConfig, num_segments: int, num_sms: int) -> float:
    """The wave model's time of the recurrence part of a call (both passes when segmented)."""

    def waves(ctas: int, steps: int) -> float:
        slots = num_sms * RECURRENCE_CTAS_PER_SM
        step = STEP_US_SHARED if ctas > num_sms else STEP_US_ALONE
        return -(-ctas // slots) * steps * step

    base = cfg.num_seqs * cfg.num_v_heads * contract.V_SPLIT
    if num_segments == 1:
        return waves(base, -(-longest_sequence(cfg) // KERNEL_CHUNK_SIZE))
    steps = segment_length(cfg, num_segments) // KERNEL_CHUNK_SIZE
    n = num_segments
    return waves(2 * base * n, steps) + waves(base * n, steps) + combine_us(cfg, n, num_sms)


def combine_us(cfg: PrefillConfig, num_segments: int, num_sms: int) -> float:
    """The model's time of the combine kernel: num_segments - 1 dependent steps, in the variant its
    launcher picks, each as long as the CTAs sharing one SM make it."""
    pairs = cfg.num_seqs * cfg.num_v_heads
    if COMBINE_NARROW_CTAS * pairs <= num_sms:
        return (num_segments - 1) * COMBINE_NARROW_STEP_US
    per_sm = -(-(COMBINE_WIDE_CTAS * pairs) // max(num_sms, 1))
    return (num_segments - 1) * COMBINE_WIDE_STEP_US * per_sm


def segments_fit(cfg: PrefillConfig, num_segments: int) -> bool:
    """Whether the kernels' limits allow `num_segments` segments per sequence: the workspace's 32-bit
    offsets, and the recurrence's grid (sequences x segments along z)."""
    if workspace_rows(cfg, num_segments) >= contract.MAX_WORKSPACE_ROWS:
        return False
    return cfg.num_seqs * num_segments <= contract.MAX_GRID_YZ


def choose_segments(cfg: PrefillConfig, num_sms: int) -> int:
    """The segment count the wave model likes best (1 unless segments win clearly)."""
    if cfg.num_seqs == 0:
        return 1
    best, best_us = 1, recurrence_us(cfg, 1, num_sms)
    limit = best_us * CP_MIN_GAIN
    for n in SEGMENT_CHOICES:
        if segment_length(cfg, n) < 4 * KERNEL_CHUNK_SIZE:
            break
        if not segments_fit(cfg, n):
            break
        us = recurrence_us(cfg, n, num_sms)
        if us < limit and us < best_us:
            best, best_us = n, us
    return best


def plan_prefill(cfg: PrefillConfig, *, num_sms: int = DEFAULT_NUM_SMS,
                 num_segments: int | None = None) -> RecurrencePlan:
    """Chooses the kernel plan for `cfg` on a GPU with `num_sms` multiprocessors.

    `num_segments` overrides the planner's choice (tests use it to run the segmented path on small
    shapes); the override must keep the workspace within the kernels' 32-bit offsets.
    """
    piece_len = piece_length(cfg)
    whole = cfg
    if piece_len:  # plan a full piece; the last, shorter one is planned when it is lowered
        cfg = dataclasses.replace(cfg, seqlen=piece_len)
    n = choose_segments(cfg, num_sms) if num_segments is None else num_segments
    if n < 1 or n > contract.MAX_SEGMENTS or not segments_fit(cfg, n):
        raise ValueError(f"num_segments={n} is not possible for this call (1..{contract.MAX_SEGMENTS}; "
                         f"workspace rows {workspace_rows(cfg, n)} < {contract.MAX_WORKSPACE_ROWS}; "
                         f"sequences x segments {cfg.num_seqs * n} of at most {contract.MAX_GRID_YZ})")
    return RecurrencePlan(
        chunk_size=KERNEL_CHUNK_SIZE,
        v_split=contract.V_SPLIT,
        num_segments=n,
        segment_len=segment_length(cfg, n) if n > 1 else 0,
        workspace_bytes=contract.workspace_bytes(cfg.batch * cfg.seqlen, cfg.num_seqs, n, cfg.num_v_heads),
        piece_len=piece_len if piece_len < whole.seqlen else 0,
    )
