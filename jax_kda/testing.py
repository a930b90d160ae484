"""Named workloads and random inputs for them, shared by the tests, the benchmarks and the demo.

`make_inputs` draws fresh random data for a `Workload` (never zeros), on the host or, for benchmark-size
inputs, on the device: q/k/v normal, beta logits or values in (0, 1), and gates in one of the contract's
forms (docs/prefill.md). The gate draws cover the hard cases: very
negative pre-activated decays (down to `decay_floor` per token) and long memory (decays near 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Workload:
    """One prefill problem. `seqlens` set means packed sequences (B == 1, cu_seqlens)."""

    name: str
    batch: int = 1
    seqlen: int = 64  # T per row (ignored when seqlens is given)
    heads: int = 2  # H (q/k heads)
    v_heads: int | None = None  # HV (default H)
    head_k: int = 32
    head_v: int = 32
    seqlens: tuple[int, ...] | None = None
    gate: str = "lower_bound"  # "preactivated" | "softplus" | "lower_bound" | "lower_bound_no_a_log"
    decay_floor: float = -5.0  # preactivated gates: most negative log-decay per token
    long_memory: bool = False  # most channels decay by < 1e-3 per token
    lower_bound: float = -5.0
    initial_state: bool = True
    output_final_state: bool = True
    state_v_first: bool = False
    l2norm: bool = True
    beta_sigmoid: bool = True
    dtype: str = "bfloat16"
    g_dtype: str | None = None  # default: bfloat16 for bf16 inputs (as models usually pass it), else float32
    beta_dtype: str | None = None  # likewise

    @property
    def num_v_heads(self) -> int:
        return self.heads if self.v_heads is None else self.v_heads

    @property
    def total_tokens(self) -> int:
        return sum(self.seqlens) if self.seqlens is not None else self.batch * self.seqlen


class _HostDraws:
    """Draws on the host with numpy's generator (float64, cast to float32 as make_inputs says)."""

    xp = np

    def __init__(self, rng: np.random.Generator):
        self._rng = rng

    def normal(self, shape, scale=1.0):
        return (scale * self._rng.standard_normal(shape)).astype(np.float32)

    def uniform(self, low, high, shape):
        return self._rng.uniform(low, high, shape)


def _as_shape(shape) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int) else tuple(shape)


class _DeviceDraws:
    """Draws on JAX's default device with `jax.random` (float32), keyed by a seed taken from the
    caller's generator, so each run's inputs are as fresh as the host's; a benchmark's gigabytes of
    inputs take milliseconds this way instead of numpy's tens of seconds."""

    xp = jnp

    def __init__(self, rng: np.random.Generator):
        self._key = jax.random.key(int(rng.integers(2**31)))

    def _next_key(self):
        self._key, key = jax.random.split(self._key)
        return key

    def normal(self, shape, scale=1.0):
        return scale * jax.random.normal(self._next_key(), _as_shape(shape), jnp.float32)

    def uniform(self, low, high, shape):
        return jax.random.uniform(self._next_key(), _as_shape(shape), jnp.float32, low, high)


