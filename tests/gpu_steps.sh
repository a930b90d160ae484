# Sourced by tests/run_gpu.sh and tests/run_multi_gpu.sh: installs the wheel given as $1 into a
# private directory (no dependencies: the machine's jax/jaxlib with CUDA are used), puts it first on
# PYTHONPATH, changes into it (so that jax_kda is imported from the wheel, not from a source tree),
# and defines `step NAME COMMAND...`, which runs a command into $logs/NAME.log and records a failure
# in $status. Sets $here (the checkout) and $logs (from $2, default ./gpu-logs).
wheel=${1:?usage: $0 WHEEL [LOG_DIR]}
logs=${2:-gpu-logs}
here=$(cd "$(dirname "$0")/.." && pwd)
site=$(mktemp -d)
logs=$(mkdir -p "$logs" && cd "$logs" && pwd)
python3 -m pip install -q --no-index --no-deps --target "$site" "$wheel" || exit 1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$site" || exit 1
status=0
step() {  # step NAME COMMAND...: runs, logs, records failure
  local name=$1; shift
  echo "== $name"
  if "$@" >"$logs/$name.log" 2>&1; then echo "   ok"; else echo "   FAILED (see $logs/$name.log)"; tail -30 "$logs/$name.log"; status=1; fi
}
