"""jax_kda: KDA (Kimi Delta Attention) prefill for JAX, with Hopper/Blackwell kernels.

    o, final_state = jax_kda.prefill(q, k, v, g, beta, ...)

`prefill` follows `fla.ops.kda.chunk_kda`'s argument names; `explain` says which backend a call
would use and why. `backend="xla"` is pure JAX and runs anywhere.
"""

from jax_kda import _native
from jax_kda.api import explain, prefill
from jax_kda.config import STATIC_ARGNAMES, PrefillConfig
from jax_kda.contract import GateMode
from jax_kda.debug import debug_checks
from jax_kda.planner import RecurrencePlan, plan_prefill

__version__ = "0.1.0"

# Register the kernels' custom call target with jax now, so that a process that only deserializes and
# runs an exported program (jax.export) finds it. Where the extension is missing this records the
# reason (`_native.unavailable_reason()`) instead of raising.
_native.registered_targets()

__all__ = [
    "GateMode",
    "PrefillConfig",
    "RecurrencePlan",
    "STATIC_ARGNAMES",
    "debug_checks",
    "explain",
    "plan_prefill",
    "prefill",
]
