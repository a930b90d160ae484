"""Which backend serves a call, and why: `decide`, used by both `prefill` and `explain`.

At trace time only the arguments and the installation are judged: a call is *kernel-eligible* when
every argument is within the kernels' limits and the extension is installed. An eligible call with
backend="auto" is bound as the kernel primitive, which lowers to the kernels for CUDA and to the XLA
path for every other platform (`jax_kda.kernel`); so the platform is decided when the program is
lowered, whatever the default device of the tracing process. The one device fact used at trace time:
when the default device is a CUDA GPU the kernels do not support (e.g. compute capability 8.0),
"auto" takes the XLA path at once. Which compiled kernels run on a GPU (sm_90a, sm_100f
or sm_110f) is resolved by the FFI handler on the device itself.

An ineligible "auto" call takes the XLA path; the reasons are logged on the `jax_kda` logger (DEBUG)
and returned by `explain`. An explicitly requested kernel backend that cannot serve the call raises a
ValueError naming the argument and the limit.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from jax_kda import _native, contract, planner
from jax_kda.config import PrefillConfig
from jax_kda.contract import Kernels

logger = logging.getLogger("jax_kda")


@dataclasses.dataclass(frozen=True)
class Device:
    """What dispatch needs of a device: its platform, compute capability (CUDA) and SM count."""

    platform: str  # "gpu" for CUDA, "cpu", "tpu", ...
    compute_capability: str | None = None
    core_count: int = planner.DEFAULT_NUM_SMS
    device_kind: str = ""

    def __str__(self) -> str:
        if self.platform != "gpu":
            return f"{self.platform} device"
        if self.compute_capability is None:
            return "CUDA GPU of unknown compute capability"
        return f"{self.device_kind or 'CUDA GPU'} (compute capability {self.compute_capability})"


@dataclasses.dataclass(frozen=True)
class Decision:
    """The backend a call gets on a device, why, and (kernels) how the kernels split it."""

    requested: str
    backend: str  # what runs on `device`: "xla", "sm90", "sm100", or "unavailable"
    reasons: tuple[str, ...] = ()  # why the kernels do not serve the call there
    device: str | None = None
    plan: planner.RecurrencePlan | None = None  # the kernels' plan, when the call lowers to them on CUDA
    kernels: Kernels | None = None  # the custom call's request; None: the XLA path on every platform
    num_sms: int = planner.DEFAULT_NUM_SMS  # the SM count the plan is sized for

    def __str__(self) -> str:
        head = f"backend={self.backend!r} (requested {self.requested!r}"
        head += f", device {self.device})" if self.device else ")"
        if self.kernels is not None and self.backend not in contract.BACKEND_KERNELS:
            head += "\n  lowered for CUDA: the kernels (" + ", ".join(
                f"{name} on compute capability {' / '.join(contract.compute_capabilities(k))}"
                for name, k in contract.BACKEND_KERNELS.items()
                if self.kernels in (k, Kernels.FOR_DEVICE)) + ")"
        if self.plan is not None:
            p = self.plan
            head += f"\n  plan: V split {p.v_split}, chunk {p.chunk_size}"
            if p.num_segments > 1:
                head += f", {p.num_segments} segments of {p.segment_len} tokens per sequence (context parallel)"
            else:
                head += ", unsegmented"
            if p.piece_len:
                head += f"; cut along T into pieces of {p.piece_len} tokens, the state carried between them"
        return head + "".join(f"\n  - {r}" for r in self.reasons)


def argument_limits(cfg: PrefillConfig) -> list[str]:
    """Reasons the kernels cannot serve this call's arguments (empty if they can)."""
    reasons = []
    d = contract.HEAD_DIM
    if cfg.head_k != d or cfg.head_v != d:
        reasons.append(f"the kernels need K == V == {d}, got K={cfg.head_k}, V={cfg.head_v}")
    if cfg.dtype != contract.DTYPE:
        reasons.append(f"the kernels need q, k, v in {contract.DTYPE}, got {cfg.dtype}")
    for name, dtype in (("g", cfg.g_dtype), ("beta", cfg.beta_dtype)):
        if dtype not in contract.GATE_DTYPES:
            reasons.append(f"the kernels need {name} in {' or '.join(contract.GATE_DTYPES)}, got {dtype}")
    if cfg.has_initial_state and cfg.initial_state_dtype != contract.STATE_DTYPE:
        reasons.append(f"the kernels need initial_state in {contract.STATE_DTYPE}, got {cfg.initial_state_dtype}")
    if cfg.num_seqs > contract.MAX_GRID_YZ or cfg.num_v_heads > contract.MAX_GRID_YZ:
        reasons.append(
            f"the kernels support at most {contract.MAX_GRID_YZ} sequences and {contract.MAX_GRID_YZ} value heads "
            f"per call (CUDA grid limits), got N={cfg.num_seqs}, HV={cfg.num_v_heads}")
    # Long calls are cut along T (planner.piece_length); what must fit is the shortest piece, 16 tokens
    # of T: (slots + N) * HV rows, its slots 1 when packed and B when dense (16 tokens of every row).
    slots, what = (1, "(N + 1) * HV") if cfg.varlen else (cfg.batch, "2 * B * HV (dense)")
    rows = (slots + cfg.num_seqs) * cfg.num_v_heads
    if rows >= contract.MAX_WORKSPACE_ROWS:
        reasons.append(
            f"the kernels support {what} < {contract.MAX_WORKSPACE_ROWS} (32-bit workspace offsets), "
            f"got {rows} (N={cfg.num_seqs}, HV={cfg.num_v_heads})")
    return reasons


