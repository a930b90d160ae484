#!/usr/bin/env bash
# Runs jax_kda's GPU checks on a machine with an NVIDIA GPU from an already-built wheel: it builds
# nothing. Installs the wheel into a private directory (no dependencies: the machine's jax/jaxlib
# with CUDA are used), then runs the GPU tests, the compute-sanitizer checks and the demo.
#
#   tests/run_gpu.sh dist/jax_kda-*linux*.whl [LOG_DIR]
#
# To run part of it (e.g. on a machine that limits a command's time), name the steps in
# GPU_STEPS (default "tests memcheck racecheck demo") and, for the tests step, the test files or
# folders of the checkout in GPU_TESTS (default "tests"):
#
#   GPU_STEPS=tests GPU_TESTS="tests/test_kernels_gpu.py tests/test_training.py" tests/run_gpu.sh ...
#   GPU_STEPS="memcheck racecheck demo" tests/run_gpu.sh ...
#
# Exits non-zero if any step fails; logs go to LOG_DIR (default ./gpu-logs).
#
# The parts share one GPU well: on an H100 (2026-12-07) these three, started together with
# XLA_PYTHON_CLIENT_PREALLOCATE=false and a LOG_DIR each, ran every step in 350 s of wall time (the
# kernels and training tests 348 s, the prefill matrix 25 s, memcheck + racecheck + the demo 117 s):
#
#   GPU_STEPS=tests GPU_TESTS="tests/test_kernels_gpu.py tests/test_training.py" tests/run_gpu.sh W logs/a &
#   GPU_STEPS=tests GPU_TESTS=tests/test_prefill_matrix.py tests/run_gpu.sh W logs/b &
#   GPU_STEPS="memcheck racecheck demo" tests/run_gpu.sh W logs/c &
#   wait
set -uo pipefail
source "$(dirname "$0")/steps.sh"
wanted_steps tests memcheck racecheck demo || exit 2  # before anything is installed
source "$(dirname "$0")/gpu_steps.sh"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
if wanted tests; then
  step gpu-tests python3 -m pytest -q -m gpu -rsP $(checkout_paths "${GPU_TESTS:-tests}") -p no:cacheprovider
  grep -h "err_ratio" "$logs/gpu-tests.log" | sort -u | sed 's/^/   /'  # accuracy per case (printed by the tests)
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Only jax_kda's kernels (all named kernel_cutlass_*) are instrumented: with XLA's own kernels and
# its GEMM autotuning checked too, racecheck of this script ran for more than 5 minutes.
for tool in memcheck racecheck; do
  wanted "$tool" || continue
  sanitize "$tool" --kernel-name kns=kernel_cutlass \
    --error-exitcode 1 python3 "$here/tests/sanitize_prefill.py" $([ "$tool" = racecheck ] && echo --max-tokens 600)
done
if wanted demo; then
  step demo python3 "$here/examples/demo.py"
  tail -5 "$logs/demo.log"
fi
exit $status
