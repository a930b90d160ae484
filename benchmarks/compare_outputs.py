"""Do jax_kda builds compute the same outputs, bit for bit? For a kernel change meant to keep every
rounding (a new thread mapping, a moved conversion), this is the check that it did.

    python benchmarks/compare_outputs.py --build main=dist_main/jax_kda-0.1.0-cp312-abi3-linux_x86_64.whl \\
        --build exp=dist_exp/jax_kda-0.1.0-cp312-abi3-linux_x86_64.whl

Each build is a wheel, installed with pip into its own directory as in `ab.py` (no dependencies: jax
and the rest come from the environment). One child process per build runs the cases, every case of
`jax_kda.testing.ACCURACY_MATRIX` and `SEGMENTED_MATRIX` (gate forms, tails, packed and empty
sequences, fp32 gates, the exact and the factorized pair products, segmented calls) plus two larger
ones, on each kernel object the GPU runs (on Hopper the wgmma kernels and the Blackwell kernels built
for sm_90a; `--backend xla`: the XLA path instead), with inputs drawn from one seed shared by the
builds (a fresh one each run unless `--seed` is given), and keeps o and the final state. Then each
array of the first build is compared byte for byte with the others' builds. Prints one line per
build and every array that differs; exits 1 if any does.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ab import install, parse_build, site_env  # noqa: E402


def extra_cases():
    """Two cases larger than the matrices': many packed prompts, and a 16-head 2K-token sequence."""
    import numpy as np
    from jax_kda.testing import Workload

    dims = dict(head_k=128, head_v=128)
    lengths = tuple(int(n) for n in np.random.default_rng(7).integers(0, 300, 40))
    return [(Workload("packed_40_prompts", seqlens=lengths, heads=8, **dims), None),
            (Workload("dense_h16_2k", seqlen=2048, heads=16, **dims), None)]


def run_cases(seed: int, backend: str, names: list[str] | None = None) -> dict:
    """{'case/kernels/o' (and '/final'): the array's bytes as uint8} for this process's jax_kda."""
    import jax
    import numpy as np

    import jax_kda
    from jax_kda.contract import Kernels
    from jax_kda.testing import ACCURACY_MATRIX, SEGMENTED_MATRIX, make_inputs, prefill_with_kernels

    cases = [(w, None) for w in ACCURACY_MATRIX] + list(SEGMENTED_MATRIX) + extra_cases()
    if names is not None:
        unknown = set(names) - {w.name for w, _ in cases}
        if unknown:
            raise SystemExit(f"unknown case(s): {', '.join(sorted(unknown))}")
        cases = [(w, s) for w, s in cases if w.name in names]
    if backend == "xla":
        variants = [("xla", lambda args, kwargs, segs: jax_kda.prefill(*args, backend="xla", **kwargs))]
    else:
        hopper = jax.devices()[0].device_kind.startswith("NVIDIA H")
        requests = (Kernels.SM90, Kernels.MMA_SYNC_ON_SM90) if hopper else (Kernels.FOR_DEVICE,)
        variants = [(k.name, lambda args, kwargs, segs, k=k: prefill_with_kernels(k, *args, num_segments=segs,
                                                                                  **kwargs))
                    for k in requests]
    arrays = {}
    for i, (w, segments) in enumerate(cases):
        args, kwargs = make_inputs(w, np.random.default_rng(seed + i))
        for label, call in variants:
            if label == "xla" and segments is not None:
                continue  # the XLA path has no segmented form
            o, final = call(args, kwargs, segments)
            arrays[f"{w.name}/{label}/o"] = np.asarray(jax.device_get(o)).view(np.uint8).ravel()
            if final is not None:
                arrays[f"{w.name}/{label}/final"] = np.asarray(jax.device_get(final)).view(np.uint8).ravel()
    return arrays


def differing(first: dict, other: dict) -> list[str]:
    """Keys whose bytes differ (or that only one side has)."""
    import numpy as np

    keys = sorted(set(first) | set(other))
    return [k for k in keys if k not in first or k not in other or not np.array_equal(first[k], other[k])]


def child(args) -> None:
    import numpy as np

    names = args.cases.split(",") if args.cases else None
    np.savez(args.child, **run_cases(args.seed, args.backend, names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--build", type=parse_build, action="append", default=[],
                        help="NAME=WHEEL, twice or more; the first is the reference")
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: a fresh one, printed)")
    parser.add_argument("--backend", choices=("kernels", "xla"), default="kernels")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per build")
    parser.add_argument("--child", type=pathlib.Path, help=argparse.SUPPRESS)  # internal: run here, save to it
    args = parser.parse_args()
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(3), "little")
    if args.child:
        child(args)
        return
    names = [name for name, _ in args.build]
    if len(names) < 2 or len(set(names)) != len(names):
        parser.error("give two or more --build entries with distinct names")
    for _, wheel in args.build:
        if not wheel.is_file():
            parser.error(f"no wheel at {wheel}")

    import numpy as np

    print(f"seed {args.seed}, backend {args.backend}", flush=True)
    with tempfile.TemporaryDirectory(prefix="jax_kda_compare_") as tmp:
        work = pathlib.Path(tmp)
        results = {}
        for name, wheel in args.build:
            site = work / f"site_{name}"
            install(wheel, site)
            out = work / f"{name}.npz"
            env = site_env(site)
            command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", str(out), "--seed",
                       str(args.seed), "--backend", args.backend, "--cases", args.cases]
            subprocess.run(command, env=env, check=True, timeout=args.timeout,
                           cwd=tempfile.gettempdir())  # not the checkout: the installed build, not the sources
            with np.load(out) as f:
                results[name] = {k: f[k] for k in f.files}
    reference = names[0]
    status = 0
    for name in names[1:]:
        bad = differing(results[reference], results[name])
        total = len(set(results[reference]) | set(results[name]))
        print(f"{name} against {reference}: {total - len(bad)} of {total} arrays identical")
        for key in bad:
            print(f"   differs: {key}")
        status |= bool(bad)
    sys.exit(status)


if __name__ == "__main__":
    main()