def make_inputs(w: Workload, rng: np.random.Generator, *, on_device: bool = False) -> tuple[tuple, dict]:
    """Returns `(args, kwargs)` for `jax_kda.prefill(*args, **kwargs)` as jax arrays.

    q/k/v are drawn in float32 and cast to `w.dtype`; g and beta in `w.g_dtype` / `w.beta_dtype`
    (default: bfloat16 when `w.dtype` is bfloat16, else float32), A_log/dt_bias/initial_state float32.
    The draws come from `rng` on the host, or with `on_device` from `jax.random` on JAX's default
    device, seeded from `rng` (same distributions; for inputs too large to draw on the host quickly).
    """
    draw = _DeviceDraws(rng) if on_device else _HostDraws(rng)
    xp = draw.xp
    dtype = jnp.dtype(w.dtype)
    default_gate_dtype = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32
    g_dtype = jnp.dtype(w.g_dtype) if w.g_dtype else default_gate_dtype
    beta_dtype = jnp.dtype(w.beta_dtype) if w.beta_dtype else default_gate_dtype
    if w.seqlens is not None:
        b, t = 1, sum(w.seqlens)
        n = len(w.seqlens)
    else:
        b, t, n = w.batch, w.seqlen, w.batch
    h, hv, kd, vd = w.heads, w.num_v_heads, w.head_k, w.head_v

    q = draw.normal((b, t, h, kd))
    k = draw.normal((b, t, h, kd))
    v = draw.normal((b, t, hv, vd))
    kwargs: dict = dict(
        use_qk_l2norm_in_kernel=w.l2norm,
        use_beta_sigmoid_in_kernel=w.beta_sigmoid,
        state_v_first=w.state_v_first,
        output_final_state=w.output_final_state,
    )
    if not w.l2norm:  # keep the recurrence stable without normalisation: |k| ~ 1
        q, k = q / np.sqrt(kd), k / np.sqrt(kd)
    beta = draw.normal((b, t, hv)) if w.beta_sigmoid else draw.uniform(0.05, 1.0, (b, t, hv)).astype(np.float32)

    if w.gate == "preactivated":
        # Log-uniform magnitudes from 1e-4 up to |decay_floor|: both long memory and -30..-60 decays.
        mags = xp.exp(draw.uniform(np.log(1e-4), np.log(-w.decay_floor), (b, t, hv, kd)))
        if w.long_memory:
            mags = xp.where(draw.uniform(0.0, 1.0, (1, 1, hv, kd)) < 0.5,
                            1e-4 * draw.uniform(0.0, 1.0, mags.shape), mags)
        g = (-mags).astype(np.float32)
    else:
        kwargs["use_gate_in_kernel"] = True
        g = draw.normal((b, t, hv, kd), scale=2.0)
        if w.long_memory:  # push half the channels' gates far negative: decays close to 0
            g = xp.where(draw.uniform(0.0, 1.0, (1, 1, hv, kd)) < 0.5, g - 12.0, g).astype(np.float32)
        kwargs["dt_bias"] = jnp.asarray(draw.normal((hv, kd), scale=0.5))
        if w.gate == "softplus":
            kwargs["A_log"] = jnp.asarray(draw.uniform(-1.0, 1.0, hv).astype(np.float32))
        elif w.gate == "lower_bound":
            kwargs["A_log"] = jnp.asarray(draw.uniform(-1.0, 1.0, hv).astype(np.float32))
            kwargs["lower_bound"] = w.lower_bound
        elif w.gate == "lower_bound_no_a_log":
            kwargs["lower_bound"] = w.lower_bound
        else:
            raise ValueError(f"unknown gate {w.gate!r}")

    if w.initial_state:
        shape = (n, hv, vd, kd) if w.state_v_first else (n, hv, kd, vd)
        kwargs["initial_state"] = jnp.asarray(draw.normal(shape, scale=0.5))
    if w.seqlens is not None:
        kwargs["cu_seqlens"] = jnp.asarray(np.concatenate([[0], np.cumsum(w.seqlens)]).astype(np.int32))
    args = (
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(g, g_dtype),
        jnp.asarray(beta, beta_dtype),
    )
    return args, kwargs


_D = dict(head_k=128, head_v=128)
W = Workload

