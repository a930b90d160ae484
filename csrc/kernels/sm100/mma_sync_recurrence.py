"""KDA prefill, kernel 2 of 2 for Blackwell (sm_100f, sm_110f): the recurrence on warp-level MMAs (mma.sync).

Warpgroup MMA (wgmma) exists only on sm_90a, so this variant computes the same per-chunk
recurrence as `sm90/wgmma_recurrence.py` with `mma.sync.m16n8k16` (bf16 operands, fp32
accumulate), which every architecture from sm_80 on runs. Everything else is
`common/recurrence.py`: the grid (V slice, value head, sequence), the warp roles (warps 0-3 MMA, warp 4 the
TMA producer), the 4-stage TMA pipeline and its shared-memory tiles, the state load and store and
the output path. The recurrence is latency-bound (a handful of small MMAs per 16-token step), so
warp-level MMAs lose little against the architecture's native ones.

Per chunk, warp w owns rows v = 16 w .. 16 w + 15 of the transposed state S^T [64 v, 128 k]
(fp32 accumulators of 16 n8-tiles):

    S_bf   = bf16(S^T)                       A operand: accumulator n-tiles 2j, 2j+1 = k-block j
    S^T   *= decay (per column k)
    U^T    = v^T (W_hi + W_lo)^T             1 k-block x 2 n-tiles, twice (A = v by ldmatrix.trans)
    U^T   += S_bf neg_kw^T                   8 k-blocks x 2 n-tiles
    O^T    = S_bf qd^T                       8 k-blocks x 2 n-tiles
    U_hi   = bf16(U^T), U_lo = bf16(U^T - U_hi)   A operands (one k-block of 16 tokens each)
    O^T   += U_hi mqk^T + U_lo mqk^T         2 n-tiles, twice
    S^T   += U_hi kr + U_lo kr               16 n-tiles, twice

B operands come from the swizzled shared-memory stages through `ldmatrix` (transposed for kr,
whose tile is k-contiguous).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32

from common.recurrence import (
    CHUNK,
    HEAD_DIM,
    SLICES,
    STAGES,
    V_SLICE,
    ChunkRecurrence,
    decay_state,
    load_state,
    store_output,
    store_state,
    to_operand,
    to_operand_split,
    zero_values_past_end,
)

MMA_WARPS = 4


class MmaSyncRecurrence(ChunkRecurrence):
    """The recurrence's MMA warps on four warps of mma.sync."""

    # Two CTAs per SM: unbounded, ptxas for sm_100a gave this kernel 255 registers (one CTA per SM;
    # 142 for sm_90a from the same PTX). The bound holds it to the 168 that two 160-thread CTAs allow.
    min_blocks_per_sm = 2

    def make_mmas(self):
        # One tiled MMA serves every product: 4 warps along M (64 rows of v), and a 16-wide
        # N tile per warp (two n8 atoms) so that one ldmatrix.x4 feeds a k-block of B.
        op = cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, Float32, (16, 8, 16))
        tiled = cute.make_tiled_mma(op, (MMA_WARPS, 1, 1), permutation_mnk=(V_SLICE, 16, 16))
        self.mma_tok = tiled
        self.mma_state = tiled
        self.mma_vw = tiled

    @cute.jit
    def consume(self, mma_tok: cute.TiledMma, mma_state: cute.TiledMma, mma_vw: cute.TiledMma, loads,
                s_kw: cute.Tensor, s_qd: cute.Tensor, s_kr: cute.Tensor, s_mqk: cute.Tensor,
                s_v: cute.Tensor, s_whi: cute.Tensor, s_wlo: cute.Tensor, s_dec: cute.Tensor, s_out: cute.Tensor, initial_state: cute.Tensor, o: cute.Tensor,
                final_state: cute.Tensor, flags: Int32, tidx: Int32, seq: Int32, hv: Int32,
                v_slice: Int32, bos: Int32, eos: Int32, num_chunks: Int32, state=None):
        """The four MMA warps: the serial walk over one unit's chunks (warp-level MMAs), on the pipeline
        from `state` (None: from the start); returns the pipeline state after them."""
        bf16 = cutlass.BFloat16
        mma = mma_tok
        thr = mma.get_slice(tidx)
        # Accumulators and their (row, column) coordinates: rows are v, columns tokens or k.
        acc_s = thr.make_fragment_C(thr.partition_shape_C((V_SLICE, HEAD_DIM)))
        acc_u = thr.make_fragment_C(thr.partition_shape_C((V_SLICE, CHUNK)))
        acc_o = thr.make_fragment_C(thr.partition_shape_C((V_SLICE, CHUNK)))
        crd_s = thr.partition_C(cute.make_identity_tensor((V_SLICE, HEAD_DIM)))
        # bf16 A operands: for m16n8k16 the fragment of k-block j is the accumulator values of
        # n-tiles 2j and 2j+1 in order, so a compact A fragment and the compact accumulator share
        # one element order (_to_operand converts element by element).
        a_s = thr.make_fragment_A(thr.partition_shape_A((V_SLICE, HEAD_DIM)))
        a_u = thr.make_fragment_A(thr.partition_shape_A((V_SLICE, CHUNK)))
        a_u_lo = thr.make_fragment_A(thr.partition_shape_A((V_SLICE, CHUNK)))
        # B operands: register fragments for one stage, filled by ldmatrix from the stage in use.
        b_kw = thr.make_fragment_B(thr.partition_shape_B((CHUNK, HEAD_DIM)))
        b_qd = thr.make_fragment_B(thr.partition_shape_B((CHUNK, HEAD_DIM)))
        b_mqk = thr.make_fragment_B(thr.partition_shape_B((CHUNK, CHUNK)))
        b_kr = thr.make_fragment_B(thr.partition_shape_B((HEAD_DIM, CHUNK)))
        # U^T = v^T W^T: A = the v slice [v, tokens] (v contiguous in shared memory: ldmatrix.trans),
        # B = W hi / lo [i, j] (K-major, like mqk).
        a_v = thr.make_fragment_A(thr.partition_shape_A((V_SLICE, CHUNK)))
        b_whi = thr.make_fragment_B(thr.partition_shape_B((CHUNK, CHUNK)))
        b_wlo = thr.make_fragment_B(thr.partition_shape_B((CHUNK, CHUNK)))
        load_k_major = cute.make_tiled_copy_B(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), bf16), mma)
        load_mn_major = cute.make_tiled_copy_B(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(True, 4), bf16), mma)
        load_a_mn_major = cute.make_tiled_copy_A(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(True, 4), bf16), mma)
        thr_a = load_a_mn_major.get_slice(tidx)
        src_v = thr_a.partition_S(s_v)
        dst_v = thr_a.retile(a_v)
        thr_k = load_k_major.get_slice(tidx)
        thr_mn = load_mn_major.get_slice(tidx)
        src_kw = thr_k.partition_S(s_kw)
        src_qd = thr_k.partition_S(s_qd)
        src_mqk = thr_k.partition_S(s_mqk)
        src_kr = thr_mn.partition_S(s_kr)
        dst_kw = thr_k.retile(b_kw)
        dst_qd = thr_k.retile(b_qd)
        dst_mqk = thr_k.retile(b_mqk)
        dst_kr = thr_mn.retile(b_kr)
        src_whi = thr_k.partition_S(s_whi)
        src_wlo = thr_k.partition_S(s_wlo)
        dst_whi = thr_k.retile(b_whi)
        dst_wlo = thr_k.retile(b_wlo)
        # The summary kernel's transition slices (SLICES..) run with zero values: U = -W k S only.
        with_values = True
        if cutlass.const_expr(self.summary):
            with_values = v_slice < SLICES

        load_state(acc_s, crd_s, initial_state, flags, seq, hv, v_slice, self.summary)
        last_valid = eos - bos - (num_chunks - 1) * CHUNK  # tokens in the last chunk

        if cutlass.const_expr(state is None):  # a unit of its own; else the pipeline goes on from `state`
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        for c in cutlass.range(num_chunks, unroll=1):
            loads.consumer_wait(state)
            stage = state.index
            if c == num_chunks - 1:
                if last_valid < CHUNK:
                    zero_values_past_end(s_v, stage, last_valid, tidx)
            acc_u.fill(0.0)
            if with_values:
                cute.copy(load_a_mn_major, src_v[None, None, 0, stage], dst_v[None, None, 0])
                cute.copy(load_k_major, src_whi[None, None, 0, stage], dst_whi[None, None, 0])
                cute.copy(load_k_major, src_wlo[None, None, 0, stage], dst_wlo[None, None, 0])
                cute.gemm(mma, acc_u, a_v[None, None, 0], b_whi[None, None, 0], acc_u)
                cute.gemm(mma, acc_u, a_v[None, None, 0], b_wlo[None, None, 0], acc_u)
            to_operand(acc_s, a_s)
            decay_state(acc_s, crd_s, s_dec, stage)
            acc_o.fill(0.0)
            # B fragments are loaded one k-block ahead of their use (ldmatrix latency overlaps the
            # MMAs of the previous k-block; registers hold two k-blocks, not the whole tile).
            cute.copy(load_k_major, src_kw[None, None, 0, stage], dst_kw[None, None, 0])
            cute.copy(load_k_major, src_qd[None, None, 0, stage], dst_qd[None, None, 0])
            for kb in cutlass.range_constexpr(HEAD_DIM // 16):
                if cutlass.const_expr(kb + 1 < HEAD_DIM // 16):
                    cute.copy(load_k_major, src_kw[None, None, kb + 1, stage], dst_kw[None, None, kb + 1])
                    cute.copy(load_k_major, src_qd[None, None, kb + 1, stage], dst_qd[None, None, kb + 1])
                else:
                    cute.copy(load_k_major, src_mqk[None, None, 0, stage], dst_mqk[None, None, 0])
                    cute.copy(load_mn_major, src_kr[None, None, 0, stage], dst_kr[None, None, 0])
                cute.gemm(mma, acc_u, a_s[None, None, kb], b_kw[None, None, kb], acc_u)
                cute.gemm(mma, acc_o, a_s[None, None, kb], b_qd[None, None, kb], acc_o)
            to_operand_split(acc_u, a_u, a_u_lo)
            cute.gemm(mma, acc_o, a_u[None, None, 0], b_mqk[None, None, 0], acc_o)
            cute.gemm(mma, acc_o, a_u_lo[None, None, 0], b_mqk[None, None, 0], acc_o)
            cute.gemm(mma, acc_s, a_u[None, None, 0], b_kr[None, None, 0], acc_s)
            cute.gemm(mma, acc_s, a_u_lo[None, None, 0], b_kr[None, None, 0], acc_s)
            # Every read of this stage (ldmatrix, decay) is done: hand it back to the producer.
            loads.consumer_release(state)
            state.advance()

            if cutlass.const_expr(not self.summary):
                store_output(acc_o, s_out, o, c, tidx, hv, v_slice, bos, eos)

        store_state(acc_s, crd_s, final_state, flags, seq, hv, v_slice, self.summary)
        return state
