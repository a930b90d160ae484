"""Where each sequence's tokens and chunk slots are, on the device: helpers every kernel shares.

Sequence n covers tokens [bos, eos): [n T, (n + 1) T) for dense inputs, [cu_seqlens[n],
cu_seqlens[n + 1]) when packed (Flag.VARLEN). Its chunks own the workspace slots base(n) + c,
c < ceil((eos - bos) / 16), with base(n) = bos // 16 + n: slots of different sequences never
overlap and all lie below total_tokens // 16 + N (the workspace's row count per value head).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from kda_contract import CHUNK


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
def sequence_base(cu_seqlens: cute.Tensor, n: Int32, num_seqs: Int32, dense_len: Int32,
                  total_tokens: Int32, varlen: cutlass.Boolean) -> Int32:
    """base(n) = bos_n // 16 + n, the first chunk slot of sequence n; past the last sequence, a
    value above every slot."""
    base = Int32(2147483647)
    if n < num_seqs:
        bos, _ = sequence_bounds(cu_seqlens, n, dense_len, total_tokens, varlen)
        base = bos // CHUNK + n
    return base