# The accuracy matrix every backend is tested on (K = V = 128, bf16, the kernels' shapes): both gate
# forms and pre-activated gates down to -60 per token, long memory, T = 0, 1, 15, 16, 17, 33 and
# long, H = 1 and H = 12, grouped value heads, packed sequences with zero-length ones, B > 1, both
# state layouts, with and without the states. tests/test_prefill_matrix.py runs it over the XLA path
# and every kernel build the machine can run; tests/sanitize_prefill.py runs it under
# compute-sanitizer.
ACCURACY_MATRIX = (
    W("t0", seqlen=0, **_D),
    W("t1", seqlen=1, **_D),
    W("t15", seqlen=15, **_D),
    W("t16", seqlen=16, **_D),
    W("t17", seqlen=17, **_D),
    W("t33_h1", seqlen=33, heads=1, **_D),
    W("h12_t100", seqlen=100, heads=12, **_D),
    W("batch3_t70", batch=3, seqlen=70, **_D),
    W("softplus", seqlen=300, gate="softplus", **_D),
    W("lower_bound_no_a_log", seqlen=300, gate="lower_bound_no_a_log", **_D),
    W("pre_minus30", seqlen=300, gate="preactivated", decay_floor=-30.0, **_D),
    W("pre_minus60", seqlen=300, gate="preactivated", decay_floor=-60.0, **_D),
    W("long_memory_lb", seqlen=4096, heads=2, long_memory=True, lower_bound=-1.0, **_D),
    W("long_memory_softplus", seqlen=2048, heads=2, gate="softplus", long_memory=True, **_D),
    W("gqa_v_first", seqlen=200, heads=2, v_heads=8, state_v_first=True, **_D),
    W("no_initial_state", seqlen=100, initial_state=False, **_D),
    W("no_final_state", seqlen=100, output_final_state=False, **_D),
    W("flags_off", seqlen=100, l2norm=False, beta_sigmoid=False, gate="preactivated", **_D),
    W("packed_mixed", seqlens=(13, 0, 64, 1, 100, 0, 31, 16, 17), heads=3, v_heads=12, **_D),
    W("packed_leading_empty", seqlens=(0, 0, 250, 17), gate="softplus", state_v_first=True, **_D),
    W("packed_all_empty", seqlens=(0, 0), **_D),
    # fp32 and mixed g / beta (a gate computed in fp32 apart from the model's bf16 activations), every
    # gate form, packed too; the kernels read them as given.
    W("f32_gates_lower_bound", seqlen=300, g_dtype="float32", beta_dtype="float32", **_D),
    W("f32_gates_softplus_long_memory", seqlen=2048, gate="softplus", long_memory=True, g_dtype="float32",
      beta_dtype="float32", **_D),
    W("f32_gates_pre_minus60", seqlen=300, gate="preactivated", decay_floor=-60.0, g_dtype="float32",
      beta_dtype="float32", **_D),
    W("f32_g_bf16_beta_no_a_log", seqlen=300, gate="lower_bound_no_a_log", g_dtype="float32", **_D),
    W("bf16_g_f32_beta_flags_off", seqlen=100, l2norm=False, beta_sigmoid=False, gate="preactivated",
      beta_dtype="float32", **_D),
    W("f32_gates_packed_mixed", seqlens=(13, 0, 64, 1, 100, 0, 31, 16, 17), heads=3, v_heads=12,
      g_dtype="float32", beta_dtype="float32", **_D),
)

# Intracard context parallelism forced onto small shapes: (workload, segments per sequence).
SEGMENTED_MATRIX = (
    (W("seg_dense_b2", batch=2, seqlen=300, heads=2, **_D), 3),
    (W("seg_packed", seqlens=(13, 0, 250, 1, 100), heads=3, v_heads=6, gate="softplus", **_D), 4),
    (W("seg_long_memory", seqlen=2048, heads=2, long_memory=True, lower_bound=-1.0, **_D), 8),
    (W("seg_h12_v_first_no_initial", seqlen=500, heads=12, state_v_first=True, initial_state=False, **_D), 5),
    (W("seg_pre_minus60", seqlen=200, gate="preactivated", decay_floor=-60.0, **_D), 2),
    (W("seg_no_final_state", seqlen=200, output_final_state=False, **_D), 2),
    (W("seg_gqa_v_first_state", seqlen=400, heads=2, v_heads=8, state_v_first=True, **_D), 3),
    # A long combine chain (16 segments, two sequences, a given state; 80-token segments, the last
    # shorter).
    (W("seg_16_dense_b2", batch=2, seqlen=1250, heads=3, **_D), 16),
    (W("seg_f32_gates_packed", seqlens=(13, 0, 250, 1, 100), heads=3, v_heads=6, gate="softplus",
       g_dtype="float32", beta_dtype="float32", **_D), 4),
)


