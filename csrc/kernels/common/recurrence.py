"""KDA prefill, kernel 2 of 2: `ChunkRecurrence`, the serial half, minus its MMAs.

One CTA per (64-wide slice of V, value head, sequence) walks the sequence's chunks in order,
carrying its slice of the fp32 state S^T [64 v, 128 k] in the MMA warps' accumulator registers.
Block z runs sequence z; in a call of packed input, the z-th longest (`unit_order`'s table), so
that the long sequences start first and the short ones fill the kernel's end.
This file is what every architecture shares: the grid, the warp roles, the TMA pipeline and its
shared-memory tiles, the state load and store, the zeroing of a partial last chunk's values and the
output path. The per-chunk products live in a subclass per architecture (`make_mmas`, `consume`):
`sm90/wgmma_recurrence.py` (warpgroup MMAs) and `sm100/mma_sync_recurrence.py` (warp-level MMAs).
Per chunk, with the operands `prepare_chunks` wrote and the chunk's v slice straight from the input:

    U^T  = v^T (W_hi + W_lo)^T + bf16(S^T) neg_kw^T
    O^T  = bf16(S^T) qd^T + (U_hi + U_lo) mqk^T          U_hi = bf16(U^T), U_lo = bf16(U^T - U_hi)
    S^T  = decay * S^T + (U_hi + U_lo) kr

Segmented prefill (intracard context parallelism, Phase.SUMMARY): the summary variant
(`summary=True`, a separate compiled kernel) has twice the V slices; slices 0-1 run each segment
from a zero state and slices 2-3 the identity's 128 columns with no values, and both store their
final state ([2 N S, HV, K, V]: B and M per segment) instead of o. The apply call
(Phase.APPLY) is the ordinary kernel over the segments, from their start states.

Warp roles (160 threads): warps 0-3 run the MMAs; warp 4 is the TMA producer.
Shared memory per pipeline stage: the `STAGE_TILES` below, 16384 bytes (4 stages), plus the output
staging (a [16 token, 16 v] bf16 block per MMA warp and chunk parity: 4 x 2 x 512 = 4096 bytes) and
the mbarriers, each buffer 1024-byte aligned (the swizzled layouts need it): about 70 KB a CTA, so
two fit on an SM.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
# The swizzled shared-memory layouts of the MMA operands; both architectures' MMAs read them.
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.experimental.primitives.nvvm_wrapper import MMALayout, stmatrix
from cutlass.tensor_utils.layout import LayoutEnum
from kda_contract import CHUNK, HEAD_DIM, RECURRENCE_THREADS, V_PER_CTA, Flag

from common.sequences import sequence_bounds
from common.unit_order import ENTRY_INTS, units_ordered

V_SLICE = V_PER_CTA  # state columns (v) per CTA
STAGES = 4
MMA_THREADS = 128
THREADS = MMA_THREADS + 32
assert THREADS == RECURRENCE_THREADS
PRODUCER_WARP = MMA_THREADS // 32
SLICES = HEAD_DIM // V_SLICE  # CTAs per (value head, sequence); twice as many in the summary kernel
VALUES_BARRIER = 2  # named barrier ids: 0 is the CTA-wide one
# Output staging: per MMA warp and chunk parity a block [16 tokens, 16 v] of bf16, as 16-byte
# units (8 v): 2 units a token, 32 a block (`out_unit`).
OUT_PAIRS = 4  # bf16 pairs (32-bit words) of a thread's O^T accumulator
OUT_BLOCK_UNITS = CHUNK * 2
OUT_UNITS = (MMA_THREADS // 32) * 2 * OUT_BLOCK_UNITS
# What the producer loads per chunk into one pipeline stage, as (rows, columns, bytes per element):
# neg_kw, qd [16, 128], kr [128, 16], mqk, w_hi, w_lo [16, 16] (bf16), v [64, 16] (bf16) and the
# decay [1, 128] (fp32). The stage's transaction byte count is their sum.
STAGE_TILES = {
    "neg_kw": (CHUNK, HEAD_DIM, 2), "qd": (CHUNK, HEAD_DIM, 2), "kr": (HEAD_DIM, CHUNK, 2),
    "mqk": (CHUNK, CHUNK, 2), "w_hi": (CHUNK, CHUNK, 2), "w_lo": (CHUNK, CHUNK, 2),
    "v": (V_SLICE, CHUNK, 2), "decay": (1, HEAD_DIM, 4),
}
STAGE_BYTES = sum(rows * cols * size for rows, cols, size in STAGE_TILES.values())  # 16 384


@cute.jit
def to_operand(acc: cute.Tensor, dst: cute.Tensor):
    """dst (bf16 A operand) <- acc (fp32 accumulator), element-wise."""
    dst_as_acc = cute.make_tensor(dst.iterator, acc.layout)
    dst_as_acc.store(acc.load().to(cutlass.BFloat16))


@cute.jit
def to_operand_split(acc: cute.Tensor, hi: cute.Tensor, lo: cute.Tensor):
    """hi <- bf16(acc), lo <- bf16(acc - hi): two bf16 A operands whose sum carries ~16 bits."""
    hi_as_acc = cute.make_tensor(hi.iterator, acc.layout)
    lo_as_acc = cute.make_tensor(lo.iterator, acc.layout)
    values = acc.load()
    rounded = values.to(cutlass.BFloat16)
    hi_as_acc.store(rounded)
    lo_as_acc.store((values - rounded.to(Float32)).to(cutlass.BFloat16))


@cute.jit
def load_state(acc_s: cute.Tensor, crd_s: cute.Tensor, initial_state: cute.Tensor, flags: Int32,
               seq: Int32, hv: Int32, v_slice: Int32, summary: cutlass.Constexpr = False):
    """acc_s <- this thread's elements of the initial state slice (zeros without one). In the
    summary kernel, slices SLICES.. are the transition columns: they start as the identity."""
    state_v_first = (flags & Flag.STATE_V_FIRST) != 0
    v0 = v_slice * V_SLICE
    acc_s.fill(0.0)
    if cutlass.const_expr(summary):
        if v_slice >= SLICES:
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                vv, kk = crd_s[e]
                if v0 - HEAD_DIM + vv == kk:
                    acc_s[e] = Float32(1.0)
    elif (flags & Flag.HAS_INITIAL_STATE) != 0:
        if state_v_first:
            # [.., v, k]: the accumulator's element pairs (2 j, 2 j + 1) are k, k + 1 of one v,
            # k even: one 8-byte load a pair. Both MMAs' C layouts have it (value mode first, its
            # first sub-mode 2 wide and one column apart; thread column offsets 2 (t % 4)):
            # wgmma m64n128 ((4,8,4),(2,2,16)):((128,1,16),(64,8,512)) over the 64 x 128 tile,
            # mma.sync m16n8 ((4,8),(2,2)):((32,1),(16,8)) over its 16 x 8 atom.
            for e in cutlass.range_constexpr(0, cute.size(acc_s), 2):
                vv, kk = crd_s[e]
                pair = cute.make_rmem_tensor(cute.make_layout(2), Float32)
                cute.autovec_copy(cute.local_tile(initial_state[seq, hv, v0 + vv, None], (2,), (kk // 2,)), pair)
                acc_s[e] = pair[0]
                acc_s[e + 1] = pair[1]
        else:
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                vv, kk = crd_s[e]
                acc_s[e] = initial_state[seq, hv, kk, v0 + vv]


@cute.jit
def store_state(acc_s: cute.Tensor, crd_s: cute.Tensor, final_state: cute.Tensor, flags: Int32,
                seq: Int32, hv: Int32, v_slice: Int32, summary: cutlass.Constexpr = False):
    """This thread's elements of the final state slice (the same ones load_state read). In the
    summary kernel, final_state is [2 N, HV, K, V]: entry 2 n holds segment n's zero-start state B,
    entry 2 n + 1 its transition M (M[k, j] = column j of the identity columns)."""
    state_v_first = (flags & Flag.STATE_V_FIRST) != 0
    v0 = v_slice * V_SLICE
    if cutlass.const_expr(summary):
        part = v_slice // SLICES
        v0 = v0 - part * HEAD_DIM
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            vv, kk = crd_s[e]
            final_state[2 * seq + part, hv, kk, v0 + vv] = acc_s[e]
    elif (flags & Flag.OUTPUT_FINAL_STATE) != 0:
        if state_v_first:
            for e in cutlass.range_constexpr(0, cute.size(acc_s), 2):  # pairs, as load_state
                vv, kk = crd_s[e]
                pair = cute.make_rmem_tensor(cute.make_layout(2), Float32)
                pair[0] = acc_s[e]
                pair[1] = acc_s[e + 1]
                cute.autovec_copy(pair, cute.local_tile(final_state[seq, hv, v0 + vv, None], (2,), (kk // 2,)))
        else:
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                vv, kk = crd_s[e]
                final_state[seq, hv, kk, v0 + vv] = acc_s[e]


@cute.jit
def zero_values_past_end(s_v: cute.Tensor, stage: Int32, valid: Int32, tidx: Int32):
    """The last chunk of a sequence can be partial: its v tile then holds the next sequence's
    first tokens (TMA reads the whole 16-token box from the input). Zero those rows of the
    stage before any MMA reads them, so that they add exact zeros (W's columns for them are zero)
    even when the next sequence's values are not finite. The fence orders these generic-proxy
    writes before the async-proxy reads (wgmma); the stage is not refilled after a CTA's last
    chunk, but if it were, the same fence would order them before that TMA write."""
    # Every MMA thread is past its reads of this stage's earlier contents. The pipeline already
    # orders them before these writes (consumer release -> producer's refill by TMA -> this chunk's
    # consumer wait), but compute-sanitizer's racecheck does not follow that chain through the TMA
    # and reported it as a race in the mma.sync summary kernel, whose chunk loop has no other named
    # barrier. One named barrier, once a CTA and only before a partial last chunk, is an order
    # racecheck sees.
    cute.arch.barrier(barrier_id=VALUES_BARRIER, number_of_threads=MMA_THREADS)
    # One 16-byte store a thread: token tt, values 8 part .. 8 part + 7 (contiguous under the
    # tile's 128-byte swizzle, which moves whole 16-byte units).
    tt = tidx // (V_SLICE // 8)
    part = tidx % (V_SLICE // 8)
    if tt >= valid:
        zeros = cute.make_rmem_tensor(cute.make_layout(8), cutlass.BFloat16)
        zeros.fill(0.0)
        cute.autovec_copy(zeros, cute.local_tile(s_v[None, tt, stage], (8,), (part,)))
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=VALUES_BARRIER, number_of_threads=MMA_THREADS)


@cute.jit
def decay_state(acc_s: cute.Tensor, crd_s: cute.Tensor, s_dec: cute.Tensor, stage: Int32):
    """S^T *= decay, per column k (the chunk's total decay, fp32)."""
    for e in cutlass.range_constexpr(cute.size(acc_s)):
        _, kk = crd_s[e]
        acc_s[e] = acc_s[e] * s_dec[0, kk, stage]


@cute.jit
def store_output(acc_o: cute.Tensor, s_out: cute.Tensor, o: cute.Tensor, c: Int32, tidx: Int32, hv: Int32,
                 v_slice: Int32, bos: Int32, eos: Int32):
    """Chunk c's O^T [64 v, 16 tokens], each warp its own 16 v (rows 16 w .. 16 w + 15 of both MMAs'
    accumulators): transposed through the warp's own [16 tokens, 16 v] block of shared memory by
    one stmatrix.x4.trans (no barrier across the warps), then one 16-byte store per lane (8 v of
    one token), only for tokens before the sequence end. The block is double-buffered by chunk
    parity, so a warp sync between the store and the read orders both chunks' uses.

    The accumulator's element pairs (2 j, 2 j + 1) are tokens t, t + 1 of one v, and pair j is
    v block j % 2 (rows +0 / +8) and token block j // 2 (tokens +0 / +8) of the warp's 16 x 16
    (both C layouts: value mode (2, 2, 2), strides 1 token, 8 rows, 8 tokens): the four 8 x 8
    matrices of the stmatrix, in order. Lane L addresses row L % 8 of matrix L // 8."""
    warp = tidx // 32
    lane = tidx % 32
    block = warp * 2 + c % 2  # this warp's block for this chunk parity
    words = cute.make_rmem_tensor(cute.make_layout(OUT_PAIRS), Int32)
    pairs = cute.recast_tensor(words, cutlass.BFloat16)
    pairs.store(acc_o.load().to(cutlass.BFloat16))
    matrix = lane // 8
    row_token = (matrix // 2) * 8 + lane % 8
    stmatrix(s_out[None, out_unit(block, row_token, matrix % 2)].iterator.llvm_ptr,
             [words[j] for j in range(OUT_PAIRS)], MMALayout.COL)
    cute.arch.sync_warp()
    token = lane // 2
    half = lane % 2
    t = bos + c * CHUNK + token
    if t < eos:
        row = cute.make_rmem_tensor(cute.make_layout(8), cutlass.BFloat16)
        cute.autovec_copy(s_out[None, out_unit(block, token, half)], row)
        cute.autovec_copy(row, cute.local_tile(o[t, hv, None], (8,), (v_slice * (V_SLICE // 8) + warp * 2 + half,)))


@cute.jit
def out_unit(block: Int32, token: Int32, half: Int32) -> Int32:
    """The 16-byte unit of the output staging that holds v half `half` (8 v) of `token` in warp
    block `block`: rows of two units, the halves swapped on tokens 4-7 and 12-15, so that the eight
    rows of each stmatrix matrix (tokens 8 b .. 8 b + 7, one half) fall in eight different bank
    groups."""
    return block * OUT_BLOCK_UNITS + token * 2 + (half ^ ((token // 4) % 2))


@cute.jit
def group_ranks(units: Int32):
    """[first, end): the ranks (positions in the unit order; unit indices in the plain kernel) block z runs,
    the grid's blocks along z splitting the units into equal groups (the last one shorter). The host
    launches one block a unit, so each group is one unit; the kernel takes the group from the grid
    all the same, so that the compiler cannot know the unit loop's trip count: inside such a loop
    the chunk loop compiles to 296 SASS instructions instead of 347 (its descriptors and offsets
    computed once a unit). Groups of several short units, the producer running ahead across them,
    measured slower on 128 prompts of 128 tokens (H100, recurrence 435 -> 479 us; 7 units a block)."""
    _, _, z = cute.arch.block_idx()
    _, _, blocks_z = cute.arch.grid_dim()
    group = (units + blocks_z - 1) // blocks_z
    first = z * group
    return first, cutlass.min(first + group, units)


@cute.jit
def chunks_of(bos: Int32, eos: Int32) -> Int32:
    """Chunks of a unit of tokens [bos, eos), a partial last one counted."""
    return (eos - bos + CHUNK - 1) // CHUNK


@cute.jit
def ranked_unit(rank: Int32, cu_seqlens: cute.Tensor, unit_table: cute.Tensor, num_seqs: Int32, dense_len: Int32,
                total_tokens: Int32, flags: Int32):
    """(unit, bos, eos) of the unit at `rank` of the order: unit_order's table entry where the call
    orders its units (`units_ordered`), the rank-th unit otherwise; bounds clamped either way."""
    seq = rank
    bos = Int32(0)
    eos = Int32(0)
    if units_ordered(flags, num_seqs):
        entry = cute.make_rmem_tensor(cute.make_layout(ENTRY_INTS), Int32)
        cute.autovec_copy(unit_table[rank, None], entry)
        seq = cutlass.min(cutlass.max(entry[0], 0), num_seqs - 1)
        bos = cutlass.min(cutlass.max(entry[1], 0), total_tokens)
        eos = cutlass.min(cutlass.max(entry[2], bos), total_tokens)
    else:
        bos, eos = sequence_bounds(cu_seqlens, seq, dense_len, total_tokens, (flags & Flag.VARLEN) != 0)
    return seq, bos, eos


class ChunkRecurrence:
    """Host-side setup (TMA atoms, smem layouts) and the device kernel, for a subclass to complete:

    * `make_mmas(self)` sets `self.mma_tok` (U^T and O^T), `self.mma_state` (the state update) and
      `self.mma_vw` (U^T = v^T W^T), the tiled MMAs; called on the host before the launch;
    * `consume(self, ...)` (a `cute.jit` method, called by `kernel` with the arguments below) is the
      MMA warps' serial walk over the chunks, from `load_state` to `store_state`.
    """

    # Launch bound: None here (ptxas gives the wgmma kernels 142 registers, under the 168 that let
    # two CTAs share an SM; when they needed exactly 168, the bound made them spill 8 bytes).
    # Subclasses may set 2 to have ptxas hold them to those 168 registers.
    min_blocks_per_sm = None

    def __init__(self, summary: bool = False, ordered: bool = False):
        # summary: the phase-1 kernel of a segmented prefill (twice the V slices, B and M stored
        # instead of o). A separate compiled kernel, so the ordinary one carries none of it.
        # ordered: the variant that takes its units from unit_order's table where the call has one
        # (`units_ordered`); launched for calls of packed input only, so that the other calls' kernel
        # carries none of it (measured: its registers shift, and the one-CTA-an-SM cases ran 1-3 %
        # slower).
        self.summary = summary
        self.ordered = ordered
        self.mma_tok = None
        self.mma_state = None
        self.mma_vw = None

    @cute.jit
    def launch(self, neg_kw: cute.Tensor, qd: cute.Tensor, kr: cute.Tensor, mqk: cute.Tensor,
               v: cute.Tensor, w_hi: cute.Tensor, w_lo: cute.Tensor, decay: cute.Tensor,
               cu_seqlens: cute.Tensor, unit_table: cute.Tensor,
               initial_state: cute.Tensor, o: cute.Tensor, final_state: cute.Tensor,
               num_seqs: Int32, dense_len: Int32, flags: Int32, stream):
        self.make_mmas()
        bf16 = cutlass.BFloat16
        # Shared-memory layouts of the MMA B operands (swizzled, staged).
        kw_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (V_SLICE, CHUNK, HEAD_DIM), bf16, STAGES)
        kr_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (V_SLICE, HEAD_DIM, CHUNK), bf16, STAGES)
        mqk_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (V_SLICE, CHUNK, CHUNK), bf16, STAGES)
        v_layout = sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (V_SLICE, CHUNK, CHUNK), bf16, STAGES)
        decay_layout = cute.make_layout((1, HEAD_DIM, STAGES), stride=(HEAD_DIM, 1, HEAD_DIM))
        out_layout = cute.make_layout((8, OUT_UNITS), stride=(1, 8))

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        # kr rows are tokens with k contiguous; the MMA wants it as [k, tokens].
        kr_nk = cute.make_tensor(kr.iterator, cute.make_layout((HEAD_DIM, kr.shape[0]), stride=(1, HEAD_DIM)))
        # The input v [T, HV, 128] as [HV * 128 (v of every head), T], v contiguous: the MMA wants
        # [v, tokens]; a CTA's tile is (V_SLICE values of its head, CHUNK tokens from any token).
        # At least one token row, so that the TMA descriptor is valid when T = 0 (no tile is
        # loaded then: every sequence is empty).
        v_row = v.shape[1] * HEAD_DIM
        v_mk = cute.make_tensor(v.iterator, cute.make_layout((v_row, cutlass.max(v.shape[0], 1)), stride=(1, v_row)))
        tma_kw, g_kw = cpasync.make_tiled_tma_atom(g2s, neg_kw, cute.slice_(kw_layout, (None, None, 0)), (CHUNK, HEAD_DIM))
        tma_qd, g_qd = cpasync.make_tiled_tma_atom(g2s, qd, cute.slice_(kw_layout, (None, None, 0)), (CHUNK, HEAD_DIM))
        tma_kr, g_kr = cpasync.make_tiled_tma_atom(g2s, kr_nk, cute.slice_(kr_layout, (None, None, 0)), (HEAD_DIM, CHUNK))
        tma_mqk, g_mqk = cpasync.make_tiled_tma_atom(g2s, mqk, cute.slice_(mqk_layout, (None, None, 0)), (CHUNK, CHUNK))
        tma_v, g_v = cpasync.make_tiled_tma_atom(g2s, v_mk, cute.slice_(v_layout, (None, None, 0)), (V_SLICE, CHUNK))
        tma_whi, g_whi = cpasync.make_tiled_tma_atom(g2s, w_hi, cute.slice_(mqk_layout, (None, None, 0)), (CHUNK, CHUNK))
        tma_wlo, g_wlo = cpasync.make_tiled_tma_atom(g2s, w_lo, cute.slice_(mqk_layout, (None, None, 0)), (CHUNK, CHUNK))
        tma_dec, g_dec = cpasync.make_tiled_tma_atom(g2s, decay, cute.slice_(decay_layout, (None, None, 0)), (1, HEAD_DIM))
        stage_bytes = STAGE_BYTES

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, STAGES * 2]
            s_kw: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(kw_layout)], 1024]
            s_qd: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(kw_layout)], 1024]
            s_kr: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(kr_layout)], 1024]
            s_mqk: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(mqk_layout)], 1024]
            s_v: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(v_layout)], 1024]
            s_whi: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(mqk_layout)], 1024]
            s_wlo: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(mqk_layout)], 1024]
            s_dec: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(decay_layout)], 128]
            s_out: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(out_layout)], 128]

        num_v_heads = o.shape[1]
        slices = SLICES * (2 if self.summary else 1)
        # With a launch bound, the carveout too (the DSL would otherwise ask a GPU for it; both
        # CTAs' shared memory must fit).
        bound = {} if self.min_blocks_per_sm is None else dict(
            min_blocks_per_mp=self.min_blocks_per_sm, preferred_smem_carveout=100)
        self.kernel(
            self.mma_tok, self.mma_state, self.mma_vw,
            tma_kw, g_kw, tma_qd, g_qd, tma_kr, g_kr, tma_mqk, g_mqk, tma_v, g_v, tma_whi, g_whi,
            tma_wlo, g_wlo, tma_dec, g_dec,
            kw_layout, kr_layout, mqk_layout, v_layout, decay_layout, out_layout,
            cu_seqlens, unit_table, initial_state, o, final_state, num_seqs, dense_len, flags,
            SharedStorage, stage_bytes,
        ).launch(grid=[slices, num_v_heads, num_seqs],
                 block=[THREADS, 1, 1], stream=stream, **bound)

    @cute.kernel
    def kernel(self, mma_tok: cute.TiledMma, mma_state: cute.TiledMma, mma_vw: cute.TiledMma,
               tma_kw: cute.CopyAtom, g_kw: cute.Tensor, tma_qd: cute.CopyAtom, g_qd: cute.Tensor,
               tma_kr: cute.CopyAtom, g_kr: cute.Tensor, tma_mqk: cute.CopyAtom, g_mqk: cute.Tensor,
               tma_v: cute.CopyAtom, g_v: cute.Tensor, tma_whi: cute.CopyAtom, g_whi: cute.Tensor,
               tma_wlo: cute.CopyAtom, g_wlo: cute.Tensor, tma_dec: cute.CopyAtom, g_dec: cute.Tensor,
               kw_layout: cute.ComposedLayout, kr_layout: cute.ComposedLayout,
               mqk_layout: cute.ComposedLayout, v_layout: cute.ComposedLayout, decay_layout: cute.Layout,
               out_layout: cute.Layout,
               cu_seqlens: cute.Tensor, unit_table: cute.Tensor, initial_state: cute.Tensor, o: cute.Tensor,
               final_state: cute.Tensor, num_seqs: Int32, dense_len: Int32, flags: Int32,
               SharedStorage: cutlass.Constexpr, stage_bytes: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        v_slice, hv, z = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        total_tokens = o.shape[0]
        num_v_heads = o.shape[1]
        v0 = v_slice * V_SLICE

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        loads = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_THREADS // 32),
            tx_count=stage_bytes,
        )
        s_kw = storage.s_kw.get_tensor(kw_layout.outer, swizzle=kw_layout.inner)
        s_qd = storage.s_qd.get_tensor(kw_layout.outer, swizzle=kw_layout.inner)
        s_kr = storage.s_kr.get_tensor(kr_layout.outer, swizzle=kr_layout.inner)
        s_mqk = storage.s_mqk.get_tensor(mqk_layout.outer, swizzle=mqk_layout.inner)
        s_v = storage.s_v.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        s_whi = storage.s_whi.get_tensor(mqk_layout.outer, swizzle=mqk_layout.inner)
        s_wlo = storage.s_wlo.get_tensor(mqk_layout.outer, swizzle=mqk_layout.inner)
        s_dec = storage.s_dec.get_tensor(decay_layout)
        s_out = storage.s_out.get_tensor(out_layout)

        vw_slice = v_slice
        if cutlass.const_expr(self.summary):
            vw_slice = v_slice % SLICES  # the transition slices load (and ignore) slice v_slice - SLICES's values
        loads_args = (tma_kw, g_kw, tma_qd, g_qd, tma_kr, g_kr, tma_mqk, g_mqk, tma_v, g_v, tma_whi, g_whi,
                      tma_wlo, g_wlo, tma_dec, g_dec, s_kw, s_qd, s_kr, s_mqk, s_v, s_whi, s_wlo, s_dec)
        consume_args = (mma_tok, mma_state, mma_vw, loads, s_kw, s_qd, s_kr, s_mqk, s_v, s_whi, s_wlo, s_dec, s_out,
                        initial_state, o, final_state, flags, tidx)
        # Block z runs the units of its ranks [first, end) in order (`group_ranks`: one unit, in a
        # loop the compiler cannot count): in the plain kernel unit z; in the ordered variant, in a
        # packed call the z-th longest (unit_order's table; its entries are a permutation of the
        # units with clamped bounds, clamped here all the same), else unit z. The variant checks
        # `units_ordered` itself although prefill.py launches it only where that holds, so that it
        # is correct for any call. The pipeline's state would carry over from unit to unit.
        first, end = group_ranks(num_seqs)
        if warp == PRODUCER_WARP:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
            for r in cutlass.range(first, end, unroll=1):
                seq, bos, eos = self.unit_at(r, cu_seqlens, unit_table, num_seqs, dense_len, total_tokens, flags)
                state = self.produce(loads, *loads_args, state, seq, hv, vw_slice, num_v_heads, bos, eos)
        if warp < PRODUCER_WARP:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            for r in cutlass.range(first, end, unroll=1):
                seq, bos, eos = self.unit_at(r, cu_seqlens, unit_table, num_seqs, dense_len, total_tokens, flags)
                # The output staging is double-buffered by chunk parity within a unit; between
                # units the parity could repeat, so the warp syncs once (the order racecheck sees).
                cute.arch.sync_warp()
                state = self.consume(*consume_args, seq, hv, v_slice, bos, eos, chunks_of(bos, eos), state)

    @cute.jit
    def unit_at(self, r: Int32, cu_seqlens: cute.Tensor, unit_table: cute.Tensor, num_seqs: Int32,
                dense_len: Int32, total_tokens: Int32, flags: Int32):
        """(unit, bos, eos) of block rank r: the ordered variant's `ranked_unit`, else unit r."""
        seq = r
        bos = Int32(0)
        eos = Int32(0)
        if cutlass.const_expr(self.ordered):
            seq, bos, eos = ranked_unit(r, cu_seqlens, unit_table, num_seqs, dense_len, total_tokens, flags)
        else:
            bos, eos = sequence_bounds(cu_seqlens, seq, dense_len, total_tokens, (flags & Flag.VARLEN) != 0)
        return seq, bos, eos

    @cute.jit
    def produce(self, loads, tma_kw: cute.CopyAtom, g_kw: cute.Tensor, tma_qd: cute.CopyAtom, g_qd: cute.Tensor,
                tma_kr: cute.CopyAtom, g_kr: cute.Tensor, tma_mqk: cute.CopyAtom, g_mqk: cute.Tensor,
                tma_v: cute.CopyAtom, g_v: cute.Tensor, tma_whi: cute.CopyAtom, g_whi: cute.Tensor,
                tma_wlo: cute.CopyAtom, g_wlo: cute.Tensor, tma_dec: cute.CopyAtom, g_dec: cute.Tensor,
                s_kw: cute.Tensor, s_qd: cute.Tensor, s_kr: cute.Tensor, s_mqk: cute.Tensor, s_v: cute.Tensor,
                s_whi: cute.Tensor, s_wlo: cute.Tensor, s_dec: cute.Tensor, state, seq: Int32, hv: Int32,
                vw_slice: Int32, num_v_heads: Int32, bos: Int32, eos: Int32):
        """The TMA producer over one unit's chunks: one stage a chunk, all eight operands on one
        transaction barrier. Returns the pipeline state after them."""
        t_kw_s, t_kw_g = cpasync.tma_partition(tma_kw, 0, cute.make_layout(1), cute.group_modes(s_kw, 0, 2),
                                               cute.group_modes(cute.local_tile(g_kw, (CHUNK, HEAD_DIM), (None, 0)), 0, 2))
        t_qd_s, t_qd_g = cpasync.tma_partition(tma_qd, 0, cute.make_layout(1), cute.group_modes(s_qd, 0, 2),
                                               cute.group_modes(cute.local_tile(g_qd, (CHUNK, HEAD_DIM), (None, 0)), 0, 2))
        t_kr_s, t_kr_g = cpasync.tma_partition(tma_kr, 0, cute.make_layout(1), cute.group_modes(s_kr, 0, 2),
                                               cute.group_modes(cute.local_tile(g_kr, (HEAD_DIM, CHUNK), (0, None)), 0, 2))
        t_mqk_s, t_mqk_g = cpasync.tma_partition(tma_mqk, 0, cute.make_layout(1), cute.group_modes(s_mqk, 0, 2),
                                                 cute.group_modes(cute.local_tile(g_mqk, (CHUNK, CHUNK), (None, 0)), 0, 2))
        # v: tiles of CHUNK tokens from the sequence's first token (not CHUNK-aligned when
        # packed); past the end of the tensor TMA fills zeros, and rows of the next sequence
        # are zeroed by the consumer (zero_values_past_end).
        g_v_seq = cute.domain_offset((0, bos), g_v)
        t_v_s, t_v_g = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(s_v, 0, 2),
                                             cute.group_modes(cute.local_tile(g_v_seq, (V_SLICE, CHUNK), (hv * SLICES + vw_slice, None)), 0, 2))
        t_whi_s, t_whi_g = cpasync.tma_partition(tma_whi, 0, cute.make_layout(1), cute.group_modes(s_whi, 0, 2),
                                                 cute.group_modes(cute.local_tile(g_whi, (CHUNK, CHUNK), (None, 0)), 0, 2))
        t_wlo_s, t_wlo_g = cpasync.tma_partition(tma_wlo, 0, cute.make_layout(1), cute.group_modes(s_wlo, 0, 2),
                                                 cute.group_modes(cute.local_tile(g_wlo, (CHUNK, CHUNK), (None, 0)), 0, 2))
        t_dec_s, t_dec_g = cpasync.tma_partition(tma_dec, 0, cute.make_layout(1), cute.group_modes(s_dec, 0, 2),
                                                 cute.group_modes(cute.local_tile(g_dec, (1, HEAD_DIM), (None, 0)), 0, 2))
        slot0 = bos // CHUNK + seq
        for c in cutlass.range(chunks_of(bos, eos), unroll=1):
            tile = (slot0 + c) * num_v_heads + hv
            loads.producer_acquire(state)
            bar = loads.producer_get_barrier(state)
            cute.copy(tma_kw, t_kw_g[(None, tile)], t_kw_s[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(tma_qd, t_qd_g[(None, tile)], t_qd_s[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(tma_kr, t_kr_g[(None, tile)], t_kr_s[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(tma_mqk, t_mqk_g[(None, tile)], t_mqk_s[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(tma_v, t_v_g[(None, c)], t_v_s[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(tma_whi, t_whi_g[(None, tile)], t_whi_s[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(tma_wlo, t_wlo_g[(None, tile)], t_wlo_s[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(tma_dec, t_dec_g[(None, tile)], t_dec_s[(None, state.index)], tma_bar_ptr=bar)
            loads.producer_commit(state)
            state.advance()
        return state
