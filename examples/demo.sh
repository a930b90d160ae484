#!/usr/bin/env bash
# Runs examples/demo.py in ./.venv, creating it first (bash .ci/setup) if it has no jax_kda.
# Arguments go to the demo, e.g. `bash examples/demo.sh --tokens 8192 --backend xla`.
set -euo pipefail
cd "$(dirname "$0")/.."
# -P: the installed package, not the checkout's source tree (which imports without being installed).
if ! .venv/bin/python -P -c 'import jax_kda' 2>/dev/null; then
  bash .ci/setup
fi
exec .venv/bin/python examples/demo.py "$@"