def build_limits() -> list[str]:
    """Reasons this installation cannot run the kernels at all (extension missing or unusable)."""
    reason = _native.unavailable_reason()
    return [] if reason is None else [f"the kernels are unavailable: {reason}"]


def default_device() -> Device | None:
    """The device a call without placement runs on: `jax.default_device` if set, else the first."""
    device = jax.config.jax_default_device
    if isinstance(device, str):  # a platform name
        device = jax.devices(device)[0]
    if device is None:
        try:
            device = jax.devices()[0]
        except RuntimeError:
            return None
    return as_device(device)


# Names of the CUDA platform: jax calls it "gpu" (Device.platform) and also accepts "cuda".
CUDA_PLATFORM_NAMES = ("gpu", "cuda")


def as_device(device) -> Device:
    """A `Device` from a jax device, a `Device`, a compute capability string such as "10.3", or a
    platform name: "gpu" / "cuda" is this host's first GPU if it has one, else a GPU of unknown
    compute capability; any other name ("cpu", "tpu", ...) is that platform (which is all the
    decision needs of it, and no backend is initialized for it)."""
    if isinstance(device, Device):
        return device
    if isinstance(device, str):
        if device[:1].isdigit():
            return Device("gpu", device, device_kind="NVIDIA GPU")
        platform = device.lower()
        if platform not in CUDA_PLATFORM_NAMES:
            return Device(platform)
        try:
            return as_device(jax.devices("gpu")[0])
        except RuntimeError:  # no GPU backend on this host
            return Device("gpu")
    return Device(device.platform, getattr(device, "compute_capability", None),
                  getattr(device, "core_count", None) or planner.DEFAULT_NUM_SMS, getattr(device, "device_kind", ""))


def device_backend(device: Device | None) -> str | None:
    """The kernel backend ("sm90", "sm100") that runs on `device`, or None."""
    if device is None or device.platform != "gpu":
        return None
    for name, kernels in contract.BACKEND_KERNELS.items():
        if device.compute_capability in contract.compute_capabilities(kernels):
            return name
    return None


def num_sms_of(device: Device | None) -> int:
    """The SM count the kernels' plan is sized for: `device`'s, planner.DEFAULT_NUM_SMS off a GPU."""
    return device.core_count if device is not None and device.platform == "gpu" else planner.DEFAULT_NUM_SMS


def plan_for(cfg: PrefillConfig, device: Device | None) -> planner.RecurrencePlan:
    """The kernel plan for `cfg` on `device` (the whole call; each device's shard is planned for its
    own shapes when the call is partitioned)."""
    return planner.plan_prefill(cfg, num_sms=num_sms_of(device))


def decide(cfg: PrefillConfig, requested: str, device=None, *, strict: bool = True) -> Decision:
    """Resolves `requested` ("auto" | "xla" | "sm90" | "sm100") for this call on `device` (default:
    the default device; a jax device, a `Device` or a compute capability such as "9.0").

    Raises:
      ValueError: with `strict`, an explicitly requested kernel backend cannot serve the call's
        arguments or this installation (the message names the argument and the limit).
    """
    defaulted = device is None
    device = default_device() if defaulted else as_device(device)
    where = None if device is None else str(device)
    if requested == "xla":
        return Decision(requested, "xla", device=where)
    reasons = argument_limits(cfg) + build_limits()
    if requested == "auto":
        if not reasons and device is not None and device.platform == "gpu" and device_backend(device) is None:
            reasons.append(f"no jax_kda kernel for {'the default device, ' if defaulted else ''}a {device}"
                           + ("" if device.compute_capability else
                              " (pass the device, or its compute capability such as device=\"9.0\")"))
        if reasons:
            decision = Decision(requested, "xla", tuple(reasons), where)
            logger.debug("jax_kda.prefill: %s", decision)
            return decision
        backend = device_backend(device) or "xla"
        return Decision(requested, backend, (), where, plan_for(cfg, device), Kernels.FOR_DEVICE, num_sms_of(device))
    kernels = contract.BACKEND_KERNELS[requested]
    if reasons:
        if strict:
            raise ValueError(f"backend={requested!r}: " + "; ".join(reasons))
        return Decision(requested, "unavailable", tuple(reasons), where)
    if device_backend(device) != requested:
        needs = " or ".join(contract.compute_capabilities(kernels))
        if device is not None and device.platform == "gpu" and device.compute_capability is None:
            reasons.append(f"{requested} runs on compute capability {needs}; this GPU's is not known (pass the "
                           "device, or its compute capability such as device=\"9.0\")")
        elif device is not None and device.platform != "gpu":
            reasons.append(f"{requested} runs on compute capability {needs}; lowering it for the {device.platform} "
                           "platform is an error (ValueError)")
        else:
            reasons.append(f"{requested} runs on compute capability {needs}; on a {device} the kernels' custom "
                           "call fails at run time")
        return Decision(requested, "unavailable", tuple(reasons), where, plan_for(cfg, device), kernels,
                        num_sms_of(device))
    return Decision(requested, requested, (), where, plan_for(cfg, device), kernels, num_sms_of(device))
