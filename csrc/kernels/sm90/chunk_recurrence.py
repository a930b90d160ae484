"""KDA prefill, SM90, kernel 2 of 2: `chunk_recurrence`, the serial half.

One CTA per (64-wide slice of V, value head, sequence); it walks the sequence's chunks in order.
The state slice lives in registers as the fp32 accumulator of a warpgroup MMA, transposed:
S^T [64 v, 128 k]. Per chunk, with the operands written by `prepare_chunks` and the chunk's v
slice straight from the input (all TMA-loaded):

    S_bf   = bf16(S^T)                       A operand, straight from the accumulator registers
    S^T   *= decay (per column k)
    U^T    = v^T W_hi^T + v^T W_lo^T         wgmma m64n16, K = 16, twice (A = v from shared memory)
    U^T   += S_bf neg_kw^T                   wgmma m64n16, K = 128, same batch
    O^T    = S_bf qd^T                       wgmma m64n16, K = 128, same batch
    U_hi   = bf16(U^T),  U_lo = bf16(U^T - U_hi)     (U to ~16 bits as two bf16 operands)
    O^T   += U_hi mqk^T + U_lo mqk^T         wgmma m64n16,  K = 16, twice
    S^T   += U_hi kr + U_lo kr               wgmma m64n128, K = 16, twice (fp32 accumulate onto the state)

Critical path per chunk: one 64-register conversion, two dependent wgmma batches. U's bf16
rounding was the largest error term (tests/kda_chunk_model.py): carrying it as hi + lo halves
takes the final-state error from ~2.4e-3 to ~1.7e-3 and o from ~2.9e-3 to ~2.5e-3 (measured).

Segmented prefill (intracard context parallelism, jax_kda/context_parallel.py): the summary variant
of this kernel (ChunkRecurrence(summary=True), launched for FLAG_SUMMARY) has twice the V slices; slices 0-1 run each segment from a zero state and slices 2-3 run
the identity's 128 columns with no values, and both store their final state ([2 N, HV, K, V]:
B and M per segment) instead of o. The apply call is this kernel unchanged, over the segments.

Warp roles (160 threads): warps 0-3 are the MMA warpgroup; warp 4 is the TMA producer.
Shared memory per pipeline stage (bytes):
    neg_kw 16 x 128 x 2 = 4096, qd 4096, kr 4096, v 16 x 64 x 2 = 2048,
    mqk, w_hi, w_lo 16 x 16 x 2 = 512 each, decay 128 x 4 = 512      -> 16384 per stage
plus the output staging tile 2 x 16 x 72 x 2 = 4608 (rows padded) and the mbarriers.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils.layout import LayoutEnum

from sm90.prepare_chunks import (
    FLAG_HAS_INITIAL_STATE,
    FLAG_OUTPUT_FINAL_STATE,
    FLAG_STATE_V_FIRST,
    FLAG_VARLEN,
    sequence_bounds,
)

CHUNK = 16
HEAD_DIM = 128
V_SLICE = 64
STAGES = 4
MMA_THREADS = 128
THREADS = MMA_THREADS + 32
PRODUCER_WARP = MMA_THREADS // 32
SLICES = HEAD_DIM // V_SLICE  # CTAs per (value head, sequence); twice as many in the summary kernel
OUTPUT_BARRIER = 1
VALUES_BARRIER = 2
# Output staging rows [16 tokens, 64 v] padded to 72: the accumulator's bf16 writes (lanes differ
# by 2 tokens and 1 v) spread over all banks, and every row starts 16-byte aligned for the
# 8-element vector reads.
OUT_PITCH = V_SLICE + 8


def shared_memory_bytes() -> int:
    """Shared memory of one CTA, as laid out by SharedStorage (1024-byte aligned swizzled tiles)."""
    barriers = 1024  # 2 * STAGES mbarriers, padded up to the first 1024-aligned tile
    mma_tiles = STAGES * (3 * CHUNK * HEAD_DIM * 2 + CHUNK * V_SLICE * 2)  # neg_kw, qd, kr, v
    small_tiles = 3 * STAGES * CHUNK * CHUNK * 2  # mqk, w_hi, w_lo: 512 B per stage each
    return barriers + mma_tiles + small_tiles + STAGES * HEAD_DIM * 4 + 2 * CHUNK * OUT_PITCH * 2  # + decay, output staging
    # (each buffer starts 1024-aligned; all but the last end on a multiple of 1024 B)


def _acc_as_operand_layout(acc_layout, operand_value_shape):
    """Register layout of a bf16 A operand that reuses an fp32 accumulator's element order.

    For 16-bit inputs the wgmma accumulator fragment of an m64nN tile holds, per thread, the
    same (row, column) pairs in the same order as the A fragment of an m64kN operand, so the
    conversion is an element-wise cast into this re-grouped layout: value modes (2, 2, 2) per
    k-block of 16 and the remaining n8-blocks become the k-block mode.
    """
    per_block = cute.size(operand_value_shape)
    return cute.make_layout(
        (operand_value_shape, acc_layout.shape[1],
         (acc_layout.shape[2], cute.size(acc_layout, mode=[0]) // per_block)),
        stride=(acc_layout.stride[0], acc_layout.stride[1],
                (acc_layout.stride[2], cute.size(operand_value_shape, mode=[2]) * acc_layout.stride[0][2])),
    )


@cute.jit
def _to_operand(acc: cute.Tensor, dst: cute.Tensor):
    """dst (bf16 A operand) <- acc (fp32 accumulator), element-wise."""
    dst_as_acc = cute.make_tensor(dst.iterator, acc.layout)
    dst_as_acc.store(acc.load().to(cutlass.BFloat16))


@cute.jit
def _to_operand_split(acc: cute.Tensor, hi: cute.Tensor, lo: cute.Tensor):
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
    state_v_first = (flags & FLAG_STATE_V_FIRST) != 0
    v0 = v_slice * V_SLICE
    acc_s.fill(0.0)
    if cutlass.const_expr(summary):
        if v_slice >= SLICES:
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                vv, kk = crd_s[e]
                if v0 - HEAD_DIM + vv == kk:
                    acc_s[e] = Float32(1.0)
    elif (flags & FLAG_HAS_INITIAL_STATE) != 0:
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            vv, kk = crd_s[e]
            if state_v_first:
                acc_s[e] = initial_state[seq, hv, v0 + vv, kk]
            else:
                acc_s[e] = initial_state[seq, hv, kk, v0 + vv]


@cute.jit
def store_state(acc_s: cute.Tensor, crd_s: cute.Tensor, final_state: cute.Tensor, flags: Int32,
                seq: Int32, hv: Int32, v_slice: Int32, summary: cutlass.Constexpr = False):
    """This thread's elements of the final state slice (the same ones load_state read). In the
    summary kernel, final_state is [2 N, HV, K, V]: entry 2 n holds segment n's zero-start state B,
    entry 2 n + 1 its transition M (M[k, j] = column j of the identity columns)."""
    state_v_first = (flags & FLAG_STATE_V_FIRST) != 0
    v0 = v_slice * V_SLICE
    if cutlass.const_expr(summary):
        part = v_slice // SLICES
        v0 = v0 - part * HEAD_DIM
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            vv, kk = crd_s[e]
            final_state[2 * seq + part, hv, kk, v0 + vv] = acc_s[e]
    elif (flags & FLAG_OUTPUT_FINAL_STATE) != 0:
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            vv, kk = crd_s[e]
            if state_v_first:
                final_state[seq, hv, v0 + vv, kk] = acc_s[e]
            else:
                final_state[seq, hv, kk, v0 + vv] = acc_s[e]


@cute.jit
def zero_values_past_end(s_v: cute.Tensor, stage: Int32, valid: Int32, tidx: Int32):
    """The last chunk of a sequence can be partial: its v tile then holds the next sequence's
    first tokens (TMA reads the whole 16-token box from the input). Zero those rows of the
    stage before any MMA reads them, so that they add exact zeros (W's columns for them are zero)
    even when the next sequence's values are not finite. The fence orders these generic-proxy
    writes before the async-proxy reads (wgmma); the stage is not refilled after a CTA's last
    chunk, but if it were, the same fence would order them before that TMA write."""
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
def store_output(acc_o: cute.Tensor, crd_t: cute.Tensor, s_out: cute.Tensor, o: cute.Tensor, c: Int32,
                 tidx: Int32, hv: Int32, v_slice: Int32, bos: Int32, eos: Int32):
    """Chunk c's O^T [64 v, 16 tokens]: transposed through shared memory (double-buffered by chunk
    parity, one named barrier of the MMA threads), then one 16-byte store per thread (8 v of one
    token row; 8 threads cover a row's 128 bytes), only for tokens before the sequence end."""
    buf = c % 2
    for e in cutlass.range_constexpr(cute.size(acc_o)):
        vv, tt = crd_t[e]
        s_out[tt, vv, buf] = acc_o[e].to(cutlass.BFloat16)
    cute.arch.barrier(barrier_id=OUTPUT_BARRIER, number_of_threads=MMA_THREADS)
    tok = tidx // 8
    part = tidx % 8
    t = bos + c * CHUNK + tok
    if t < eos:
        row = cute.make_rmem_tensor(cute.make_layout(8), cutlass.BFloat16)
        cute.autovec_copy(cute.local_tile(s_out[tok, None, buf], (8,), (part,)), row)
        cute.autovec_copy(row, cute.local_tile(o[t, hv, None], (8,), (v_slice * 8 + part,)))


class ChunkRecurrence:
    """Host-side setup (TMA atoms, smem layouts, MMAs) and the device kernel."""

    # Launch bound: None here (ptxas lands on exactly 168 registers, the most that lets two CTAs
    # share an SM; with the bound it spilled 8 bytes). Subclasses may set 2 to have ptxas hold them
    # to those 168 registers.
    min_blocks_per_sm = None

    def __init__(self, summary: bool = False):
        # summary: the phase-1 kernel of a segmented prefill (twice the V slices, B and M stored
        # instead of o). A separate compiled kernel, so the ordinary one carries none of it.
        self.summary = summary
        self.mma_tok = None
        self.mma_state = None
        self.mma_vw = None

    def make_mmas(self):
        # m64n16: U^T and O^T. A = registers (K-major by construction), B = [tokens, k] K-major.
        self.mma_tok = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K,
            Float32, (1, 1, 1), (V_SLICE, CHUNK), warpgroup.OperandSource.RMEM)
        # m64n128: the state update. B = kr viewed as [k (N), tokens (K)], k contiguous: MN-major.
        self.mma_state = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.MN,
            Float32, (1, 1, 1), (V_SLICE, HEAD_DIM), warpgroup.OperandSource.RMEM)
        # m64n16: U^T = v^T W^T. A = the chunk's v slice from shared memory, [v (M), tokens (K)]
        # with v contiguous (MN-major); B = W (hi or lo) as [i (N), j (K)], K-major like mqk.
        self.mma_vw = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.MN, OperandMajorMode.K,
            Float32, (1, 1, 1), (V_SLICE, CHUNK), warpgroup.OperandSource.SMEM)

    @cute.jit
    def launch(self, neg_kw: cute.Tensor, qd: cute.Tensor, kr: cute.Tensor, mqk: cute.Tensor,
               v: cute.Tensor, w_hi: cute.Tensor, w_lo: cute.Tensor, decay: cute.Tensor,
               cu_seqlens: cute.Tensor,
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
        out_layout = cute.make_layout((CHUNK, V_SLICE, 2), stride=(OUT_PITCH, 1, CHUNK * OUT_PITCH))

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
        stage_bytes = (3 * CHUNK * HEAD_DIM * 2 + 3 * CHUNK * CHUNK * 2 + CHUNK * V_SLICE * 2 + HEAD_DIM * 4)

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
        # With a launch bound, the carveout too (the DSL would otherwise ask a GPU for it; both
        # CTAs' shared memory must fit).
        bound = {} if self.min_blocks_per_sm is None else dict(
            min_blocks_per_mp=self.min_blocks_per_sm, preferred_smem_carveout=100)
        self.kernel(
            self.mma_tok, self.mma_state, self.mma_vw,
            tma_kw, g_kw, tma_qd, g_qd, tma_kr, g_kr, tma_mqk, g_mqk, tma_v, g_v, tma_whi, g_whi,
            tma_wlo, g_wlo, tma_dec, g_dec,
            kw_layout, kr_layout, mqk_layout, v_layout, decay_layout, out_layout,
            cu_seqlens, initial_state, o, final_state, num_seqs, dense_len, flags,
            SharedStorage, stage_bytes,
        ).launch(grid=[SLICES * (2 if self.summary else 1), num_v_heads, num_seqs],
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
               cu_seqlens: cute.Tensor, initial_state: cute.Tensor, o: cute.Tensor,
               final_state: cute.Tensor, num_seqs: Int32, dense_len: Int32, flags: Int32,
               SharedStorage: cutlass.Constexpr, stage_bytes: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        v_slice, hv, seq = cute.arch.block_idx()
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

        varlen = (flags & FLAG_VARLEN) != 0
        bos, eos = sequence_bounds(cu_seqlens, seq, dense_len, total_tokens, varlen)
        num_chunks = (eos - bos + CHUNK - 1) // CHUNK
        slot0 = bos // CHUNK + seq

        vw_slice = v_slice
        if cutlass.const_expr(self.summary):
            vw_slice = v_slice % SLICES  # the transition slices load (and ignore) slice v_slice - SLICES's values
        if warp == PRODUCER_WARP:
            # TMA producer: one stage per chunk, all eight operands on one transaction barrier.
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
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
            for c in cutlass.range(num_chunks, unroll=1):
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

        if warp < PRODUCER_WARP:
            self.consume(mma_tok, mma_state, mma_vw, loads, s_kw, s_qd, s_kr, s_mqk, s_v, s_whi, s_wlo,
                         s_dec, s_out,
                         initial_state, o, final_state, flags, tidx, seq, hv, v_slice, bos, eos,
                         num_chunks)

    @cute.jit
    def consume(self, mma_tok: cute.TiledMma, mma_state: cute.TiledMma, mma_vw: cute.TiledMma, loads,
                s_kw: cute.Tensor, s_qd: cute.Tensor, s_kr: cute.Tensor, s_mqk: cute.Tensor,
                s_v: cute.Tensor, s_whi: cute.Tensor, s_wlo: cute.Tensor, s_dec: cute.Tensor, s_out: cute.Tensor, initial_state: cute.Tensor, o: cute.Tensor,
                final_state: cute.Tensor, flags: Int32, tidx: Int32, seq: Int32, hv: Int32,
                v_slice: Int32, bos: Int32, eos: Int32, num_chunks: Int32):
        """The MMA warpgroup: the serial walk over the chunks (warpgroup MMAs)."""
        thr_tok = mma_tok.get_slice(tidx)
        thr_state = mma_state.get_slice(tidx)
        # B operand views of every stage.
        b_kw = thr_tok.make_fragment_B(thr_tok.partition_B(s_kw))
        b_qd = thr_tok.make_fragment_B(thr_tok.partition_B(s_qd))
        b_mqk = thr_tok.make_fragment_B(thr_tok.partition_B(s_mqk))
        b_kr = thr_state.make_fragment_B(thr_state.partition_B(s_kr))
        thr_vw = mma_vw.get_slice(tidx)
        a_v = thr_vw.make_fragment_A(thr_vw.partition_A(s_v))
        b_whi = thr_vw.make_fragment_B(thr_vw.partition_B(s_whi))
        b_wlo = thr_vw.make_fragment_B(thr_vw.partition_B(s_wlo))
        # The summary kernel's transition slices (SLICES..) run with zero values: U = -W k S only.
        with_values = True
        if cutlass.const_expr(self.summary):
            with_values = v_slice < SLICES
        # Accumulators and their (row, column) coordinates: rows are v, columns tokens or k.
        acc_s = thr_state.make_fragment_C(thr_state.partition_shape_C((V_SLICE, HEAD_DIM)))
        acc_u = thr_tok.make_fragment_C(thr_tok.partition_shape_C((V_SLICE, CHUNK)))
        acc_o = thr_tok.make_fragment_C(thr_tok.partition_shape_C((V_SLICE, CHUNK)))
        crd_s = thr_state.partition_C(cute.make_identity_tensor((V_SLICE, HEAD_DIM)))
        crd_t = thr_tok.partition_C(cute.make_identity_tensor((V_SLICE, CHUNK)))
        # bf16 A operands built from the accumulators.
        a_value_shape = mma_tok.tv_layout_A.shape[1]
        a_s = cute.make_rmem_tensor(_acc_as_operand_layout(acc_s.layout, a_value_shape), cutlass.BFloat16)
        a_u = cute.make_rmem_tensor(_acc_as_operand_layout(acc_u.layout, a_value_shape), cutlass.BFloat16)
        a_u_lo = cute.make_rmem_tensor(_acc_as_operand_layout(acc_u.layout, a_value_shape), cutlass.BFloat16)

        load_state(acc_s, crd_s, initial_state, flags, seq, hv, v_slice, self.summary)
        last_valid = eos - bos - (num_chunks - 1) * CHUNK  # tokens in the last chunk

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        for c in cutlass.range(num_chunks, unroll=1):
            loads.consumer_wait(state)
            stage = state.index
            if c == num_chunks - 1:
                if last_valid < CHUNK:
                    zero_values_past_end(s_v, stage, last_valid, tidx)
            _to_operand(acc_s, a_s)
            # Decay the fp32 state now: ptxas would otherwise serialize this against the
            # batch below anyway (it treats acc_s as live wgmma output across the loop).
            decay_state(acc_s, crd_s, s_dec, stage)

            warpgroup.fence()
            # U^T = v^T (W_hi + W_lo)^T: W as two bf16 halves, v exact in bf16. The transition
            # slices discard it: their first neg_kw product overwrites instead of accumulating
            # (a runtime scale-d, not a branch around the MMAs, which would make ptxas wait).
            mma_vw.set(warpgroup.Field.ACCUMULATE, False)
            cute.gemm(mma_vw, acc_u, a_v[None, None, 0, stage], b_whi[None, None, 0, stage], acc_u)
            mma_vw.set(warpgroup.Field.ACCUMULATE, True)
            cute.gemm(mma_vw, acc_u, a_v[None, None, 0, stage], b_wlo[None, None, 0, stage], acc_u)
            for kb in cutlass.range_constexpr(HEAD_DIM // 16):
                mma_tok.set(warpgroup.Field.ACCUMULATE, with_values if kb == 0 else True)
                cute.gemm(mma_tok, acc_u, a_s[None, None, kb], b_kw[None, None, kb, stage], acc_u)
            warpgroup.commit_group()
            # O^T = S_bf qd^T in a group of its own: the tensor cores run it while U is split.
            for kb in cutlass.range_constexpr(HEAD_DIM // 16):
                mma_tok.set(warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(mma_tok, acc_o, a_s[None, None, kb], b_qd[None, None, kb, stage], acc_o)
            warpgroup.commit_group()

            warpgroup.wait_group(1)  # U's group (O's may still run)

            _to_operand_split(acc_u, a_u, a_u_lo)
            warpgroup.fence()
            # The state first (the next chunk waits for it), then O, which accumulates after the
            # in-flight O group (same MMA shape and accumulator: ordered by the hardware).
            mma_state.set(warpgroup.Field.ACCUMULATE, True)
            cute.gemm(mma_state, acc_s, a_u[None, None, 0], b_kr[None, None, 0, stage], acc_s)
            cute.gemm(mma_state, acc_s, a_u_lo[None, None, 0], b_kr[None, None, 0, stage], acc_s)
            mma_tok.set(warpgroup.Field.ACCUMULATE, True)
            cute.gemm(mma_tok, acc_o, a_u[None, None, 0], b_mqk[None, None, 0, stage], acc_o)
            cute.gemm(mma_tok, acc_o, a_u_lo[None, None, 0], b_mqk[None, None, 0, stage], acc_o)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            loads.consumer_release(state)
            state.advance()

            if cutlass.const_expr(not self.summary):
                store_output(acc_o, crd_t, s_out, o, c, tidx, hv, v_slice, bos, eos)

        store_state(acc_s, crd_s, final_state, flags, seq, hv, v_slice, self.summary)
