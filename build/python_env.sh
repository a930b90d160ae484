# Sourced (from the checkout's root) by .ci/setup, build/wheel.sh, examples/demo.sh and tests/run.sh.

# find_python prints a Python >= 3.12 (jax >= 0.11 needs it): $PYTHON if set, else the first of
# python3.12, python3.13, python3 and pyenv's 3.12+ that is one.
find_python() {
  local candidate
  for candidate in "${PYTHON:-}" python3.12 python3.13 python3 "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python; do
    [ -n "$candidate" ] || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  if [ -n "${PYTHON:-}" ]; then
    echo "PYTHON=$PYTHON is not a Python >= 3.12 (jax >= 0.11 needs one)" >&2
  else
    echo "no Python >= 3.12 found (jax >= 0.11 needs one): set PYTHON=/path/to/python3.12" >&2
  fi
  return 1
}

# source_digest prints a digest of the files the package is built from, so that ./.venv's install can
# be told apart from one of an older checkout. .ci/setup records it in SETUP_MARKER after installing.
SETUP_MARKER=.venv/.created-by-jax_kda-setup
source_digest() {
  find jax_kda csrc build CMakeLists.txt pyproject.toml -name __pycache__ -prune -o -type f -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
}

# ensure_venv runs .ci/setup unless ./.venv holds an install of the checkout as it is now.
ensure_venv() {
  if [ -f "$SETUP_MARKER" ] && [ "$(cat "$SETUP_MARKER")" = "$(source_digest)" ] \
      && .venv/bin/python -P -c 'import jax_kda' 2>/dev/null; then
    return 0
  fi
  [ -f "$SETUP_MARKER" ] && echo "./.venv holds an install of other sources than the checkout's: installing again"
  bash .ci/setup
}
