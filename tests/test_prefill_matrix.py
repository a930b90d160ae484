"""The accuracy matrix (`jax_kda.testing.ACCURACY_MATRIX`) on every backend this machine can run, against
the one oracle, the float64 token recurrence (`jax_kda.gold`), at the tests' bar (5e-3 err_ratio).

Backends: the XLA path (every machine, so CI runs the whole matrix on CPU), the Hopper kernels
(backend="sm90"), the Blackwell kernels built for sm_90a (the same source as backend="sm100", on a
Hopper GPU) and backend="sm100" on a Blackwell GPU; the kernel ones are marked `gpu` and skip where
the machine has no such GPU. The segmented (intracard context-parallel) path is forced onto
`SEGMENTED_MATRIX` on every kernel backend.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_kda
from jax_kda import _native, contract
from jax_kda.contract import Kernels
from jax_kda.testing import SEGMENTED_MATRIX, ACCURACY_MATRIX, check_against_gold, make_inputs, prefill_with_kernels


def _gpu_compute_capability() -> str | None:
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None
    return getattr(gpus[0], "compute_capability", None) if gpus else None


def _kernel_backend(name: str, kernels: Kernels):
    """A kernel backend as a pytest param: marked gpu, skipped without a GPU it runs on (any compute
    capability the contract gives it: sm100 on 10.0, 10.3 and 11.0) or the extension."""
    capabilities = contract.compute_capabilities(kernels)
    reason = (_native.unavailable_reason() if _gpu_compute_capability() in capabilities
              else f"needs a compute capability {' / '.join(capabilities)} GPU")
    return pytest.param(kernels, id=name, marks=[pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=str(reason))])


KERNEL_BACKENDS = [
    _kernel_backend("sm90", Kernels.SM90),
    _kernel_backend("mma_sync_on_sm90", Kernels.MMA_SYNC_ON_SM90),
    _kernel_backend("sm100", Kernels.SM100),
]
BACKENDS = [pytest.param(None, id="xla"), *KERNEL_BACKENDS]


@pytest.mark.parametrize("kernels", BACKENDS)
@pytest.mark.parametrize("w", ACCURACY_MATRIX, ids=lambda w: w.name)
def test_matches_float64_recurrence(w, kernels, fresh_seed):
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    if kernels is None:
        o, final = jax_kda.prefill(*args, backend="xla", **kwargs)
    else:
        o, final = prefill_with_kernels(kernels, *args, **kwargs)
    check_against_gold(f"{w.name} [{'xla' if kernels is None else kernels.name}]", w, args, kwargs, o, final)


@pytest.mark.parametrize("kernels", KERNEL_BACKENDS)
@pytest.mark.parametrize("w,segments", SEGMENTED_MATRIX, ids=lambda c: getattr(c, "name", str(c)))
def test_segmented_prefill_matches_float64_recurrence(w, segments, kernels, fresh_seed):
    """The summary call, the combine and the apply call together, against the float64 recurrence."""
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    o, final = prefill_with_kernels(kernels, *args, num_segments=segments, **kwargs)
    check_against_gold(f"{w.name} x{segments} [{kernels.name}]", w, args, kwargs, o, final)
