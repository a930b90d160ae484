"""Numpy model of the SM90 KDA prefill kernels' chunked algorithm (csrc/kernels/sm90).

This mirrors, step by step, what `prepare_chunks` and the recurrence (csrc/kernels/common/recurrence.py) compute, with
the same chunk size, the same exponent handling and the same rounding points: bf16 where the
recurrence feeds a tensor-core MMA (U as a hi + lo pair of bf16), TF32 where `prepare_chunks`
does (round to nearest, ties away; the fast path's pair-product factors truncated), fp32
elsewhere. Tests compare it against a float64
token-by-token recurrence, which validates the math before a GPU ever runs the kernels.

Conventions (all inside one sequence, one value head):
  G[i, d]   inclusive cumsum of the log2 decay over the chunk (G <= 0, non-increasing in i)
  fast path when min_d G[last, d] >= -FAST_PATH_RANGE: pair factors are taken relative to a
            per-channel reference G_ref = G[last] / 2, so every factor lies in
            [2^-(range/2), 2^(range/2)] and neither overflows nor underflows
  slow path otherwise: 2^(G_i - G_j) evaluated element-wise for i >= j (exponent <= 0), fp32
  TF32 operands (prepare_chunks' mma.sync m16n8k8): the fast path's three factor tiles, and on both
            paths W and k 2^G for neg_kw; all products accumulate in fp32
  U = W v in the recurrence: W (fp32 from the forward substitution) as two bf16 halves
            hi = bf16(W), lo = bf16(W - hi), v exact in bf16
"""

from __future__ import annotations

import numpy as np

CHUNK = 16
LOG2E = 1.4426950408889634
# Chunks whose total per-channel decay (log2) stays above -FAST_PATH_RANGE use factorized
# pair products; each factor is then bounded by 2^(FAST_PATH_RANGE / 2) = 2^100.
FAST_PATH_RANGE = 200.0

GATE_PREACTIVATED = 0
GATE_SOFTPLUS = 1
GATE_LOWER_BOUND_A_LOG = 2
GATE_LOWER_BOUND = 3


def bf16_round(x):
    """Round float32 values to bfloat16 (round-to-nearest-even) and return them as float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32).reshape(x.shape)


def tf32_round(x):
    """Round float32 values to TF32 as cvt.rna.tf32.f32 does (10 mantissa bits, nearest, ties
    away from zero) and return them as float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).reshape(x.shape)


