# Sourced by tests/run_gpu.sh and tests/run_multi_gpu.sh: installs the wheel given as $1 into a
# private directory (no dependencies: the machine's jax/jaxlib with CUDA are used), puts it first on
# PYTHONPATH, changes into it (so that jax_kda is imported from the wheel, not from a source tree),
# and defines `step NAME COMMAND...` and `sanitize TOOL COMMAND...` (tests/steps.sh), which run a
# command into $logs/NAME.log and record a failure in $status. Sets $here (the checkout) and $logs
# (from $2, default ./gpu-logs).
wheel=${1:?usage: $0 WHEEL [LOG_DIR]}
logs=${2:-gpu-logs}
case $logs in *.whl)  # a glob such as dist/jax_kda-*.whl that matched build/wheel.sh's two wheels
  echo "$0: one wheel, then an optional log folder; got two wheels ($wheel, $logs): pass the" \
       "platform wheel (dist/jax_kda-*linux*.whl), not the pure-Python one" >&2
  exit 2 ;;
esac
here=$(cd "$(dirname "$0")/.." && pwd)
site=$(mktemp -d)
logs=$(mkdir -p "$logs" && cd "$logs" && pwd)
python3 -m pip install -q --no-index --no-deps --target "$site" "$wheel" || exit 1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$site" || exit 1
status=0
source "$here/tests/steps.sh"
