"""KDA prefill, packed batches: `order_units`, the recurrence's units longest first.

The recurrence runs one CTA per (V slice, value head, unit), a unit being a sequence (or, in a
segmented call, a segment of one), and its grid's z index walks the units. A GPU starts blocks in
index order, so in cu_seqlens order a long sequence that comes late in a mixed batch starts when
the SMs are already full, and the kernel ends with that one sequence's heads running alone: the
tail of the kernel is one long unit. Started longest first (the LPT rule), the long units overlap
with the short ones and the short ones fill the end.

This kernel writes the order as a table in the workspace, one 16-byte entry per unit (int32
unit, bos, eos, 0, bounds clamped as `sequence_bounds` clamps them), at the unit's rank: units
with more chunks first, equal counts in index order. The rank is a permutation of the units, so
every unit is run exactly once, and it depends on the lengths alone, so the results are bitwise
those of index order (each CTA's work is unchanged; only when it starts changes). The recurrence's
block z reads entry z (`units_ordered`): calls of at most UNIT_ORDER_MAX_UNITS units whose
caller passed packed sequences (Flag.ORDER_UNITS). Dense batches are all one length, and a
segmented call of dense input has segments of one length (each sequence's last may be shorter):
both keep index order without a table, on the plain recurrence.

One thread per unit, THREADS a CTA: each CTA loads every unit's chunk count into shared memory
(at most UNIT_ORDER_MAX_UNITS ints), then each thread counts the units ranked before its own
(O(units) shared-memory reads a thread, ~1 000 at the limit).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from kda_contract import CHUNK, UNIT_ORDER_MAX_UNITS, UNIT_TABLE_ENTRY_BYTES, Flag

from common.sequences import sequence_bounds

THREADS = 128
ENTRY_INTS = UNIT_TABLE_ENTRY_BYTES // 4  # unit, bos, eos, 0
assert ENTRY_INTS == 4


@cute.jit
def units_ordered(flags: Int32, units: Int32):
    """Whether the recurrence takes its units from the table: packed calls that ask for the order
    (ORDER_UNITS: the caller's input is packed) of at most UNIT_ORDER_MAX_UNITS units (the table
    kernel's shared memory holds that many counts)."""
    order = int(Flag.VARLEN | Flag.ORDER_UNITS)
    return ((flags & order) == order) & (units <= UNIT_ORDER_MAX_UNITS)


def unit_table(ws_bytes_ptr, byte_offset, units):
    """The table, int32 [units, 4], at `byte_offset` (a multiple of 16) of the workspace."""
    ptr = cute.recast_ptr(ws_bytes_ptr + cute.assume(byte_offset, divby=16), dtype=Int32)
    return cute.make_tensor(ptr, cute.make_layout((units, ENTRY_INTS), stride=(ENTRY_INTS, 1)))


@cute.kernel
def order_units_kernel(cu_seqlens: cute.Tensor, table: cute.Tensor, units: Int32, total_tokens: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    smem = cutlass.utils.SmemAllocator()
    s_chunks = smem.allocate_tensor(Int32, cute.make_layout(UNIT_ORDER_MAX_UNITS), 16)
    for i in cutlass.range(tidx, units, THREADS, unroll=1):
        bos, eos = sequence_bounds(cu_seqlens, i, Int32(0), total_tokens, True)
        s_chunks[i] = (eos - bos + CHUNK - 1) // CHUNK
    cute.arch.sync_threads()
    u = bidx * THREADS + tidx
    if u < units:
        mine = s_chunks[u]
        rank = Int32(0)
        for w in cutlass.range(units, unroll=4):
            c = s_chunks[w]
            rank = rank + cutlass.select_((c > mine) | ((c == mine) & (w < u)), Int32(1), Int32(0))
        bos, eos = sequence_bounds(cu_seqlens, u, Int32(0), total_tokens, True)
        entry = cute.make_rmem_tensor(cute.make_layout(ENTRY_INTS), Int32)
        entry[0] = u
        entry[1] = bos
        entry[2] = eos
        entry[3] = Int32(0)
        cute.autovec_copy(entry, table[rank, None])


@cute.jit
def launch(cu_seqlens: cute.Tensor, table: cute.Tensor, units: Int32, total_tokens: Int32, stream):
    """Writes the table of `units` packed units (call from a `cute.jit` function, only where
    `units_ordered` holds and units > 0)."""
    order_units_kernel(cu_seqlens, table, units, total_tokens).launch(
        grid=[(units + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream)
