#!/usr/bin/env bash
# The sharded prefill on every GPU of this machine, from an already-built wheel (it builds nothing):
# the multi-GPU tests (head- and batch-sharded calls against one GPU and the float64 gold, no
# collective in the compiled program), the tensor-parallel example, compute-sanitizer memcheck of a
# small sharded case, and the scaling benchmark (time per call at 1 and N GPUs).
#
#   tests/run_multi_gpu.sh dist/jax_kda-*.whl [LOG_DIR]
#
# Exits non-zero if any step fails; logs go to LOG_DIR (default ./gpu-logs). On a machine with one
# GPU the same steps run on a 1-device mesh.
set -uo pipefail
wheel=${1:?usage: tests/run_multi_gpu.sh WHEEL [LOG_DIR]}
logs=${2:-gpu-logs}
here=$(cd "$(dirname "$0")/.." && pwd)
site=$(mktemp -d)
logs=$(mkdir -p "$logs" && cd "$logs" && pwd)
python3 -m pip install -q --no-index --no-deps --target "$site" "$wheel" || exit 1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$site"  # import jax_kda from the wheel, not from a source tree
status=0
step() {  # step NAME COMMAND...: runs, logs, records failure
  local name=$1; shift
  echo "== $name"
  if "$@" >"$logs/$name.log" 2>&1; then echo "   ok"; else echo "   FAILED (see $logs/$name.log)"; tail -30 "$logs/$name.log"; status=1; fi
}
nvidia-smi --query-gpu=index,name,compute_cap,driver_version --format=csv,noheader
step multi-gpu-tests python3 -m pytest -q -m gpu -rsP "$here/tests/test_multi_gpu.py" -p no:cacheprovider
grep -h "GPU(s)\|err_ratio" "$logs/multi-gpu-tests.log" | sort -u | sed 's/^/   /'
step example python3 "$here/examples/tensor_parallel.py"
tail -6 "$logs/example.log"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
step sanitizer-memcheck compute-sanitizer --tool memcheck --kernel-name kns=kernel_cutlass --error-exitcode 1 \
  python3 -m pytest -q -m gpu "$here/tests/test_multi_gpu.py" -k "heads_packed and state" -p no:cacheprovider
step scaling python3 "$here/benchmarks/scaling.py" --out "$logs"
tail -6 "$logs/scaling.log"
exit $status
