"""KDA prefill for SM90 (K = V = 128): the AOT entry point that launches both kernels.

build/aot_compile.py compiles `prefill` (with `compile_arguments()`) for sm_90a into one object
that serves every shape and flag combination: all sizes are symbolic, every flag is a runtime bit
of `flags`. The exported C function launches `prepare_chunks` then `chunk_recurrence` on the
caller's stream, and launches nothing when the grid would be empty. With FLAG_SKIP_PREPARE the workspace already holds
prepare's operands and only the recurrence runs (the second call of a segmented prefill, see
jax_kda/context_parallel.py); it still reads v, which must be the summary call's v. Build-time
only (imports the DSL).

Workspace (one buffer, bytes, 16-byte aligned; see `workspace_bytes`):
    R = (total_tokens // 16 + num_seqs) * HV           chunk slots x value heads
    [0,        4096 R)   neg_kw  bf16 [R * 16, 128]
    [4096 R,   8192 R)   qd      bf16 [R * 16, 128]
    [8192 R,  12288 R)   kr      bf16 [R * 16, 128]
    [12288 R, 12800 R)   mqk     bf16 [R * 16, 16]
    [12800 R, 13312 R)   w_hi    bf16 [R * 16, 16]    W = (I + L)^-1 diag(beta) = w_hi + w_lo
    [13312 R, 13824 R)   w_lo    bf16 [R * 16, 16]
    [13824 R, 14336 R)   decay   fp32 [R, 128]
(v is not copied: the recurrence reads it from the input.)
and, in the two calls of a segmented prefill (num_seqs = N S segments; P = num_seqs * HV * 65536):
    [14336 R, 14336 R + 2 P)         bm      fp32 [2 num_seqs, HV, 128, 128]  per segment B, M
    [14336 R + 2 P, 14336 R + 3 P)   starts  fp32 [num_seqs, HV, 128, 128]    per segment start state

Launch order: prepare (unless FLAG_SKIP_PREPARE); then the recurrence, which is the summary kernel
followed by `combine_segments` with FLAG_SUMMARY, the ordinary kernel from `starts` with
FLAG_SKIP_PREPARE, and the ordinary kernel from `initial_state` otherwise.
"""


import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from sm90 import chunk_recurrence, combine_segments, prepare_chunks

CHUNK = 16
HEAD_DIM = 128
WORKSPACE_BYTES_PER_SLOT_HEAD = 3 * 4096 + 4 * 512
STATE_BYTES = HEAD_DIM * HEAD_DIM * 4  # one fp32 state [128, 128]
# The runtime `flags` bits are defined in prepare_chunks.py (FLAG_*); csrc/prefill.h mirrors them.

_BF16, _F32 = cutlass.BFloat16, cutlass.Float32


