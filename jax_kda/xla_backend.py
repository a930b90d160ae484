"""`backend="xla"`: KDA prefill in pure JAX, chunked, exact for any decay. Runs on any platform.

This is the reference every kernel is tested against and the portable fallback, so it is written
for exactness first and reasonable speed second.

Chunked form (chunk C tokens; G_i = sum of the log-decays g_1..g_i from the chunk start):

    A[i, j]   = sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])                 j < i
    Mqk[i, j] = sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])                 j <= i
    (I + diag(beta) A) [U0 | W] = diag(beta) [v | k exp(G)]              (the WY form)
    per chunk, sequentially:  U = U0 - W S
                              o = scale (q exp(G) S + Mqk U)
                              S = exp(G_last) S + (k exp(G_last - G))^T U

Exactness. Factorising exp(G_i - G_j) as exp(G_i) exp(-G_j) overflows once a chunk decays by more
than ~88 (natural log): a -60 per token gate or an unbounded softplus gate does that. Here every
exponent is a sum of log-decays over a token range that is never negative-length, so every exp()
is of a value <= 0: the pairwise terms are built level by level over halves of the chunk, and for
i in the upper half and j in the lower half, exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j) with r
the last token of the lower half; both factors are <= 1. Each exponent is computed as a direct
partial sum over its own range (never a difference of two large cumulative sums), so its absolute
error is relative to its own size, which keeps the long-memory case accurate.

The unit lower-triangular system is solved by a blocked inverse over the same halves (matrix
products only): on a 2-core CPU this made the whole path 2x faster than a batched triangular solve
(293 -> 147 ms at T=2048, 8 heads, K=V=128) with the same accuracy.

Packed sequences (traced `cu_seqlens`) are laid out with every sequence padded to a multiple of C,
so no chunk spans two sequences; padding tokens have k = v = beta = 0 and g = 0 and leave the state
untouched. The padded length is a static bound, T + N (C - 1) tokens, so many short packed
sequences cost up to C times their length in time.

Memory. The call is a scan over blocks of chunks (`chunks_per_block`): a block's tokens are
gathered from the inputs, made ready (fp32, l2norm, gate, beta) and turned into its chunk tensors
when the block runs, and its outputs are written into o in place, so the temporary memory is one
block's (about 9 KB per token-head in fp32 at K = V = 128), not the call's; no O(T K V) tensor is
built. The blocks are rematerialized in the backward pass (`jax.checkpoint`): a gradient keeps
only each block's carries and recomputes one block at a time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_kda import dispatch
from jax_kda.config import Operands, PrefillConfig
from jax_kda.gates import beta_activation, l2_normalize, log_decay

CHUNK_SIZE = 64
_HIGHEST = lax.Precision.HIGHEST


def varying_axes(x) -> frozenset:
    """The manual mesh axes (jax.shard_map) that x (an array or a tracer, or its abstract value)
    varies over, as its type says; empty outside shard_map."""
    aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
    return frozenset(aval.mat.varying)


def _varying_like(x: jax.Array, *refs: jax.Array) -> jax.Array:
    """x, marked as varying over every manual mesh axis any of `refs` varies over (shard_map)."""
    missing = tuple(sorted(frozenset().union(*map(varying_axes, refs)) - varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _einsum(spec: str, *operands: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *operands, precision=_HIGHEST)


def _reverse_exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
    """out[j] = sum of x[t] for t > j along `axis`, summed directly (no subtraction)."""
    inclusive = jnp.flip(jnp.cumsum(jnp.flip(x, axis), axis), axis)
    tail = lax.slice_in_dim(inclusive, 1, x.shape[axis], axis=axis)
    return jnp.concatenate([tail, jnp.zeros_like(lax.slice_in_dim(x, 0, 1, axis=axis))], axis=axis)


def _strictly_lower_decayed_dots(a: jax.Array, b: jax.Array, g: jax.Array) -> jax.Array:
    """M[..., i, j] = sum_d a_i[d] b_j[d] exp(G_i[d] - G_j[d]) for j < i, else 0.

    a, b, g: `[..., C, K]` with C a power of two; g holds per-token log-decays (<= 0). Built bottom
    up: at each level, blocks of `size` rows are paired, and the (upper, lower) tile of each pair
    uses the lower block's last token as the reference, so both exponent factors are <= 0.
    """
    *lead, c, kdim = a.shape
    blocks = jnp.zeros((*lead, c, 1, 1), a.dtype)  # strictly-lower parts of the 1x1 diagonal blocks
    size = 1
    while size < c:
        pairs = c // (2 * size)
        halves = lambda x: x.reshape(*lead, pairs, 2, size, kdim)  # noqa: E731
        a2, b2, g2 = halves(a), halves(b), halves(g)
        # exp(G_i - G_r): log-decays from the upper block's start up to i (inclusive).
        left = a2[..., 1, :, :] * jnp.exp(jnp.cumsum(g2[..., 1, :, :], axis=-2))
        # exp(G_r - G_j): log-decays after j up to the lower block's last token r.
        right = b2[..., 0, :, :] * jnp.exp(_reverse_exclusive_cumsum(g2[..., 0, :, :], axis=-2))
        tile = _einsum("...pik,...pjk->...pij", left, right)
        diag = blocks.reshape(*lead, pairs, 2, size, size)
        top = jnp.concatenate([diag[..., 0, :, :], jnp.zeros_like(tile)], axis=-1)
        bottom = jnp.concatenate([tile, diag[..., 1, :, :]], axis=-1)
        blocks = jnp.concatenate([top, bottom], axis=-2)
        size *= 2
    return blocks.reshape(*lead, c, c)


def _unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """(I + lower)^-1 for strictly lower-triangular `[..., C, C]` (C a power of two), by blocks.

    Bottom up over the same halves as `_strictly_lower_decayed_dots`: with the inverses A^-1 and
    D^-1 of the two diagonal blocks and the block B below the diagonal, the inverse of their union
    is [[A^-1, 0], [-D^-1 B A^-1, D^-1]]. Only matrix products, which XLA runs far better than a
    batched triangular solve of small matrices.
    """
    *lead, c, _ = lower.shape
    inverse = jnp.ones((*lead, c, 1, 1), lower.dtype)
    size = 1
    while size < c:
        pairs = c // (2 * size)
        diag = inverse.reshape(*lead, pairs, 2, size, size)
        a_inv, d_inv = diag[..., 0, :, :], diag[..., 1, :, :]
        # The (upper half, lower half) block of each 2*size diagonal block of `lower`.
        blocks = jnp.diagonal(lower.reshape(*lead, pairs, 2 * size, pairs, 2 * size), axis1=-4, axis2=-2)
        below = jnp.moveaxis(blocks, -1, -3)[..., size:, :size]
        corner = -_einsum("...ij,...jk,...kl->...il", d_inv, below, a_inv)
        top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
        bottom = jnp.concatenate([corner, d_inv], axis=-1)
        inverse = jnp.concatenate([top, bottom], axis=-2)
        size *= 2
    return inverse.reshape(*lead, c, c)


def _prepare_chunks(q, k, v, g, beta, scale):
    """State-independent per-chunk tensors. Inputs `[..., C, X]` (beta `[..., C]`)."""
    g_in = jnp.cumsum(g, axis=-2)  # G_i
    g_to_end = _reverse_exclusive_cumsum(g, axis=-2)  # G_last - G_i
    decay_in = jnp.exp(g_in)
    q_decayed = scale * q * decay_in
    k_decayed = k * decay_in
    k_to_end = k * jnp.exp(g_to_end)
    chunk_decay = jnp.exp(g_in[..., -1, :])
    a_kk = _strictly_lower_decayed_dots(k, k, g)
    m_qk = _strictly_lower_decayed_dots(q, k, g)
    m_qk = scale * (m_qk + jnp.eye(q.shape[-2], dtype=q.dtype) * jnp.sum(q * k, axis=-1)[..., None, :])
    lower = beta[..., :, None] * a_kk
    rhs = beta[..., :, None] * jnp.concatenate([v, k_decayed], axis=-1)
    solved = _einsum("...ij,...jk->...ik", _unit_lower_inverse(lower), rhs)
    u0, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
    return dict(q=q_decayed, w=w, u0=u0, m_qk=m_qk, k_to_end=k_to_end, decay=chunk_decay)


def _chunk_step(state, chunk):
    """One chunk of the recurrence for all (batch, head): state `[..., K, V]`."""
    u = chunk["u0"] - _einsum("...ck,...kv->...cv", chunk["w"], state)
    o = _einsum("...ck,...kv->...cv", chunk["q"], state) + _einsum("...ij,...jv->...iv", chunk["m_qk"], u)
    state = chunk["decay"][..., :, None] * state + _einsum("...ck,...cv->...kv", chunk["k_to_end"], u)
    return state, o


def _to_chunks(x: jax.Array, num_chunks: int, c: int) -> jax.Array:
    """`[B, num_chunks * C, HV, ...]` -> `[num_chunks, B, HV, C, ...]`."""
    b, _, hv = x.shape[:3]
    x = x.reshape(b, num_chunks, c, hv, *x.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)


def _from_chunks(x: jax.Array) -> jax.Array:
    """`[num_chunks, B, HV, C, V]` -> `[B, num_chunks * C, HV, V]`."""
    n, b, hv, c, vdim = x.shape
    return jnp.moveaxis(x, 0, 1).transpose(0, 1, 3, 2, 4).reshape(b, n * c, hv, vdim)


# Blocks: the call runs as a scan over blocks of chunks, each block's token-wise inputs and
# state-independent chunk tensors made when the block runs (about 8x its inputs' bytes: fp32, and
# several tensors a token), so the temporary memory is a block's, not the call's. A block is at
# most 1/BLOCKS_PER_CALL of the call's chunks (a long call's temporaries are then about 13 % of its
# inputs) and at least `min_block_token_heads` token x value-head pairs (small calls run as one
# block). That floor depends on the platform. On a GPU each block costs a fixed 0.1-0.2 ms of
# kernel launches and loop steps, whatever its size: on an H100 (benchmarks/xla_path.py), 16
# blocks of 2^14 made an 8K-token x 32-head call 36 % slower than one block, 4 blocks of 2^16 21 %,
# and jax.grad 28 % and 2 %. On a CPU smaller blocks are faster (they stay in cache): 16K x 4 heads
# took 356 ms in 4 blocks of 2^14 and 493 ms as one block.
BLOCKS_PER_CALL = 64
MIN_BLOCK_TOKEN_HEADS = 1 << 16  # GPUs and every platform but the CPU (TPUs: not measured)
MIN_BLOCK_TOKEN_HEADS_CPU = 1 << 14
# Chunk steps per iteration of the loops that walk a block's chunks (lax.scan's `unroll`): one step,
# as measured above; benchmarks/xla_path.py --unroll times others.
CHUNK_STEPS_PER_ITERATION = 1


def block_platform(platforms) -> str:
    """The platform whose block size a program lowered for `platforms` (jax's names) uses: the CPU's
    only where every one is the CPU (a multi-platform lowering of one rule, as jax.export makes)."""
    return "cpu" if all(p == "cpu" for p in platforms) else next(p for p in platforms if p != "cpu")


def min_block_token_heads(platform: str | None) -> int:
    """The least token x value-head pairs of a block on `platform`, a jax platform name ("cpu",
    "cuda", "gpu", "tpu", ...); None: the default device's (the platform a traced call runs on
    unless it is placed elsewhere)."""
    if platform is None:
        device = dispatch.default_device()
        platform = device and device.platform
    return MIN_BLOCK_TOKEN_HEADS_CPU if platform == "cpu" else MIN_BLOCK_TOKEN_HEADS


def chunks_per_block(num_chunks: int, token_heads_per_chunk: int, platform: str | None) -> int:
    """How many chunks a block of the scan holds on `platform` (static; see BLOCKS_PER_CALL)."""
    least = -(-min_block_token_heads(platform) // max(token_heads_per_chunk, 1))
    return max(1, min(num_chunks, max(-(-num_chunks // BLOCKS_PER_CALL), least)))


def prefill(cfg: PrefillConfig, ops: Operands, *, chunk_size: int = CHUNK_SIZE, platform: str | None = None):
    """The XLA path of `jax_kda.prefill` for a validated call, lowered for `platform` (None: the
    default device's; it sets only the block size). Returns (o, final_state or None)."""
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    compute = jnp.promote_types(jnp.dtype(cfg.dtype), jnp.float32)
    n, hv, kdim, vdim = cfg.num_seqs, cfg.num_v_heads, cfg.head_k, cfg.head_v
    if ops.initial_state is None:
        state0 = jnp.zeros((n, hv, kdim, vdim), compute)
    else:
        state0 = ops.initial_state.astype(compute)
        if cfg.state_v_first:
            state0 = jnp.swapaxes(state0, -1, -2)
    tokens = (ops.q, ops.k, ops.v, ops.g, ops.beta)
    # Inside jax.shard_map the scans' carries must vary over the same mesh axes as what updates
    # them: any operand (a state or dt_bias may vary over more axes than the tokens).
    operands = jax.tree.leaves(ops)
    state0 = _varying_like(state0, *operands)
    o0 = _varying_like(jnp.zeros((cfg.batch, cfg.seqlen, hv, vdim), jnp.dtype(cfg.dtype)), *operands)
    # Cast once, outside the blocks: their gradients then add up across the blocks in fp32.
    A_log, dt_bias = (None if x is None else x.astype(compute) for x in (ops.A_log, ops.dt_bias))
    token_inputs = functools.partial(_token_inputs, cfg, compute, A_log, dt_bias)
    if cfg.seqlen == 0 or n == 0:
        o, final = o0, state0
    elif cfg.varlen:
        o, final = _prefill_packed(cfg, tokens, token_inputs, state0, o0, ops.cu_seqlens, chunk_size, platform)
    else:
        o, final = _prefill_dense(cfg, tokens, token_inputs, state0, o0, chunk_size, platform)
    if not cfg.output_final_state:
        return o, None
    if cfg.state_v_first:
        final = jnp.swapaxes(final, -1, -2)
    return o, final.astype(jnp.dtype(cfg.state_dtype))


def _token_inputs(cfg, compute, A_log, dt_bias, real, q, k, v, g, beta):
    """A block's token-wise inputs, `[B, L, H or HV, ...]` as given, made ready for the chunk
    algorithm: `compute` dtype (fp32, float64 for float64 input; A_log and dt_bias come in it), q/k
    l2-normalised, the gate as log-decay, beta activated, q/k repeated over their value heads;
    tokens where `real` `[B, L]` is False (past the end, padding) are zeros, which leave the state
    untouched."""
    q, k, v, g, beta = (x.astype(compute) for x in (q, k, v, g, beta))
    if cfg.use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    g = log_decay(g, cfg.gate_mode, A_log=A_log, dt_bias=dt_bias, lower_bound=cfg.lower_bound)
    beta = beta_activation(beta, cfg.use_beta_sigmoid)
    if cfg.group_size > 1:
        q = jnp.repeat(q, cfg.group_size, axis=2)
        k = jnp.repeat(k, cfg.group_size, axis=2)

    def masked(x):
        return jnp.where(real.reshape(real.shape + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))

    return tuple(masked(x) for x in (q, k, v, g, beta))


def _block_chunks(cfg, inputs, num_chunks, c):
    """The state-independent tensors of a block's chunks, `[num_chunks, B, HV, C, ...]`."""
    return _prepare_chunks(*(_to_chunks(x, num_chunks, c) for x in inputs), cfg.scale)


def _prefill_dense(cfg, tokens, token_inputs, state0, o0, c, platform):
    t = cfg.seqlen
    num_chunks = -(-t // c)
    per_block = chunks_per_block(num_chunks, cfg.batch * cfg.num_v_heads * c, platform)
    length = per_block * c  # tokens a block

    def block(carry, index):
        state, o = carry
        pos = index * length + jnp.arange(length, dtype=jnp.int32)
        real = jnp.broadcast_to(pos < t, (cfg.batch, length))
        inputs = token_inputs(real, *(jnp.take(x, jnp.minimum(pos, t - 1), axis=1) for x in tokens))
        state, o_block = lax.scan(_chunk_step, state, _block_chunks(cfg, inputs, per_block, c),
                                  unroll=CHUNK_STEPS_PER_ITERATION)
        # Tokens past the end go to index t, which the update drops.
        o = o.at[:, jnp.where(pos < t, pos, t)].set(_from_chunks(o_block).astype(o.dtype), mode="drop")
        return (state, o), None

    # Rematerialized blocks: a gradient saves each block's carries, not its chunk tensors.
    (final, o), _ = lax.scan(jax.checkpoint(block), (state0, o0), jnp.arange(-(-num_chunks // per_block), dtype=jnp.int32))
    return o, final


def _prefill_packed(cfg, tokens, token_inputs, state0, o0, cu_seqlens, c, platform):
    """B == 1, N sequences given by a traced cu_seqlens, each laid out padded to a multiple of C
    tokens (the module docstring); a block is a range of that padded layout, gathered from the
    packed input when it runs."""
    t, n = cfg.seqlen, cfg.num_seqs
    # Malformed (non-monotone or out-of-range) cu_seqlens cannot be detected at trace time: they are
    # clipped so every index stays in bounds; the outputs are then unspecified but memory-safe.
    cu = jnp.clip(cu_seqlens.astype(jnp.int32), 0, t)
    starts = cu[:-1]
    lengths = jnp.maximum(cu[1:] - starts, 0)
    padded_lengths = (lengths + c - 1) // c * c
    pad_starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(padded_lengths)])
    num_chunks = -(-(t + n * (c - 1)) // c)
    per_block = chunks_per_block(num_chunks, cfg.num_v_heads * c, platform)
    length = per_block * c

    def block(carry, index):
        state, finals, o = carry
        # Padded position -> (sequence, source token).
        pos = index * length + jnp.arange(length, dtype=jnp.int32)
        seq = jnp.searchsorted(pad_starts[1:], pos, side="right").astype(jnp.int32)
        seq_safe = jnp.minimum(seq, n - 1)
        offset = pos - pad_starts[seq_safe]
        real = (seq < n) & (offset < lengths[seq_safe])
        src = jnp.clip(starts[seq_safe] + offset, 0, t - 1)
        inputs = token_inputs(real[None], *(jnp.take(x, src, axis=1) for x in tokens))
        first_pos, chunk_seq, chunk_real = pos[::c], seq_safe[::c], real[::c]
        chunk_first = chunk_real & (first_pos == pad_starts[chunk_seq])

        def step(carry, xs):
            state, finals = carry
            chunk, s, is_real, is_first = xs
            state = jnp.where(is_first, state0[s][None], state)
            new_state, o = _chunk_step(state, chunk)
            new_state = jnp.where(is_real, new_state, state)
            if finals is not None:
                finals = finals.at[s].set(jnp.where(is_real, new_state[0], finals[s]))
            return (new_state, finals), o

        (state, finals), o_block = lax.scan(step, (state, finals), (_block_chunks(cfg, inputs, per_block, c),
                                                                     chunk_seq, chunk_real, chunk_first),
                                            unroll=CHUNK_STEPS_PER_ITERATION)
        # Padding goes to index t, which the update drops.
        o = o.at[:, jnp.where(real, src, t)].set(_from_chunks(o_block).astype(o.dtype), mode="drop")
        return (state, finals, o), None

    finals0 = state0 if cfg.output_final_state else None
    carry = (jnp.zeros_like(state0[:1]), finals0, o0)
    (_, finals, o), _ = lax.scan(jax.checkpoint(block), carry, jnp.arange(-(-num_chunks // per_block), dtype=jnp.int32))
    return o, finals
