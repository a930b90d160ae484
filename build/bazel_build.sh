#!/usr/bin/env bash
# Builds the extension jax_kda._jax_kda_ext and its ahead-of-time kernels with Bazel (BUILD.bazel),
# from pip packages alone, and imports it:
#   1. a Python 3.12 virtualenv with pyproject.toml's build requirements and jax (made once, and again
#      when the requirements change);
#   2. bazel build //:jax_kda_ext, the virtualenv given to the build_env repository (WORKSPACE) and
#      the output base outside the checkout;
#   3. the built .so beside a copy of jax_kda/ in a temporary folder, imported with the virtualenv's
#      Python: it must load and register its FFI target (without a GPU it reports no problem).
# Needs Bazel 4.2 (Debian: apt-get install bazel-bootstrap), no GPU and no CUDA toolkit: where one is
# installed (/usr/local/cuda*), every build action runs in the Linux sandbox with it hidden.
#
#   build/bazel_build.sh
#
#   PYTHON              the Python 3.12 to make the virtualenv with (default: python3.12)
#   JAX_KDA_BAZEL_DIR   where the virtualenv and Bazel's output base go (default: $TMPDIR/jax_kda_bazel,
#                       TMPDIR defaulting to /tmp); delete it to build from scratch
#   JAX_KDA_BUILD_JOBS  how many kernel exports are compiled at once (default: the CPUs this process may use)
#   JAX_KDA_BAZEL_SHUTDOWN  1: stop the Bazel server when done (default: it stays up 10 idle minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
work=${JAX_KDA_BAZEL_DIR:-${TMPDIR:-/tmp}/jax_kda_bazel}
venv=$work/venv
python=${PYTHON:-python3.12}
command -v bazel >/dev/null || { echo "bazel_build.sh: needs bazel (Debian: apt-get install bazel-bootstrap)" >&2; exit 1; }
"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null \
  || { echo "bazel_build.sh: needs a Python 3.12: set PYTHON (it is '$python')" >&2; exit 1; }
mkdir -p "$work"

# --- 1. The build environment --------------------------------------------------------------------
# pyproject.toml's build requirements but scikit-build-core (the CMake build's), and jax for step 3.
"$python" - > "$work/requirements.txt" <<'EOF'
import tomllib
with open("pyproject.toml", "rb") as f:
    requires = tomllib.load(f)["build-system"]["requires"]
print("\n".join([r for r in requires if not r.startswith("scikit-build-core")] + ["jax"]))
EOF
if ! cmp -s "$work/requirements.txt" "$venv/installed-requirements.txt"; then
  echo "bazel_build.sh: making the build environment $venv"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q -r "$work/requirements.txt"
  cp "$work/requirements.txt" "$venv/installed-requirements.txt"
fi

# --- 2. Bazel --------------------------------------------------------------------------------------
build_options=(--repo_env=JAX_KDA_PYTHON="$venv/bin/python")
# A system CUDA toolkit is hidden from every action, which only the Linux sandbox can do (it needs
# namespaces: where the machine has none, say so and build beside the toolkit, which the build does not
# look for anyway).
hidden=()
for toolkit in /usr/local/cuda*; do
  [ -e "$toolkit" ] && hidden+=(--sandbox_block_path="$toolkit")
done
if [ ${#hidden[@]} -gt 0 ]; then
  if unshare --user --map-root-user --mount true 2>/dev/null || unshare --mount true 2>/dev/null; then
    build_options+=(--spawn_strategy=linux-sandbox "${hidden[@]}")
  else
    echo "bazel_build.sh: no namespaces for Bazel's Linux sandbox: building beside the CUDA toolkit, not hiding it" >&2
  fi
fi
run_bazel() {
  # Unset: what would point the configuration of the C++ toolchain, or build_env.py, at a CUDA toolkit.
  # The Bazel server, with its caches, stays up for 10 idle minutes.
  env -u CPATH -u C_INCLUDE_PATH -u CPLUS_INCLUDE_PATH -u LIBRARY_PATH -u CUDA_HOME -u CUDA_PATH \
    bazel --output_base="$work/output_base" --max_idle_secs=600 "$@"
}
package=""
cleanup() {
  [ -z "$package" ] || rm -rf "$package"
  # JAX_KDA_BAZEL_SHUTDOWN=1 (CI): stop the server on the way out, success or not.
  [ "${JAX_KDA_BAZEL_SHUTDOWN:-0}" != 1 ] || run_bazel shutdown >/dev/null 2>&1 || true
}
trap cleanup EXIT
run_bazel build "${build_options[@]}" //:jax_kda_ext
extension=$(run_bazel info "${build_options[@]}" bazel-bin)/_jax_kda_ext.abi3.so

# --- 3. Import -------------------------------------------------------------------------------------
package=$(mktemp -d "$work/import.XXXXXX")
cp -r jax_kda "$package/"
cp "$extension" "$package/jax_kda/"
PYTHONPATH="$package" "$venv/bin/python" -P - <<'EOF'
import sys

from jax_kda import _native

print("kernel_objects():", _native.kernel_objects())
reason = _native.unavailable_reason()
print("unavailable_reason():", reason)
print("registered_targets():", sorted(_native.registered_targets()))
if not _native.registered_targets():
    sys.exit(f"bazel_build.sh: the extension did not load or register its FFI target: {reason}")
# Only a GPU whose driver is too old for the CUDA runtime linked in may make the kernels unavailable.
if reason is not None and "driver" not in reason:
    sys.exit(f"bazel_build.sh: the kernels are unavailable: {reason}")
EOF
echo "bazel_build.sh: built and imported $extension in $((SECONDS - started)) s"
