"""Argument validation for `jax_kda.prefill` and the static description of one call.

Everything here runs at trace time on shapes, dtypes and Python values only (docs/prefill.md, "Errors"):
a bad call raises before anything is traced into the program, with a message that names the
argument, what was expected and what was given. The result, `PrefillConfig`, is frozen and
hashable; the backends and the planner read only it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from jax_kda.contract import BACKEND_KERNELS, GateMode

BACKENDS = ("auto", "xla", *BACKEND_KERNELS)

# Arguments that must be Python values (not traced) when `prefill` is jitted directly:
# `jax.jit(jax_kda.prefill, static_argnames=jax_kda.STATIC_ARGNAMES)`.
STATIC_ARGNAMES = (
    "scale",
    "output_final_state",
    "use_qk_l2norm_in_kernel",
    "use_gate_in_kernel",
    "lower_bound",
    "use_beta_sigmoid_in_kernel",
    "state_v_first",
    "state_in_place",
    "backend",
)


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Static facts of one `prefill` call: shapes, dtypes and flags, validated."""

    batch: int  # B
    seqlen: int  # T (tokens per row; the packed length with cu_seqlens)
    num_qk_heads: int  # H
    num_v_heads: int  # HV
    head_k: int  # K
    head_v: int  # V
    num_seqs: int  # N: B, or len(cu_seqlens) - 1
    dtype: str  # q/k/v dtype name
    g_dtype: str
    beta_dtype: str
    scale: float
    gate_mode: GateMode
    lower_bound: float  # 0.0 when the gate mode has none
    has_dt_bias: bool
    use_qk_l2norm: bool
    use_beta_sigmoid: bool
    state_v_first: bool
    has_initial_state: bool
    initial_state_dtype: str | None
    output_final_state: bool
    varlen: bool
    state_in_place: bool = False  # the kernels write the final state into initial_state's buffer

    @property
    def group_size(self) -> int:
        """Value heads per q/k head."""
        return self.num_v_heads // self.num_qk_heads

    @property
    def state_dtype(self) -> str:
        """The final state's dtype: float32, or float64 for float64 inputs (jax_enable_x64)."""
        return "float64" if self.dtype == "float64" else "float32"

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        n, hv, k, v = self.num_seqs, self.num_v_heads, self.head_k, self.head_v
        return (n, hv, v, k) if self.state_v_first else (n, hv, k, v)


@dataclasses.dataclass(frozen=True)
class Operands:
    """The arrays of one `prefill` call, as one pytree (absent optional ones are None)."""

    q: Any
    k: Any
    v: Any
    g: Any
    beta: Any
    A_log: Any = None
    dt_bias: Any = None
    cu_seqlens: Any = None
    initial_state: Any = None


jax.tree_util.register_dataclass(
    Operands,
    data_fields=["q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "initial_state"],
    meta_fields=[],
)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _dtype(x: Any) -> np.dtype:
    return np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)


def _is_float(dtype: np.dtype) -> bool:
    return bool(jax.numpy.issubdtype(dtype, jax.numpy.floating))


def _require_rank(name: str, x: Any, rank: int, layout: str) -> tuple[int, ...]:
    shape = _shape(x)
    if len(shape) != rank:
        raise ValueError(f"{name} must have rank {rank} ({layout}), got shape {shape} (rank {len(shape)})")
    return shape


def _require_float(name: str, x: Any) -> np.dtype:
    dtype = _dtype(x)
    if not _is_float(dtype):
        raise ValueError(f"{name} must have a floating-point dtype, got {dtype}")
    return dtype