def workspace_bytes(total_tokens: int, num_seqs: int, num_v_heads: int, segmented: bool = False) -> int:
    """Workspace size for `total_tokens` = B * T tokens in `num_seqs` sequences (B when dense;
    segments, for the calls of a segmented prefill)."""
    size = (total_tokens // CHUNK + num_seqs) * num_v_heads * WORKSPACE_BYTES_PER_SLOT_HEAD
    return size + (3 * num_seqs * num_v_heads * STATE_BYTES if segmented else 0)


def _region(ws_bytes_ptr, byte_offset, dtype, shape):
    ptr = cute.recast_ptr(ws_bytes_ptr + cute.assume(byte_offset, divby=512), dtype=dtype)
    return cute.make_tensor(ptr, cute.make_layout(shape, stride=(shape[1], 1)))


def _states(ws_bytes_ptr, byte_offset, count, num_v_heads):
    """fp32 states [count, HV, 128, 128] (K-first, compact) at `byte_offset` of the workspace."""
    ptr = cute.recast_ptr(ws_bytes_ptr + cute.assume(byte_offset, divby=512), dtype=_F32)
    plane = HEAD_DIM * HEAD_DIM
    return cute.make_tensor(ptr, cute.make_layout((count, num_v_heads, HEAD_DIM, HEAD_DIM),
                                                  stride=(cute.assume(cutlass.Int64(num_v_heads) * plane, divby=plane), plane, HEAD_DIM, 1)))


@cute.jit
def prefill(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
            a_log: cute.Tensor, dt_bias: cute.Tensor, cu_seqlens: cute.Tensor,
            initial_state: cute.Tensor, o: cute.Tensor, final_state: cute.Tensor,
            workspace: cute.Tensor, num_seqs: Int32, dense_len: Int32, flags: Int32,
            scale: Float32, lower_bound: Float32, num_sms: Int32, stream: cuda.CUstream):
    launch_prefill(q, k, v, g, beta, a_log, dt_bias, cu_seqlens, initial_state, o, final_state,
                   workspace, num_seqs, dense_len, flags, scale, lower_bound, num_sms, stream,
                   chunk_recurrence.ChunkRecurrence)


@cute.jit
def launch_prefill(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
                   a_log: cute.Tensor, dt_bias: cute.Tensor, cu_seqlens: cute.Tensor,
                   initial_state: cute.Tensor, o: cute.Tensor, final_state: cute.Tensor,
                   workspace: cute.Tensor, num_seqs: Int32, dense_len: Int32, flags: Int32,
                   scale: Float32, lower_bound: Float32, num_sms: Int32, stream: cuda.CUstream,
                   recurrence: cutlass.Constexpr):
    """Both launches, with `recurrence` (ChunkRecurrence or a subclass) as the serial kernel."""
    num_v_heads = v.shape[1]
    slots = q.shape[0] // CHUNK + num_seqs
    rows = slots * num_v_heads
    rows64 = cutlass.Int64(rows)
    base = workspace.iterator
    neg_kw = _region(base, rows64 * 0, _BF16, (rows * CHUNK, HEAD_DIM))
    qd = _region(base, rows64 * 4096, _BF16, (rows * CHUNK, HEAD_DIM))
    kr = _region(base, rows64 * 8192, _BF16, (rows * CHUNK, HEAD_DIM))
    mqk = _region(base, rows64 * 12288, _BF16, (rows * CHUNK, CHUNK))
    w_hi = _region(base, rows64 * 12800, _BF16, (rows * CHUNK, CHUNK))
    w_lo = _region(base, rows64 * 13312, _BF16, (rows * CHUNK, CHUNK))
    decay = _region(base, rows64 * 13824, _F32, (rows, HEAD_DIM))
    if rows > 0 and (flags & prepare_chunks.FLAG_SKIP_PREPARE) == 0:
        # Persistent: as many CTAs as fit at once (num_sms: the device's SM count), each striding
        # over the rows.
        ctas = cutlass.min(rows, cutlass.max(num_sms, 1) * prepare_chunks.CTAS_PER_SM)
        prepare_chunks.prepare_chunks_kernel(
            q, k, g, beta, a_log, dt_bias, cu_seqlens, neg_kw, qd, kr, mqk, w_hi, w_lo, decay,
            num_seqs, dense_len, flags, scale, lower_bound,
        ).launch(grid=[ctas, 1, 1], block=[prepare_chunks.THREADS, 1, 1], stream=stream,
                 # The largest carveout: the persistent grid assumes CTAS_PER_SM fit at once
                 # (4 x (44 944 + 1 024 reserved) B of shared memory).
                 preferred_smem_carveout=100)
    if num_seqs * num_v_heads > 0:
        # Segmented calls (num_seqs counts segments): per-segment B and M, then start states, after
        # the seven regions above.
        seg_base = rows64 * WORKSPACE_BYTES_PER_SLOT_HEAD
        seg_states = cutlass.Int64(num_seqs) * num_v_heads * STATE_BYTES
        if (flags & prepare_chunks.FLAG_SUMMARY) != 0:
            # The summary pass is its own compiled kernel (no runtime branches in the ordinary
            # one's per-chunk loop); it stores B and M as its "final states".
            bm = _states(base, seg_base, 2 * num_seqs, num_v_heads)
            starts = _states(base, seg_base + 2 * seg_states, num_seqs, num_v_heads)
            recurrence(summary=True).launch(
                neg_kw, qd, kr, mqk, v, w_hi, w_lo, decay, cu_seqlens, initial_state, o, bm, num_seqs,
                dense_len, flags, stream)
            segments = (flags >> prepare_chunks.SEGMENTS_SHIFT) & 0xFF
            if segments > 0:
                sequences = num_seqs // segments
                if sequences > 0:
                    combine_segments.launch(bm, initial_state, starts, sequences, num_v_heads, segments,
                                            flags, num_sms, stream)
        elif (flags & prepare_chunks.FLAG_SKIP_PREPARE) != 0:
            starts = _states(base, seg_base + 2 * seg_states, num_seqs, num_v_heads)
            recurrence().launch(
                neg_kw, qd, kr, mqk, v, w_hi, w_lo, decay, cu_seqlens, starts, o, final_state, num_seqs,
                dense_len, flags | prepare_chunks.FLAG_HAS_INITIAL_STATE, stream)
        else:
            recurrence().launch(
                neg_kw, qd, kr, mqk, v, w_hi, w_lo, decay, cu_seqlens, initial_state, o, final_state, num_seqs,
                dense_len, flags, stream)


def compile_arguments() -> tuple:
    """Placeholder arguments for `cute.compile`: every size is symbolic, so one object serves all."""
    tokens, q_heads, v_heads, seqs, seqs_plus_one = (cute.sym_int32() for _ in range(5))
    ws_len = cute.sym_int64()

    def tensor(dtype, shape):
        order = tuple(reversed(range(len(shape))))
        return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=16)

    return (
        tensor(_BF16, (tokens, q_heads, HEAD_DIM)),               # q
        tensor(_BF16, (tokens, q_heads, HEAD_DIM)),               # k
        tensor(_BF16, (tokens, v_heads, HEAD_DIM)),               # v
        tensor(_BF16, (tokens, v_heads, HEAD_DIM)),               # g
        tensor(_BF16, (tokens, v_heads)),                         # beta
        tensor(_F32, (v_heads,)),                                 # A_log
        tensor(_F32, (v_heads, HEAD_DIM)),                        # dt_bias
        tensor(cutlass.Int32, (seqs_plus_one,)),                  # cu_seqlens
        tensor(_F32, (seqs, v_heads, HEAD_DIM, HEAD_DIM)),        # initial_state
        tensor(_BF16, (tokens, v_heads, HEAD_DIM)),               # o
        tensor(_F32, (seqs, v_heads, HEAD_DIM, HEAD_DIM)),        # final_state
        tensor(cutlass.Uint8, (ws_len,)),                         # workspace
        Int32(1), Int32(0), Int32(0), Float32(1.0), Float32(-5.0), Int32(132), make_fake_stream(),
    )
