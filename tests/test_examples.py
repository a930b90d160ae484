"""The examples run as a user runs them: the tensor-parallel layer on fake CPU devices."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def test_tensor_parallel_example_agrees_with_one_device():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run([sys.executable, str(EXAMPLES / "tensor_parallel.py"), "--cpu-devices", "4",
                          "--tokens", "256", "--heads", "8", "--d-model", "128"],
                         env=env, capture_output=True, text=True, timeout=600)
    print(run.stdout, run.stderr[-2000:])
    assert run.returncode == 0
    assert "jit + NamedSharding over 4 devices" in run.stdout and "shard_map over 4 devices" in run.stdout
