"""KDA prefill, SM90, kernel 1 of 2: `prepare_chunks`, the token-parallel half.

One CTA per (chunk slot, value head): 128 threads, thread d owns key/value channel d. It turns
the raw inputs of one 16-token chunk into the operands of the serial recurrence
(`chunk_recurrence.py`), all independent of the state:

    G        inclusive cumsum of the log2 decay over the chunk           (registers, fp32)
    L        strictly lower beta_i * sum_d k_i k_j 2^(G_i - G_j)          (smem, fp32)
    W        (I + L)^-1 diag(beta)                                        (smem, fp32)
    neg_kw   -W (k * 2^G)            [16, 128] bf16   B operand of  U^T = Vw^T + S^T neg_kw^T
    vw       W v                     [16, 128] fp32   initial accumulator of U^T
    qd       scale * q * 2^G         [16, 128] bf16   B operand of  O^T = S^T qd^T + ...
    kr       k * 2^(G_last - G)      [16, 128] bf16   B operand of  S^T += U^T kr
    mqk      scale q_i k_j 2^(G_i-G_j), j <= i  [16, 16] bf16   B operand of O^T += U^T mqk^T
    decay    2^G_last                [128] fp32       per-channel state decay

Exactness: every exponent used is <= 0 except in the factorized fast path, which is taken only
when the whole chunk's decay satisfies min_d G_last[d] >= -FAST_PATH_RANGE; its factors are
then taken relative to G_ref = G_last / 2 and lie within 2^(+-FAST_PATH_RANGE/2). Otherwise the
pair products use 2^(G_i - G_j) element-wise (i >= j). tests/kda_chunk_model.py is the numpy
model of exactly this file.

Chunk slots: sequence n (tokens [bos_n, eos_n)) owns slots base(n) + c for its chunks c, with
base(n) = bos_n // 16 + n. Slots never overlap and all lie below total_tokens // 16 + N, which
is the workspace row count (see README.md). Slots that belong to no chunk exit at once.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

CHUNK = 16
HEAD_DIM = 128
THREADS = 128
WARPS = THREADS // 32
LOG2E = 1.4426950408889634
FAST_PATH_RANGE = 200.0
# fp32 rows padded by 4 words so that 8 threads reading 8 different rows at the same column
# hit 8 different bank quadruples.
ROW_PITCH = HEAD_DIM + 4

# Bits of the runtime `flags` argument shared by both kernels.
FLAG_QK_L2NORM = 1 << 0
FLAG_BETA_SIGMOID = 1 << 1
FLAG_VARLEN = 1 << 2
FLAG_HAS_INITIAL_STATE = 1 << 3
FLAG_OUTPUT_FINAL_STATE = 1 << 4
FLAG_STATE_V_FIRST = 1 << 5
GATE_MODE_SHIFT = 8  # bits 8..9: 0 pre-activated, 1 softplus, 2 lower-bound*sigmoid(exp(A)x), 3 lower-bound*sigmoid(x)


def shared_memory_bytes() -> int:
    """Shared memory of one CTA: four padded [16, 132] fp32 tiles, two [16, 17] fp32 matrices,
    beta, the l2-norm partial sums and the fast-path vote."""
    return 4 * CHUNK * ROW_PITCH * 4 + 2 * CHUNK * (CHUNK + 1) * 4 + CHUNK * 4 + 2 * WARPS * CHUNK * 4 + WARPS * 4


@cute.jit
def sequence_bounds(cu_seqlens: cute.Tensor, n: Int32, dense_len: Int32, total_tokens: Int32,
                    varlen: cutlass.Boolean):
    """[bos, eos) of sequence n, clamped into [0, total_tokens] with eos >= bos, so that a
    malformed cu_seqlens can give wrong results but never an out-of-bounds access."""
    bos = n * dense_len
    eos = bos + dense_len
    if varlen:
        bos = cu_seqlens[n]
        eos = cu_seqlens[n + 1]
    bos = cutlass.min(cutlass.max(bos, 0), total_tokens)
    eos = cutlass.min(cutlass.max(eos, bos), total_tokens)
    return bos, eos


@cute.jit
def warp_sum(x: Float32) -> Float32:
    for offset in cutlass.range_constexpr(5):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << (4 - offset))
    return x


@cute.kernel
def prepare_chunks_kernel(
    q: cute.Tensor,          # [T, H, 128] bf16
    k: cute.Tensor,          # [T, H, 128] bf16
    v: cute.Tensor,          # [T, HV, 128] bf16
    g: cute.Tensor,          # [T, HV, 128] bf16
    beta: cute.Tensor,       # [T, HV] bf16
    a_log: cute.Tensor,      # [HV] fp32
    dt_bias: cute.Tensor,    # [HV, 128] fp32
    cu_seqlens: cute.Tensor,  # [N + 1] int32 (read only with FLAG_VARLEN)
    neg_kw_out: cute.Tensor,  # [R * 16, 128] bf16, R = slots * HV
    qd_out: cute.Tensor,      # [R * 16, 128] bf16
    kr_out: cute.Tensor,      # [R * 16, 128] bf16
    mqk_out: cute.Tensor,     # [R * 16, 16] bf16
    vw_out: cute.Tensor,      # [R * 16, 128] fp32
    decay_out: cute.Tensor,   # [R, 128] fp32
    num_seqs: Int32,
    dense_len: Int32,
    flags: Int32,
    scale: Float32,
    lower_bound: Float32,
):
    d, _, _ = cute.arch.thread_idx()
    slot, hv, _ = cute.arch.block_idx()
    warp = d // 32
    lane = d % 32
    total_tokens = q.shape[0]
    num_q_heads = q.shape[1]
    num_v_heads = v.shape[1]
    hq = hv // (num_v_heads // num_q_heads)
    varlen = (flags & FLAG_VARLEN) != 0

    smem = cutlass.utils.SmemAllocator()
    pitch = cute.make_layout((CHUNK, HEAD_DIM), stride=(ROW_PITCH, 1))
    s_left = smem.allocate_tensor(Float32, pitch, 16)    # k (or k * 2^(G - ref))
    s_query = smem.allocate_tensor(Float32, pitch, 16)   # q (or q * 2^(G - ref))
    s_right = smem.allocate_tensor(Float32, pitch, 16)   # k (or k * 2^(ref - G))
    s_cum = smem.allocate_tensor(Float32, pitch, 16)     # G, slow path only
    s_lower = smem.allocate_tensor(Float32, cute.make_layout((CHUNK, CHUNK + 1), stride=(CHUNK + 1, 1)), 16)
    s_w = smem.allocate_tensor(Float32, cute.make_layout((CHUNK, CHUNK + 1), stride=(CHUNK + 1, 1)), 16)
    s_beta = smem.allocate_tensor(Float32, cute.make_layout(CHUNK), 16)
    s_norm = smem.allocate_tensor(Float32, cute.make_layout((2, WARPS, CHUNK), stride=(WARPS * CHUNK, CHUNK, 1)), 16)
    s_fast = smem.allocate_tensor(Int32, cute.make_layout(WARPS), 16)

    # Sequence owning this slot: the largest n with base(n) = bos_n // 16 + n <= slot.
    lo = Int32(0)
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        mid_bos, _ = sequence_bounds(cu_seqlens, mid, dense_len, total_tokens, varlen)
        if mid_bos // CHUNK + mid <= slot:
            lo = mid
        else:
            hi = mid - 1
    bos, eos = sequence_bounds(cu_seqlens, lo, dense_len, total_tokens, varlen)
    chunk = slot - (bos // CHUNK + lo)
    valid = eos - bos - chunk * CHUNK
    if valid > 0:
        valid = cutlass.min(valid, CHUNK)
        tok0 = bos + chunk * CHUNK
        row0 = (slot * num_v_heads + hv) * CHUNK

        q_r = cute.make_rmem_tensor(cute.make_layout(CHUNK), Float32)
        k_r = cute.make_rmem_tensor(cute.make_layout(CHUNK), Float32)
        v_r = cute.make_rmem_tensor(cute.make_layout(CHUNK), Float32)
        cum = cute.make_rmem_tensor(cute.make_layout(CHUNK), Float32)
        kd_r = cute.make_rmem_tensor(cute.make_layout(CHUNK), Float32)

        gate_mode = (flags >> GATE_MODE_SHIFT) & 3
        a_exp = Float32(1.0)
        if gate_mode == 1 or gate_mode == 2:
            a_exp = cute.math.exp(a_log[hv])
        bias = Float32(0.0)
        if gate_mode != 0:
            bias = dt_bias[hv, d]

        # Loads (tokens past the sequence end read as zeros and a zero decay).
        for i in cutlass.range_constexpr(CHUNK):
            q_r[i] = Float32(0.0)
            k_r[i] = Float32(0.0)
            v_r[i] = Float32(0.0)
            cum[i] = Float32(0.0)
            if i < valid:
                t = tok0 + i
                q_r[i] = q[t, hq, d].to(Float32)
                k_r[i] = k[t, hq, d].to(Float32)
                v_r[i] = v[t, hv, d].to(Float32)
                x = g[t, hv, d].to(Float32)
                ln_decay = x
                if gate_mode == 1:
                    z = x + bias
                    softplus = z
                    if z <= Float32(20.0):
                        softplus = cute.math.log1p(cute.math.exp(z))
                    ln_decay = -a_exp * softplus
                elif gate_mode >= 2:
                    z = (x + bias) * a_exp
                    ln_decay = lower_bound / (Float32(1.0) + cute.math.exp(-z))
                cum[i] = ln_decay * Float32(LOG2E)
        if d < CHUNK:
            b = Float32(0.0)
            if d < valid:
                b = beta[tok0 + d, hv].to(Float32)
                if (flags & FLAG_BETA_SIGMOID) != 0:
                    b = Float32(1.0) / (Float32(1.0) + cute.math.exp(-b))
            s_beta[d] = b

        # Inclusive cumsum of the log2 decay; tokens past the end add nothing.
        for i in cutlass.range_constexpr(1, CHUNK):
            cum[i] = cum[i] + cum[i - 1]
        g_last = cum[CHUNK - 1]

        if (flags & FLAG_QK_L2NORM) != 0:
            for i in cutlass.range_constexpr(CHUNK):
                sq = warp_sum(q_r[i] * q_r[i])
                sk = warp_sum(k_r[i] * k_r[i])
                if lane == 0:
                    s_norm[0, warp, i] = sq
                    s_norm[1, warp, i] = sk
            cute.arch.sync_threads()
            for i in cutlass.range_constexpr(CHUNK):
                nq = s_norm[0, 0, i] + s_norm[0, 1, i] + s_norm[0, 2, i] + s_norm[0, 3, i]
                nk = s_norm[1, 0, i] + s_norm[1, 1, i] + s_norm[1, 2, i] + s_norm[1, 3, i]
                q_r[i] = q_r[i] * cute.math.rsqrt(nq + Float32(1e-6))
                k_r[i] = k_r[i] * cute.math.rsqrt(nk + Float32(1e-6))

        # Whole-CTA vote: factorized pair products are safe iff every channel's chunk decay
        # stays within FAST_PATH_RANGE.
        fast_here = cute.arch.vote_all_sync(g_last >= Float32(-FAST_PATH_RANGE))
        if lane == 0:
            s_fast[warp] = Int32(1) if fast_here else Int32(0)
        cute.arch.sync_threads()
        fast = (s_fast[0] + s_fast[1] + s_fast[2] + s_fast[3]) == WARPS

        ref = g_last * Float32(0.5)
        for i in cutlass.range_constexpr(CHUNK):
            if fast:
                up = cute.math.exp2(cum[i] - ref, fastmath=True)
                down = cute.math.exp2(ref - cum[i], fastmath=True)
                s_left[i, d] = k_r[i] * up
                s_query[i, d] = q_r[i] * up
                s_right[i, d] = k_r[i] * down
            else:
                s_left[i, d] = k_r[i]
                s_query[i, d] = q_r[i]
                s_right[i, d] = k_r[i]
                s_cum[i, d] = cum[i]
        cute.arch.sync_threads()

        # Pair products: thread (i, j0) computes rows i, columns j0 and j0 + 8.
        pi = d // 8
        for half in cutlass.range_constexpr(2):
            pj = d % 8 + half * 8
            acc_kk = Float32(0.0)
            acc_qk = Float32(0.0)
            if pj <= pi:
                if fast:
                    for e in cutlass.range(HEAD_DIM, unroll=8):
                        r = s_right[pj, e]
                        acc_kk = acc_kk + s_left[pi, e] * r
                        acc_qk = acc_qk + s_query[pi, e] * r
                else:
                    for e in cutlass.range(HEAD_DIM, unroll=8):
                        r = s_right[pj, e] * cute.math.exp2(s_cum[pi, e] - s_cum[pj, e], fastmath=True)
                        acc_kk = acc_kk + s_left[pi, e] * r
                        acc_qk = acc_qk + s_query[pi, e] * r
            lower = Float32(0.0)
            if pj < pi:
                lower = acc_kk * s_beta[pi]
            s_lower[pi, pj] = lower
            mqk_out[row0 + pi, pj] = (acc_qk * scale).to(cutlass.BFloat16)
        cute.arch.sync_threads()

        # W = (I + L)^-1 diag(beta) by forward substitution; lane c of warp 0 owns column c.
        if d < CHUNK:
            col = cute.make_rmem_tensor(cute.make_layout(CHUNK), Float32)
            for i in cutlass.range_constexpr(CHUNK):
                x = Float32(1.0) if d == i else Float32(0.0)
                for j in cutlass.range_constexpr(i):
                    x = x - s_lower[i, j] * col[j]
                col[i] = x
            b = s_beta[d]
            for i in cutlass.range_constexpr(CHUNK):
                s_w[i, d] = col[i] * b
        cute.arch.sync_threads()

        # Per-channel outputs: d owns column d of every [16, 128] operand.
        for j in cutlass.range_constexpr(CHUNK):
            kd_r[j] = k_r[j] * cute.math.exp2(cum[j], fastmath=True)
        for i in cutlass.range_constexpr(CHUNK):
            kw = Float32(0.0)
            vw = Float32(0.0)
            for j in cutlass.range_constexpr(i + 1):
                w = s_w[i, j]
                kw = kw + w * kd_r[j]
                vw = vw + w * v_r[j]
            row = row0 + i
            neg_kw_out[row, d] = (-kw).to(cutlass.BFloat16)
            vw_out[row, d] = vw
            qd_out[row, d] = (scale * q_r[i] * cute.math.exp2(cum[i], fastmath=True)).to(cutlass.BFloat16)
            kr_out[row, d] = (k_r[i] * cute.math.exp2(g_last - cum[i], fastmath=True)).to(cutlass.BFloat16)
        decay_out[slot * num_v_heads + hv, d] = cute.math.exp2(g_last, fastmath=True)