def gold_kwargs(kwargs: dict) -> dict:
    """`prefill` kwargs as `jax_kda.gold.recurrence` takes them (numpy, no backend/output flags)."""
    out = {k: v for k, v in kwargs.items() if k not in ("backend", "output_final_state")}
    return {k: (np.asarray(v) if hasattr(v, "shape") else v) for k, v in out.items()}


def as_numpy64(args) -> list[np.ndarray]:
    """The (already rounded) inputs as float64 numpy arrays, for the gold recurrence."""
    return [np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in args]


# The accuracy bar of the tests (docs/prefill.md, "Accuracy"): err_ratio against the float64 gold.
ERR_RATIO_BAR = 5e-3


def check_against_gold(label: str, w: Workload, args, kwargs, o, final, bar: float = ERR_RATIO_BAR):
    """o and the final state of a prefill of `w` against the float64 recurrence on the same (rounded)
    inputs; raises AssertionError past `bar`. Prints the err_ratio lines tests/run_gpu.sh collects
    and returns (o err_ratio, state err_ratio or None)."""
    from jax_kda import gold

    gold_o, gold_final = gold.recurrence(*as_numpy64(args), **gold_kwargs(kwargs))
    o32 = np.asarray(jnp.asarray(o, jnp.float32))
    assert o.dtype == jnp.dtype(w.dtype) and o.shape == gold_o.shape, (o.dtype, o.shape, gold_o.shape)
    assert np.all(np.isfinite(o32)), f"{label}: o is not finite"
    o_err = gold.err_ratio(o32, gold_o)
    print(f"{label}: o err_ratio {o_err:.2e}")
    assert o_err <= bar, f"{label}: o err_ratio {o_err:.2e} > {bar}"
    if not w.output_final_state:
        assert final is None
        return o_err, None
    s_err = gold.err_ratio(np.asarray(final), gold_final)
    print(f"{label}: state err_ratio {s_err:.2e}")
    assert final.dtype == jnp.float32 and final.shape == gold_final.shape
    assert s_err <= bar, f"{label}: state err_ratio {s_err:.2e} > {bar}"
    return o_err, s_err


def _grid_case(name: str, heads: int, seqlen: int = 0, seqlens: tuple[int, ...] | None = None,
               gate_dtype: str | None = None) -> Workload:
    return Workload(
        name,
        seqlen=seqlen,
        seqlens=seqlens,
        heads=heads,
        head_k=128,
        head_v=128,
        gate="lower_bound",
        lower_bound=-5.0,
        state_v_first=True,
        dtype="bfloat16",
        g_dtype=gate_dtype,
        beta_dtype=gate_dtype,
    )


MIXED_SEQLENS = (1300, 547, 2048, 963, 271, 3063)
# A serving batch of short prompts: 48 of 100-900 tokens (drawn once, uniformly; 20757 tokens in all).
SHORT_MIXED_SEQLENS = (
    431, 254, 504, 766, 149, 174, 648, 196, 474, 696, 159, 619, 319, 138, 188, 544, 528, 171, 346,
    192, 664, 534, 160, 679, 226, 328, 745, 742, 696, 163, 690, 699, 506, 150, 326, 147, 670, 236,
    396, 529, 247, 653, 220, 684, 415, 673, 798, 285,
)

# The benchmark grid (benchmarks/BENCHMARK_H200.md): D = 128, bf16, lower-bound gate -5 with gate /
# beta sigmoid / l2norm in the kernel, fp32 initial and final state in the [N, H, V, K] layout.
BENCHMARK_GRID = (
    _grid_case("h96_fixed8k", 96, seqlen=8192),
    _grid_case("h96_mixed", 96, seqlens=MIXED_SEQLENS),
    _grid_case("h96_8x1k", 96, seqlens=(1024,) * 8),
    _grid_case("h64_fixed8k", 64, seqlen=8192),
    _grid_case("h64_fixed1k", 64, seqlen=1024),
    _grid_case("h32_fixed8k", 32, seqlen=8192),
    _grid_case("h32_fixed32k", 32, seqlen=32768),
    _grid_case("h12_fixed8k", 12, seqlen=8192),
    _grid_case("h8_fixed64k", 8, seqlen=65536),
    _grid_case("h16_8x4k", 16, seqlens=(4096,) * 8),
)

