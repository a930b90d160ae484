#!/usr/bin/env bash
# The sharded prefill on every GPU of this machine, from an already-built wheel (it builds nothing):
# the multi-GPU tests (head- and batch-sharded calls against one GPU and the float64 gold, no
# collective in the compiled program), the tensor-parallel example, compute-sanitizer memcheck of a
# small sharded case, and the scaling benchmark (time per call at 1 and N GPUs).
#
#   tests/run_multi_gpu.sh dist/jax_kda-*linux*.whl [LOG_DIR]
#
# Exits non-zero if any step fails; logs go to LOG_DIR (default ./gpu-logs). On a machine with one
# GPU the same steps run on a 1-device mesh.
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh"
nvidia-smi --query-gpu=index,name,compute_cap,driver_version --format=csv,noheader
step multi-gpu-tests python3 -m pytest -q -m gpu -rsP "$here/tests/test_multi_gpu.py" -p no:cacheprovider
grep -h "GPU(s)\|err_ratio" "$logs/multi-gpu-tests.log" | sort -u | sed 's/^/   /'
step example python3 "$here/examples/tensor_parallel.py"
tail -6 "$logs/example.log"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
sanitize memcheck --kernel-name kns=kernel_cutlass --error-exitcode 1 \
  python3 -m pytest -q -m gpu "$here/tests/test_multi_gpu.py" -k "heads_packed and state" -p no:cacheprovider
step scaling python3 "$here/benchmarks/scaling.py" --out "$logs"
tail -6 "$logs/scaling.log"
exit $status
