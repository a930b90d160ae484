"""Access to the compiled extension ``jax_kda._jax_kda_ext`` and registration of its FFI targets.

The package must import and run (``backend="xla"``) where the extension is missing: a build without a
CUDA toolkit, or an extension that fails to load. So the extension is imported lazily, on the first call
of any function here, and a failure is recorded as a reason instead of raised at import.

On that first call the extension's XLA FFI API version (of the jaxlib headers it was compiled against) is
compared with the running jaxlib's, and the custom call targets are registered with JAX for the CUDA
platform, exactly once per process. A handler built against a newer FFI API than jaxlib's is rejected by
XLA only when the GPU backend starts, with a message that names neither package; checking here turns that
into a clear reason at the first use.
"""

from __future__ import annotations

import functools
import importlib
import pathlib
import re
import threading
import types

import jax

from jax_kda import contract

_EXTENSION = "jax_kda._jax_kda_ext"

_lock = threading.Lock()
_state: tuple[types.ModuleType | None, str | None, frozenset[str]] | None = None


def ffi_api_incompatibility(built: tuple[int, int], runtime: tuple[int, int]) -> str | None:
    """Why an extension built against XLA FFI API ``built`` cannot run under jaxlib's API ``runtime``.

    XLA accepts a handler of the same major version and a minor version no newer than its own.

    Returns:
      None if compatible, else a message naming both versions and what to do.
    """
    if built[0] == runtime[0] and built[1] <= runtime[1]:
        return None
    built_text = f"{built[0]}.{built[1]}"
    runtime_text = f"{runtime[0]}.{runtime[1]}"
    if built[0] == runtime[0]:
        remedy = (
            f"install a jaxlib whose XLA FFI API is {built[0]}.x with x >= {built[1]}, or rebuild jax_kda "
            "against the installed jaxlib"
        )
    else:
        remedy = f"rebuild jax_kda against the installed jaxlib (XLA FFI API {runtime_text})"
    return (
        f"the jax_kda extension was compiled against XLA FFI API {built_text}, but the installed jaxlib "
        f"{_jaxlib_version()} provides XLA FFI API {runtime_text}: {remedy}"
    )


def driver_incompatibility(driver: int, runtime: int, has_gpu: bool) -> str | None:
    """Why the kernels cannot run with CUDA driver version `driver` (1000 * major + 10 * minor; 0 for
    none) when the extension links CUDA runtime `runtime` statically, or None. Only where this
    process has CUDA devices: on a host without a GPU the kernels still lower (jax.export)."""
    if not has_gpu or driver >= runtime:
        return None
    need = f"{runtime // 1000}.{runtime % 1000 // 10}"
    found = "no CUDA driver" if driver == 0 else f"CUDA driver {driver // 1000}.{driver % 1000 // 10}"
    return (f"the jax_kda kernels are built with CUDA {need} and need an NVIDIA driver that supports it (>= 580 "
            f"for CUDA 13.0), but this machine has {found}: update the driver (backend='xla' works without it)")


def _has_cuda_devices() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def runtime_ffi_api_version() -> tuple[int, int]:
    """The XLA FFI API version of the running jaxlib, read from the C API header it ships.

    Raises:
      RuntimeError: the header is missing or does not define the version.
    """
    header = pathlib.Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
    try:
        text = header.read_text()
    except OSError as e:
        raise RuntimeError(f"cannot read the XLA FFI API version of jaxlib {_jaxlib_version()}: {e}") from e
    version = []
    for name in ("XLA_FFI_API_MAJOR", "XLA_FFI_API_MINOR"):
        match = re.search(rf"^#define {name} (\d+)\s*$", text, re.MULTILINE)
        if match is None:
            raise RuntimeError(f"{header} does not define {name}")
        version.append(int(match.group(1)))
    return version[0], version[1]


def load() -> types.ModuleType:
    """The extension module, with its FFI targets registered for CUDA.

    Raises:
      RuntimeError: the kernels are unavailable; the message says why.
    """
    module, _, _ = _initialize()
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"jax_kda kernels are unavailable: {reason}")
    return module


def unavailable_reason() -> str | None:
    """Why the kernels cannot be used in this process, or None if they can: the extension's load and
    registration, then (at the first call that asks, not at import, since it starts jax's backends)
    the CUDA driver against the runtime the extension links."""
    module, reason, _ = _initialize()
    return reason if reason is not None else _driver_reason()


@functools.cache
def _driver_reason() -> str | None:
    module = _initialize()[0]
    return driver_incompatibility(module.cuda_driver_version(), module.cuda_runtime_version(), _has_cuda_devices())


def kernel_objects() -> tuple[tuple[str, str, str, int], ...]:
    """The kernel exports linked into the extension (`contract.KERNEL_EXPORTS`), as (export name,
    kernel object, compiler target, gate variant) tuples (e.g. ``("prefill_wgmma_sm_90a_g_f32_beta_bf16",
    "prefill_wgmma_sm_90a", "sm_90a", 2)``); empty when the kernels are unavailable."""
    module = _initialize()[0]
    return tuple(tuple(o) for o in module.kernel_objects()) if module is not None else ()


def compiled_archs() -> tuple[str, ...]:
    """The GPU architectures the kernels were compiled for (e.g. ``("sm_90a", "sm_100f", "sm_110f")``), in the
    order of the contract's architectures; empty when the kernels are unavailable."""
    built = {arch for _, _, arch, _ in kernel_objects()}
    return tuple(arch.name for arch in contract.ARCHS if arch.name in built)


def registered_targets() -> frozenset[str]:
    """The custom call targets registered with JAX for CUDA (`contract.FFI_TARGET`); empty when the
    kernels are unavailable."""
    return _initialize()[2]


def _initialize() -> tuple[types.ModuleType | None, str | None, frozenset[str]]:
    global _state
    with _lock:
        if _state is None:
            _state = _load_and_register()
        return _state


def _load_and_register() -> tuple[types.ModuleType | None, str | None, frozenset[str]]:
    try:
        module = importlib.import_module(_EXTENSION)
    except ImportError as e:
        package = pathlib.Path(__file__).resolve().parent
        if (package.parent / "pyproject.toml").is_file() and (package.parent / "csrc").is_dir():
            return None, (
                f"you are importing the jax_kda source checkout at {package.parent}, which has no compiled "
                f"extension ({e}); install the package (pip install .) and import it from outside the "
                "checkout to use the kernels (backend='xla' works as it is)"
            ), frozenset()
        return None, (
            f"the compiled extension {_EXTENSION} could not be imported ({e}). It is built at install time "
            "on Linux (its build requirements are pip packages, no CUDA toolkit needed); this installation "
            "has none, so only backend='xla' works: reinstall jax_kda on Linux with "
            "JAX_KDA_BUILD_KERNELS=ON to see why the build skipped it"
        ), frozenset()
    try:
        runtime = runtime_ffi_api_version()
    except RuntimeError as e:
        return None, str(e), frozenset()
    reason = ffi_api_incompatibility(tuple(module.ffi_api_version()), runtime)
    if reason is not None:
        return None, reason, frozenset()
    targets = module.registrations()
    try:
        for name, handlers in targets.items():
            jax.ffi.register_ffi_target(name, handlers, platform="CUDA")
    except Exception as e:  # whatever jaxlib raises, the kernels are unusable: keep it as the reason
        reason = f"registering the jax_kda FFI targets with jaxlib {_jaxlib_version()} failed: {e!r}"
        return None, reason, frozenset()
    return module, None, frozenset(targets)


def _jaxlib_version() -> str:
    import jaxlib.version

    return jaxlib.version.__version__
