"""KDA prefill, kernel 1 of 2 (every architecture): `prepare_chunks`, the token-parallel half.

Work items are (chunk slot, value head) pairs; persistent CTAs of 128 threads stride over them
(grid: up to CTAS_PER_SM per SM), prefetching the next item's raw q, k, g tiles with cp.async
into a second shared-memory stage while they process the current one. g and beta come in bf16 or
fp32 (each its own compile-time variant: the tensors' element types); they are converted to fp32
as loaded, so both give the same arithmetic from there on. In the element-wise phases a
thread owns two adjacent key channels at 8 of the 16 tokens; the 16 x 16 and 16 x 128 products run on tensor cores (warp-level
`mma.sync m16n8k8` TF32, fp32 accumulate). It turns the raw inputs of one 16-token chunk into the
operands of the serial recurrence (`recurrence.py`), all independent of the state:

    G        inclusive cumsum of the log2 decay over the chunk           (registers, fp32)
    L        strictly lower beta_i * sum_d k_i k_j 2^(G_i - G_j)          (smem, fp32)
    W        (I + L)^-1 diag(beta): TF32 in smem (for neg_kw); w_hi = bf16(W), w_lo = bf16(W - w_hi)
             [16, 16] bf16 each, B operands of  U^T = v^T w_hi^T + v^T w_lo^T + S^T neg_kw^T
             (v itself is not touched here: the recurrence reads it from the input)
    neg_kw   -W (k * 2^G)            [16, 128] bf16   B operand of  U^T = ... + S^T neg_kw^T
    qd       scale * q * 2^G         [16, 128] bf16   B operand of  O^T = S^T qd^T + ...
    kr       k * 2^(G_last - G)      [16, 128] bf16   B operand of  S^T += U^T kr
    mqk      scale q_i k_j 2^(G_i-G_j), j <= i  [16, 16] bf16   B operand of O^T += U^T mqk^T
    decay    2^G_last                [128] fp32       per-channel state decay

Exactness: every exponent used is <= 0 except in the factorized fast path, which is taken only
when the whole chunk's decay satisfies min_d G_last[d] >= -FAST_PATH_RANGE; its factors are
then taken relative to G_ref = G_last / 2 and lie within 2^(+-FAST_PATH_RANGE/2). Otherwise the
pair products use 2^(G_i - G_j) element-wise (i >= j, fp32 on CUDA cores).

Rounding (tests/kda_chunk_model.py models it exactly): the fast path's factors k 2^(G-ref),
q 2^(G-ref), k 2^(ref-G) go to the TF32 MMA as fp32 bits (the tensor core truncates them to
TF32); on both paths W and k 2^G are rounded to TF32 (round to nearest, ties away) for neg_kw;
the recurrence gets W as hi + lo bf16 halves (~16 bits). Products accumulate in fp32.

Phases per item (four CTA barriers, after the one that publishes the item's stage):
    1  q, k, g from the stage (thread (pair, half): channels 2 pair, 2 pair + 1 at tokens
       8 half .. 8 half + 7, one 4-byte load a token and tensor), gate, cumsum (one serial sum
       per channel, through a shuffle between the halves); l2-norm partial sums (16-byte loads
       of the stage's rows) and the fast-path vote                                 -> barrier
    2  l2 norms; factor tiles into smem; qd, kr to global (channel pairs: 8-byte shared and
       4-byte global stores)                                                        -> barrier
    3  pair products: warps 0-1 A_kk, warps 2-3 Mqk, warp w over channels 64 (w % 2) .. + 63
       for all 16 columns; the two warps of a product swap partial sums through the stage
       (a 64-thread named barrier) and warp w finishes columns 8 (w % 2) .. + 7       -> barrier
    4  warp 0: forward substitution for W (fp32 to smem; L's columns as 16-byte broadcast
       loads); every thread: its channels' tokens of -k 2^G in fp32, token-contiguous per
       channel (4-token units of rows 8..15 of every 16 swapped in pairs: operand_unit), over
       factor tiles 0-1 (dead after phase 3)                                       -> barrier
    5  every thread: two entries of W as hi / lo to global; W application: warp w computes
       channels 32 w .. 32 w + 31 of neg_kw = W (-k 2^G) (both rounded to TF32 as their
       fragments are loaded) into a swizzled staging tile, which warp 0 stores to the workspace
       with one TMA copy after the next item's first barrier (NEG_KW_STAGING_OFFSET)
Measured (H200, alternating A/B, benchmarks/results/h200/prepare_phases_ab.txt): taking the norm
sums from the stage and W's hi/lo and TF32 rounding off warp 0 made prepare 5-7 % faster on every
case timed (96 heads x 8K: 510 -> 476 us).

Chunk slots: sequence n (tokens [bos_n, eos_n)) owns slots base(n) + c for its chunks c, with
base(n) = bos_n // 16 + n. Slots never overlap and all lie below total_tokens // 16 + N, which
is the workspace row count (common/sequences.py). Slots that belong to no chunk are skipped.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass._mlir.dialects import arith, llvm
from cutlass.cute.nvgpu import LoadCacheMode, cpasync
# ldmatrix with a raw shared-memory pointer: `cutlass.experimental` in nvidia-cutlass-dsl 4.8.1, the
# version pyproject.toml pins (an experimental API may move in later releases).
from cutlass.experimental.primitives.nvvm_wrapper import MMALayout, ldmatrix
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils.layout import LayoutEnum
from kda_contract import CHUNK, GATE_MODE_MASK, GATE_MODE_SHIFT, HEAD_DIM, PREPARE_CTAS_PER_SM, PREPARE_THREADS, Flag, GateMode

from common.sequences import sequence_base, sequence_bounds

THREADS = PREPARE_THREADS
WARPS = THREADS // 32
LOG2E = 1.4426950408889634
FAST_PATH_RANGE = 200.0
# Factor tiles [16 tokens, 128 channels] fp32, rows padded to 132 words: the MMA fragment reads
# (8 rows x 4 columns per instruction) hit 32 different banks.
FACTOR_PITCH = HEAD_DIM + 4
# Token-contiguous tiles [128 channels, 16 tokens] and W [16, 16]: rows padded to 20 words, so
# that fragment reads (8 rows x 4 columns) and 16-byte writes of consecutive rows are conflict-free.
OPERAND_PITCH = CHUNK + 4
# In the operand tile -k 2^G, phase 4's 16-byte writes come from lanes two rows apart (a thread
# owns channels 2 pair, 2 pair + 1), and rows r and r + 8 share banks at this pitch: so rows whose
# bit OPERAND_SWAP_BIT is set (rows 8..15 of every 16) hold their 4-token units in the order u ^ 1
# (see operand_unit).
OPERAND_SWAP_BIT = 3
MMA_K = 8  # m16n8k8 TF32
# Phases 1-2: a thread owns two adjacent channels at half of the chunk's tokens; the two token
# halves of a channel pair sit HALF_WARP lanes apart in one warp.
TOKENS_PER_THREAD = CHUNK // 2
HALF_WARP = 16
# The bf16 stage tiles (q, k; g when bf16) hold the rows of tokens 8..15 with their 64-byte blocks
# swapped in pairs (byte offset b stored at b ^ HALF_SWAP_BYTES): in phase 1 a warp's two token
# halves read the same channels of rows t and t + 8, 2 KB apart, which would otherwise fall on the
# same banks (a 2-way conflict on every load). The same mapping in 16-byte copy units (8 bf16) and
# in 32-bit words (bf16 pairs): u ^ HALF_SWAP_UNITS half_swap(row), w ^ HALF_SWAP_WORDS half_swap(row).
HALF_SWAP_BYTES = 64
HALF_SWAP_UNITS = HALF_SWAP_BYTES // 16
HALF_SWAP_WORDS = HALF_SWAP_BYTES // 4

# Persistent CTAs: each walks items (chunk slot, value head) with a grid stride and prefetches
# the next item's raw q, k, g tiles (cp.async, 16 bytes per copy) while it works on the current
# one. CTAS_PER_SM[g's element bytes] of them an SM (contract.PREPARE_CTAS_PER_SM). With bf16 g five
# CTAs fit, held to 96 registers a thread by the launch bound (45 392 B of shared memory each); with
# fp32 g (53 584 B) four, at up to 128 registers. Residency also needs the CTA to name few barriers
# (phase 3). Three CTAs an SM measured 23-34 % slower than five; a sixth no faster, because the single
# input stage that made room for it cost as much (about 3 %) as it gained; the kernel is bound by
# latency, not memory (csrc/kernels/README.md, "The memory system's headroom").
CTAS_PER_SM = {2: PREPARE_CTAS_PER_SM["bfloat16"], 4: PREPARE_CTAS_PER_SM["float32"]}
# Each CTA keeps (tok0, valid) of its next ITEM_TABLE items in shared memory, one entry computed by
# each of the first ITEM_TABLE threads (fill_item_table), refilled every ITEM_TABLE items.
ITEM_TABLE = THREADS // 4
INPUT_TILES = 3       # q, k, g (v goes from the input straight to the recurrence)
INPUT_STAGES = 2
QK_TILE_BYTES = CHUNK * HEAD_DIM * 2  # a bf16 q or k tile [16, 128]: 4 096


def stage_bytes(g_bytes: int) -> int:
    """One input stage: the q and k tiles, then the g tile in g's dtype (2 or 4 bytes an element):
    12 288 B with bf16 g, 16 384 B with fp32 g."""
    return 2 * QK_TILE_BYTES + CHUNK * HEAD_DIM * g_bytes


def copies_per_thread(elem_bytes: int) -> int:
    """16-byte cp.async copies per thread for one [16, 128] tile of `elem_bytes`-byte elements."""
    return CHUNK * HEAD_DIM * elem_bytes // 16 // THREADS

# Phases 2-3 use three factor tiles [16 tokens, 128 channels] fp32 (rows of FACTOR_PITCH words),
# phases 4-5 one operand tile -k 2^G [128 channels, 16 tokens] fp32 (rows of OPERAND_PITCH words).
# Two factor tiles, then the operand tile, live in the CTA's own region; the third factor tile in
# the current input stage, over its q, k, g tiles (dead once phase 1 has read them).
FACTOR_TILE_BYTES = CHUNK * FACTOR_PITCH * 4      # 8 448
OPERAND_TILE_BYTES = HEAD_DIM * OPERAND_PITCH * 4  # 10 240
FACTOR_TILES_BYTES = 2 * FACTOR_TILE_BYTES         # the CTA's own region: 16 896
assert OPERAND_TILE_BYTES <= FACTOR_TILES_BYTES
# Phase 5 writes neg_kw [16, 128] bf16 into a staging tile in the same region, after the operand
# tile it reads (neg_kw_staging_layout: 128-byte swizzle, so that the MMA accumulator's rows land
# on different banks); one thread then stores the tile to the workspace with one TMA bulk tensor
# copy, off the LSU pipe, which 4-byte stores of 8 rows x 16 bytes each kept busy (8 lines an
# instruction). The tile must be 1 024-byte aligned (the swizzle's period); s_fac is.
NEG_KW_STAGING_OFFSET = OPERAND_TILE_BYTES
NEG_KW_STAGING_BYTES = CHUNK * HEAD_DIM * 2
SWIZZLE_ALIGN = 1024
assert NEG_KW_STAGING_OFFSET % SWIZZLE_ALIGN == 0
assert NEG_KW_STAGING_OFFSET + NEG_KW_STAGING_BYTES <= FACTOR_TILES_BYTES
# Phase 3's partial sums swapped between the two warps of a product (4 fp32 a lane, a warp's own
# 512 B), in the item's stage after factor tile 2; named barriers PAIR_BARRIER + product.
EXCHANGE_OFFSET = FACTOR_TILE_BYTES
EXCHANGE_BYTES = WARPS * 32 * 4 * 4
PAIR_BARRIER = 1
assert EXCHANGE_OFFSET % 16 == 0 and EXCHANGE_OFFSET + EXCHANGE_BYTES <= stage_bytes(2)
assert FACTOR_TILE_BYTES <= stage_bytes(2)  # factor tile 2 over the stage's q, k, g
# stage_sums_of_squares: four threads a vector (q and k tokens), 32 channels each; phase 5: two
# of W's entries a thread.
assert THREADS == 2 * CHUNK * 4 and HEAD_DIM == 4 * 32
assert THREADS * 2 == CHUNK * CHUNK
# Phases 1-2: (channel pair, token half) per thread, the two halves of a pair 16 lanes apart.
assert THREADS == (HEAD_DIM // 2) * 2 and WARPS * HALF_WARP == HEAD_DIM // 2
# issue_input_loads: whole 16-byte copies per thread for every tile dtype (bf16 q, k; bf16 or fp32 g).
assert all(CHUNK * HEAD_DIM * size % (16 * THREADS) == 0 for size in (2, 4))


def shared_memory_bytes(g_bytes: int) -> int:
    """Shared memory of one CTA (g in `g_bytes`-byte elements): the two input stages, two factor
    tiles (reused for an operand tile), L (transposed) and W [16, 20] each, beta, the l2-norm partial sums and
    norms, the fast-path vote, the item table: 45 392 B with bf16 g, 53 584 B with fp32 g."""
    return (INPUT_STAGES * stage_bytes(g_bytes) + FACTOR_TILES_BYTES + CHUNK * OPERAND_PITCH * 4
            + CHUNK * OPERAND_PITCH * 4 + CHUNK * 4 + 2 * WARPS * 2 * CHUNK * 4 + WARPS * 4 + ITEM_TABLE * 2 * 4)


# The persistent grid sizes itself for CTAS_PER_SM resident CTAs an SM (Hopper and the SM100 family:
# 228 KB of shared memory an SM, allocated to a CTA in 128-byte units, plus 1 KB reserved per CTA):
# an edit that outgrows it fails here. (With 64 item-table entries, 45 648 B, five CTAs missed by
# 128 B, and the driver configured the SM for four.)
SM_SHARED_MEMORY_BYTES = 228 * 1024
SHARED_ALLOCATION_UNIT = 128
RESERVED_SHARED_BYTES_PER_CTA = 1024


def shared_memory_allocated(g_bytes: int) -> int:
    """Shared memory an SM gives one CTA: its own, in allocation units, and the reserved 1 KB."""
    units = -(-shared_memory_bytes(g_bytes) // SHARED_ALLOCATION_UNIT)
    return units * SHARED_ALLOCATION_UNIT + RESERVED_SHARED_BYTES_PER_CTA


assert all(ctas * shared_memory_allocated(g_bytes) <= SM_SHARED_MEMORY_BYTES for g_bytes, ctas in CTAS_PER_SM.items())


def neg_kw_staging_layout():
    """The smem layout of phase 5's neg_kw staging tile [16 tokens, 128 channels, 1] bf16: the
    recurrence's own TMA layout for the same operand (128-byte swizzle in 64-channel blocks), with
    one stage."""
    return sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (HEAD_DIM, CHUNK, HEAD_DIM), cutlass.BFloat16, 1)


@cute.jit
def tf32_bits(x: Float32) -> Int32:
    """x rounded to TF32 (cvt.rna: nearest, ties away from zero), as the bits of an MMA operand.
    (An inline-asm add-and-mask version of the same rounding measured 8 % slower end to end.)"""
    return Int32(cute.arch.cvt_f32_tf32(x))


@cute.jit
def half_swap(token: Int32) -> Int32:
    """1 for the tokens whose bf16 stage rows are stored swizzled (8..15: HALF_SWAP_BYTES), else 0."""
    return (token // TOKENS_PER_THREAD) % 2


@cute.jit
def operand_unit(row: Int32, unit: Int32) -> Int32:
    """Where 4-token unit `unit` (tokens 4 unit .. 4 unit + 3) of channel `row` sits in the operand
    tile: units of rows 8..15 of every 16 are swapped in pairs, so that a quarter-warp's writes of
    rows 2 p + e (p = 8 m .. 8 m + 7) cover the 32 banks once. Reads of 8 consecutive rows from
    a multiple of 8 (the MMA fragments) see one swap for all, so they stay conflict-free."""
    return unit ^ ((row >> OPERAND_SWAP_BIT) & 1)


@cute.jit
def stage_sums_of_squares(s_stage: cute.Tensor, s_norm: cute.Tensor, valid: Int32, tid: Int32):
    """Partial l2-norm sums of the item's 32 vectors (q tokens 0..15, then k tokens 0..15), read
    straight from the input stage: thread tid sums the squares of 32 channels of vector tid // 4
    (four 16-byte loads: channel groups p, p + 4, p + 8, p + 12 of 8 channels, p = tid % 4) into
    s_norm[p, vector], the layout phase 2 adds up. Vectors past the chunk's last valid token get 0.

    It replaces a transposed warp butterfly over the per-channel registers (31 shuffles and 62
    selects a thread). The loads are conflict-free: the stage's rows are 256 bytes, so every row
    starts at bank 0, and the two rows of a quarter-warp take their four groups in orders one
    apart, so the eight 16-byte loads of a quarter-warp cover the 32 banks once (the two rows are
    in the same token half, so the half swap moves both groups alike)."""
    vector = tid // 4
    p = tid % 4
    token = vector % CHUNK
    row = s_stage[vector // CHUNK, token, None]
    row_words = cute.make_tensor(cute.recast_ptr(row.iterator, dtype=Int32), cute.make_layout(HEAD_DIM // 2))
    part = cute.make_rmem_tensor(cute.make_layout(4), Float32)
    for j in cutlass.range_constexpr(4):
        group = p + 4 * ((j + vector % 2) % 4)
        words = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        cute.autovec_copy(cute.local_tile(row_words, (4,), (group ^ (HALF_SWAP_UNITS * half_swap(token)),)), words)
        acc = Float32(0.0)
        for e in cutlass.range_constexpr(8):  # channel 8 group + e: a half of word e // 2
            x = bf16_low(words[e // 2]) if e % 2 == 0 else bf16_high(words[e // 2])
            acc = acc + x * x
        part[j] = acc
    total = (part[0] + part[1]) + (part[2] + part[3])
    if token >= valid:
        total = Float32(0.0)
    s_norm[p, vector] = total


@cute.jit
def slot_chunk(slot: Int32, cu_seqlens: cute.Tensor, num_seqs: Int32, dense_len: Int32, total_tokens: Int32,
               varlen: cutlass.Boolean):
    """(tok0, valid) of chunk slot `slot`: the chunk's first token and its number of tokens, 0 for
    a slot that belongs to no chunk. The owning sequence is the largest n with base(n) <= slot, found
    by bisection over all sequences (log2 N dependent loads of cu_seqlens); a slot below base(0)
    (tokens before cu_seqlens[0]) or with N = 0 has none. With a malformed cu_seqlens the sequence
    may be wrong, but tok0 stays in [bos, eos) of one whose bounds are clamped into [0, T]."""
    tok0 = Int32(0)
    valid = Int32(0)
    if num_seqs > 0:
        lo = Int32(0)
        hi = num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sequence_base(cu_seqlens, mid, num_seqs, dense_len, total_tokens, varlen) <= slot:
                lo = mid
            else:
                hi = mid - 1
        bos, eos = sequence_bounds(cu_seqlens, lo, dense_len, total_tokens, varlen)
        chunk = slot - (bos // CHUNK + lo)
        if chunk >= 0:
            tok0 = bos + chunk * CHUNK
            valid = cutlass.max(cutlass.min(eos - tok0, CHUNK), 0)
    return tok0, valid


@cute.jit
def fill_item_table(s_items: cute.Tensor, window_item: Int32, num_ctas: Int32, items: Int32, num_v_heads: Int32,
                    cu_seqlens: cute.Tensor, num_seqs: Int32, dense_len: Int32, total_tokens: Int32,
                    varlen: cutlass.Boolean, tid: Int32):
    """s_items[tid] = (tok0, valid) of the CTA's item window_item + tid * num_ctas (0, 0 past the
    last item): the CTA's next ITEM_TABLE items, one search a thread, all at once. Callers put a CTA
    barrier before (every read of the old entries done) and after (the new ones visible).

    It replaces a per-CTA cursor that only moved forward with a galloping search from it, which
    ran at almost every item on batches of short prompts (a CTA's slot moves by num_ctas // HV an
    item): one thread's dependent loads on the item loop's path, against ITEM_TABLE searches in
    parallel once every ITEM_TABLE items."""
    if tid < ITEM_TABLE:
        item = window_item + tid * num_ctas
        entry = cute.make_rmem_tensor(cute.make_layout(2), Int32)
        entry[0] = Int32(0)
        entry[1] = Int32(0)
        if item < items:
            entry[0], entry[1] = slot_chunk(item // num_v_heads, cu_seqlens, num_seqs, dense_len, total_tokens, varlen)
        cute.autovec_copy(entry, s_items[tid, None])


@cute.jit
def read_item_table(s_items: cute.Tensor, index: Int32):
    """(tok0, valid) of table entry `index` (one 8-byte shared load)."""
    entry = cute.make_rmem_tensor(cute.make_layout(2), Int32)
    cute.autovec_copy(s_items[index, None], entry)
    return entry[0], entry[1]


@cute.jit
def advance_item(slot: Int32, hv: Int32, hq: Int32, r: Int32, step_slot: Int32, step_hv: Int32,
                 step_hq: Int32, step_r: Int32, group: Int32, num_v_heads: Int32, num_q_heads: Int32):
    """(slot, hv, hq, r) of item + num_ctas from those of item (hv = hq * group + r, r < group),
    with the steps of num_ctas precomputed: no integer division in the item loop."""
    slot = slot + step_slot
    hv = hv + step_hv
    hq = hq + step_hq
    r = r + step_r
    if r >= group:
        r = r - group
        hq = hq + 1
    if hv >= num_v_heads:
        hv = hv - num_v_heads
        hq = hq - num_q_heads
        slot = slot + 1
    return slot, hv, hq, r


@cute.jit
def issue_input_loads(load_atom: cute.CopyAtom, g_atom: cute.CopyAtom, s_qk: cute.Tensor, s_g: cute.Tensor,
                      q: cute.Tensor, k: cute.Tensor, g: cute.Tensor, tok0: Int32, valid: Int32, hq: Int32,
                      hv: Int32, tid: Int32):
    """cp.async the chunk's q, k tiles (into `s_qk` [2, 16, 128]) and g tile (into `s_g` [16, 128],
    g's dtype) of one input stage, 16 bytes per copy; rows past the chunk's last valid token repeat
    that token (zeroed after loading). bf16 rows of tokens 8..15 are stored swizzled
    (HALF_SWAP_UNITS)."""
    if valid > 0:
        for tile in cutlass.range_constexpr(INPUT_TILES):
            src_tensor = (q, k, g)[tile]
            per_copy = 128 // src_tensor.element_type.width  # elements per 16-byte copy
            for j in cutlass.range_constexpr(copies_per_thread(src_tensor.element_type.width // 8)):
                piece = tid + THREADS * j
                row = piece // (HEAD_DIM // per_copy)
                col = piece % (HEAD_DIM // per_copy)
                t = tok0 + cutlass.min(row, valid - 1)
                src = src_tensor[t, (hq, hq, hv)[tile], None]
                dst = s_g[row, None] if tile == 2 else s_qk[tile, row, None]
                dst_col = col
                if cutlass.const_expr(src_tensor.element_type.width == 16):
                    dst_col = col ^ (HALF_SWAP_UNITS * half_swap(row))
                cute.copy(g_atom if tile == 2 else load_atom, cute.local_tile(src, (per_copy,), (col,)),
                          cute.local_tile(dst, (per_copy,), (dst_col,)))


@dsl_user_op
def opaque(x, *, loc=None, ip=None):
    """x (Float32 or BFloat16) through an inline-asm move that the compiler cannot look through.
    A value loaded for the next item and converted only after that item's barrier would otherwise
    have its conversion folded back into the loop-carried value, right behind the load, where the
    warp waits for the load before the barrier."""
    value = x.ir_value(loc=loc, ip=ip)
    if x.dtype == Float32:
        return Float32(llvm.inline_asm(T.f32(), [value], "mov.b32 $0, $1;", "=f,f", has_side_effects=True,
                                       is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                       loc=loc, ip=ip))
    bits = arith.bitcast(T.i16(), value, loc=loc, ip=ip)
    bits = llvm.inline_asm(T.i16(), [bits], "mov.b16 $0, $1;", "=h,h", has_side_effects=True,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return x.dtype(arith.bitcast(x.dtype.mlir_type, bits, loc=loc, ip=ip))


@dsl_user_op
def float_bits(x: Int32, *, loc=None, ip=None) -> Float32:
    """The Float32 whose bits are x (a bit cast, no conversion)."""
    return Float32(arith.bitcast(T.f32(), x.ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


# A bf16 is the top half of an fp32: the two bf16 of a 32-bit word widen with one integer
# instruction each (bf16_low: the element at the lower address).
@cute.jit
def bf16_low(word: Int32) -> Float32:
    return float_bits(word << 16)


@cute.jit
def bf16_high(word: Int32) -> Float32:
    return float_bits(word & Int32(-65536))  # 0xffff0000


@cute.jit
def load_fragments(tile: cute.Tensor, row: Int32, col: Int32, frag: cute.Tensor, first: cutlass.Constexpr):
    """frag[first .. first + 3] = one ldmatrix.x4 of 32-bit `tile` elements (a [rows, words] smem
    tensor, rows 16-byte aligned): lane L passes the address of its row `row`, column `col`, and
    gets word t = L % 4 of row L / 4 of the four 8 x 4 matrices whose rows lanes 0-7, 8-15,
    16-23, 24-31 addressed. The callers pick row and col so that the matrices are the TF32 MMA
    fragment's values (m16n8k8: A values (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4); B values
    (g, t), (g, t + 4), ... in 4-word steps of k), one instruction instead of four shared loads."""
    regs = ldmatrix((tile.iterator + cute.crd2idx((row, col), tile.layout)).llvm_ptr, 4, MMALayout.ROW)
    for j in cutlass.range_constexpr(4):
        frag[first + j] = regs[j]


@cute.jit
def load_head_scalars(beta: cute.Tensor, a_log: cute.Tensor, dt_bias: cute.Tensor, tok0: Int32,
                      valid: Int32, hv: Int32, d: Int32, pair: Int32, gate_mode: Int32):
    """Thread d's raw beta of token d (d < 16, beta's dtype), A_log[hv] and dt_bias[hv, 2 pair],
    dt_bias[hv, 2 pair + 1] (one 8-byte load) for one item, as loaded. Issued one item ahead (in the
    item before's phase 2), they are first used after the item's CTA barrier: never waited for."""
    b = beta.element_type(0.0)
    a_log_hv = Float32(0.0)
    bias0 = Float32(0.0)
    bias1 = Float32(0.0)
    if valid > 0:
        if d < valid:
            b = beta[tok0 + d, hv]
        if gate_mode == GateMode.SOFTPLUS or gate_mode == GateMode.LOWER_BOUND_A_LOG:
            a_log_hv = a_log[hv]
        if gate_mode != GateMode.PREACTIVATED:
            bias = cute.make_rmem_tensor(cute.make_layout(2), Float32)
            cute.autovec_copy(cute.local_tile(dt_bias[hv, None], (2,), (pair,)), bias)
            bias0 = bias[0]
            bias1 = bias[1]
    return b, a_log_hv, bias0, bias1


@cute.kernel
def prepare_chunks_kernel(
    q: cute.Tensor,          # [T, H, 128] bf16
    k: cute.Tensor,          # [T, H, 128] bf16
    g: cute.Tensor,          # [T, HV, 128] bf16 or fp32
    beta: cute.Tensor,       # [T, HV] bf16 or fp32
    a_log: cute.Tensor,      # [HV] fp32
    dt_bias: cute.Tensor,    # [HV, 128] fp32
    cu_seqlens: cute.Tensor,  # [N + 1] int32 (read only with Flag.VARLEN)
    tma_neg_kw: cute.CopyAtom,  # TMA store of neg_kw tiles [16, 128] from neg_kw_staging_layout()
    g_neg_kw: cute.Tensor,    # neg_kw [R * 16, 128] bf16, R = slots * HV, as the TMA atom's view
    qd_out: cute.Tensor,      # [R * 16, 128] bf16
    kr_out: cute.Tensor,      # [R * 16, 128] bf16
    mqk_out: cute.Tensor,     # [R * 16, 16] bf16
    w_hi_out: cute.Tensor,    # [R * 16, 16] bf16
    w_lo_out: cute.Tensor,    # [R * 16, 16] bf16
    decay_out: cute.Tensor,   # [R, 128] fp32
    num_seqs: Int32,
    dense_len: Int32,
    flags: Int32,
    scale: Float32,
    lower_bound: Float32,
):
    d, _, _ = cute.arch.thread_idx()
    first_item, _, _ = cute.arch.block_idx()
    num_ctas, _, _ = cute.arch.grid_dim()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    lane = cute.arch.lane_idx()
    # Phases 1-2: thread (pair, half) owns channels 2 pair, 2 pair + 1 at tokens 8 half .. 8 half + 7
    # (warp w: channels 32 w .. 32 w + 31; lanes l and l + 16 the two halves of the same channels).
    pair = warp * HALF_WARP + lane % HALF_WARP
    half = lane // HALF_WARP
    total_tokens = q.shape[0]
    num_q_heads = q.shape[1]
    num_v_heads = g.shape[1]
    group = num_v_heads // num_q_heads
    varlen = (flags & Flag.VARLEN) != 0
    gate_mode = (flags >> GATE_MODE_SHIFT) & GATE_MODE_MASK
    items = (total_tokens // CHUNK + num_seqs) * num_v_heads

    smem = cutlass.memory.SmemAllocator()
    # Raw input tiles, two stages of [q, k][16 tokens][128] bf16 then g [16 tokens][128] in g's
    # dtype: 2 x 12 288 B (bf16 g) or 2 x 16 384 B (fp32 g).
    stage_elems = stage_bytes(g.element_type.width // 8) // 2
    s_in = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((INPUT_STAGES, stage_elems),
                                                                   stride=(stage_elems, 1)), 16)
    # Factor tiles [0] k (or k 2^(G-ref)), [1] q (or q 2^(G-ref)): 2 x 16 x 132 x 4 B = 16 896 B
    # (the third, G or k 2^(ref-G), is in the item's input stage: prepare_one). The fast path
    # stores TF32 bits, the slow path floats. After phase 3 the same bytes hold the operand tile
    # -k 2^G (fp32), token-contiguous per channel (units swapped: operand_unit): 128 x 20 x 4 B = 10 240 B.
    s_fac = smem.allocate_tensor(
        Float32, cute.make_layout((2, CHUNK, HEAD_DIM), stride=(CHUNK * FACTOR_PITCH, FACTOR_PITCH, 1)),
        SWIZZLE_ALIGN)
    # Phase 5's neg_kw staging tile, in s_fac after the operand tile; the item's TMA store of it
    # is issued after the next loop-top barrier and must have read it before factor tile 1 is
    # written again (phase 2 of the CTA's next item: warp 0 waits before phase 1's barrier).
    kw_layout = neg_kw_staging_layout()
    s_kw_stage = cute.make_tensor(
        cute.recast_ptr(s_fac.iterator + NEG_KW_STAGING_OFFSET // 4, kw_layout.inner, dtype=cutlass.BFloat16),
        kw_layout.outer)
    t_kw_s, t_kw_g = cpasync.tma_partition(
        tma_neg_kw, 0, cute.make_layout(1), cute.group_modes(s_kw_stage, 0, 2),
        cute.group_modes(cute.local_tile(g_neg_kw, (CHUNK, HEAD_DIM), (None, 0)), 0, 2))
    # L [16, 16] stored transposed (element (i, j) at j * OPERAND_PITCH + i): phase 4 reads its
    # columns as 16-byte rows; phase 3's fragment stores stay conflict-free.
    s_lower = smem.allocate_tensor(Float32, cute.make_layout((CHUNK, CHUNK), stride=(1, OPERAND_PITCH)), 16)  # 1 280 B
    s_w = smem.allocate_tensor(Float32, cute.make_layout((CHUNK, CHUNK), stride=(OPERAND_PITCH, 1)), 16)  # W, 1 280 B
    s_beta = smem.allocate_tensor(Float32, cute.make_layout(CHUNK), 16)                                # 64 B
    s_norm = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 2 * CHUNK), stride=(2 * CHUNK, 1)), 16)   # 512 B
    s_rnorm = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 2 * CHUNK), stride=(2 * CHUNK, 1)), 16)  # 512 B
    s_fast = smem.allocate_tensor(Int32, cute.make_layout(WARPS), 16)                                  # 16 B
    s_items = smem.allocate_tensor(Int32, cute.make_layout((ITEM_TABLE, 2), stride=(2, 1)), 16)        # 256 B

    # cp.async.cg: 16-byte copies that skip L1 (each byte is read once).
    load_atom = cute.make_copy_atom(cpasync.CopyG2SOp(LoadCacheMode.GLOBAL), cutlass.BFloat16,
                                    num_bits_per_copy=128)
    g_atom = cute.make_copy_atom(cpasync.CopyG2SOp(LoadCacheMode.GLOBAL), g.element_type, num_bits_per_copy=128)

    # Item coordinates: item = slot * HV + hv, hv = hq * group + r (hq: the q/k head). A CTA's
    # items step by num_ctas; the step is split the same way once, here.
    step_slot = num_ctas // num_v_heads
    step_hv = num_ctas - step_slot * num_v_heads
    step_hq = step_hv // group
    step_r = step_hv - step_hq * group
    slot = first_item // num_v_heads
    hv = first_item - slot * num_v_heads
    hq = hv // group
    r = hv - hq * group

    # Prologue: the item table of the first ITEM_TABLE items, the first item's inputs into stage 0.
    item = first_item
    fill_item_table(s_items, item, num_ctas, items, num_v_heads, cu_seqlens, num_seqs, dense_len, total_tokens,
                    varlen, d)
    cute.arch.sync_threads()
    tok0, valid = read_item_table(s_items, 0)
    entry = Int32(0)  # the current item's table entry
    issue_input_loads(load_atom, g_atom, stage_qk(s_in, 0), stage_g(s_in, 0, g.element_type), q, k, g,
                      tok0, valid, hq, hv, d)
    cute.arch.cp_async_commit_group()
    beta_raw, a_log_hv, bias0, bias1 = load_head_scalars(beta, a_log, dt_bias, tok0, valid, hv, d, pair,
                                                         gate_mode)
    stage = Int32(0)
    pending_tile = Int32(-1)  # the workspace row of the item whose neg_kw waits in the staging tile
    while item < items:
        cute.arch.cp_async_wait_group(0)   # this thread's copies of the current item have landed
        cute.arch.sync_threads()           # ... and everyone else's; and the item before is done
        store_neg_kw(tma_neg_kw, t_kw_s, t_kw_g, pending_tile, warp)
        pending_tile = Int32(-1)
        # Prefetch the next item into the other stage, after the barrier: the item before this
        # one used that stage (factor tile 2, the exchange) up to its phase 3.
        next_item = item + num_ctas
        n_slot, n_hv, n_hq, n_r = advance_item(slot, hv, hq, r, step_slot, step_hv, step_hq, step_r,
                                               group, num_v_heads, num_q_heads)
        entry = entry + 1
        if entry == ITEM_TABLE:
            # The next item starts a new table: every thread has read the old one (before the
            # barrier above), so it is overwritten now and published by one more barrier.
            fill_item_table(s_items, next_item, num_ctas, items, num_v_heads, cu_seqlens, num_seqs, dense_len,
                            total_tokens, varlen, d)
            cute.arch.sync_threads()
            entry = Int32(0)
        n_tok0, n_valid = read_item_table(s_items, entry)
        issue_input_loads(load_atom, g_atom, stage_qk(s_in, 1 - stage), stage_g(s_in, 1 - stage, g.element_type),
                          q, k, g, n_tok0, n_valid, n_hq, n_hv, d)
        cute.arch.cp_async_commit_group()
        # The next item's beta, A_log, dt_bias are loaded inside prepare_one, after this item's
        # last use of its own (phase 1): ptxas gives every such load one scoreboard, and the
        # first use of this item's values (first item: still in flight from the prologue)
        # would otherwise wait for the next item's loads just issued.
        n_beta_raw = beta.element_type(0.0)
        n_a_log_hv = Float32(0.0)
        n_bias0 = Float32(0.0)
        n_bias1 = Float32(0.0)
        if valid > 0:
            n_beta_raw, n_a_log_hv, n_bias0, n_bias1 = prepare_one(
                stage_qk(s_in, stage), stage_g(s_in, stage, g.element_type), s_fac, s_lower,
                s_w, s_beta, s_norm, s_rnorm, s_fast,
                s_kw_stage, qd_out, kr_out, mqk_out, w_hi_out, w_lo_out, decay_out,
                slot, hv, valid, beta_raw, a_log_hv, bias0, bias1, num_v_heads, d, pair, half, warp, lane,
                flags, gate_mode, scale, lower_bound,
                beta, a_log, dt_bias, n_tok0, n_valid, n_hv)
            pending_tile = slot * num_v_heads + hv
        else:
            n_beta_raw, n_a_log_hv, n_bias0, n_bias1 = load_head_scalars(beta, a_log, dt_bias, n_tok0, n_valid,
                                                                         n_hv, d, pair, gate_mode)
        item = next_item
        slot, hv, hq, r, tok0, valid = n_slot, n_hv, n_hq, n_r, n_tok0, n_valid
        beta_raw, a_log_hv, bias0, bias1 = n_beta_raw, n_a_log_hv, n_bias0, n_bias1
        stage = 1 - stage
    cute.arch.cp_async_wait_group(0)
    # The last item's neg_kw; the CTA stays until the TMA has read the staging tile.
    cute.arch.sync_threads()
    store_neg_kw(tma_neg_kw, t_kw_s, t_kw_g, pending_tile, warp)
    if warp == 0:
        cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def store_neg_kw(tma_neg_kw: cute.CopyAtom, t_kw_s: cute.Tensor, t_kw_g: cute.Tensor, tile: Int32, warp: Int32):
    """Warp 0 stores the staging tile to workspace row `tile` of neg_kw with one TMA bulk tensor
    copy (one elected lane), when `tile` >= 0 (an item was prepared since the last store). Called
    after a CTA barrier that follows every thread's staging writes and proxy fence."""
    if warp == 0 and tile >= 0:
        cute.copy(tma_neg_kw, t_kw_s[(None, 0)], t_kw_g[(None, tile)])
        cute.arch.cp_async_bulk_commit_group()


@cute.jit
def stage_qk(s_in: cute.Tensor, stage: Int32) -> cute.Tensor:
    """The q, k tiles [2, 16 tokens, 128] bf16 of input stage `stage`."""
    return cute.make_tensor(s_in[stage, None].iterator,
                            cute.make_layout((2, CHUNK, HEAD_DIM), stride=(CHUNK * HEAD_DIM, HEAD_DIM, 1)))


@cute.jit
def stage_g(s_in: cute.Tensor, stage: Int32, dtype: cutlass.Constexpr) -> cute.Tensor:
    """The g tile [16 tokens, 128] of input stage `stage`, in g's dtype, after its q, k tiles."""
    ptr = cute.recast_ptr(s_in[stage, None].iterator + 2 * CHUNK * HEAD_DIM, dtype=dtype)
    return cute.make_tensor(ptr, cute.make_layout((CHUNK, HEAD_DIM), stride=(HEAD_DIM, 1)))


@cute.jit
def load_pairs(row: cute.Tensor, pair: Int32, half: Int32, dst: cute.Tensor, first: cutlass.Constexpr):
    """dst[first], dst[first + TOKENS_PER_THREAD] (fp32) = elements 2 pair, 2 pair + 1 of `row`, a
    bf16 or fp32 shared row of token half `half`, in one 4- or 8-byte load (a bf16 row of the second
    half is stored swizzled: HALF_SWAP_WORDS). A bf16 pair is widened from its word with one integer
    instruction each (bf16 is the top half of an fp32)."""
    if cutlass.const_expr(row.element_type == cutlass.BFloat16):
        words = cute.make_tensor(cute.recast_ptr(row.iterator, dtype=Int32), cute.make_layout(HEAD_DIM // 2))
        word = words[pair ^ (HALF_SWAP_WORDS * half)]
        dst[first] = bf16_low(word)
        dst[first + TOKENS_PER_THREAD] = bf16_high(word)
    else:
        values = cute.make_rmem_tensor(cute.make_layout(2), row.element_type)
        cute.autovec_copy(cute.local_tile(row, (2,), (pair,)), values)
        dst[first] = values[0].to(Float32)
        dst[first + TOKENS_PER_THREAD] = values[1].to(Float32)


@cute.jit
def store_pair(x0, x1, dtype: cutlass.Constexpr, row: cute.Tensor, pair: Int32):
    """Elements 2 pair, 2 pair + 1 of `row` = x0, x1 converted to `dtype` (one 4- or 8-byte store)."""
    values = cute.make_rmem_tensor(cute.make_layout(2), dtype)
    values[0] = x0.to(dtype)
    values[1] = x1.to(dtype)
    cute.autovec_copy(values, cute.local_tile(row, (2,), (pair,)))


@cute.jit
def prepare_one(s_stage: cute.Tensor, s_g: cute.Tensor, s_fac: cute.Tensor, s_lower: cute.Tensor, s_w: cute.Tensor,
                s_beta: cute.Tensor,
                s_norm: cute.Tensor, s_rnorm: cute.Tensor, s_fast: cute.Tensor,
                s_kw_stage: cute.Tensor, qd_out: cute.Tensor, kr_out: cute.Tensor, mqk_out: cute.Tensor,
                w_hi_out: cute.Tensor, w_lo_out: cute.Tensor, decay_out: cute.Tensor,
                slot: Int32, hv: Int32, valid: Int32, beta_raw, a_log_hv: Float32,
                bias0: Float32, bias1: Float32,
                num_v_heads: Int32, d: Int32, pair: Int32, half: Int32, warp: Int32, lane: Int32, flags: Int32,
                gate_mode: Int32, scale: Float32, lower_bound: Float32,
                beta: cute.Tensor, a_log: cute.Tensor, dt_bias: cute.Tensor, next_tok0: Int32,
                next_valid: Int32, next_hv: Int32):
    """All five phases for one item whose raw tiles are in `s_stage` (q, k) and `s_g` (g) (CTA-uniform call). Returns the
    next item's (`next_*`) raw beta, A_log, dt_bias, loaded once phase 1 no longer needs this one's.

    In phases 1-2 thread (pair, half) holds channels c_e = 2 pair + e (e = 0, 1) at tokens
    t0 + i (t0 = 8 half, i < 8) as element e * 8 + i of its register arrays."""
    row0 = (slot * num_v_heads + hv) * CHUNK
    t0 = half * TOKENS_PER_THREAD
    # Shared tiles (see FACTOR_TILES_BYTES): factor tiles 0, 1 and then the operand tile -k 2^G in
    # s_fac; factor tile 2 at the start of the stage, over its raw q, k, g, then phase 3's
    # exchange (EXCHANGE_OFFSET).
    s_fac_bits = cute.make_tensor(cute.recast_ptr(s_fac.iterator, dtype=Int32), s_fac.layout)
    stage_f32 = cute.recast_ptr(s_stage.iterator, dtype=Float32)
    s_fac2 = cute.make_tensor(stage_f32, cute.make_layout((CHUNK, HEAD_DIM), stride=(FACTOR_PITCH, 1)))
    s_fac2_bits = cute.make_tensor(cute.recast_ptr(stage_f32, dtype=Int32), s_fac2.layout)
    op_layout = cute.make_layout((HEAD_DIM, CHUNK), stride=(OPERAND_PITCH, 1))
    s_neg_kd = cute.make_tensor(s_fac.iterator, op_layout)
    s_neg_kd_bits = cute.make_tensor(cute.recast_ptr(s_fac.iterator, dtype=Int32), op_layout)

    q_r = cute.make_rmem_tensor(cute.make_layout(CHUNK), Float32)
    k_r = cute.make_rmem_tensor(cute.make_layout(CHUNK), Float32)
    cum = cute.make_rmem_tensor(cute.make_layout(CHUNK), Float32)
    neg_kd_r = cute.make_rmem_tensor(cute.make_layout(CHUNK), Float32)  # -k 2^G
    bias = (bias0, bias1)

    a_exp = Float32(1.0)
    if gate_mode == GateMode.SOFTPLUS or gate_mode == GateMode.LOWER_BOUND_A_LOG:
        a_exp = cute.math.exp(opaque(a_log_hv))

    # ---- Phase 1: gate, cumsum, l2-norm partial sums, fast-path vote; inputs from the stage
    # (rows past the last valid token hold copies of it and are zeroed below: zero inputs,
    # zero decay).
    last = valid - 1
    for i in cutlass.range_constexpr(TOKENS_PER_THREAD):
        load_pairs(s_stage[0, t0 + i, None], pair, half, q_r, i)
        load_pairs(s_stage[1, t0 + i, None], pair, half, k_r, i)
        load_pairs(s_g[t0 + i, None], pair, half, cum, i)
    # Log2 decay from the gate (softplus and pre-activated gates give the natural log first);
    # one loop per mode so that each computes only its own.
    if gate_mode == GateMode.SOFTPLUS:
        for j in cutlass.range_constexpr(CHUNK):
            z = cum[j] + bias[j // TOKENS_PER_THREAD]
            softplus = z
            if z <= Float32(20.0):
                softplus = cute.math.log1p(cute.math.exp(z))
            cum[j] = -a_exp * softplus
    if gate_mode >= GateMode.LOWER_BOUND_A_LOG:  # both lower-bound gates
        # log2 decay = lower_bound log2(e) sigmoid(z), z = (g + bias) a, with the hardware exp2
        # and reciprocal (relative error ~1e-7, far below the bf16 inputs' resolution). The
        # constants are folded per item: one FFMA, one EX2, one FADD, one RCP, one FMUL a token.
        e_scale = a_exp * Float32(-LOG2E)
        e_shift = (bias0 * e_scale, bias1 * e_scale)
        log2_bound = lower_bound * Float32(LOG2E)
        for j in cutlass.range_constexpr(CHUNK):
            denom = Float32(1.0) + cute.math.exp2(cum[j] * e_scale + e_shift[j // TOKENS_PER_THREAD], fastmath=True)
            cum[j] = log2_bound * cute.arch.rcp_approx(denom)
    else:
        for j in cutlass.range_constexpr(CHUNK):
            cum[j] = cum[j] * Float32(LOG2E)
    if valid < CHUNK:
        for j in cutlass.range_constexpr(CHUNK):
            if t0 + j % TOKENS_PER_THREAD > last:
                q_r[j] = Float32(0.0)
                k_r[j] = Float32(0.0)
                cum[j] = Float32(0.0)
    if d < CHUNK:
        b = opaque(beta_raw).to(Float32)
        if d < valid and (flags & Flag.BETA_SIGMOID) != 0:
            b = Float32(1.0) / (Float32(1.0) + cute.math.exp(-b))
        s_beta[d] = b

    # Inclusive cumsum of the log2 decay (tokens past the end add nothing), in token order as one
    # serial sum per channel: the first half's lanes sum tokens 0-7, pass their sums to the
    # second half's lanes (lane + 16), which continue from them over tokens 8-15.
    if half == 0:
        for j in cutlass.range_constexpr(CHUNK):
            if j % TOKENS_PER_THREAD != 0:
                cum[j] = cum[j] + cum[j - 1]
    carry = []
    for e in cutlass.range_constexpr(2):
        carry.append(cute.arch.shuffle_sync_bfly(cum[e * TOKENS_PER_THREAD + TOKENS_PER_THREAD - 1], offset=HALF_WARP))
    if half == 1:
        for j in cutlass.range_constexpr(CHUNK):
            if j % TOKENS_PER_THREAD == 0:
                cum[j] = carry[j // TOKENS_PER_THREAD] + cum[j]
            else:
                cum[j] = cum[j] + cum[j - 1]
    # Both halves need each channel's G_last, which the second half holds.
    g_last0 = cum[TOKENS_PER_THREAD - 1]
    g_last1 = cum[CHUNK - 1]
    from_second0 = cute.arch.shuffle_sync_bfly(g_last0, offset=HALF_WARP)
    from_second1 = cute.arch.shuffle_sync_bfly(g_last1, offset=HALF_WARP)
    if half == 0:
        g_last0 = from_second0
        g_last1 = from_second1
    g_last = (g_last0, g_last1)

    l2norm = (flags & Flag.QK_L2NORM) != 0
    if l2norm:
        stage_sums_of_squares(s_stage, s_norm, valid, d)

    # Whole-CTA vote: factorized pair products are safe iff every channel's chunk decay
    # stays within FAST_PATH_RANGE.
    fast_here = cute.arch.vote_all_sync(cutlass.min(g_last0, g_last1) >= Float32(-FAST_PATH_RANGE))
    if lane == 0:
        s_fast[warp] = Int32(1) if fast_here else Int32(0)
    if warp == 0:
        # The item before's neg_kw store has read the staging tile, which phase 2 overwrites
        # (factor tile 1).
        cute.arch.cp_async_bulk_wait_group(0, read=True)
    cute.arch.sync_threads()
    next_scalars = load_head_scalars(beta, a_log, dt_bias, next_tok0, next_valid, next_hv, d, pair, gate_mode)

    # ---- Phase 2: l2 norms, factor tiles, qd and kr (channel pairs: 8-byte shared and 4-byte
    # global stores).
    if l2norm:
        # Every warp finishes the 32 norms itself (lane l: value l) and shares them through
        # its own row of s_rnorm.
        total = s_norm[0, lane] + s_norm[1, lane] + s_norm[2, lane] + s_norm[3, lane]
        s_rnorm[warp, lane] = cute.math.rsqrt(total + Float32(1e-6))
        cute.arch.sync_warp()
        for j in cutlass.range_constexpr(CHUNK):
            i = j % TOKENS_PER_THREAD
            q_r[j] = q_r[j] * s_rnorm[warp, t0 + i]
            k_r[j] = k_r[j] * s_rnorm[warp, CHUNK + t0 + i]

    fast = (s_fast[0] + s_fast[1] + s_fast[2] + s_fast[3]) == WARPS
    if fast:
        ref = []
        ref_scale = []  # 2^ref: 2^G = 2^(G-ref) 2^ref
        q_scale = []
        neg_ref_scale = []
        for e in cutlass.range_constexpr(2):
            ref.append(g_last[e] * Float32(0.5))
            ref_scale.append(cute.math.exp2(ref[e], fastmath=True))
            q_scale.append(scale * ref_scale[e])
            neg_ref_scale.append(-ref_scale[e])
        for i in cutlass.range_constexpr(TOKENS_PER_THREAD):
            left = []
            query = []
            right = []
            for e in cutlass.range_constexpr(2):
                j = e * TOKENS_PER_THREAD + i
                up = cute.math.exp2(cum[j] - ref[e], fastmath=True)
                down = cute.math.exp2(ref[e] - cum[j], fastmath=True)
                left.append(k_r[j] * up)
                query.append(q_r[j] * up)
                right.append(k_r[j] * down)
                neg_kd_r[j] = left[e] * neg_ref_scale[e]
            # Stored as fp32: the TF32 MMA reads the top 19 bits (truncation), which costs no
            # instructions; rounding them here (4 instructions each) bought no accuracy
            # (tests/kda_chunk_model.py: the pair products feed L and Mqk, both far from the
            # error budget's large terms).
            store_pair(left[0], left[1], Float32, s_fac[0, t0 + i, None], pair)
            store_pair(query[0], query[1], Float32, s_fac[1, t0 + i, None], pair)
            store_pair(right[0], right[1], Float32, s_fac2[t0 + i, None], pair)
            store_pair(query[0] * q_scale[0], query[1] * q_scale[1], cutlass.BFloat16, qd_out[row0 + t0 + i, None], pair)
            store_pair(right[0] * ref_scale[0], right[1] * ref_scale[1], cutlass.BFloat16,
                       kr_out[row0 + t0 + i, None], pair)
    else:
        for i in cutlass.range_constexpr(TOKENS_PER_THREAD):
            j0 = i
            j1 = TOKENS_PER_THREAD + i
            store_pair(k_r[j0], k_r[j1], Float32, s_fac[0, t0 + i, None], pair)
            store_pair(q_r[j0], q_r[j1], Float32, s_fac[1, t0 + i, None], pair)
            store_pair(cum[j0], cum[j1], Float32, s_fac2[t0 + i, None], pair)
            qd = []
            kr = []
            for e in cutlass.range_constexpr(2):
                j = e * TOKENS_PER_THREAD + i
                decay_i = cute.math.exp2(cum[j], fastmath=True)
                qd.append(scale * q_r[j] * decay_i)
                kr.append(k_r[j] * cute.math.exp2(g_last[e] - cum[j], fastmath=True))
                neg_kd_r[j] = k_r[j] * -decay_i
            store_pair(qd[0], qd[1], cutlass.BFloat16, qd_out[row0 + t0 + i, None], pair)
            store_pair(kr[0], kr[1], cutlass.BFloat16, kr_out[row0 + t0 + i, None], pair)
    if half == 1:
        store_pair(cute.math.exp2(g_last[0], fastmath=True), cute.math.exp2(g_last[1], fastmath=True), Float32,
                   decay_out[slot * num_v_heads + hv, None], pair)
    cute.arch.sync_threads()

    # ---- Phase 3: pair products A_kk (-> L) and Mqk.
    mma = cute.make_tiled_mma(cute.nvgpu.warp.MmaTF32Op((16, 8, MMA_K)))
    thr = mma.get_slice(lane)
    crd_c = thr.partition_C(cute.make_identity_tensor((CHUNK, 8)))
    if fast:
        # Warps 2 p, 2 p + 1: rows of factor tile p (k or q) against all 16 columns, warp w over
        # channels 64 (w % 2) .. + 63 (each A fragment is loaded by one warp, not two). The pair
        # then swaps partial sums through the stage (s_xchg): warp w keeps columns 8 (w % 2) ..
        # + 7 and adds its partner's partial sums of them.
        product = warp // 2
        k_half = warp % 2
        col0 = k_half * 8
        cols = (col0, 8 - col0)  # the columns kept, the columns given to the partner
        k0 = k_half * (HEAD_DIM // 2)
        frag_a = thr.make_fragment_A(thr.partition_shape_A((CHUNK, MMA_K)))
        frag_b = thr.make_fragment_B(thr.partition_shape_B((8, MMA_K)))
        b_pairs = []  # B values of two k blocks, per column half
        accs = []
        for c in cutlass.range_constexpr(2):
            b_pairs.append(cute.make_rmem_tensor(cute.make_layout(4), Int32))
            accs.append(thr.make_fragment_C(thr.partition_shape_C((CHUNK, 8))))
            accs[c].fill(0.0)
        a_tile = s_fac_bits[product, None, None]
        b_tile = s_fac2_bits
        for kb in cutlass.range_constexpr(HEAD_DIM // 2 // MMA_K):
            # A: lanes 0-15 rows 0-15 at k + 0, lanes 16-31 the same rows at k + 4. B (every
            # other block, for two blocks): lanes 8 j .. 8 j + 7 rows col .. col + 7 at k + 4 j.
            k = k0 + kb * MMA_K
            load_fragments(a_tile, lane % 16, k + (lane // 16) * 4, frag_a, 0)
            for c in cutlass.range_constexpr(2):
                if kb % 2 == 0:
                    load_fragments(b_tile, cols[c] + lane % 8, k + (lane // 8) * 4, b_pairs[c], 0)
                frag_b[0] = b_pairs[c][(kb % 2) * 2]
                frag_b[1] = b_pairs[c][(kb % 2) * 2 + 1]
                cute.gemm(mma, accs[c], frag_a, frag_b, accs[c])
        s_xchg = cute.make_tensor(stage_f32 + EXCHANGE_OFFSET // 4,
                                  cute.make_layout((WARPS, 32, 4), stride=(32 * 4, 4, 1)))
        cute.autovec_copy(accs[1], s_xchg[warp, lane, None])
        # One barrier per product, each named by a constant: for a barrier id computed at run time
        # ptxas reserves all 16 of the CTA's barriers, and then no more than four CTAs share an SM
        # (Nsight Compute's barrier limit; CTAS_PER_SM needs five).
        if product == 0:
            cute.arch.barrier(barrier_id=PAIR_BARRIER, number_of_threads=2 * 32)
        else:
            cute.arch.barrier(barrier_id=PAIR_BARRIER + 1, number_of_threads=2 * 32)
        partner = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        cute.autovec_copy(s_xchg[warp ^ 1, lane, None], partner)
        acc = accs[0]
        for e in cutlass.range_constexpr(cute.size(acc)):
            acc[e] = acc[e] + partner[e]
        # Entries above the diagonal can overflow (factors up to 2^100 each): select, never scale.
        if product == 0:
            for e in cutlass.range_constexpr(cute.size(acc)):
                i, jj = crd_c[e]
                j = col0 + jj
                lower = Float32(0.0)
                if j < i:
                    lower = acc[e] * s_beta[i]
                s_lower[i, j] = lower
        else:
            for e in cutlass.range_constexpr(cute.size(acc)):
                i, jj = crd_c[e]
                j = col0 + jj
                m_ij = Float32(0.0)
                if j <= i:
                    m_ij = acc[e] * scale
                mqk_out[row0 + i, j] = m_ij.to(cutlass.BFloat16)
    else:
        # Exact element-wise decays on CUDA cores: thread (i, j0) computes rows i, columns
        # j0 and j0 + 8; s_fac holds k and q, s_fac2 G.
        pi = d // 8
        for column_half in cutlass.range_constexpr(2):
            pj = d % 8 + column_half * 8
            acc_kk = Float32(0.0)
            acc_qk = Float32(0.0)
            if pj <= pi:
                for e in cutlass.range(HEAD_DIM, unroll=8):
                    r = s_fac[0, pj, e] * cute.math.exp2(s_fac2[pi, e] - s_fac2[pj, e], fastmath=True)
                    acc_kk = acc_kk + s_fac[0, pi, e] * r
                    acc_qk = acc_qk + s_fac[1, pi, e] * r
            lower = Float32(0.0)
            if pj < pi:
                lower = acc_kk * s_beta[pi]
            s_lower[pi, pj] = lower
            mqk_out[row0 + pi, pj] = (acc_qk * scale).to(cutlass.BFloat16)
    cute.arch.sync_threads()

    # ---- Phase 4: W = (I + L)^-1 diag(beta) (warp 0, lane c: column c) to shared memory in
    # fp32, and the W-application operand -k 2^G in fp32 (every thread: its two channels' eight
    # tokens, over the free factor tiles 0-1, placed by operand_unit). Warp 0 does only the solve and one store per entry
    # here, the rest of its work (TF32 rounding included) after it: the other three warps wait at
    # the barrier for this warp alone. (Measured, H200, 96 heads x 8K: with the TF32 bits and the
    # workspace's w_hi, w_lo also written here, the wait for warp 0 before phase 5 was the largest
    # barrier stall of the kernel.)
    if d < CHUNK:
        # Right-looking: once col[j] is final, it updates every later col[i]. Each col[i] still
        # subtracts its terms in increasing j (the same float operations, bit for bit, as the
        # row-by-row form), but the updates of one step are independent, so the dependency
        # chain is 16 FFMAs long instead of 120. s_lower holds L transposed, so that the
        # column L[j + 1.., j] a step needs comes in 16-byte broadcast loads (36 loads, not 120).
        col = cute.make_rmem_tensor(cute.make_layout(CHUNK), Float32)
        for i in cutlass.range_constexpr(CHUNK):
            col[i] = Float32(1.0) if d == i else Float32(0.0)
        for j in cutlass.range_constexpr(CHUNK - 1):
            column = cute.make_rmem_tensor(cute.make_layout(CHUNK), Float32)
            for v in cutlass.range_constexpr((j + 1) // 4, CHUNK // 4):
                cute.autovec_copy(cute.local_tile(s_lower[None, j], (4,), (v,)),
                                  cute.local_tile(column, (4,), (v,)))
            for i in cutlass.range_constexpr(j + 1, CHUNK):
                col[i] = col[i] - column[i] * col[j]
        b = s_beta[d]
        for i in cutlass.range_constexpr(CHUNK):
            s_w[i, d] = col[i] * b
    units = TOKENS_PER_THREAD // 4
    for e in cutlass.range_constexpr(2):
        for v in cutlass.range_constexpr(units):
            cute.autovec_copy(cute.local_tile(neg_kd_r, (4,), (e * units + v,)),
                              cute.local_tile(s_neg_kd[2 * pair + e, None], (4,),
                                              (operand_unit(2 * pair + e, units * half + v),)))
    cute.arch.sync_threads()

    # ---- Phase 5: W to the workspace as two bf16 tiles, hi = bf16(W), lo = bf16(W - hi) (their
    # sum carries ~16 bits) for the recurrence's U = W v (thread d: two entries of row d / 8);
    # neg_kw = W (-k 2^G) with both rounded to TF32 as their fragments are loaded (TF32 rounding
    # (to nearest, ties away), the MMA's products and sums and bf16 rounding are all odd functions,
    # so this is -(W (k 2^G)) bit for bit, with no negation left to do); warp w owns channels
    # 32 w .. 32 w + 31, written to the staging tile (stored by TMA: store_neg_kw).
    w_row = d // 8
    w_pair = d % 8
    pair_hi = cute.make_rmem_tensor(cute.make_layout(2), cutlass.BFloat16)
    pair_lo = cute.make_rmem_tensor(cute.make_layout(2), cutlass.BFloat16)
    for e in cutlass.range_constexpr(2):
        w = s_w[w_row, 2 * w_pair + e]
        w_hi = w.to(cutlass.BFloat16)
        pair_hi[e] = w_hi
        pair_lo[e] = (w - w_hi.to(Float32)).to(cutlass.BFloat16)
    cute.autovec_copy(pair_hi, cute.local_tile(w_hi_out[row0 + w_row, None], (2,), (w_pair,)))
    cute.autovec_copy(pair_lo, cute.local_tile(w_lo_out[row0 + w_row, None], (2,), (w_pair,)))
    frag_w = thr.make_fragment_A(thr.partition_shape_A((CHUNK, CHUNK)))
    frag_kd = thr.make_fragment_B(thr.partition_shape_B((8, CHUNK)))
    acc_kd = thr.make_fragment_C(thr.partition_shape_C((CHUNK, 8)))
    w_words = cute.make_rmem_tensor(cute.make_layout(2 * 4), Int32)
    kd_words = cute.make_rmem_tensor(cute.make_layout(4 * 4), Int32)
    for kb in cutlass.range_constexpr(CHUNK // MMA_K):
        load_fragments(s_w, lane % 16, kb * MMA_K + (lane // 16) * 4, w_words, 4 * kb)
    # All four n-tiles' fragments of -k 2^G before the first staging store: the staging tile shares
    # s_fac with the operand tile, so the compiler keeps a load behind every earlier store (one
    # ldmatrix latency an n-tile on the warp's path, as written in one loop).
    for nt in cutlass.range_constexpr(32 // 8):
        ch0 = warp * 32 + nt * 8
        # Lanes 8 j .. 8 j + 7: channels ch0 .. ch0 + 7 at tokens 4 j .. 4 j + 3.
        load_fragments(s_neg_kd_bits, ch0 + lane % 8, operand_unit(ch0 + lane % 8, lane // 8) * 4, kd_words, 4 * nt)
    for e in cutlass.range_constexpr(2 * 4):
        frag_w[e] = tf32_bits(float_bits(w_words[e]))
    for nt in cutlass.range_constexpr(32 // 8):
        ch0 = warp * 32 + nt * 8
        for e in cutlass.range_constexpr(4):
            frag_kd[e] = tf32_bits(float_bits(kd_words[4 * nt + e]))
        acc_kd.fill(0.0)
        cute.gemm(mma, acc_kd, frag_w, frag_kd, acc_kd)
        # Accumulator values (2 h, 2 h + 1) are columns (n, n + 1) of one row: paired stores.
        for h in cutlass.range_constexpr(2):
            i, n = crd_c[2 * h]
            pair_kw = cute.make_rmem_tensor(cute.make_layout(2), cutlass.BFloat16)
            for e in cutlass.range_constexpr(2):
                pair_kw[e] = acc_kd[2 * h + e].to(cutlass.BFloat16)
            pair_col = (ch0 + n) // 2
            cute.autovec_copy(pair_kw, cute.local_tile(s_kw_stage[i, None, 0], (2,), (pair_col,)))
    # The staging writes, ordered before the TMA store (async proxy) that the next barrier releases.
    cute.arch.fence_proxy("async.shared", space="cta")
    return next_scalars