def _static_bool(name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a static Python bool, got a traced value; when jitting prefill directly use "
            "jax.jit(jax_kda.prefill, static_argnames=jax_kda.STATIC_ARGNAMES)"
        )
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _static_float(name: str, value: Any) -> float:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a static Python float, got a traced value; when jitting prefill directly use "
            "jax.jit(jax_kda.prefill, static_argnames=jax_kda.STATIC_ARGNAMES)"
        )
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def validate(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    use_beta_sigmoid_in_kernel=False,
    state_v_first=False,
    state_in_place=False,
    backend="auto",
) -> PrefillConfig:
    """Checks a `prefill` call against the contract (docs/prefill.md) and returns its `PrefillConfig`.

    Takes `prefill`'s arguments with the same defaults; arrays may be `jax.ShapeDtypeStruct`s.

    Raises:
      ValueError: a shape, rank, dtype or value is outside the contract.
      TypeError: a static argument has the wrong type or is traced.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    b, t, h, kdim = _require_rank("q", q, 4, "[B, T, H, K]")
    k_shape = _require_rank("k", k, 4, "[B, T, H, K]")
    if k_shape != (b, t, h, kdim):
        raise ValueError(f"k must have the shape of q {(b, t, h, kdim)} ([B, T, H, K]), got {k_shape}")
    v_shape = _require_rank("v", v, 4, "[B, T, HV, V]")
    if v_shape[:2] != (b, t):
        raise ValueError(f"v must have B, T = {(b, t)} like q ([B, T, HV, V]), got shape {v_shape}")
    hv, vdim = v_shape[2], v_shape[3]
    if kdim == 0 or vdim == 0:
        raise ValueError(f"the head dims K (q's last) and V (v's last) must be positive, got K={kdim}, V={vdim}")
    if h == 0 or hv % h != 0 or hv == 0:
        raise ValueError(f"the number of value heads HV must be a positive multiple of H={h}, got HV={hv}")
    g_shape = _require_rank("g", g, 4, "[B, T, HV, K]")
    if g_shape != (b, t, hv, kdim):
        raise ValueError(f"g must have shape [B, T, HV, K] = {(b, t, hv, kdim)}, got {g_shape}")
    beta_shape = _require_rank("beta", beta, 3, "[B, T, HV]")
    if beta_shape != (b, t, hv):
        raise ValueError(f"beta must have shape [B, T, HV] = {(b, t, hv)}, got {beta_shape}")

    dtype = _require_float("q", q)
    for name, x in (("k", k), ("v", v)):
        if _dtype(x) != dtype:
            raise ValueError(f"{name} must have the dtype of q ({dtype}), got {_dtype(x)}")
    g_dtype = _require_float("g", g)
    beta_dtype = _require_float("beta", beta)

    if scale is None:
        scale_value = kdim**-0.5
    else:
        scale_value = _static_float("scale", scale)
        if not math.isfinite(scale_value):
            raise ValueError(f"scale must be finite, got {scale_value}")

    output_final_state = _static_bool("output_final_state", output_final_state)
    use_qk_l2norm = _static_bool("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    use_gate = _static_bool("use_gate_in_kernel", use_gate_in_kernel)
    use_beta_sigmoid = _static_bool("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)
    state_v_first = _static_bool("state_v_first", state_v_first)
    state_in_place = _static_bool("state_in_place", state_in_place)
    if state_in_place and (initial_state is None or not output_final_state):
        raise ValueError(
            "state_in_place=True writes the final state into initial_state's buffer, so it needs "
            f"initial_state and output_final_state=True; got initial_state="
            f"{'None' if initial_state is None else 'an array'}, output_final_state={output_final_state}"
        )

    if cu_seqlens is None:
        n = b
    else:
        cu_shape = _shape(cu_seqlens)
        if len(cu_shape) != 1 or cu_shape[0] < 1:
            raise ValueError(f"cu_seqlens must have shape [N+1] with N >= 0, got shape {cu_shape}")
        cu_dtype = _dtype(cu_seqlens)
        if cu_dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_dtype}")
        if b != 1:
            raise ValueError(f"cu_seqlens (packed sequences) requires B == 1, got B={b}")
        n = cu_shape[0] - 1

    state_dtype = None
    if initial_state is not None:
        expected = (n, hv, vdim, kdim) if state_v_first else (n, hv, kdim, vdim)
        layout = "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]"
        got = _shape(initial_state)
        if got != expected:
            raise ValueError(
                f"initial_state must have shape {layout} = {expected} (N={n} "
                f"{'sequences in cu_seqlens' if cu_seqlens is not None else '= B'}), got {got}"
            )
        state_dtype = _require_float("initial_state", initial_state)

    if lower_bound is not None:
        lb = _static_float("lower_bound", lower_bound)
        if not (-5.0 <= lb < 0.0):
            raise ValueError(f"lower_bound must be in [-5, 0), got {lb}")
    if use_gate:
        if lower_bound is None and A_log is None:
            raise ValueError(
                "use_gate_in_kernel=True needs A_log (softplus gate) or lower_bound (sigmoid gate); got neither"
            )
        if A_log is not None:
            a_shape = _shape(A_log)
            if a_shape != (hv,):
                raise ValueError(f"A_log must have shape [HV] = ({hv},), got {a_shape}")
            _require_float("A_log", A_log)
        if dt_bias is not None:
            d_shape = _shape(dt_bias)
            if d_shape not in ((hv, kdim), (hv * kdim,)):
                raise ValueError(f"dt_bias must have shape [HV, K] = {(hv, kdim)} or [HV*K] = ({hv * kdim},), got {d_shape}")
            _require_float("dt_bias", dt_bias)
        if lower_bound is None:
            gate_mode = GateMode.SOFTPLUS
        elif A_log is not None:
            gate_mode = GateMode.LOWER_BOUND_A_LOG
        else:
            gate_mode = GateMode.LOWER_BOUND
    else:
        for name, value in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if value is not None:
                raise ValueError(
                    f"{name} is only used with use_gate_in_kernel=True (g is taken as the log-decay otherwise); "
                    f"pass use_gate_in_kernel=True or drop {name}"
                )
        gate_mode = GateMode.PREACTIVATED

    return PrefillConfig(
        batch=b,
        seqlen=t,
        num_qk_heads=h,
        num_v_heads=hv,
        head_k=kdim,
        head_v=vdim,
        num_seqs=n,
        dtype=dtype.name,
        g_dtype=g_dtype.name,
        beta_dtype=beta_dtype.name,
        scale=scale_value,
        gate_mode=gate_mode,
        lower_bound=0.0 if lower_bound is None else float(lower_bound),
        has_dt_bias=dt_bias is not None,
        use_qk_l2norm=use_qk_l2norm,
        use_beta_sigmoid=use_beta_sigmoid,
        state_v_first=state_v_first,
        has_initial_state=initial_state is not None,
        initial_state_dtype=None if state_dtype is None else state_dtype.name,
        output_final_state=output_final_state,
        varlen=cu_seqlens is not None,
        state_in_place=state_in_place,
    )
