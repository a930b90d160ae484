"""Where the build environment's Python keeps what the Bazel build of the extension uses, one
`name<TAB>directory` line each, for build_env.bzl: the same queries CMakeLists.txt makes. Run with
the Python of a virtualenv that has pyproject.toml's build requirements installed."""

import importlib.metadata
import importlib.util
import pathlib
import subprocess
import sys
import sysconfig

if sys.version_info < (3, 12):
    sys.exit(f"jax_kda: the extension targets the Python 3.12 stable ABI; {sys.executable} is {sys.version.split()[0]}")


def package_dir(name: str) -> pathlib.Path:
    spec = importlib.util.find_spec(name)
    if spec is None:
        sys.exit(f"jax_kda: {name} is not installed for {sys.executable}")
    return pathlib.Path(spec.submodule_search_locations[0])


def cuda_root() -> pathlib.Path:
    """The nvidia/cu13 folder of nvidia-cuda-runtime, which nvidia-cuda-crt and -cccl fill with the
    headers cuda_runtime.h includes."""
    try:
        files = importlib.metadata.files("nvidia-cuda-runtime") or []
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"jax_kda: nvidia-cuda-runtime is not installed for {sys.executable}")
    header = next(f for f in files if f.name == "cuda_runtime.h")
    return pathlib.Path(header.locate()).resolve().parent.parent


def dsl_libdir() -> pathlib.Path:
    query = [sys.executable, "-m", "cutlass.cute.export.aot_config", "--libdir"]
    return pathlib.Path(subprocess.run(query, check=True, capture_output=True, text=True).stdout.strip())


# name: (directory, a file it must have)
DIRECTORIES = {
    "python_include": (pathlib.Path(sysconfig.get_paths()["include"]), "Python.h"),
    "nanobind": (package_dir("nanobind"), "src/nb_combined.cpp"),
    "xla_ffi": (package_dir("jaxlib") / "include", "xla/ffi/api/ffi.h"),
    "cuda": (cuda_root(), "lib/libcudart_static.a"),
    "dsl_lib": (dsl_libdir(), "libcuda_dialect_runtime_static.a"),
}

for name, (directory, required) in DIRECTORIES.items():
    if not (directory / required).is_file():
        sys.exit(f"jax_kda: {directory} has no {required}")
    print(f"{name}\t{directory.resolve()}")
