"""The accuracy matrix through every Hopper-runnable kernel build, for compute-sanitizer (memcheck,
racecheck): run by tests/run_gpu.sh.

    compute-sanitizer --tool memcheck --kernel-name kns=kernel_cutlass python tests/sanitize_prefill.py [--max-tokens N]

Runs `jax_kda.testing.ACCURACY_MATRIX` (packed sequences with zero-length ones and partial 16-token
tiles, H = 12, T = 0..33, dense B > 1, no initial state, the in-place state, every gate form) on
backend="sm90" and on the Blackwell kernels built for sm_90a, `SEGMENTED_MATRIX` (summary call,
combine, apply call, with partial and empty segments) on both, and calls with more (chunk, head)
items than prepare has persistent CTAs (CTAs walk several items and reuse their input stages), with
bf16 and with fp32 gates. Then `cu_seqlens` the kernels cannot trust (MALFORMED: no sequence over
T > 0 tokens, non-monotone, negative, past T, INT32_MAX): their results are unspecified, so they are
only run, on one segment and on several, for memcheck to see that every access stays in bounds (the
script's own run sets XLA's platform allocator, one cudaMalloc a buffer, so that an access past a
small buffer such as cu_seqlens is outside an allocation, not inside XLA's pool).
`--max-tokens` skips the cases with more tokens (racecheck is slow on the long ones). Every result
is checked against the float64 recurrence; exits non-zero if one is off.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

# Before jax allocates: every buffer its own allocation (see the docstring).
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")

from jax_kda.contract import Kernels
from jax_kda.testing import SEGMENTED_MATRIX, ACCURACY_MATRIX, Workload, check_against_gold, make_inputs, prefill_with_kernels

# 1200 tokens x 8 heads = 600 items, more than the 4 x 132 persistent prepare CTAs of an H200; packed
# with fp32 gates too (the larger input stage of that variant, reused across items).
MULTI_ITEM = Workload("multi_item", seqlen=1200, heads=8, head_k=128, head_v=128)
MULTI_ITEM_F32 = Workload("multi_item_f32_gates_packed", seqlens=(700, 0, 13, 500), heads=8, head_k=128,
                          head_v=128, g_dtype="float32", beta_dtype="float32")
# The same stage reuse within racecheck's --max-tokens 600: 160 tokens x 64 heads = 704 items.
SHORT_MULTI_ITEM = Workload("short_multi_item", seqlen=160, heads=64, head_k=128, head_v=128)
SHORT_MULTI_ITEM_F32 = Workload("short_multi_item_f32_gates", seqlen=160, heads=64, head_k=128, head_v=128,
                                g_dtype="float32", beta_dtype="float32")

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--max-tokens", type=int, default=None)
limit = parser.parse_args().max_tokens
seed = int(os.environ.get("JAX_KDA_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
print(f"JAX_KDA_TEST_SEED={seed}")
rng = np.random.default_rng(seed)
cases = [(w, None) for w in (*ACCURACY_MATRIX, MULTI_ITEM, MULTI_ITEM_F32, SHORT_MULTI_ITEM, SHORT_MULTI_ITEM_F32)]
cases += list(SEGMENTED_MATRIX)
failed = 0
for w, segments in cases:
    if limit is not None and w.total_tokens > limit:
        continue
    args, kwargs = make_inputs(w, rng)
    for kernels in (Kernels.SM90, Kernels.MMA_SYNC_ON_SM90):
        label = f"{w.name}{'' if segments is None else f' x{segments}'} [{kernels.name}]"
        try:
            o, final = prefill_with_kernels(kernels, *args, num_segments=segments, **kwargs)
            check_against_gold(label, w, args, kwargs, o, final)
        except AssertionError as e:
            print(f"FAILED {label}: {e}")
            failed += 1

# (workload the inputs are drawn for, the cu_seqlens given instead of its own). 100 tokens, 3 q/k
# heads, 6 value heads; the workload's seqlens only size the inputs.
_MALFORMED_INPUTS = Workload("malformed", seqlens=(40, 60), heads=3, v_heads=6, head_k=128, head_v=128)
MALFORMED = (
    ("no_sequence", (0,)),                       # N = 0 over T = 100 tokens: no kernel reads a sequence
    ("non_monotone", (0, 60, 20, 100)),
    ("negative_and_past_t", (-7, 40, 5000)),
    ("int32_max", (0, 2**31 - 1, 100)),
    ("inside_t", (30, 31, 31, 64)),               # valid: tokens outside [30, 64) belong to no sequence
)
for name, cu in MALFORMED:
    args, kwargs = make_inputs(_MALFORMED_INPUTS, rng)
    n = len(cu) - 1
    kwargs["cu_seqlens"] = np.asarray(cu, np.int32)
    kwargs["initial_state"] = kwargs["initial_state"][:1].repeat(n, axis=0) if n else kwargs["initial_state"][:0]
    for segments in (None, 3):
        for kernels in (Kernels.SM90, Kernels.MMA_SYNC_ON_SM90):
            label = f"malformed {name}{'' if segments is None else f' x{segments}'} [{kernels.name}]"
            try:
                o, final = prefill_with_kernels(kernels, *args, num_segments=segments, **kwargs)
                o, final = np.asarray(o), np.asarray(final)  # wait for the kernels
                assert final.shape[0] == n, final.shape
                print(f"{label}: ran")
            except Exception as e:  # noqa: BLE001 - any failure of a call counts
                print(f"FAILED {label}: {type(e).__name__}: {e}")
                failed += 1
print(f"{failed} failed")
sys.exit(1 if failed else 0)
