"""KDA prefill, segmented calls: `combine_segments`, every segment's start state.

Intracard context parallelism (Phase.SUMMARY, jax_kda/kernel.py) cuts each of N sequences into S
segments. The summary pass of the recurrence writes, per packed segment i = n S + j and value head,
the segment's zero-start state B_i and its transition M_i (K-first fp32, into the workspace). This
kernel, launched right after it in the same call, walks each sequence's segments in order:

    start_0     = initial_state[n]           (zeros without Flag.HAS_INITIAL_STATE)
    start_{j+1} = M_{nS+j} start_j + B_{nS+j}     j = 0 .. S - 2

in fp32 on CUDA cores, and writes start_0 .. start_{S-1} for the apply pass to start from.

One CTA per (block of V columns, value head, sequence), 256 threads; thread t owns rows t // 4
and t // 4 + 64 and a quarter of the block's columns. Two compiled variants: 16-column blocks (8
accumulators and 1 024 FFMAs per thread and step) and 8-column blocks (4 and 512, twice the
CTAs); the launcher takes 8 columns when all their CTAs fit on the SMs at one per SM, and 16
otherwise (measured below). A step reads all of M_j (64 KB) and the block of start_j; nothing of
M depends on the states, so M is streamed through shared memory ahead of the arithmetic:

- M_j is cut into four column chunks M_j[:, 32 q .. 32 q + 31] (16 KB); the chunks of all steps
  form one stream that `cp.async` copies into a ring of four slots, three chunks ahead of the one
  being multiplied (chunk q of every step lands in slot q). Rows are padded to 36 floats so that
  the 8 rows a warp reads at once fall in distinct banks.
- B_{j+1} is loaded into registers at the start of step j and becomes step j+1's accumulator.
- start_j's block sits in shared memory [128 k][block columns], double-buffered by step parity: step j reads one
  buffer while its result start_{j+1} is written into the other.

Measured on the H200 (benchmarks/sweep_segments.py, combine kernel time per call):

| variant | HV 8, 16 segments (64 / 128 CTAs) | HV 12, 8 segments (96 / 192) | HV 32, 4 segments (256 / 512) |
|---|---|---|---|
| M read from global inside the step, 16 columns | 108 us (7.2 per step) | 51 | |
| ring, 16 columns | 55 (3.7 per step) | 28 (4.0) | 25 |
| ring, 8 columns | 41 (2.7 per step) | 34 (4.9) | 33 |

Without the ring each of a step's 32 load rounds waited out the L2 latency. With it, a step is
issue- and latency-bound (two warps per scheduler do not hide the shared-memory latency of the
FFMA chains; ~940 instructions per thread and step for 512 FFMAs at 8 columns, ~1 440 for 1 024
at 16): 8-column blocks win while they leave SMs idle otherwise, 16-column blocks once CTAs
share SMs.

Layouts (fp32, [.., K, V] with V contiguous):
    bm             [2 N S, HV, 128, 128]   entry 2 i: B_i; entry 2 i + 1: M_i (M[k, k'] at [.., k, k'])
    initial_state  [N, HV, 128, 128]       read with Flag.HAS_INITIAL_STATE
    starts         [N S, HV, 128, 128]
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import LoadCacheMode, cpasync

from kda_contract import HEAD_DIM, Flag

THREADS = 256
V_BLOCKS = (8, 16)            # the two compiled variants' columns per CTA
HALF = HEAD_DIM // 2          # a thread's second row is its first + HALF
VEC = 4                       # floats per 16-byte copy of M
K_CHUNK = 32                  # columns of M per streamed chunk
CHUNKS = HEAD_DIM // K_CHUNK  # chunks per step; also the ring's slot count (chunk q -> slot q)
M_PITCH = K_CHUNK + 4         # floats per row of a slot: 144 B, so 8 rows x 16 B hit distinct banks
PIECES_PER_ROW = K_CHUNK // VEC
COPIES = HEAD_DIM * PIECES_PER_ROW // THREADS  # 16-byte copies per thread per chunk


def shared_memory_bytes(v_block: int) -> int:
    """Shared memory of one CTA: the ring of M chunks and the two start-state blocks."""
    return CHUNKS * HEAD_DIM * M_PITCH * 4 + 2 * HEAD_DIM * v_block * 4


@cute.jit
def issue_chunk(atom: cute.CopyAtom, bm: cute.Tensor, s_ring: cute.Tensor, seg0: Int32, hv: Int32,
                chunk: Int32, num_chunks: Int32, slot: cutlass.Constexpr, tidx: Int32):
    """cp.async chunk `chunk` of the stream (M of segment seg0 + chunk // CHUNKS, columns
    32 (chunk % CHUNKS) ..) into ring slot `slot`, then commit a group (an empty one past the end,
    so that every thread's group count stays in step with the chunk index)."""
    if chunk < num_chunks:
        m_index = 2 * (seg0 + chunk // CHUNKS) + 1
        col0 = (chunk % CHUNKS) * PIECES_PER_ROW
        for i in cutlass.range_constexpr(COPIES):
            piece = tidx + THREADS * i
            row = piece // PIECES_PER_ROW
            col = piece % PIECES_PER_ROW
            cute.copy(atom, cute.local_tile(bm[m_index, hv, row, None], (VEC,), (col0 + col,)),
                      cute.local_tile(s_ring[slot, row, None], (VEC,), (col,)))
    cute.arch.cp_async_commit_group()


@cute.kernel
def combine_segments_kernel(bm: cute.Tensor, initial_state: cute.Tensor, starts: cute.Tensor,
                            num_segments: Int32, flags: Int32, v_block: cutlass.Constexpr):
    cols = v_block // 4  # columns per thread
    tidx, _, _ = cute.arch.thread_idx()
    block, hv, n = cute.arch.block_idx()
    smem = cutlass.memory.SmemAllocator()
    s_ring = smem.allocate_tensor(
        Float32, cute.make_layout((CHUNKS, HEAD_DIM, M_PITCH), stride=(HEAD_DIM * M_PITCH, M_PITCH, 1)), 16)
    s_state = smem.allocate_tensor(
        Float32, cute.make_layout((2, HEAD_DIM, v_block), stride=(HEAD_DIM * v_block, v_block, 1)), 16)
    # cp.async.cg: 16-byte copies that skip L1 (each CTA reads each byte of M once).
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(LoadCacheMode.GLOBAL), Float32, num_bits_per_copy=128)

    row = tidx // 4
    part = tidx % 4                     # this thread's columns within the block, in units of cols
    vec = block * (v_block // cols) + part  # ... and within the 128 columns
    seg0 = n * num_segments
    steps = num_segments - 1
    num_chunks = steps * CHUNKS

    # The stream's first three chunks (step 0's columns 0..95), before anything waits.
    for c in cutlass.range_constexpr(CHUNKS - 1):
        issue_chunk(atom, bm, s_ring, seg0, hv, Int32(c), num_chunks, c, tidx)

    acc = [cute.make_rmem_tensor(cute.make_layout(cols), Float32) for _ in range(2)]
    b_next = [cute.make_rmem_tensor(cute.make_layout(cols), Float32) for _ in range(2)]
    for r in cutlass.range_constexpr(2):
        acc[r].fill(0.0)
        if (flags & Flag.HAS_INITIAL_STATE) != 0:
            cute.autovec_copy(cute.local_tile(initial_state[n, hv, row + r * HALF, None], (cols,), (vec,)), acc[r])
        # start_0: to global for the apply pass, to shared memory for step 0.
        cute.autovec_copy(acc[r], cute.local_tile(starts[seg0, hv, row + r * HALF, None], (cols,), (vec,)))
        cute.autovec_copy(acc[r], cute.local_tile(s_state[0, row + r * HALF, None], (cols,), (part,)))
        if steps > 0:
            cute.autovec_copy(cute.local_tile(bm[2 * seg0, hv, row + r * HALF, None], (cols,), (vec,)), b_next[r])

    for j in cutlass.range(steps, unroll=1):
        buf = j % 2
        # start_{j+1} accumulates onto B_j; B_{j+1} is loaded now and waited for a step later.
        for r in cutlass.range_constexpr(2):
            for c in cutlass.range_constexpr(cols):
                acc[r][c] = b_next[r][c]
            if j + 1 < steps:
                cute.autovec_copy(cute.local_tile(bm[2 * (seg0 + j + 1), hv, row + r * HALF, None], (cols,), (vec,)),
                                  b_next[r])
        for q in cutlass.range_constexpr(CHUNKS):
            chunk = j * CHUNKS + q
            cute.arch.cp_async_wait_group(CHUNKS - 2)  # this thread's copies of `chunk` have landed
            # ... and everyone's; every thread is also done with the chunk before (its slot is
            # refilled next) and, at q = 0, has written its part of start_j.
            cute.arch.sync_threads()
            issue_chunk(atom, bm, s_ring, seg0, hv, chunk + CHUNKS - 1, num_chunks, (q + CHUNKS - 1) % CHUNKS, tidx)
            for kb in cutlass.range_constexpr(K_CHUNK // VEC):
                m = [cute.make_rmem_tensor(cute.make_layout(VEC), Float32) for _ in range(2)]
                for r in cutlass.range_constexpr(2):
                    cute.autovec_copy(cute.local_tile(s_ring[q, row + r * HALF, None], (VEC,), (kb,)), m[r])
                for i in cutlass.range_constexpr(VEC):
                    s = cute.make_rmem_tensor(cute.make_layout(cols), Float32)
                    cute.autovec_copy(cute.local_tile(s_state[buf, q * K_CHUNK + kb * VEC + i, None], (cols,), (part,)), s)
                    for r in cutlass.range_constexpr(2):
                        for c in cutlass.range_constexpr(cols):
                            acc[r][c] = acc[r][c] + m[r][i] * s[c]
        # start_{j+1}: to global, and into the other buffer (last read in step j - 1, which every
        # thread finished before this step's first barrier).
        for r in cutlass.range_constexpr(2):
            cute.autovec_copy(acc[r], cute.local_tile(starts[seg0 + j + 1, hv, row + r * HALF, None], (cols,), (vec,)))
            cute.autovec_copy(acc[r], cute.local_tile(s_state[1 - buf, row + r * HALF, None], (cols,), (part,)))
    cute.arch.cp_async_wait_group(0)


@cute.jit
def launch(bm: cute.Tensor, initial_state: cute.Tensor, starts: cute.Tensor, num_seqs: Int32,
           num_v_heads: Int32, num_segments: Int32, flags: Int32, num_sms: Int32, stream):
    """Launches the combine for `num_seqs` sequences of `num_segments` segments (call from a
    `cute.jit` function; the caller skips it when the grid is empty). `num_sms` (the device's SM
    count) picks the variant: any value is correct."""
    narrow, wide = V_BLOCKS
    if (HEAD_DIM // narrow) * num_seqs * num_v_heads <= num_sms:
        combine_segments_kernel(bm, initial_state, starts, num_segments, flags, narrow).launch(
            grid=[HEAD_DIM // narrow, num_v_heads, num_seqs], block=[THREADS, 1, 1], stream=stream)
    else:
        combine_segments_kernel(bm, initial_state, starts, num_segments, flags, wide).launch(
            grid=[HEAD_DIM // wide, num_v_heads, num_seqs], block=[THREADS, 1, 1], stream=stream)
