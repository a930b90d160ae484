"""The KDA gate activation by the CUDA kernel: custom call ``jax_kda_gate_activation``.

Computes the same log-decay as :func:`jax_kda.gates.log_decay` (SPEC.md §1 "Gate activation") with the
ahead-of-time compiled CuTe DSL kernel (csrc/kernels/gate_activation.py), from a bfloat16 raw gate into
float32. It is the smallest real piece of KDA on the native path, and proves that path end to end.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda import _native
from jax_kda.config import GateMode

FFI_TARGET = "jax_kda_gate_activation"

# SPEC.md §4: the lower-bound gates take lower_bound in [-5, 0).
LOWER_BOUND_RANGE = (-5.0, 0.0)

_KERNEL_GATE_MODES = (GateMode.SOFTPLUS, GateMode.LOWER_BOUND_A_LOG, GateMode.LOWER_BOUND)


def gate_activation(
    g: jax.Array,
    A_log: jax.Array | None,
    dt_bias: jax.Array | None,
    *,
    lower_bound: float | None,
    gate_mode: GateMode | int,
) -> jax.Array:
    """The natural-log decay from a raw gate, computed by the CUDA kernel.

    Args:
      g: ``[..., HV, K]`` bfloat16, the raw gate.
      A_log: ``[HV]`` float32 for ``SOFTPLUS`` and ``LOWER_BOUND_A_LOG``; None for ``LOWER_BOUND``.
      dt_bias: ``[HV, K]`` or ``[HV * K]`` float32, or None for zeros.
      lower_bound: a float in [-5, 0) for the ``LOWER_BOUND*`` modes; ignored by ``SOFTPLUS``.
      gate_mode: ``GateMode.SOFTPLUS``, ``LOWER_BOUND_A_LOG`` or ``LOWER_BOUND`` (1, 2, 3).

    Returns:
      ``[..., HV, K]`` float32, the log-decay (<= 0).

    Raises:
      ValueError: an argument has the wrong shape, dtype or value; the message names it.
      RuntimeError: the kernels are unavailable in this installation; the message says why.
    """
    mode = _check_gate_mode(gate_mode)
    if g.ndim < 2:
        raise ValueError(f"g must be [..., HV, K], got shape {g.shape}")
    if g.dtype != jnp.bfloat16:
        raise ValueError(f"g must be bfloat16 for the gate kernel, got {g.dtype}")
    num_heads, head_dim = g.shape[-2:]
    num_tokens = math.prod(g.shape[:-2])

    if mode == GateMode.LOWER_BOUND:
        if A_log is not None:
            raise ValueError("A_log must be None with GateMode.LOWER_BOUND (it uses sigmoid(g + dt_bias))")
        # The kernel does not read A_log in this mode; an empty buffer fills the operand slot.
        a_log = jnp.zeros((0,), jnp.float32)
    else:
        if A_log is None:
            raise ValueError(f"A_log [HV={num_heads}] is required with {mode!r}")
        _check_float32("A_log", A_log, [(num_heads,)])
        a_log = A_log

    if dt_bias is None:
        bias = jnp.zeros((num_heads * head_dim,), jnp.float32)
    else:
        _check_float32("dt_bias", dt_bias, [(num_heads, head_dim), (num_heads * head_dim,)])
        bias = jnp.reshape(dt_bias, (num_heads * head_dim,))

    if mode == GateMode.SOFTPLUS:
        bound = 0.0  # the attribute is always passed; this mode does not read it
    else:
        if lower_bound is None or not LOWER_BOUND_RANGE[0] <= lower_bound < LOWER_BOUND_RANGE[1]:
            raise ValueError(f"lower_bound must be a float in [-5, 0) with {mode!r}, got {lower_bound!r}")
        bound = float(lower_bound)

    _native.load()
    call = jax.ffi.ffi_call(
        FFI_TARGET,
        jax.ShapeDtypeStruct((num_tokens, num_heads, head_dim), jnp.float32),
        # A batched call loops over the batch: correct for any batching of the three operands.
        vmap_method="sequential",
    )
    decay = call(
        jnp.reshape(g, (num_tokens, num_heads, head_dim)),
        a_log,
        bias,
        # 32-bit attributes, as the handler binds them (plain Python numbers would become 64-bit).
        gate_mode=np.int32(mode),
        lower_bound=np.float32(bound),
    )
    return jnp.reshape(decay, g.shape)


def _check_gate_mode(gate_mode: GateMode | int) -> GateMode:
    try:
        mode = GateMode(gate_mode)
    except ValueError:
        mode = None
    if mode not in _KERNEL_GATE_MODES:
        names = ", ".join(f"{m.name} ({m.value})" for m in _KERNEL_GATE_MODES)
        raise ValueError(f"gate_mode must be one of {names}, got {gate_mode!r}")
    return mode


def _check_float32(name: str, x: jax.Array, shapes: list[tuple[int, ...]]) -> None:
    if tuple(x.shape) not in shapes:
        expected = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(f"{name} must have shape {expected}, got {list(x.shape)}")
    if x.dtype != jnp.float32:
        raise ValueError(f"{name} must be float32, got {x.dtype}")
