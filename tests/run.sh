#!/usr/bin/env bash
# Runs the test suite in ./.venv, installing the checkout into it first (bash .ci/setup: the kernels
# are compiled then) unless it holds an install of the checkout as it is now. GPU tests are marked
# `gpu` and skip, each saying why, without an NVIDIA GPU. Arguments go to pytest, e.g.
# `bash tests/run.sh tests/test_api.py -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
source build/python_env.sh
ensure_venv
exec .venv/bin/pytest "$@"
