"""The float64 oracle: KDA as a token-by-token recurrence, straight from the contract (docs/prefill.md).

This is deliberately the simplest possible code (numpy, float64, one token at a time) and shares
nothing with the chunked XLA path or the kernels, so that agreement with it means something. Tests,
benchmarks and the demo measure every backend against it with `err_ratio`, the metric FLA and
FlashKDA report.
"""

from __future__ import annotations

import numpy as np


def err_ratio(x, gold) -> float:
    """RMS(x - gold) / RMS(gold), computed in float64. NaN anywhere gives NaN."""
    x = np.asarray(x, dtype=np.float64)
    gold = np.asarray(gold, dtype=np.float64)
    if x.shape != gold.shape:
        raise ValueError(f"shape mismatch: {x.shape} vs gold {gold.shape}")
    denom = np.sqrt(np.mean(gold**2)) if gold.size else 0.0
    num = np.sqrt(np.mean((x - gold) ** 2)) if gold.size else 0.0
    if denom == 0.0:
        return float(num)
    return float(num / denom)


def _softplus(x):
    return np.logaddexp(0.0, x)


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _log_decay(g, use_gate_in_kernel, A_log, dt_bias, lower_bound):
    """g: [T, HV, K] float64 -> the per-token natural-log decay, [T, HV, K]."""
    if not use_gate_in_kernel:
        return g
    hv, kdim = g.shape[1], g.shape[2]
    bias = np.zeros((hv, kdim)) if dt_bias is None else np.asarray(dt_bias, np.float64).reshape(hv, kdim)
    x = g + bias[None]
    if lower_bound is None:
        a = np.exp(np.asarray(A_log, np.float64))[None, :, None]
        return -a * _softplus(x)
    if A_log is not None:
        x = np.exp(np.asarray(A_log, np.float64))[None, :, None] * x
    return lower_bound * _sigmoid(x)


def _l2norm(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def recurrence(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    use_beta_sigmoid_in_kernel=False,
    state_v_first=False,
):
    """Float64 KDA forward, token by token. The arguments are `jax_kda.prefill`'s but for
    `output_final_state`, `state_in_place` and `backend`: the final state is always returned, and
    no input is validated (pass what prefill accepts).

    Returns:
      (o, final_state): o `[B, T, HV, V]` and the final state `[N, HV, K, V]` (or `[N, HV, V, K]`
      with `state_v_first`), both float64 numpy arrays.
    """
    q, k, v, g, beta = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta))
    b, t, h, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    group = hv // h
    scale = kdim**-0.5 if scale is None else float(scale)

    if cu_seqlens is None:
        spans = [(n, 0, t) for n in range(b)]
    else:
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        spans = [(0, int(cu[n]), int(cu[n + 1])) for n in range(len(cu) - 1)]

    o = np.zeros((b, t, hv, vdim))
    final = np.zeros((len(spans), hv, kdim, vdim))
    for n, (row, start, end) in enumerate(spans):
        if initial_state is None:
            state = np.zeros((hv, kdim, vdim))
        else:
            s0 = np.asarray(initial_state, dtype=np.float64)[n]
            state = np.swapaxes(s0, -1, -2).copy() if state_v_first else s0.copy()
        qs = np.repeat(q[row, start:end], group, axis=1)  # [L, HV, K]
        ks = np.repeat(k[row, start:end], group, axis=1)
        if use_qk_l2norm_in_kernel:
            qs, ks = _l2norm(qs), _l2norm(ks)
        decay = np.exp(_log_decay(g[row, start:end], use_gate_in_kernel, A_log, dt_bias, lower_bound))
        bt = beta[row, start:end]
        if use_beta_sigmoid_in_kernel:
            bt = _sigmoid(bt)
        for i in range(end - start):
            state = decay[i][:, :, None] * state
            predicted = np.einsum("hkv,hk->hv", state, ks[i])
            delta = bt[i][:, None] * (v[row, start + i] - predicted)
            state = state + ks[i][:, :, None] * delta[:, None, :]
            o[row, start + i] = scale * np.einsum("hkv,hk->hv", state, qs[i])
        final[n] = state
    if state_v_first:
        final = np.swapaxes(final, -1, -2)
    return o, final
