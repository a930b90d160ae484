"""benchmarks/windows.py on the machine at hand (the XLA path on a CPU): every cut of a packed and of a
dense call runs, and its outputs match the same tokens in one call."""

import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def test_windows_run_and_match_one_call(tmp_path, fresh_seed):
    script = HERE.parent / "benchmarks" / "windows.py"
    args = ["--windows", "1,2", "--prompts", "4", "--prompt-len", "24", "--packed-heads", "2", "--dense-tokens", "48",
            "--dense-heads", "2", "--reps", "1", "--seed", str(fresh_seed), "--out", str(tmp_path)]
    run = subprocess.run([sys.executable, str(script), *args], timeout=600, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "windows.json").read_text())["rows"]
    assert [(r["case"], r["windows"]) for r in rows] == [(c, w) for c in ("packed", "dense") for w in (1, 2)]
    for r in rows:
        assert r["us"] > 0
        # o is bfloat16: a cut may round a value differently (one unit in the last place, 2^-8 relative).
        assert r["difference"]["o"] <= 2.0 ** -7, r
        assert r["difference"]["state"] <= 1e-5, r