def tf32_truncate(x):
    """Float32 values as a TF32 MMA operand that was given fp32 bits: the low 13 mantissa bits
    dropped (truncation toward zero)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).reshape(x.shape)


def _softplus(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def log2_decay(g, gate_mode, a_log, dt_bias, lower_bound):
    """Per-token log2 decay, fp32, from g [T, K] (one value head)."""
    g = g.astype(np.float32)
    if gate_mode == GATE_PREACTIVATED:
        ln_decay = g
    elif gate_mode == GATE_SOFTPLUS:
        ln_decay = -np.exp(np.float32(a_log)) * _softplus(g + dt_bias)
    elif gate_mode == GATE_LOWER_BOUND_A_LOG:
        ln_decay = lower_bound * _sigmoid(np.exp(np.float32(a_log)) * (g + dt_bias))
    else:
        ln_decay = lower_bound * _sigmoid(g + dt_bias)
    return (ln_decay * np.float32(LOG2E)).astype(np.float32)


def fp16_round(x):
    """Round float32 values to float16 (nearest even; overflow to inf) and return them as float32."""
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


# kr formats: "bf16" is the kernels' (one bf16 tile). "fp16_scaled" is a design studied for 32-token
# chunks, not built (benchmarks/chunk_model_study.py): row t of kr stored in fp16 after a power-of-two
# scale 2^-e_t (e_t from the row's largest magnitude, clamped to +-KR_EXPONENT_CLAMP), split exactly
# into bf16 hi + lo for the MMAs; mqk's column t is stored times 2^-e_t and U's row t multiplied by
# 2^e_t, so every product is the unscaled one (powers of two commute with bf16 rounding). "fp16" is
# the same without the scale (e_t = 0), for comparison.
KR_FORMATS = ("bf16", "fp16", "fp16_scaled")
KR_EXPONENT_CLAMP = 30


PAIR_PRODUCTS = ("chunk", "halves")


def _pair_products(q, k, G, scale):
    """The chunk's pair products, k_i k_j 2^(G_i - G_j) and scale q_i k_j 2^(G_i - G_j) summed over the
    channels (fp32; entries with i < j are garbage, the caller masks them), with the element-wise
    factors qd = scale q 2^G, kr = k 2^(G_last - G), k_dec = k 2^G; on the fast path when the whole
    chunk votes for it, else element-wise. Returns (a_kk, m_qk, qd, kr, k_dec, fast)."""
    g_last = G[-1]
    if g_last.min() >= -FAST_PATH_RANGE:
        ref = g_last * np.float32(0.5)
        ref_scale = np.exp2(ref)                      # 2^G = 2^(G - ref) 2^ref
        up, down = np.exp2(G - ref), np.exp2(ref - G)
        left, query, right = k * up, q * up, k * down
        # Entries with i < j may overflow here; they are discarded below (the kernel selects
        # them away). Entries with i >= j are bounded by |q_i| |k_j|.
        with np.errstate(over="ignore", invalid="ignore"):
            a_kk = tf32_truncate(left) @ tf32_truncate(right).T
            m_qk = tf32_truncate(query) @ tf32_truncate(right).T
        qd = query * (np.float32(scale) * ref_scale)
        kr = right * ref_scale
        k_dec = left * ref_scale
        return a_kk, m_qk, qd, kr, k_dec, True
    decay_ij = np.exp2(np.minimum(G[:, None, :] - G[None, :, :], 0.0))
    a_kk = np.einsum("id,jd,ijd->ij", k, k, decay_ij, dtype=np.float32)
    m_qk = np.einsum("id,jd,ijd->ij", q, k, decay_ij, dtype=np.float32)
    qd = scale * q * np.exp2(G)
    kr = k * np.exp2(g_last[None, :] - G)
    k_dec = k * np.exp2(G)
    return a_kk, m_qk, qd, kr, k_dec, False


def _pair_products_by_halves(q, k, G, scale):
    """`_pair_products` of a chunk as its two halves' own (each half on its own fast or slow path,
    its cumsum restarted at the half) plus the cross block (rows in the second half, columns in the
    first) from factors that never leave [0, |k|]: with G_mid the cumsum at the first half's end,
    k_i 2^(G_i - G_mid) (i in the second half) and k_j 2^(G_mid - G_j) (j in the first), both
    exponents <= 0, on TF32 MMAs (truncated, as the fast path's factors). So no vote over the whole
    chunk is needed, and no exponent of the chunk's full decay is ever formed. The element-wise
    factors are taken from the whole chunk's cumsum with exponents <= 0. Returns as
    `_pair_products`, fast = both halves on their fast path."""
    h = G.shape[0] // 2
    g_mid = G[h - 1]
    a_kk = np.zeros((2 * h, 2 * h), np.float32)
    m_qk = np.zeros((2 * h, 2 * h), np.float32)
    fast = True
    for lo, hi, base in ((0, h, np.zeros_like(g_mid)), (h, 2 * h, g_mid)):
        a, m, _, _, _, half_fast = _pair_products(q[lo:hi], k[lo:hi], (G[lo:hi] - base).astype(np.float32), scale)
        a_kk[lo:hi, lo:hi], m_qk[lo:hi, lo:hi] = a, m
        fast = fast and half_fast
    second = np.exp2(G[h:] - g_mid)                   # exponents <= 0
    first = np.exp2(g_mid - G[:h])                    # exponents <= 0
    right = tf32_truncate(k[:h] * first)
    a_kk[h:, :h] = tf32_truncate(k[h:] * second) @ right.T
    m_qk[h:, :h] = tf32_truncate(q[h:] * second) @ right.T
    qd = scale * q * np.exp2(G)
    kr = k * np.exp2(G[-1][None, :] - G)
    k_dec = k * np.exp2(G)
    return a_kk, m_qk, qd.astype(np.float32), kr.astype(np.float32), k_dec.astype(np.float32), fast


def prepare_chunk(q, k, v, g2, beta, scale, *, chunk=CHUNK, kr_format="bf16", pair_products="chunk"):
    """One chunk of `prepare_chunks`: inputs are fp32 [n, K] / [n, V] / [n] with n <= chunk
    already normalized and gated (g2 = per-token log2 decay). Returns the recurrence operands
    padded to `chunk` rows, rounded as the kernel stores them (`chunk`, `kr_format`,
    `pair_products`: the kernels' by default; see KR_FORMATS and PAIR_PRODUCTS: "halves" is
    `_pair_products_by_halves`, a design for 32-token chunks), and `fast`, whether the pair
    products took the fast path."""
    n = q.shape[0]
    kdim, vdim = k.shape[1], v.shape[1]
    pad = chunk - n

    def padrows(x):
        return np.concatenate([x, np.zeros((pad,) + x.shape[1:], np.float32)]) if pad else x

    q, k, v, g2, beta = padrows(q), padrows(k), padrows(v), padrows(g2), padrows(beta)
    G = np.cumsum(g2, axis=0, dtype=np.float32)
    g_last = G[-1]
    if pair_products == "chunk":
        a_kk, m_qk, qd, kr, k_dec, fast = _pair_products(q, k, G, scale)
    elif pair_products == "halves":
        a_kk, m_qk, qd, kr, k_dec, fast = _pair_products_by_halves(q, k, G, scale)
    else:
        raise ValueError(f"pair_products {pair_products!r} not in {PAIR_PRODUCTS}")
    strict = np.tril(np.ones((chunk, chunk), bool), -1)
    lower = np.where(strict, beta[:, None] * a_kk, 0.0).astype(np.float32)
    # (I + L)^-1 by forward substitution, one row at a time, as the kernel does.
    inv = np.zeros((chunk, chunk), np.float32)
    for i in range(chunk):
        row = np.zeros(chunk, np.float32)
        row[i] = 1.0
        for j in range(i):
            row -= lower[i, j] * inv[j]
        inv[i] = row
    w32 = (inv * beta[None, :]).astype(np.float32)
    w = tf32_round(w32)
    neg_kw = -(w @ tf32_round(k_dec))
    # The recurrence's U = W v: W as two bf16 halves (hi + lo), v exact in bf16, fp32 accumulate.
    w_hi = bf16_round(w32)
    w_lo = bf16_round(w32 - w_hi)
    vw = (w_hi @ v).astype(np.float32) + (w_lo @ v).astype(np.float32)
    mqk = np.where(np.tril(np.ones((chunk, chunk), bool)), scale * m_qk, 0.0).astype(np.float32)
    if kr_format == "bf16":
        kr_hi, kr_lo, u_scale = bf16_round(kr), None, None
    elif kr_format in ("fp16", "fp16_scaled"):
        top = np.abs(kr).max(axis=1)
        e = np.where(top > 0, np.ceil(np.log2(np.where(top > 0, top, 1.0))), 0.0)
        clamp = KR_EXPONENT_CLAMP if kr_format == "fp16_scaled" else 0
        e = np.clip(e, -clamp, clamp).astype(np.float32)
        kr16 = fp16_round(kr * np.exp2(-e)[:, None])
        kr_hi = bf16_round(kr16)
        kr_lo = bf16_round(kr16 - kr_hi)
        mqk = mqk * np.exp2(-e)[None, :]
        u_scale = np.exp2(e)
    else:
        raise ValueError(f"kr_format {kr_format!r} not in {KR_FORMATS}")
    return dict(
        neg_kw=bf16_round(neg_kw), qd=bf16_round(qd), kr=kr_hi, kr_lo=kr_lo, u_scale=u_scale,
        mqk=bf16_round(mqk), vw=vw.astype(np.float32), decay=np.exp2(g_last).astype(np.float32),
        n=n, fast=fast,
    )


def recurrence_chunk(state, ops):
    """One chunk of the recurrence on an fp32 state [K, V]; returns (o [n, V] bf16-rounded, state).
    U enters its two MMAs as two bf16 operands, hi = bf16(U) and lo = bf16(U - hi)."""
    s_bf = bf16_round(state)
    u = ops["vw"] + ops["neg_kw"] @ s_bf
    if ops["u_scale"] is not None:
        u = (u * ops["u_scale"][:, None]).astype(np.float32)
    u_hi = bf16_round(u)
    u_lo = bf16_round(u - u_hi)
    o = ops["qd"] @ s_bf + ops["mqk"] @ u_hi + ops["mqk"] @ u_lo
    state = ops["decay"][:, None] * state + ops["kr"].T @ u_hi + ops["kr"].T @ u_lo
    if ops["kr_lo"] is not None:
        state = state + ops["kr_lo"].T @ u_hi
    return bf16_round(o[: ops["n"]]), state.astype(np.float32)


def normalize(x):
    x = x.astype(np.float32)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(1e-6))


def lookahead_chunk(state, u_prev, ops_prev, ops, cross="bf16"):
    """One chunk of the lookahead recurrence (a design, not built): chunk c + 1's products taken from
    the decayed state of chunk c, A = decay_c * S_c, and chunk c's U, instead of from S_{c+1}:

        S_{c+1} = A + kr_c^T U_c                  (as today, fp32)
        U_{c+1} = vw + neg_kw A + (neg_kw kr_c^T) U_c
        O_{c+1} = qd A + (qd kr_c^T) U_c + mqk U_{c+1}

    so that U_{c+1} no longer waits for the state update of chunk c (the serial chain per chunk
    holds one MMA round trip instead of two). The two 16 x 16 cross products are formed on chip from
    bf16 operands in fp32, then enter their MMA as bf16 (`cross` "bf16") or as a hi + lo pair
    ("hi_lo"); U_c as its hi + lo pair, as today. `state` is S_c, `u_prev` U_c (fp32), `ops_prev`
    chunk c's operands; returns (o, S_{c+1}, U_{c+1})."""
    a = ops_prev["decay"][:, None] * state
    a_bf = bf16_round(a)
    up_hi = bf16_round(u_prev)
    up_lo = bf16_round(u_prev - up_hi)
    kr_prev = ops_prev["kr"]

    def cross_product(x):
        m = (x @ kr_prev.T).astype(np.float32)
        hi = bf16_round(m)
        if cross == "bf16":
            return hi @ up_hi + hi @ up_lo
        lo = bf16_round(m - hi)
        return hi @ up_hi + hi @ up_lo + lo @ up_hi

    u = ops["vw"] + ops["neg_kw"] @ a_bf + cross_product(ops["neg_kw"])
    u_hi = bf16_round(u)
    u_lo = bf16_round(u - u_hi)
    o = ops["qd"] @ a_bf + cross_product(ops["qd"]) + ops["mqk"] @ u_hi + ops["mqk"] @ u_lo
    new_state = a + kr_prev.T @ up_hi + kr_prev.T @ up_lo
    return bf16_round(o[: ops["n"]]), new_state.astype(np.float32), u.astype(np.float32)


RECURRENCES = ("serial", "lookahead", "lookahead_hi_lo")


def chunked_prefill(q, k, v, g, beta, *, scale, initial_state=None, gate_mode=GATE_PREACTIVATED,
                    a_log=None, dt_bias=None, lower_bound=-5.0, use_qk_l2norm=False,
                    use_beta_sigmoid=False, chunk=CHUNK, kr_format="bf16", pair_products="chunk",
                    recurrence="serial"):
    """Model of the kernels for one sequence. q, k [T, H, K]; v, g [T, HV, *]; beta [T, HV];
    initial_state [HV, K, V]. Returns o [T, HV, V] and the final state [HV, K, V] (fp32).
    `chunk`, `kr_format`, `pair_products` and `recurrence` default to the kernels'; other values
    model designs not built (`recurrence`: RECURRENCES, "lookahead*" is `lookahead_chunk`)."""
    if recurrence not in RECURRENCES:
        raise ValueError(f"recurrence {recurrence!r} not in {RECURRENCES}")
    if recurrence != "serial" and kr_format != "bf16":
        raise ValueError("the lookahead recurrence is modelled with bf16 kr only")
    t_len, h_q, kdim = q.shape
    hv_count, vdim = v.shape[1], v.shape[2]
    group = hv_count // h_q
    o = np.zeros((t_len, hv_count, vdim), np.float32)
    final = np.zeros((hv_count, kdim, vdim), np.float32)
    for hv in range(hv_count):
        qh, kh = q[:, hv // group].astype(np.float32), k[:, hv // group].astype(np.float32)
        if use_qk_l2norm:
            qh, kh = normalize(qh), normalize(kh)
        bh = beta[:, hv].astype(np.float32)
        if use_beta_sigmoid:
            bh = _sigmoid(bh).astype(np.float32)
        g2 = log2_decay(g[:, hv], gate_mode,
                        0.0 if a_log is None else a_log[hv],
                        np.zeros(kdim, np.float32) if dt_bias is None else dt_bias[hv],
                        np.float32(lower_bound))
        state = (np.zeros((kdim, vdim), np.float32) if initial_state is None
                 else initial_state[hv].astype(np.float32))
        ops_prev = u_prev = None
        for c0 in range(0, t_len, chunk):
            c1 = min(c0 + chunk, t_len)
            ops = prepare_chunk(qh[c0:c1], kh[c0:c1], v[c0:c1, hv].astype(np.float32),
                                g2[c0:c1], bh[c0:c1], np.float32(scale), chunk=chunk, kr_format=kr_format,
                                pair_products=pair_products)
            if recurrence == "serial":
                o[c0:c1, hv], state = recurrence_chunk(state, ops)
                continue
            if ops_prev is None:  # the first chunk: from the initial state, as the serial walk
                s_bf = bf16_round(state)
                u_prev = (ops["vw"] + ops["neg_kw"] @ s_bf).astype(np.float32)
                u_hi = bf16_round(u_prev)
                u_lo = bf16_round(u_prev - u_hi)
                o[c0:c1, hv] = bf16_round((ops["qd"] @ s_bf + ops["mqk"] @ u_hi + ops["mqk"] @ u_lo)[: ops["n"]])
            else:
                o[c0:c1, hv], state, u_prev = lookahead_chunk(
                    state, u_prev, ops_prev, ops, cross="hi_lo" if recurrence == "lookahead_hi_lo" else "bf16")
            ops_prev = ops
        if recurrence != "serial" and ops_prev is not None:  # the last chunk's state update
            u_hi = bf16_round(u_prev)
            state = (ops_prev["decay"][:, None] * state + ops_prev["kr"].T @ u_hi
                     + ops_prev["kr"].T @ bf16_round(u_prev - u_hi)).astype(np.float32)
        final[hv] = state
    return o, final
