"""Ahead-of-time compile step: CuTe DSL kernels -> C headers and objects linked into the extension.

CMake runs this at build time, on a machine that needs no GPU. Every kernel in ``KERNELS`` is compiled for
each of its architectures with symbolic sizes and exported with ``export_to_c`` to
``<out-dir>/<kernel>_<arch>.h`` and ``.o``. The exported C symbols carry the prefix
``jax_kda_<kernel>_<arch>``: an exported module is process-global, so every (kernel, arch) pair needs its
own. The C++ side includes the headers by those names (csrc/<kernel>.cc).

Adding a kernel is one ``KERNELS`` entry: a module under csrc/kernels/ (dotted for a subfolder, e.g.
``sm90.prepare``) that defines the ``@cute.jit`` entry point and ``compile_arguments()``.

Usage: aot_compile.py --out-dir DIR [--list-outputs]
"""

import argparse
import ctypes
import dataclasses
import importlib
import os
import pathlib
import sys
import time

KERNEL_SOURCE_DIR = pathlib.Path(__file__).resolve().parent.parent / "csrc" / "kernels"


# Always pinned: without --gpu-arch the DSL silently targets sm_100a. An "a" cubin runs only on its exact
# compute capability (sm_100a on 10.0, not on 10.3). csrc/kernel_module.h lists the same architectures.
ARCHITECTURES = ("sm_90a", "sm_100a")


@dataclasses.dataclass(frozen=True)
class KernelExport:
    """One kernel to export: ``module`` under csrc/kernels/ defines ``entry`` and ``compile_arguments()``."""

    name: str
    module: str
    entry: str
    archs: tuple[str, ...] = ARCHITECTURES  # a subset, for kernels written for one architecture


KERNELS = (
    KernelExport(name="gate_activation", module="gate_activation", entry="gate_activation"),
    # Hopper: the recurrence on warpgroup MMAs (wgmma exists only on sm_90a).
    KernelExport(name="prefill", module="sm90.kda_prefill", entry="prefill", archs=("sm_90a",)),
    # Blackwell: the recurrence on warp-level MMAs.
    KernelExport(name="prefill", module="sm100.kda_prefill", entry="prefill", archs=("sm_100a",)),
    # The Blackwell kernels built for Hopper too, so that a Hopper GPU can test them
    # (custom call target jax_kda_prefill_sm90_mma; not a user-facing backend).
    KernelExport(name="prefill_mma", module="sm100.kda_prefill", entry="prefill", archs=("sm_90a",)),
)


def export_stem(kernel: KernelExport, arch: str) -> str:
    return f"{kernel.name}_{arch}"


def output_paths(out_dir: pathlib.Path) -> list[pathlib.Path]:
    return [
        out_dir / f"{export_stem(kernel, arch)}{suffix}"
        for kernel in KERNELS
        for arch in kernel.archs
        for suffix in (".h", ".o")
    ]


def compile_all(out_dir: pathlib.Path) -> None:
    # The build must not depend on what an earlier build left in the DSL's on-disk cache.
    os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"
    import cutlass.cute as cute
    import cutlass.runtime

    # export_to_c resolves symbols of the DSL runtime library; on a machine without a GPU nothing else
    # has loaded it, so load it globally first.
    runtime_library = cutlass.runtime.find_runtime_libraries(enable_tvm_ffi=False)[0]
    ctypes.CDLL(runtime_library, mode=ctypes.RTLD_GLOBAL)

    sys.path.insert(0, str(KERNEL_SOURCE_DIR))
    out_dir.mkdir(parents=True, exist_ok=True)
    for kernel in KERNELS:
        module = importlib.import_module(kernel.module)
        entry = getattr(module, kernel.entry)
        for arch in kernel.archs:
            stem = export_stem(kernel, arch)
            started = time.perf_counter()
            compiled = cute.compile(entry, *module.compile_arguments(), options=f"--gpu-arch {arch}")
            compiled.export_to_c(str(out_dir), stem, function_prefix=f"jax_kda_{stem}")
            print(f"aot_compile: {stem} in {time.perf_counter() - started:.2f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out-dir", type=pathlib.Path, required=True)
    parser.add_argument(
        "--list-outputs",
        action="store_true",
        help="print the files this step writes, one per line, and compile nothing",
    )
    args = parser.parse_args()
    if args.list_outputs:
        print("\n".join(str(path) for path in output_paths(args.out_dir)))
        return
    compile_all(args.out_dir)
    missing = [path for path in output_paths(args.out_dir) if not path.is_file()]
    if missing:
        sys.exit(f"aot_compile: export did not write {', '.join(map(str, missing))}")


if __name__ == "__main__":
    main()