# More shapes of the serving regime, benchmarked next to the grid: 64 heads mixed and 8 x 1K packed,
# short prompts, long 96-head prompts.
EXTRA_CASES = (
    _grid_case("h64_mixed", 64, seqlens=MIXED_SEQLENS),
    _grid_case("h64_8x1k", 64, seqlens=(1024,) * 8),
    # Batches of short prompts (where each recurrence CTA runs few steps) and 96 heads at 32K.
    _grid_case("h32_128x128", 32, seqlens=(128,) * 128),
    _grid_case("h32_short_mixed", 32, seqlens=SHORT_MIXED_SEQLENS),
    _grid_case("h96_fixed32k", 96, seqlen=32768),
)
# What fp32 g and beta cost (a gate computed in fp32 apart from the model): grid shapes with both fp32.
GATE_DTYPE_CASES = (
    _grid_case("h96_fixed8k_f32gates", 96, seqlen=8192, gate_dtype="float32"),
    _grid_case("h32_fixed8k_f32gates", 32, seqlen=8192, gate_dtype="float32"),
    _grid_case("h8_fixed64k_f32gates", 8, seqlen=65536, gate_dtype="float32"),
)
BENCHMARK_CASES = {w.name: w for w in BENCHMARK_GRID + EXTRA_CASES + GATE_DTYPE_CASES}


def hbm_floor_bytes(w: Workload) -> int:
    """Fewest bytes a prefill must move: q, k, v, raw g, beta read once, o written once (q's dtype;
    g, beta in theirs), the fp32 state read and written once per sequence."""
    t, h, hv, k, v = w.total_tokens, w.heads, w.num_v_heads, w.head_k, w.head_v
    n = len(w.seqlens) if w.seqlens is not None else w.batch
    size = jnp.dtype(w.dtype).itemsize
    g_size = jnp.dtype(w.g_dtype).itemsize if w.g_dtype else size
    beta_size = jnp.dtype(w.beta_dtype).itemsize if w.beta_dtype else size
    per_token = size * (2 * h * k + 2 * hv * v) + g_size * hv * k + beta_size * hv
    return t * per_token + 2 * 4 * n * hv * k * v


def prefill_with_kernels(kernels, q, k, v, g, beta, *, num_segments: int | None = None, **kwargs):
    """`jax_kda.prefill(q, k, v, g, beta, **kwargs)` on the kernels of request `kernels` (a
    `contract.Kernels`), bypassing backend dispatch: testing only, e.g.
    `Kernels.MMA_SYNC_ON_SM90` (the Blackwell kernels built for sm_90a) on a Hopper GPU.
    `num_segments` overrides the planner's intracard context parallelism (None: its choice)."""
    from jax_kda import _native, dispatch, kernel
    from jax_kda.config import Operands, validate

    # Backend dispatch is what normally loads the extension and registers its target; do it here
    # (a no-op without the kernels, so this still lowers on a machine without a GPU).
    _native.registered_targets()
    if kwargs.get("cu_seqlens") is not None:
        kwargs["cu_seqlens"] = jnp.asarray(kwargs["cu_seqlens"])
    cfg = validate(q, k, v, g, beta, **kwargs)
    ops = Operands(q, k, v, g, beta, kwargs.get("A_log"), kwargs.get("dt_bias"), kwargs.get("cu_seqlens"),
                   kwargs.get("initial_state"))
    num_sms = dispatch.num_sms_of(dispatch.default_device())
    return kernel.prefill(ops, cfg, kernels, num_sms, num_segments=num_segments)
