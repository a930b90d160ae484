"""The SM90 kernels' chunked algorithm (tests/kda_chunk_model.py) against a float64 token recurrence.

Runs on CPU in seconds; it checks the math and the rounding points of the kernels, not the kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

import kda_chunk_model as model

K = V = 128
O_BAR = 5e-3
STATE_BAR = 5e-3
# The kernels' accuracy on the H200 on the long-memory case (benchmarks/BENCHMARK_H200.md's runs):
# what a change of the algorithm's chunk or roundings must keep.
LONG_MEMORY_O_BAR = 3.6e-3
LONG_MEMORY_STATE_BAR = 2.2e-3


def err_ratio(x, gold):
    return float(np.sqrt(np.mean((x - gold) ** 2)) / np.sqrt(np.mean(gold ** 2)))


def token_recurrence_f64(q, k, v, g, beta, *, scale, initial_state, gate_mode, a_log, dt_bias,
                         lower_bound, use_qk_l2norm, use_beta_sigmoid):
    """The recurrence of docs/prefill.md, float64, one token at a time."""
    t_len, h_q, _ = q.shape
    hv_count = v.shape[1]
    group = hv_count // h_q
    q, k, v, g, beta = (x.astype(np.float64) for x in (q, k, v, g, beta))
    o = np.zeros((t_len, hv_count, V))
    final = np.zeros((hv_count, K, V))
    for hv in range(hv_count):
        qh, kh = q[:, hv // group], k[:, hv // group]
        if use_qk_l2norm:
            qh = qh / np.sqrt(np.sum(qh * qh, -1, keepdims=True) + 1e-6)
            kh = kh / np.sqrt(np.sum(kh * kh, -1, keepdims=True) + 1e-6)
        b = beta[:, hv]
        if use_beta_sigmoid:
            b = 1.0 / (1.0 + np.exp(-b))
        x = g[:, hv] + (0.0 if dt_bias is None else dt_bias[hv].astype(np.float64))
        if gate_mode == model.GATE_PREACTIVATED:
            ln_decay = g[:, hv]
        elif gate_mode == model.GATE_SOFTPLUS:
            ln_decay = -np.exp(float(a_log[hv])) * np.logaddexp(0.0, x)
        elif gate_mode == model.GATE_LOWER_BOUND_A_LOG:
            ln_decay = lower_bound / (1.0 + np.exp(-np.exp(float(a_log[hv])) * x))
        else:
            ln_decay = lower_bound / (1.0 + np.exp(-x))
        s = np.zeros((K, V)) if initial_state is None else initial_state[hv].astype(np.float64)
        for t in range(t_len):
            s = np.exp(ln_decay[t])[:, None] * s
            u = b[t] * (v[t, hv] - s.T @ kh[t])
            s = s + np.outer(kh[t], u)
            o[t, hv] = scale * (s.T @ qh[t])
        final[hv] = s
    return o, final


def bf16(x):
    return model.bf16_round(np.asarray(x, np.float32))


def make_case(rng, t_len, h_q, hv_count, gate_mode, *, long_memory=False, strong_decay=None,
              with_state=True):
    q = bf16(rng.standard_normal((t_len, h_q, K)))
    k = bf16(rng.standard_normal((t_len, h_q, K)))
    v = bf16(rng.standard_normal((t_len, hv_count, V)))
    beta = bf16(rng.standard_normal((t_len, hv_count)))
    a_log = rng.uniform(-1.0, 1.0, hv_count).astype(np.float32)
    dt_bias = (0.5 * rng.standard_normal((hv_count, K))).astype(np.float32)
    if gate_mode == model.GATE_PREACTIVATED:
        if strong_decay is not None:
            g = -rng.uniform(0.0, strong_decay, (t_len, hv_count, K))
        else:
            g = np.log(rng.uniform(0.9, 1.0, (t_len, hv_count, K)))
        if long_memory:
            g[..., : K // 2] = -rng.uniform(0.0, 1e-4, (t_len, hv_count, K // 2))
    else:
        g = 2.0 * rng.standard_normal((t_len, hv_count, K))
        if long_memory:
            g[..., : K // 2] = -12.0
    g = bf16(g)
    state = (rng.standard_normal((hv_count, K, V)).astype(np.float32) if with_state else None)
    return dict(q=q, k=k, v=v, g=g, beta=beta, a_log=a_log, dt_bias=dt_bias,
                initial_state=state)


CASES = [
    # name, T, H, HV, gate_mode, extra
    ("preact_T1", 1, 1, 1, model.GATE_PREACTIVATED, {}),
    ("preact_T15", 15, 1, 2, model.GATE_PREACTIVATED, {}),
    ("preact_T16", 16, 1, 1, model.GATE_PREACTIVATED, {}),
    ("preact_T17", 17, 1, 1, model.GATE_PREACTIVATED, {}),
    ("preact_T33_gqa", 33, 1, 3, model.GATE_PREACTIVATED, {}),
    ("preact_minus60", 48, 1, 1, model.GATE_PREACTIVATED, dict(strong_decay=120.0)),
    ("preact_minus30_mixed", 64, 1, 1, model.GATE_PREACTIVATED, dict(strong_decay=30.0)),
    ("preact_long_memory", 512, 1, 1, model.GATE_PREACTIVATED, dict(long_memory=True)),
    ("softplus_T33", 33, 1, 1, model.GATE_SOFTPLUS, {}),
    ("softplus_long_memory", 512, 1, 1, model.GATE_SOFTPLUS, dict(long_memory=True)),
    ("lower_bound_alog_T100", 100, 1, 1, model.GATE_LOWER_BOUND_A_LOG, {}),
    ("lower_bound_T65_nostate", 65, 1, 1, model.GATE_LOWER_BOUND, dict(with_state=False)),
]


@pytest.mark.parametrize("name,t_len,h_q,hv_count,gate_mode,extra", CASES,
                         ids=[c[0] for c in CASES])
@pytest.mark.parametrize("use_qk_l2norm", [True, False], ids=["l2norm", "raw_qk"])
def test_chunked_model_matches_token_recurrence(name, t_len, h_q, hv_count, gate_mode, extra,
                                                use_qk_l2norm):
    rng = np.random.default_rng(abs(hash((name, use_qk_l2norm))) % 2**32)
    case = make_case(rng, t_len, h_q, hv_count, gate_mode, **extra)
    if not use_qk_l2norm:
        # Unnormalized keys of norm ~sqrt(K) make the delta rule unstable; scale them like
        # real pre-normalized projections.
        case["q"], case["k"] = bf16(case["q"] / np.sqrt(K)), bf16(case["k"] / np.sqrt(K))
    flags = dict(scale=K ** -0.5, gate_mode=gate_mode, a_log=case["a_log"],
                 dt_bias=case["dt_bias"], lower_bound=-5.0, use_qk_l2norm=use_qk_l2norm,
                 use_beta_sigmoid=True)
    args = (case["q"], case["k"], case["v"], case["g"], case["beta"])
    o, final = model.chunked_prefill(*args, initial_state=case["initial_state"], **flags)
    o_gold, final_gold = token_recurrence_f64(*args, initial_state=case["initial_state"], **flags)
    e_o, e_s = err_ratio(o, o_gold), err_ratio(final, final_gold)
    print(f"{name:28s} l2norm={use_qk_l2norm!s:5s} err_ratio o={e_o:.2e} state={e_s:.2e}")
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(final))
    assert e_o <= O_BAR, f"o err_ratio {e_o:.2e}"
    assert e_s <= STATE_BAR, f"state err_ratio {e_s:.2e}"


@pytest.mark.parametrize("pair_products", model.PAIR_PRODUCTS)
@pytest.mark.parametrize("key_scale", [None, 1e-6], ids=["keys", "tiny_keys"])
def test_fp16_scaled_kr_at_32_token_chunks_keeps_the_bar_and_beats_bf16_kr(key_scale, pair_products, fresh_seed):
    """A studied design, not built (benchmarks/chunk_model_study.py): 32-token chunks with kr in fp16
    under a per-token power-of-two scale meet the kernels' long-memory accuracy, with a final state
    more accurate than bf16 kr's at 32 tokens on the same inputs, also for keys far below fp16's
    normal range (no initial state, so that the keys' writes are all the state holds); with the
    pair products over the whole chunk or by 16-token halves."""
    case = make_case(np.random.default_rng(fresh_seed), 256, 1, 1, model.GATE_PREACTIVATED, long_memory=True,
                     with_state=key_scale is None)
    l2 = key_scale is None
    if key_scale is not None:
        case["q"], case["k"] = bf16(case["q"] / np.sqrt(K)), bf16(case["k"] / np.sqrt(K) * key_scale)
    flags = dict(scale=K ** -0.5, gate_mode=model.GATE_PREACTIVATED, a_log=case["a_log"],
                 dt_bias=case["dt_bias"], lower_bound=-5.0, use_qk_l2norm=l2, use_beta_sigmoid=True)
    args = (case["q"], case["k"], case["v"], case["g"], case["beta"])
    o_gold, final_gold = token_recurrence_f64(*args, initial_state=case["initial_state"], **flags)
    errors = {}
    for kr_format in ("fp16_scaled", "bf16"):
        o, final = model.chunked_prefill(*args, initial_state=case["initial_state"], chunk=32,
                                         kr_format=kr_format,
                                         pair_products=pair_products if kr_format == "fp16_scaled" else "chunk",
                                         **flags)
        errors[kr_format] = err_ratio(o, o_gold), err_ratio(final, final_gold)
        print(f"32-token chunks, kr {kr_format}, keys x {key_scale}: err_ratio o={errors[kr_format][0]:.2e} "
              f"state={errors[kr_format][1]:.2e}")
    e_o, e_s = errors["fp16_scaled"]
    assert e_o <= LONG_MEMORY_O_BAR and e_s <= LONG_MEMORY_STATE_BAR, (e_o, e_s)
    assert e_s < 0.75 * errors["bf16"][1], errors


@pytest.mark.parametrize("recurrence", ["lookahead", "lookahead_hi_lo"])
@pytest.mark.parametrize("t_len", [256, 250])
def test_lookahead_recurrence_keeps_the_bar(recurrence, t_len, fresh_seed):
    """A studied design, not built (benchmarks/chunk_model_study.py): the recurrence one chunk ahead
    (kda_chunk_model.lookahead_chunk), whose chunk c + 1 takes its products from chunk c's decayed
    state and U, meets the kernels' long-memory accuracy (a partial last chunk too); with its cross
    products as hi + lo pairs it stays within 5 % of the serial walk's errors on the same inputs."""
    case = make_case(np.random.default_rng(fresh_seed), t_len, 1, 2, model.GATE_PREACTIVATED, long_memory=True)
    flags = dict(scale=K ** -0.5, gate_mode=model.GATE_PREACTIVATED, a_log=case["a_log"],
                 dt_bias=case["dt_bias"], lower_bound=-5.0, use_qk_l2norm=True, use_beta_sigmoid=True)
    args = (case["q"], case["k"], case["v"], case["g"], case["beta"])
    o_gold, final_gold = token_recurrence_f64(*args, initial_state=case["initial_state"], **flags)
    errors = {}
    for walk in ("serial", recurrence):
        o, final = model.chunked_prefill(*args, initial_state=case["initial_state"], recurrence=walk, **flags)
        errors[walk] = err_ratio(o, o_gold), err_ratio(final, final_gold)
        print(f"{walk}: err_ratio o={errors[walk][0]:.2e} state={errors[walk][1]:.2e}")
    e_o, e_s = errors[recurrence]
    assert e_o <= LONG_MEMORY_O_BAR and e_s <= LONG_MEMORY_STATE_BAR, errors
    if recurrence == "lookahead_hi_lo":
        assert e_o <= 1.05 * errors["serial"][0] and e_s <= 1.05 * errors["serial"][1], errors


def saturated_lower_bound_case(rng, t_len=256):
    """((q, k, v, g, beta), flags, initial_state) of one head whose lower-bound gate is saturated
    (-5 a token, ln) on the first half of the channels and random on the rest."""
    case = make_case(rng, t_len, 1, 1, model.GATE_LOWER_BOUND)
    g = case["g"].copy()
    g[:, :, : K // 2] = 30.0  # sigmoid(30) = 1 in fp32: those channels decay -5 a token
    case["g"] = bf16(g)
    flags = dict(scale=K ** -0.5, gate_mode=model.GATE_LOWER_BOUND, a_log=case["a_log"],
                 dt_bias=case["dt_bias"], lower_bound=-5.0, use_qk_l2norm=True, use_beta_sigmoid=True)
    return (case["q"], case["k"], case["v"], case["g"], case["beta"]), flags, case["initial_state"]


def fast_path_per_chunk(args, flags, **design):
    """For a one-head case of `saturated_lower_bound_case`'s form: whether each full chunk's pair
    products took the fast path under `design` (prepare_chunk's chunk, kr_format, pair_products)."""
    q, k, v, g, beta = args
    chunk = design["chunk"]
    g2 = model.log2_decay(g[:, 0], flags["gate_mode"], flags["a_log"][0], flags["dt_bias"][0],
                          np.float32(flags["lower_bound"]))
    q, k = model.normalize(q[:, 0]), model.normalize(k[:, 0])
    v, beta = v[:, 0].astype(np.float32), model._sigmoid(beta[:, 0].astype(np.float32))
    return [model.prepare_chunk(q[c0:c0 + chunk], k[c0:c0 + chunk], v[c0:c0 + chunk], g2[c0:c0 + chunk],
                                beta[c0:c0 + chunk], np.float32(flags["scale"]), **design)["fast"]
            for c0 in range(0, q.shape[0] - chunk + 1, chunk)]


def test_32_token_pair_products_by_halves_keep_a_saturated_lower_bound_gate_on_the_fast_path():
    """A lower-bound gate saturated at -5 a token (ln) decays 32 tokens by 2^-231, past the fast
    path's 2^-200: whole-chunk pair products at 32 tokens go element-wise for every chunk. By
    16-token halves plus a cross block of bounded factors (the design benchmarks/chunk_model_study.py
    studies) they stay on the tensor-core path, and the result meets the bar."""
    args, flags, initial_state = saturated_lower_bound_case(np.random.default_rng())
    g2 = model.log2_decay(args[3][:, 0], model.GATE_LOWER_BOUND, 0.0, flags["dt_bias"][0], np.float32(-5.0))
    assert g2[:, 0].max() == np.float32(-5.0 * model.LOG2E)
    assert not any(fast_path_per_chunk(args, flags, chunk=32, kr_format="fp16_scaled", pair_products="chunk"))
    assert all(fast_path_per_chunk(args, flags, chunk=32, kr_format="fp16_scaled", pair_products="halves"))
    o_gold, final_gold = token_recurrence_f64(*args, initial_state=initial_state, **flags)
    o, final = model.chunked_prefill(*args, initial_state=initial_state, chunk=32,
                                     kr_format="fp16_scaled", pair_products="halves", **flags)
    e_o, e_s = err_ratio(o, o_gold), err_ratio(final, final_gold)
    print(f"saturated lower bound, 32-token chunks by halves: err_ratio o={e_o:.2e} state={e_s:.2e}")
    assert e_o <= O_BAR and e_s <= STATE_BAR, (e_o, e_s)


def test_slow_path_is_taken_for_strong_decay_and_fast_path_for_lower_bound_gate():
    """-60 per token must use the element-wise path; the lower-bound gate never needs it."""
    per_token_lb = np.full((model.CHUNK, K), -5.0 * model.LOG2E, np.float32)
    assert np.cumsum(per_token_lb, 0)[-1].min() >= -model.FAST_PATH_RANGE
    per_token_strong = np.full((model.CHUNK, K), -60.0 * model.LOG2E, np.float32)
    assert np.cumsum(per_token_strong, 0)[-1].min() < -model.FAST_PATH_RANGE


def test_tf32_round_keeps_ten_mantissa_bits_rounding_ties_away_from_zero():
    """The model's TF32 rounding is cvt.rna.tf32.f32: nearest, ties away, low 13 bits zero."""
    ulp = 2.0 ** -10  # TF32 spacing in [1, 2); it is 2 ulp in [2, 4)
    x = np.array([1 + ulp / 2, -(1 + ulp / 2), 1 + ulp / 2 - 2.0 ** -23, 3 + ulp, 3 + ulp / 2],
                 np.float32)
    expected = np.array([1 + ulp, -(1 + ulp), 1, 3 + 2 * ulp, 3], np.float32)
    rounded = model.tf32_round(x)
    assert np.array_equal(rounded, expected)
    assert np.all(rounded.view(np.uint32) & np.uint32(0x1FFF) == 0)


def _bounds(cu, n, total):
    bos = min(max(cu[n], 0), total)
    return bos, min(max(cu[n + 1], bos), total)


def _slot_chunk(cu, n_seqs, total, slot):
    """prepare_chunks' slot_chunk: (tok0, valid) of chunk slot `slot`, the owning sequence (the largest
    n with base(n) <= slot) found by bisection; (0, 0) below base(0) or with no sequence."""
    if n_seqs == 0:
        return 0, 0
    lo, hi = 0, n_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _bounds(cu, mid, total)[0] // 16 + mid <= slot:
            lo = mid
        else:
            hi = mid - 1
    bos, eos = _bounds(cu, lo, total)
    chunk = slot - (bos // 16 + lo)
    if chunk < 0:
        return 0, 0
    tok0 = bos + chunk * 16
    return tok0, max(min(eos - tok0, 16), 0)


def _item_table_walk(first, ctas, items, heads, lookup, table=128):
    """The (item, (tok0, valid)) a persistent CTA works through, as prepare_chunks_kernel reads them
    from its item table: filled for items first + e * ctas (e < table), then, whenever the entry
    index reaches `table`, refilled from the next item on."""
    def fill(window_item):
        return [lookup(i // heads) if i < items else (0, 0) for i in window_item + ctas * np.arange(table)]

    entries, entry, item = fill(first), 0, first
    while item < items:
        yield item, entries[entry]
        entry += 1
        if entry == table:
            entries, entry = fill(item + ctas), 0
        item += ctas


def test_item_table_gives_every_item_its_chunk():
    """prepare_chunks' persistent CTAs read each item's (tok0, valid) from a shared-memory table that
    each thread fills with one bisection (csrc/kernels/common/prepare_chunks.py, fill_item_table):
    the chunks of the sequence layout (sequence n's chunks c at slots base(n) + c), every item once,
    valid 0 for slots that belong to no chunk (tokens before cu_seqlens[0], zero-length sequences)."""
    rng = np.random.default_rng()
    for _ in range(300):
        lens = rng.choice([0, 0, 1, 5, 16, 17, 33, 100], size=rng.integers(1, 40))
        start = int(rng.choice([0, 0, 0, 7, 40]))  # tokens before the first sequence belong to none
        cu = (start + np.concatenate([[0], np.cumsum(lens)])).tolist()
        n_seqs, total = len(lens), cu[-1] + int(rng.choice([0, 0, 9]))
        expected = {}
        for n in range(n_seqs):
            bos, eos = cu[n], cu[n + 1]
            for c in range(max(1, -(-(eos - bos) // 16))):
                expected[bos // 16 + n + c] = (bos + 16 * c, max(min(eos - bos - 16 * c, 16), 0))
        heads, ctas = int(rng.integers(1, 6)), int(rng.integers(1, 40))
        table = int(rng.choice([1, 3, 128]))
        items = (total // 16 + n_seqs) * heads
        seen = []
        for first in range(min(ctas, items)):
            for item, (tok0, valid) in _item_table_walk(first, ctas, items, heads,
                                                        lambda slot: _slot_chunk(cu, n_seqs, total, slot), table):
                want_tok0, want_valid = expected.get(item // heads, (0, 0))
                assert valid == want_valid and (valid == 0 or tok0 == want_tok0), (cu, item)
                seen.append(item)
        assert sorted(seen) == list(range(items))


def test_slot_chunk_stays_in_bounds_on_malformed_cu_seqlens():
    """With a cu_seqlens that is not monotone, negative or past T, a slot may get a wrong chunk,
    but always tokens [tok0, tok0 + valid) inside [0, T) (the kernel reads only those)."""
    rng = np.random.default_rng()
    for _ in range(2000):
        n_seqs = int(rng.integers(0, 300))
        cu = rng.integers(-50, 5000, size=n_seqs + 1).tolist()
        total = int(rng.integers(0, 5000))
        for slot in rng.integers(0, total // 16 + n_seqs + 1, size=20):
            tok0, valid = _slot_chunk(cu, n_seqs, total, int(slot))
            assert 0 <= valid <= 16 and (valid == 0 or 0 <= tok0 and tok0 + valid <= total), (cu, total, slot)


def test_item_stepping_matches_division():
    """prepare_chunks' persistent CTAs step (slot, hv, hq) by num_ctas without dividing
    (csrc/kernels/common/prepare_chunks.py, advance_item); same coordinates as item // HV."""
    rng = np.random.default_rng()
    for _ in range(300):
        h_q = int(rng.integers(1, 9))
        group = int(rng.choice([1, 1, 2, 3, 4, 8]))
        hv_count = h_q * group
        ctas = int(rng.integers(1, 800))
        step_slot, step_hv = divmod(ctas, hv_count)
        step_hq, step_r = divmod(step_hv, group)
        first = int(rng.integers(0, ctas))
        slot, hv = divmod(first, hv_count)
        hq, r = divmod(hv, group)
        for item in range(first, first + 40 * ctas, ctas):
            assert (slot, hv, hq) == (item // hv_count, item % hv_count, (item % hv_count) // group)
            slot, hv, hq, r = slot + step_slot, hv + step_hv, hq + step_hq, r + step_r
            if r >= group:
                r, hq = r - group, hq + 1
            if hv >= hv_count:
                hv, hq, slot = hv - hv_count, hq - h_q, slot + 1


def test_transposed_butterfly_gives_each_lane_its_sum():
    """prepare_chunks' l2-norm reduction (warp_sums_of_squares): 32 values per lane (16 q, 16 k
    squares), 31 shuffles; lane l ends with the warp's total of value l."""
    rng = np.random.default_rng()
    q, k = rng.standard_normal((2, 32, 16))  # [lane, token]
    lanes = np.arange(32)
    upper = (lanes & 16) != 0
    keep = np.where(upper[:, None], k * k, q * q)
    send = np.where(upper[:, None], q * q, k * k)
    vals = keep + send[lanes ^ 16]
    for step in range(1, 5):
        half = 16 >> step
        upper = (lanes & half) != 0
        keep = np.where(upper[:, None], vals[:, half:2 * half], vals[:, :half])
        send = np.where(upper[:, None], vals[:, :half], vals[:, half:2 * half])
        vals = keep + send[lanes ^ half]
    want = np.concatenate([(q * q).sum(0), (k * k).sum(0)])
    np.testing.assert_allclose(vals[:, 0], want, rtol=1e-12)
