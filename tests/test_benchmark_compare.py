"""benchmarks/compare_outputs.py on the machine at hand: its case runner on the XLA path (two runs from
one seed agree bit for bit, another seed does not), the comparison, and its child process."""

import pathlib
import subprocess
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "benchmarks"))
import compare_outputs  # noqa: E402

CASES = ["t17", "packed_mixed"]


def test_same_seed_same_bytes_and_a_changed_byte_is_found():
    seed = int(np.random.default_rng().integers(1 << 20))
    print(f"seed {seed}")
    first = compare_outputs.run_cases(seed, "xla", CASES)
    assert sorted(first) == ["packed_mixed/xla/final", "packed_mixed/xla/o", "t17/xla/final", "t17/xla/o"]
    assert compare_outputs.differing(first, compare_outputs.run_cases(seed, "xla", CASES)) == []
    assert compare_outputs.differing(first, compare_outputs.run_cases(seed + 1, "xla", CASES)) == sorted(first)
    changed = {k: v.copy() for k, v in first.items()}
    changed["t17/xla/o"][3] ^= 1
    del changed["packed_mixed/xla/final"]
    assert compare_outputs.differing(first, changed) == ["packed_mixed/xla/final", "t17/xla/o"]


def test_child_process_saves_the_arrays(tmp_path):
    out = tmp_path / "arrays.npz"
    subprocess.run([sys.executable, str(HERE.parent / "benchmarks" / "compare_outputs.py"), "--child", str(out),
                    "--seed", "5", "--backend", "xla", "--cases", "t17"], check=True, timeout=600)
    with np.load(out) as saved:
        assert sorted(saved.files) == ["t17/xla/final", "t17/xla/o"]
        assert compare_outputs.differing(dict(saved), compare_outputs.run_cases(5, "xla", ["t17"])) == []
