"""The accuracy matrix through every Hopper-runnable kernel build, for compute-sanitizer (memcheck,
racecheck): run by tests/run_gpu.sh.

    compute-sanitizer --tool memcheck --kernel-name kns=kernel_cutlass python tests/sanitize_prefill.py [--max-tokens N]

Runs `jax_kda.testing.ACCURACY_MATRIX` (packed sequences with zero-length ones and partial 16-token
tiles, H = 12, T = 0..33, dense B > 1, no initial state, the in-place state, every gate form) on
backend="sm90" and on the Blackwell kernels built for sm_90a, `SEGMENTED_MATRIX` (summary call,
combine, apply call, with partial and empty segments) on both, and calls with more (chunk, head)
items than prepare has persistent CTAs (CTAs walk several items and reuse their input stages), with
bf16 and with fp32 gates.
`--max-tokens` skips the cases with more tokens (racecheck is slow on the long ones). Every result
is checked against the float64 recurrence; exits non-zero if one is off.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

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
print(f"{failed} failed")
sys.exit(1 if failed else 0)
