"""Small prefill calls for compute-sanitizer (memcheck, racecheck): run by tests/run_gpu.sh; both the
sm90 kernels and the sm100 kernels built for sm_90a.

    compute-sanitizer --tool memcheck --kernel-name kns=kernel_cutlass python tests/sanitize_prefill.py

Covers packed sequences with zero-length ones and partial 16-token tiles, H = 12, T = 17, dense
B > 1, no initial state, the in-place (aliased) state, and persistent prepare CTAs that process
several items each; and the segmented (context-parallel) path: its summary call, combine and apply
call, with partial and empty segments. Exits non-zero if a result is off.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import jax_kda
from jax_kda import gold
from jax_kda.primitive import FFI_TARGETS
from jax_kda.testing import MMA_ON_HOPPER_TARGET, Workload, as_numpy64, gold_kwargs, make_inputs, prefill_on_target

D = dict(head_k=128, head_v=128)
CASES = [
    Workload("packed_h12", seqlens=(17, 0, 33, 1, 0), heads=12, **D),
    Workload("dense_t17_b2", batch=2, seqlen=17, heads=2, gate="softplus", **D),
    Workload("pre_minus60_no_state", seqlen=40, heads=1, gate="preactivated", decay_floor=-60.0,
             initial_state=False, state_v_first=True, **D),
    # More (chunk, head) items than prepare_chunks has CTAs on a 132-SM GPU (3 per SM): CTAs walk
    # several items and reuse their two input stages.
    Workload("multi_item", seqlen=4000, heads=2, **D),
]

seed = int(os.environ.get("JAX_KDA_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
print(f"JAX_KDA_TEST_SEED={seed}")
rng = np.random.default_rng(seed)
failed = False
RUNNERS = {
    "sm90": lambda *a, **kw: jax_kda.prefill(*a, backend="sm90", **kw),
    "sm100 kernels built for sm_90a": lambda *a, **kw: prefill_on_target(MMA_ON_HOPPER_TARGET, *a, **kw),
    "sm90, 3 segments": lambda *a, **kw: prefill_on_target(FFI_TARGETS["sm90"], *a, num_segments=3, **kw),
}
for w in CASES:
    args, kwargs = make_inputs(w, rng)
    gold_o, gold_final = gold.recurrence(*as_numpy64(args), **gold_kwargs(kwargs))
    for name, run in RUNNERS.items():
        o, final = run(*args, **kwargs)
        o_err = gold.err_ratio(np.asarray(o, np.float32), gold_o)
        s_err = gold.err_ratio(np.asarray(final), gold_final)
        print(f"{w.name} [{name}]: o {o_err:.2e} state {s_err:.2e}")
        failed |= not (o_err <= 5e-3 and s_err <= 5e-3)
sys.exit(1 if failed else 0)
