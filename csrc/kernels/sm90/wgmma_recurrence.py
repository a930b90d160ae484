"""KDA prefill, kernel 2 of 2 for Hopper (sm_90a): the recurrence on warpgroup MMAs (wgmma).

`common/recurrence.py` has the kernel around it (grid, TMA producer, pipeline, state load and
store, output path); this file is its MMA warpgroup. One CTA per (64-wide slice of V, value head,
sequence); the state slice lives in registers as the fp32 accumulator of a warpgroup MMA,
transposed: S^T [64 v, 128 k]. Per chunk:

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
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

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



# U's k-blocks: 0 .. U_SPLIT - 1 continue v W^T's accumulator, U_SPLIT .. 7 go to a second one; the
# issue order alternates between the two chains.
U_SPLIT = 3
U_CHAIN_ORDER = ((0, False), (3, True), (1, False), (4, True), (2, False), (5, True), (6, True), (7, True))
ONE_CHAIN_ORDER = tuple((kb, False) for kb in range(8))


class WgmmaRecurrence(ChunkRecurrence):
    """The recurrence's MMA warpgroup on warpgroup MMAs."""

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
    def consume(self, mma_tok: cute.TiledMma, mma_state: cute.TiledMma, mma_vw: cute.TiledMma, loads,
                s_kw: cute.Tensor, s_qd: cute.Tensor, s_kr: cute.Tensor, s_mqk: cute.Tensor,
                s_v: cute.Tensor, s_whi: cute.Tensor, s_wlo: cute.Tensor, s_dec: cute.Tensor, s_out: cute.Tensor, initial_state: cute.Tensor, o: cute.Tensor,
                final_state: cute.Tensor, flags: Int32, tidx: Int32, seq: Int32, hv: Int32,
                v_slice: Int32, bos: Int32, eos: Int32, num_chunks: Int32, state=None):
        """The MMA warpgroup: the serial walk over one unit's chunks (warpgroup MMAs), on the pipeline
        from `state` (None: from the start); returns the pipeline state after them."""
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
        acc_u2 = thr_tok.make_fragment_C(thr_tok.partition_shape_C((V_SLICE, CHUNK)))
        acc_o = thr_tok.make_fragment_C(thr_tok.partition_shape_C((V_SLICE, CHUNK)))
        crd_s = thr_state.partition_C(cute.make_identity_tensor((V_SLICE, HEAD_DIM)))
        # bf16 A operands built from the accumulators.
        a_value_shape = mma_tok.tv_layout_A.shape[1]
        a_s = cute.make_rmem_tensor(_acc_as_operand_layout(acc_s.layout, a_value_shape), cutlass.BFloat16)
        a_u = cute.make_rmem_tensor(_acc_as_operand_layout(acc_u.layout, a_value_shape), cutlass.BFloat16)
        a_u_lo = cute.make_rmem_tensor(_acc_as_operand_layout(acc_u.layout, a_value_shape), cutlass.BFloat16)

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
            to_operand(acc_s, a_s)
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
            # S_bf neg_kw^T: in the ordinary kernel on two independent accumulator chains, issued
            # alternately: k-blocks 0-2 onto v W^T (5 dependent MMAs), 3-7 onto acc_u2 (5), added
            # once the group is done. The summary kernel keeps one chain (its loop, with no O
            # products, would only gain the adds).
            for kb, second in (ONE_CHAIN_ORDER if self.summary else U_CHAIN_ORDER):
                if cutlass.const_expr(second):
                    mma_tok.set(warpgroup.Field.ACCUMULATE, kb != U_SPLIT)
                    cute.gemm(mma_tok, acc_u2, a_s[None, None, kb], b_kw[None, None, kb, stage], acc_u2)
                else:
                    mma_tok.set(warpgroup.Field.ACCUMULATE, with_values if kb == 0 else True)
                    cute.gemm(mma_tok, acc_u, a_s[None, None, kb], b_kw[None, None, kb, stage], acc_u)
            warpgroup.commit_group()
            # O^T = S_bf qd^T in a group of its own: the tensor cores run it while U is split.
            for kb in cutlass.range_constexpr(HEAD_DIM // 16):
                mma_tok.set(warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(mma_tok, acc_o, a_s[None, None, kb], b_qd[None, None, kb, stage], acc_o)
            warpgroup.commit_group()

            warpgroup.wait_group(1)  # U's group (O's may still run)
            if cutlass.const_expr(not self.summary):
                for e in cutlass.range_constexpr(cute.size(acc_u)):
                    acc_u[e] = acc_u[e] + acc_u2[e]

            to_operand_split(acc_u, a_u, a_u_lo)
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
                store_output(acc_o, s_out, o, c, tidx, hv, v_slice, bos, eos)

        store_state(acc_s, crd_s, final_state, flags, seq, hv, v_slice, self.summary)
        return state
