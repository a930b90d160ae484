#!/usr/bin/env bash
# Runs examples/demo.py in ./.venv, installing the checkout into it first (bash .ci/setup) unless it
# holds an install of the checkout as it is now. Arguments go to the demo, e.g.
# `bash examples/demo.sh --tokens 8192 --backend xla`.
set -euo pipefail
cd "$(dirname "$0")/.."
source build/python_env.sh
ensure_venv
exec .venv/bin/python examples/demo.py "$@"
