"""KDA prefill, segmented calls: `combine_segments`, every segment's start state.

Intracard context parallelism (jax_kda/context_parallel.py) cuts each of N sequences into S
segments. The summary pass of the recurrence writes, per packed segment i = n S + j and value head,
the segment's zero-start state B_i and its transition M_i (K-first fp32, into the workspace). This
kernel, launched right after it in the same call, walks each sequence's segments in order:

    start_0     = initial_state[n]           (zeros without FLAG_HAS_INITIAL_STATE)
    start_{j+1} = M_{nS+j} start_j + B_{nS+j}     j = 0 .. S - 2

in fp32 on CUDA cores, and writes start_0 .. start_{S-1} for the apply pass to start from. It
replaces a combine in XLA whose S - 1 dependent batched matmuls cost ~9 us each on the H200.

One CTA per (16-column block of V, value head, sequence): 256 threads, thread t owns rows t // 4
and t // 4 + 64 and columns 4 (t % 4) .. 4 (t % 4) + 3 of the block (8 fp32 values in
registers). The current start is staged in shared memory [128 k][16 v] because every output row
reads all of its rows. Per step a thread reads its two rows of M (2 x 512 B) and does 1 024 FFMAs.

Layouts (fp32, [.., K, V] with V contiguous):
    bm             [2 N S, HV, 128, 128]   entry 2 i: B_i; entry 2 i + 1: M_i (M[k, k'] at [.., k, k'])
    initial_state  [N, HV, 128, 128]       read with FLAG_HAS_INITIAL_STATE
    starts         [N S, HV, 128, 128]
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from sm90.prepare_chunks import FLAG_HAS_INITIAL_STATE

HEAD_DIM = 128
THREADS = 256
V_BLOCK = 16
BLOCKS = HEAD_DIM // V_BLOCK  # CTAs per (value head, sequence)
HALF = HEAD_DIM // 2          # a thread's second row is its first + HALF
VEC = 4                       # columns per thread (one 16-byte access)


def shared_memory_bytes() -> int:
    """Shared memory of one CTA: the current start state's block [128, 16] fp32."""
    return HEAD_DIM * V_BLOCK * 4


@cute.kernel
def combine_segments_kernel(bm: cute.Tensor, initial_state: cute.Tensor, starts: cute.Tensor,
                            num_segments: Int32, flags: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    v_block, hv, n = cute.arch.block_idx()
    smem = cutlass.memory.SmemAllocator()
    s_state = smem.allocate_tensor(Float32, cute.make_layout((HEAD_DIM, V_BLOCK), stride=(V_BLOCK, 1)), 16)

    row = tidx // VEC
    part = tidx % VEC                   # this thread's 4 columns within the block
    vec = v_block * (V_BLOCK // VEC) + part  # ... and within the 128 columns, in units of 4
    acc = [cute.make_rmem_tensor(cute.make_layout(VEC), Float32) for _ in range(2)]
    for r in cutlass.range_constexpr(2):
        acc[r].fill(0.0)
        if (flags & FLAG_HAS_INITIAL_STATE) != 0:
            cute.autovec_copy(cute.local_tile(initial_state[n, hv, row + r * HALF, None], (VEC,), (vec,)), acc[r])

    for j in cutlass.range(num_segments, unroll=1):
        seg = n * num_segments + j
        # start_j: to global for the apply pass, and to shared memory for the next product.
        for r in cutlass.range_constexpr(2):
            cute.autovec_copy(acc[r], cute.local_tile(starts[seg, hv, row + r * HALF, None], (VEC,), (vec,)))
            cute.autovec_copy(acc[r], cute.local_tile(s_state[row + r * HALF, None], (VEC,), (part,)))
        if j + 1 < num_segments:
            # start_{j+1} = B_j + M_j start_j, accumulated onto B_j in increasing k'. B_j does not
            # depend on start_j: its load is issued before the barrier.
            for r in cutlass.range_constexpr(2):
                cute.autovec_copy(cute.local_tile(bm[2 * seg, hv, row + r * HALF, None], (VEC,), (vec,)), acc[r])
        cute.arch.sync_threads()
        if j + 1 < num_segments:
            for kb in cutlass.range(HEAD_DIM // VEC, unroll=4):
                m = [cute.make_rmem_tensor(cute.make_layout(VEC), Float32) for _ in range(2)]
                for r in cutlass.range_constexpr(2):
                    cute.autovec_copy(cute.local_tile(bm[2 * seg + 1, hv, row + r * HALF, None], (VEC,), (kb,)), m[r])
                for i in cutlass.range_constexpr(VEC):
                    s = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
                    cute.autovec_copy(cute.local_tile(s_state[kb * VEC + i, None], (VEC,), (part,)), s)
                    for r in cutlass.range_constexpr(2):
                        for c in cutlass.range_constexpr(VEC):
                            acc[r][c] = acc[r][c] + m[r][i] * s[c]
        # Every thread has read s_state before the next iteration overwrites it.
        cute.arch.sync_threads()


def launch(bm: cute.Tensor, initial_state: cute.Tensor, starts: cute.Tensor, num_seqs: Int32,
           num_v_heads: Int32, num_segments: Int32, flags: Int32, stream):
    """Launches the combine for `num_seqs` sequences of `num_segments` segments (call from a
    `cute.jit` function; the caller skips it when the grid is empty)."""
    combine_segments_kernel(bm, initial_state, starts, num_segments, flags).launch(
        grid=[BLOCKS, num_v_heads, num_seqs], block=[THREADS, 1, 1], stream=stream)
