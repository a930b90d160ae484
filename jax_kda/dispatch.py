"""Which backend serves a call, and why: `choose_backend` (used by `prefill` and `explain`).

"auto" takes the kernel for the device when every argument is eligible and falls back to "xla"
otherwise; the reasons are logged on the `jax_kda` logger (DEBUG) and returned by `explain`, so a
fallback is never silent guesswork. An explicitly requested kernel backend that cannot serve the
call raises a ValueError naming the argument and the limit.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from jax_kda import _native, planner
from jax_kda.config import PrefillConfig
from jax_kda.primitive import FFI_TARGETS

logger = logging.getLogger("jax_kda")

# Compute capabilities each kernel backend runs on.
# An "a" cubin runs only on its exact compute capability: sm_100a on 10.0, not 10.3 (B300).
BACKEND_CAPABILITIES = {"sm90": ("9.0",), "sm100": ("10.0",)}
KERNEL_DTYPES = ("bfloat16",)
KERNEL_GATE_DTYPES = ("bfloat16",)
KERNEL_HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class Decision:
    """The backend that runs a call and, when it is not the one asked for, why."""

    requested: str
    backend: str
    reasons: tuple[str, ...] = ()
    device: str | None = None
    plan: planner.RecurrencePlan | None = None  # how the kernels split the call (kernel backends)

    def __str__(self) -> str:
        head = f"backend={self.backend!r} (requested {self.requested!r}"
        head += f", device {self.device})" if self.device else ")"
        if self.plan is not None:
            p = self.plan
            head += f"\n  plan: V split {p.v_split}, chunk {p.chunk_size}"
            if p.num_segments > 1:
                head += f", {p.num_segments} segments of {p.segment_len} tokens per sequence (context parallel)"
            else:
                head += ", unsegmented"
        return head + "".join(f"\n  - {r}" for r in self.reasons)


def plan_for(cfg: PrefillConfig, device=None) -> planner.RecurrencePlan:
    """The kernel plan for `cfg` on `device` (default: the default device; its SM count)."""
    device = default_device() if device is None else device
    return planner.plan_prefill(cfg, num_sms=getattr(device, "core_count", planner.DEFAULT_NUM_SMS))


def argument_limits(cfg: PrefillConfig, backend: str) -> list[str]:
    """Reasons the kernels of `backend` cannot serve this call's arguments (empty if they can)."""
    reasons = []
    if cfg.head_k != KERNEL_HEAD_DIM or cfg.head_v != KERNEL_HEAD_DIM:
        reasons.append(f"{backend} needs K == V == {KERNEL_HEAD_DIM}, got K={cfg.head_k}, V={cfg.head_v}")
    if cfg.dtype not in KERNEL_DTYPES:
        reasons.append(f"{backend} needs q, k, v in bfloat16, got {cfg.dtype}")
    if cfg.g_dtype not in KERNEL_GATE_DTYPES:
        reasons.append(f"{backend} needs g in bfloat16, got {cfg.g_dtype}")
    if cfg.beta_dtype not in KERNEL_GATE_DTYPES:
        reasons.append(f"{backend} needs beta in bfloat16, got {cfg.beta_dtype}")
    if cfg.has_initial_state and cfg.initial_state_dtype != "float32":
        reasons.append(f"{backend} needs initial_state in float32, got {cfg.initial_state_dtype}")
    if cfg.num_seqs > planner.MAX_GRID_YZ or cfg.num_v_heads > planner.MAX_GRID_YZ:
        reasons.append(
            f"{backend} supports at most {planner.MAX_GRID_YZ} sequences and {planner.MAX_GRID_YZ} value heads "
            f"per call (CUDA grid limits), got N={cfg.num_seqs}, HV={cfg.num_v_heads}"
        )
    rows = planner.workspace_rows(cfg)
    if rows >= planner.MAX_WORKSPACE_ROWS:
        reasons.append(
            f"{backend} supports ((B*T) // 16 + N) * HV < {planner.MAX_WORKSPACE_ROWS} (32-bit workspace offsets), "
            f"got {rows} (B*T={cfg.batch * cfg.seqlen}, N={cfg.num_seqs}, HV={cfg.num_v_heads})"
        )
    return reasons


def build_limits(backend: str) -> list[str]:
    """Reasons this installation cannot run `backend` at all (extension, kernels, architecture)."""
    reason = _native.unavailable_reason()
    if reason is not None:
        return [f"{backend} kernels are unavailable: {reason}"]
    if FFI_TARGETS[backend] not in _native.registered_targets():
        return [
            f"{backend}: the KDA prefill kernels for this architecture are not in this build of jax_kda "
            "yet (only the XLA path serves prefill); use backend='xla' or 'auto'"
        ]
    return []


def default_device():
    """The device a call without placement runs on: `jax.default_device` if set, else the first."""
    device = jax.config.jax_default_device
    if isinstance(device, str):  # a platform name
        device = jax.devices(device)[0]
    if device is not None:
        return device
    try:
        return jax.devices()[0]
    except RuntimeError:
        return None


def device_backend(device) -> tuple[str | None, str]:
    """(kernel backend for `device` or None, a description of the device)."""
    if device is None:
        return None, "no device"
    if device.platform != "gpu":
        return None, f"{device.platform} device"
    cc = getattr(device, "compute_capability", None)
    name = f"{device.device_kind} (compute capability {cc})"
    for backend, ccs in BACKEND_CAPABILITIES.items():
        if cc in ccs:
            return backend, name
    return None, name


def kernel_limits(cfg: PrefillConfig, backend: str, device) -> list[str]:
    """Everything that stops `backend`'s kernels from serving this call on `device`."""
    found, desc = device_backend(device)
    if found != backend:
        needs = " or ".join(BACKEND_CAPABILITIES[backend])
        return [f"{backend} needs a GPU of compute capability {needs}; the default device is a {desc}"]
    return build_limits(backend) or argument_limits(cfg, backend)


def choose_backend(cfg: PrefillConfig, requested: str, device=None) -> Decision:
    """Resolves `requested` ("auto" | "xla" | "sm90" | "sm100") for this call.

    Raises:
      ValueError: an explicitly requested kernel backend cannot serve the call.
    """
    if requested == "xla":
        return Decision(requested, "xla")
    device = default_device() if device is None else device
    if requested == "auto":
        backend, desc = device_backend(device)
        if backend is None:
            decision = Decision(requested, "xla", (f"no jax_kda kernel for the default device: {desc}",), desc)
        else:
            reasons = kernel_limits(cfg, backend, device)
            decision = Decision(requested, "xla" if reasons else backend, tuple(reasons), desc)
        if decision.reasons:
            logger.debug("jax_kda.prefill: %s", decision)
        return decision
    reasons = kernel_limits(cfg, requested, device)
    if reasons:
        raise ValueError("; ".join(reasons))
    return Decision(requested, requested, (), device_backend(device)[1])
