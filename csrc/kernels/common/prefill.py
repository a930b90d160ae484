"""KDA prefill (K = V = 128): the ahead-of-time entry point that launches the kernels of one call.

`build/aot_compile.py` compiles `prefill` once per `kda_contract.KERNEL_EXPORTS` entry: a kernel
object's architecture, its recurrence class (`RECURRENCE` of `sm90/prefill.py` or `sm100/prefill.py`)
as a compile-time argument, and one pair of g / beta dtypes (the gate variant: only prepare_chunks
reads them). Every size is symbolic and every flag a runtime value, so one export serves every shape
and flag combination of its gate dtypes. The exported C function enqueues, on the caller's stream:

    Phase.WHOLE    prepare_chunks, then the recurrence from initial_state: o and the final state
    Phase.SUMMARY  prepare_chunks, the summary recurrence (every segment's B and M), then
                   combine_segments (every segment's start state); all into the workspace
    Phase.APPLY    the recurrence alone, from the start states in the workspace (the SUMMARY call's)

and nothing where a grid would be empty. A segmented call (SUMMARY, APPLY) runs over the
`num_sequences * num_segments` segments as one packed batch: `cu_seqlens` holds the segments'
offsets then. The recurrence reads v straight from its operand, so an APPLY call must be given the
SUMMARY call's v.

Workspace (one buffer, 16-byte aligned; `kda_contract.workspace_bytes`): with R rows (chunk slots
x value heads), the `kda_contract.WORKSPACE_REGIONS` one after the other, region r taking
R * r.bytes_per_row bytes; in a segmented call then, with P = units * HV * 65536 bytes (units =
sequences x segments), bm fp32 [2 units, HV, 128, 128] (each segment's B, M) over 2 P bytes and
starts fp32 [units, HV, 128, 128] (each segment's start state) over P bytes; last, in every call,
the unit table int32 [units, 4] (`unit_order`: the order the recurrence runs packed units in),
written by WHOLE and SUMMARY calls and read by the APPLY call after them.

Build-time only (imports the DSL).
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from kda_contract import (
    CHUNK,
    HEAD_DIM,
    SEGMENT_STATES,
    STATE_BYTES,
    WORKSPACE_BYTES_PER_ROW,
    WORKSPACE_REGIONS,
    Flag,
    Phase,
    region_offsets_per_row,
)

from common import combine_segments, prepare_chunks, unit_order

_DTYPES = {"bfloat16": cutlass.BFloat16, "float32": cutlass.Float32}


def _region(ws_bytes_ptr, byte_offset, dtype, shape):
    ptr = cute.recast_ptr(ws_bytes_ptr + cute.assume(byte_offset, divby=512), dtype=dtype)
    return cute.make_tensor(ptr, cute.make_layout(shape, stride=(shape[1], 1)))


def _states(ws_bytes_ptr, byte_offset, count, num_v_heads):
    """fp32 states [count, HV, 128, 128] (K-first, compact) at `byte_offset` of the workspace."""
    ptr = cute.recast_ptr(ws_bytes_ptr + cute.assume(byte_offset, divby=512), dtype=cutlass.Float32)
    plane = HEAD_DIM * HEAD_DIM
    return cute.make_tensor(ptr, cute.make_layout((count, num_v_heads, HEAD_DIM, HEAD_DIM),
                                                  stride=(cute.assume(cutlass.Int64(num_v_heads) * plane, divby=plane), plane, HEAD_DIM, 1)))


def _workspace_regions(workspace: cute.Tensor, rows) -> dict:
    """{region name: its [R * rows per slot, cols] tensor} over the workspace, R = `rows`."""
    rows64 = cutlass.Int64(rows)
    offsets = region_offsets_per_row()
    views = {}
    for region in WORKSPACE_REGIONS:
        extent = rows * region.rows if region.rows > 1 else rows
        views[region.name] = _region(workspace.iterator, rows64 * offsets[region.name], _DTYPES[region.dtype],
                                     (extent, region.cols))
    return views


@cute.jit
def prefill(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
            a_log: cute.Tensor, dt_bias: cute.Tensor, cu_seqlens: cute.Tensor,
            initial_state: cute.Tensor, o: cute.Tensor, final_state: cute.Tensor,
            workspace: cute.Tensor, num_sequences: Int32, num_segments: Int32, dense_len: Int32,
            flags: Int32, phase: Int32, scale: Float32, lower_bound: Float32, num_sms: Int32,
            stream: cuda.CUstream, recurrence: cutlass.Constexpr):
    """One call's launches; `recurrence` is the architecture's ChunkRecurrence subclass.

    Tensors as `compile_arguments` lays them out; `num_segments` is 1 in a WHOLE call. The
    summary call's initial_state has one entry per sequence, the apply call's final_state one
    per segment."""
    num_v_heads = v.shape[1]
    units = num_sequences * num_segments  # the recurrence's sequences: segments in SUMMARY / APPLY
    rows = (q.shape[0] // CHUNK + units) * num_v_heads
    ws = _workspace_regions(workspace, rows)
    neg_kw, qd, kr, mqk = ws["neg_kw"], ws["qd"], ws["kr"], ws["mqk"]
    w_hi, w_lo, decay = ws["w_hi"], ws["w_lo"], ws["decay"]
    # Segmented calls: per-segment B and M, then start states, after the regions above; the unit
    # table last.
    seg_base = cutlass.Int64(rows) * WORKSPACE_BYTES_PER_ROW
    seg_states = cutlass.Int64(units) * num_v_heads * STATE_BYTES
    table_base = seg_base
    if num_segments > 1:
        table_base = seg_base + SEGMENT_STATES * seg_states
    table = unit_order.unit_table(workspace.iterator, table_base, units)
    ordered = unit_order.units_ordered(flags, units)
    # The order first (it reads cu_seqlens alone), so that it runs beside prepare's start.
    if units * num_v_heads > 0 and ordered and phase != Phase.APPLY:
        unit_order.launch(cu_seqlens, table, units, q.shape[0], stream)
    # Prepare runs only for the recurrence's sake: with no sequence (N = 0, cu_seqlens = [0]) its
    # rows hold T's slots but nothing reads them, and its sequence lookup would read cu_seqlens[1].
    if rows > 0 and units > 0 and phase != Phase.APPLY:
        # Persistent: as many CTAs as fit at once (num_sms: the device's SM count), each striding
        # over the rows.
        per_sm = prepare_chunks.CTAS_PER_SM[g.element_type.width // 8]
        ctas = cutlass.min(rows, cutlass.max(num_sms, 1) * per_sm)
        # neg_kw leaves each CTA's shared memory by TMA (prepare_chunks.NEG_KW_STAGING_OFFSET).
        tma_neg_kw, g_neg_kw = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), neg_kw,
            cute.slice_(prepare_chunks.neg_kw_staging_layout(), (None, None, 0)), (CHUNK, HEAD_DIM))
        prepare_chunks.prepare_chunks_kernel(
            q, k, g, beta, a_log, dt_bias, cu_seqlens, tma_neg_kw, g_neg_kw, qd, kr, mqk, w_hi, w_lo, decay,
            units, dense_len, flags, scale, lower_bound,
        ).launch(grid=[ctas, 1, 1], block=[prepare_chunks.THREADS, 1, 1], stream=stream,
                 # The largest carveout and a register bound: the persistent grid assumes per_sm
                 # CTAs fit at once (prepare_chunks.CTAS_PER_SM).
                 preferred_smem_carveout=100, min_blocks_per_mp=per_sm)
    if units * num_v_heads > 0:
        if phase == Phase.SUMMARY:
            # The summary pass is its own compiled kernel (no runtime branches in the ordinary
            # one's per-chunk loop); it stores B and M as its "final states".
            bm = _states(workspace.iterator, seg_base, 2 * units, num_v_heads)
            starts = _states(workspace.iterator, seg_base + (SEGMENT_STATES - 1) * seg_states, units, num_v_heads)
            _launch_recurrence(recurrence, True, ordered, table, neg_kw, qd, kr, mqk, v, w_hi, w_lo, decay,
                               cu_seqlens, initial_state, o, bm, units, dense_len, flags, stream)
            combine_segments.launch(bm, initial_state, starts, num_sequences, num_v_heads, num_segments,
                                    flags, num_sms, stream)
        elif phase == Phase.APPLY:
            starts = _states(workspace.iterator, seg_base + (SEGMENT_STATES - 1) * seg_states, units, num_v_heads)
            _launch_recurrence(recurrence, False, ordered, table, neg_kw, qd, kr, mqk, v, w_hi, w_lo, decay,
                               cu_seqlens, starts, o, final_state, units, dense_len, flags | Flag.HAS_INITIAL_STATE,
                               stream)
        else:
            _launch_recurrence(recurrence, False, ordered, table, neg_kw, qd, kr, mqk, v, w_hi, w_lo, decay,
                               cu_seqlens, initial_state, o, final_state, units, dense_len, flags, stream)


@cute.jit
def _launch_recurrence(recurrence: cutlass.Constexpr, summary: cutlass.Constexpr, ordered, table: cute.Tensor,
                       neg_kw: cute.Tensor, qd: cute.Tensor, kr: cute.Tensor, mqk: cute.Tensor, v: cute.Tensor,
                       w_hi: cute.Tensor, w_lo: cute.Tensor, decay: cute.Tensor, cu_seqlens: cute.Tensor,
                       initial_state: cute.Tensor, o: cute.Tensor, final_state: cute.Tensor, units: Int32,
                       dense_len: Int32, flags: Int32, stream):
    """The recurrence over `units`: its ordered variant with the unit table in a call that orders its
    units (`ordered`: the caller's input is packed), else the plain kernel, which takes no table."""
    if ordered:
        recurrence(summary=summary, ordered=True).launch(
            neg_kw, qd, kr, mqk, v, w_hi, w_lo, decay, cu_seqlens, table, initial_state, o, final_state, units,
            dense_len, flags, stream)
    else:
        recurrence(summary=summary).launch(
            neg_kw, qd, kr, mqk, v, w_hi, w_lo, decay, cu_seqlens, None, initial_state, o, final_state, units,
            dense_len, flags, stream)

def compile_arguments(recurrence, gates) -> tuple:
    """The arguments of `cute.compile(prefill, ...)` for one export: every size symbolic, so one
    object serves all; g and beta in the dtypes of `gates` (a `kda_contract.GateDtypes`)."""
    tokens, q_heads, v_heads, seqs, seqs_plus_one = (cute.sym_int32() for _ in range(5))
    ws_len = cute.sym_int64()
    bf16, f32 = cutlass.BFloat16, cutlass.Float32

    def tensor(dtype, shape):
        order = tuple(reversed(range(len(shape))))
        return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=16)

    return (
        tensor(bf16, (tokens, q_heads, HEAD_DIM)),               # q
        tensor(bf16, (tokens, q_heads, HEAD_DIM)),               # k
        tensor(bf16, (tokens, v_heads, HEAD_DIM)),               # v
        tensor(_DTYPES[gates.g], (tokens, v_heads, HEAD_DIM)),   # g
        tensor(_DTYPES[gates.beta], (tokens, v_heads)),          # beta
        tensor(f32, (v_heads,)),                                 # A_log
        tensor(f32, (v_heads, HEAD_DIM)),                        # dt_bias
        tensor(cutlass.Int32, (seqs_plus_one,)),                 # cu_seqlens
        tensor(f32, (seqs, v_heads, HEAD_DIM, HEAD_DIM)),        # initial_state
        tensor(bf16, (tokens, v_heads, HEAD_DIM)),               # o
        tensor(f32, (seqs, v_heads, HEAD_DIM, HEAD_DIM)),        # final_state
        tensor(cutlass.Uint8, (ws_len,)),                        # workspace
        Int32(1), Int32(1), Int32(0), Int32(0), Int32(int(Phase.WHOLE)),  # num_sequences, num_segments, dense_len, flags, phase
        Float32(1.0), Float32(-5.0), Int32(132), make_fake_stream(),  # scale, lower_bound, num_sms, stream
        recurrence,
    )
