"""Named workloads and random inputs for them, shared by the tests, the benchmarks and the demo.

`make_inputs` draws fresh random data for a `Workload` (never zeros): q/k/v normal, beta logits or
values in (0, 1), and gates in one of the SPEC forms. The gate draws cover the hard cases: very
negative pre-activated decays (down to `decay_floor` per token) and long memory (decays near 0).
"""

from __future__ import annotations

import dataclasses

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

    @property
    def num_v_heads(self) -> int:
        return self.heads if self.v_heads is None else self.v_heads

    @property
    def total_tokens(self) -> int:
        return sum(self.seqlens) if self.seqlens is not None else self.batch * self.seqlen


def make_inputs(w: Workload, rng: np.random.Generator) -> tuple[tuple, dict]:
    """Returns `(args, kwargs)` for `jax_kda.prefill(*args, **kwargs)` as jax arrays.

    q/k/v are drawn in float32 and cast to `w.dtype`; g and beta are float32 (bfloat16 when
    `w.dtype` is bfloat16, as the kernels take them), A_log/dt_bias/initial_state float32.
    """
    dtype = jnp.dtype(w.dtype)
    gate_dtype = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32
    if w.seqlens is not None:
        b, t = 1, sum(w.seqlens)
        n = len(w.seqlens)
    else:
        b, t, n = w.batch, w.seqlen, w.batch
    h, hv, kd, vd = w.heads, w.num_v_heads, w.head_k, w.head_v

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    q = normal(b, t, h, kd)
    k = normal(b, t, h, kd)
    v = normal(b, t, hv, vd)
    kwargs: dict = dict(
        use_qk_l2norm_in_kernel=w.l2norm,
        use_beta_sigmoid_in_kernel=w.beta_sigmoid,
        state_v_first=w.state_v_first,
        output_final_state=w.output_final_state,
    )
    if not w.l2norm:  # keep the recurrence stable without normalisation: |k| ~ 1
        q, k = q / np.sqrt(kd), k / np.sqrt(kd)
    beta = normal(b, t, hv) if w.beta_sigmoid else rng.uniform(0.05, 1.0, (b, t, hv)).astype(np.float32)

    if w.gate == "preactivated":
        # Log-uniform magnitudes from 1e-4 up to |decay_floor|: both long memory and -30..-60 decays.
        mags = np.exp(rng.uniform(np.log(1e-4), np.log(-w.decay_floor), (b, t, hv, kd)))
        if w.long_memory:
            mags = np.where(rng.uniform(size=(1, 1, hv, kd)) < 0.5, 1e-4 * rng.uniform(size=mags.shape), mags)
        g = (-mags).astype(np.float32)
    else:
        kwargs["use_gate_in_kernel"] = True
        g = normal(b, t, hv, kd, scale=2.0)
        if w.long_memory:  # push half the channels' gates far negative: decays close to 0
            g = np.where(rng.uniform(size=(1, 1, hv, kd)) < 0.5, g - 12.0, g).astype(np.float32)
        kwargs["dt_bias"] = jnp.asarray(normal(hv, kd, scale=0.5))
        if w.gate == "softplus":
            kwargs["A_log"] = jnp.asarray(rng.uniform(-1.0, 1.0, hv).astype(np.float32))
        elif w.gate == "lower_bound":
            kwargs["A_log"] = jnp.asarray(rng.uniform(-1.0, 1.0, hv).astype(np.float32))
            kwargs["lower_bound"] = w.lower_bound
        elif w.gate == "lower_bound_no_a_log":
            kwargs["lower_bound"] = w.lower_bound
        else:
            raise ValueError(f"unknown gate {w.gate!r}")

    if w.initial_state:
        shape = (n, hv, vd, kd) if w.state_v_first else (n, hv, kd, vd)
        kwargs["initial_state"] = jnp.asarray(normal(*shape, scale=0.5))
    if w.seqlens is not None:
        kwargs["cu_seqlens"] = jnp.asarray(np.concatenate([[0], np.cumsum(w.seqlens)]).astype(np.int32))
    args = (
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(g, gate_dtype),
        jnp.asarray(beta, gate_dtype),
    )
    return args, kwargs


def gold_kwargs(kwargs: dict) -> dict:
    """`prefill` kwargs as `jax_kda.gold.recurrence` takes them (numpy, no backend/output flags)."""
    out = {k: v for k, v in kwargs.items() if k not in ("backend", "output_final_state")}
    return {k: (np.asarray(v) if hasattr(v, "shape") else v) for k, v in out.items()}


def as_numpy64(args) -> list[np.ndarray]:
    """The (already rounded) inputs as float64 numpy arrays, for the gold recurrence."""
    return [np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in args]


def _grid_case(name: str, heads: int, seqlen: int = 0, seqlens: tuple[int, ...] | None = None) -> Workload:
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
    )


MIXED_SEQLENS = (1300, 547, 2048, 963, 271, 3063)

# shared/BENCHMARKS.md: D = 128, bf16, lower-bound gate -5 with gate / beta sigmoid / l2norm in the
# kernel, fp32 initial and final state in the [N, H, V, K] layout.
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

# Two of the six FlashKDA acceptance shapes (64 and 96 heads x fixed 8K, mixed, 8x1K) that
# shared/BENCHMARKS.md does not time (no FlashKDA or FLA figure there): benchmarked next to the grid.
EXTRA_CASES = (
    _grid_case("h64_mixed", 64, seqlens=MIXED_SEQLENS),
    _grid_case("h64_8x1k", 64, seqlens=(1024,) * 8),
)
BENCHMARK_CASES = {w.name: w for w in BENCHMARK_GRID + EXTRA_CASES}


def hbm_floor_bytes(w: Workload) -> int:
    """Fewest bytes a prefill must move: q, k, v, raw g, beta read once, o written once (bf16),
    the fp32 state read and written once per sequence."""
    t, h, hv, k, v = w.total_tokens, w.heads, w.num_v_heads, w.head_k, w.head_v
    n = len(w.seqlens) if w.seqlens is not None else w.batch
    per_token = 2 * (2 * h * k + hv * v + hv * k + hv + hv * v)
    return t * per_token + 2 * 4 * n * hv * k * v


# The Blackwell (sm_100a) prefill kernels, also built for sm_90a so that a Hopper GPU can test them.
MMA_ON_HOPPER_TARGET = "jax_kda_prefill_sm90_mma"


def prefill_on_target(target: str, q, k, v, g, beta, *, num_segments: int | None = None, **kwargs):
    """`jax_kda.prefill(q, k, v, g, beta, **kwargs)` run by the kernels behind custom call `target`,
    bypassing backend dispatch (testing only: e.g. MMA_ON_HOPPER_TARGET on a Hopper GPU).
    `num_segments` overrides the planner's intracard context parallelism (None: its choice)."""
    from jax_kda import _native, planner
    from jax_kda.api import kernel_prefill
    from jax_kda.config import validate

    # Backend dispatch is what normally loads the extension and registers its targets; do it here
    # (a no-op without the kernels, so this still lowers on a machine without a GPU).
    _native.registered_targets()
    if kwargs.get("cu_seqlens") is not None:
        kwargs["cu_seqlens"] = jnp.asarray(kwargs["cu_seqlens"])
    cfg = validate(q, k, v, g, beta, **kwargs)
    plan = planner.plan_prefill(cfg, num_segments=num_segments)
    return kernel_prefill(cfg, plan, target, q, k, v, g, beta, kwargs.get("A_log"), kwargs.get("dt_bias"),
                          kwargs.get("cu_seqlens"), kwargs.get("initial_state"))

