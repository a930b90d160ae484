"""Opt-in run-time checks of what trace-time validation cannot see: the values inside the arrays.

    from jax.experimental import checkify

    with jax_kda.debug_checks():
        err, (o, state) = checkify.checkify(jax.jit(layer))(q, k, v, g, beta, cu_seqlens)
    err.throw()   # raises if a pre-activated log-decay is positive or cu_seqlens is malformed

Inside `debug_checks()`, every `prefill` traced adds `checkify.check`s on the device data: a
pre-activated gate (`use_gate_in_kernel=False`) must be <= 0 everywhere (a positive log-decay makes
the state grow without bound), and `cu_seqlens` must start at >= 0, never decrease and end at <= T.
The function must then be run under `checkify.checkify` (jax rejects an unfunctionalized check);
outside the context nothing is added and nothing is checked. The context counts when a function is
traced: a jitted function traced before keeps what it was traced with. The kernels never access memory out
of bounds whatever cu_seqlens holds; these checks are for finding wrong inputs, not for safety.
"""

from __future__ import annotations

import contextlib
import threading

import jax.numpy as jnp
from jax.experimental import checkify

from jax_kda.contract import GateMode

_state = threading.local()


@contextlib.contextmanager
def debug_checks(enabled: bool = True):
    """Within the block, prefill adds run-time checks of its inputs' values (see the module doc)."""
    previous = getattr(_state, "enabled", False)
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = previous


def enabled() -> bool:
    return getattr(_state, "enabled", False)


def check_inputs(cfg, g, cu_seqlens) -> None:
    """The run-time checks of one prefill call (called while tracing, inside `debug_checks()`)."""
    if cfg.gate_mode == GateMode.PREACTIVATED:  # g is the log-decay itself
        checkify.check(jnp.all(g <= 0), "jax_kda.prefill: g holds positive log-decays (max {max_g}); a "
                       "pre-activated gate must be <= 0 (or pass use_gate_in_kernel=True for a raw gate)",
                       max_g=jnp.max(g) if g.size else jnp.zeros((), g.dtype))
    if cu_seqlens is not None:
        cu = jnp.asarray(cu_seqlens)
        total = cfg.batch * cfg.seqlen
        checkify.check(cu[0] >= 0, "jax_kda.prefill: cu_seqlens[0] = {first} is negative", first=cu[0])
        checkify.check(cu[-1] <= total, "jax_kda.prefill: cu_seqlens[-1] = {last} exceeds T = {t}",
                       last=cu[-1], t=jnp.asarray(total, cu.dtype))
        if cu.shape[0] > 1:
            checkify.check(jnp.all(cu[1:] >= cu[:-1]), "jax_kda.prefill: cu_seqlens decreases (first at index "
                           "{at})", at=jnp.argmax(cu[1:] < cu[:-1]) + 1)
