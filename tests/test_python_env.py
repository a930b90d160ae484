"""build/python_env.sh, which examples/demo.sh and tests/run.sh use to decide whether ./.venv holds an
install of the checkout as it is now (else they run .ci/setup), against a stand-in checkout whose
.ci/setup only counts its runs."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

PYTHON_ENV = pathlib.Path(__file__).resolve().parent.parent / "build" / "python_env.sh"

# The stand-in .ci/setup: counts its runs and, like the real one, records the digest last.
FAKE_SETUP = """set -e
source build/python_env.sh
echo x >> setup-runs
mkdir -p .venv/bin
printf '#!/usr/bin/env bash\\nexit 0\\n' > .venv/bin/python; chmod +x .venv/bin/python
source_digest > "$SETUP_MARKER"
"""


@pytest.fixture
def checkout(tmp_path):
    for d in ("jax_kda", "csrc", "build", ".ci"):
        (tmp_path / d).mkdir()
    (tmp_path / "jax_kda" / "api.py").write_text("x = 1\n")
    (tmp_path / "csrc" / "prefill.cc").write_text("int x;\n")
    (tmp_path / "CMakeLists.txt").write_text("project(x)\n")
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    (tmp_path / "build" / "python_env.sh").write_text(PYTHON_ENV.read_text())
    (tmp_path / ".ci" / "setup").write_text(FAKE_SETUP)
    return tmp_path


def _bash(cwd: pathlib.Path, script: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -e; source build/python_env.sh; {script}"], cwd=cwd,
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", **env})


def _setup_runs(checkout: pathlib.Path) -> int:
    runs = checkout / "setup-runs"
    return len(runs.read_text().split()) if runs.exists() else 0


def test_ensure_venv_installs_once_and_again_after_an_edit(checkout):
    for _ in range(2):
        assert _bash(checkout, "ensure_venv").returncode == 0
    assert _setup_runs(checkout) == 1  # the second call found the install current
    (checkout / "jax_kda" / "__pycache__").mkdir()
    (checkout / "jax_kda" / "__pycache__" / "api.cpython-312.pyc").write_bytes(b"\0")
    assert _bash(checkout, "ensure_venv").returncode == 0
    assert _setup_runs(checkout) == 1  # bytecode is not a source
    (checkout / "csrc" / "prefill.cc").write_text("int y;\n")
    done = _bash(checkout, "ensure_venv")
    assert done.returncode == 0 and "installing again" in done.stdout
    assert _setup_runs(checkout) == 2  # an edited source: installed again


def test_ensure_venv_installs_where_the_package_does_not_import(checkout):
    assert _bash(checkout, "ensure_venv").returncode == 0
    (checkout / ".venv" / "bin" / "python").write_text("#!/usr/bin/env bash\nexit 1\n")
    assert _bash(checkout, "ensure_venv").returncode == 0
    assert _setup_runs(checkout) == 2


def test_a_new_source_file_changes_the_digest(checkout):
    before = _bash(checkout, "source_digest").stdout
    (checkout / "jax_kda" / "new.py").write_text("")
    assert _bash(checkout, "source_digest").stdout != before


def test_find_python_takes_python_if_it_is_one_and_refuses_it_otherwise(checkout, tmp_path):
    old = tmp_path / "python3.11"  # answers the version check as a Python 3.11 would
    old.write_text("#!/usr/bin/env bash\nexit 1\n")
    old.chmod(0o755)
    for python in (str(old), "/nonexistent/python"):
        refused = _bash(checkout, "find_python", PYTHON=python)
        assert refused.returncode != 0 and f"PYTHON={python} is not a Python >= 3.12" in refused.stderr
    if sys.version_info >= (3, 12):
        found = _bash(checkout, "find_python", PYTHON=sys.executable)
        assert found.returncode == 0 and found.stdout.strip() == sys.executable
