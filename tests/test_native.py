"""The native path: the extension, its FFI registration, and the kernel objects built into it.

CPU tests check what can be checked without a GPU: the extension's FFI API version, the kernel
objects and the cubins really embedded in it (their architectures and register counts), the
version-compatibility rule, registration, and that the C++ side agrees with jax_kda/contract.py.
"""

from __future__ import annotations

import pathlib
import re

import pytest
from jaxlib import xla_client

from jax_kda import _native, contract
from jax_kda._cubin import (barrier_counts, cubin_arch, embedded_cubins, max_barriers, max_registers, register_counts,
                             text_digests)

# A build without a CUDA toolkit is pure Python (backend="xla" only); CI builds with
# JAX_KDA_BUILD_KERNELS=ON, so there a missing extension fails the install instead of skipping here.
requires_extension = pytest.mark.skipif(
    _native.unavailable_reason() is not None, reason=f"kernels not built: {_native.unavailable_reason()}"
)


# --- The extension -----------------------------------------------------------------------------------


@requires_extension
def test_extension_is_built_against_ffi_api_0_4_with_every_kernel_object():
    extension = _native.load()
    assert _native.unavailable_reason() is None
    assert tuple(extension.ffi_api_version()) == (0, 4)
    assert _native.kernel_objects() == tuple((e.name, e.object.name, e.object.arch.name, i % len(contract.GATE_VARIANTS))
                                             for i, e in enumerate(contract.KERNEL_EXPORTS))
    # Every kernel object in every pair of gate dtypes, in the order the C++ side indexes them.
    assert [(e.object, e.gates) for e in contract.KERNEL_EXPORTS] == [
        (o, contract.GateDtypes(g, b)) for o in contract.KERNEL_OBJECTS for g in contract.GATE_DTYPES
        for b in contract.GATE_DTYPES]
    assert [contract.gate_variant(v.g, v.beta) for v in contract.GATE_VARIANTS] == [0, 1, 2, 3]
    assert _native.compiled_archs() == ("sm_90a", "sm_100f", "sm_110f")


@requires_extension
def test_running_jaxlib_accepts_the_extension_ffi_api():
    built = tuple(_native.load().ffi_api_version())
    assert _native.ffi_api_incompatibility(built, _native.runtime_ffi_api_version()) is None


@requires_extension
def test_extension_embeds_a_cubin_for_each_kernel_object():
    # One cubin per export, of its object's architecture: the wgmma prefill on sm_90a, the mma.sync
    # prefill as family cubins for sm_100f and sm_110f (the ELF flags say "f", not "a"), and the same
    # mma.sync kernels built for sm_90a (to test them there); each in the four pairs of gate dtypes.
    archs = [cubin_arch(c) for c in embedded_cubins(pathlib.Path(_native.load().__file__).read_bytes())]
    assert sorted(archs) == sorted(e.object.arch.name for e in contract.KERNEL_EXPORTS)


@requires_extension
def test_every_kernel_has_a_text_digest_and_a_register_count():
    """build/kernel_digests.py's view of the build: one .text digest per kernel, the same kernels
    that carry register counts (prepare, combine x 2, order_units, and the recurrence x 6 per
    object: its plain and ordered variants, each launched by the whole, apply and summary calls)."""
    for image in embedded_cubins(pathlib.Path(_native.load().__file__).read_bytes()):
        digests = text_digests(image)
        assert len(digests) == 10 and set(digests) == set(register_counts(image))
        assert sum("order_units" in name for name in digests) == 1
        assert sum("recurrence" in name.lower() for name in digests) == 6
        assert all(len(d) == 32 for d in digests.values())


@requires_extension
@pytest.mark.parametrize(("cc", "arch"), [((9, 0), "sm_90a"), ((10, 0), "sm_100f"), ((10, 3), "sm_100f"),
                                          ((11, 0), "sm_110f"), ((8, 0), None), ((12, 0), None), ((9, 1), None)])
def test_extension_maps_compute_capabilities_like_the_contract(cc, arch):
    """The SM100 family build serves 10.0 and 10.3 (B200, B300), the SM110 family 11.0; dispatch in
    the built extension says so."""
    assert _native.load().arch_for_compute_capability(*cc) == arch
    named = [a.name for a in contract.ARCHS if cc in a.compute_capabilities]
    assert named == ([arch] if arch else [])


@requires_extension
@pytest.mark.parametrize(("tokens", "sequences", "segments", "heads"),
                         [(0, 0, 1, 1), (300, 5, 1, 12), (8192, 1, 1, 96), (65536, 2, 16, 8), (17, 3, 4, 12)])
def test_extension_sizes_the_workspace_like_the_contract(tokens, sequences, segments, heads):
    """The handler's check of the workspace XLA allocates uses the same formula as the planner."""
    assert _native.load().workspace_bytes(tokens, sequences, segments, heads) == contract.workspace_bytes(
        tokens, sequences, segments, heads)


# The occupancy each prefill kernel is built around, as (CTAs per SM, threads per CTA)
# (jax_kda/contract.py): prepare's persistent grid assumes 5 CTAs of 128 threads with bf16 g and 4
# with fp32 g, the recurrence two CTAs of 160 threads per SM. That allows 96 or 128 and 168
# registers a thread (jax_kda._cubin.max_registers). A compiler update (e.g. of the pinned
# nvidia-cutlass-dsl) or an edit that crossed them would silently cost a fifth to a half of the
# speed; nothing else would notice. The margins are small on purpose: prepare with bf16 g uses
# exactly its 96 (ptxas fits it under the launch bound).
def occupancy(kernel: str) -> tuple[str, int, int] | None:
    """(family, CTAs per SM, threads per CTA) of a prefill kernel, from its symbol name; None for
    the others. prepare's name spells its tensor arguments q, k, g first, each as tensorptr<dtype>."""
    if "prepare_chunks" in kernel:
        g = re.findall(r"tensorptr(bf16|f32)", kernel)[2]
        g_dtype = {"bf16": "bfloat16", "f32": "float32"}[g]
        return "prepare_chunks " + g_dtype, contract.PREPARE_CTAS_PER_SM[g_dtype], contract.PREPARE_THREADS
    if "recurrence" in kernel:
        return "recurrence", contract.RECURRENCE_CTAS_PER_SM, contract.RECURRENCE_THREADS
    return None


@requires_extension
def test_embedded_prefill_kernels_fit_their_occupancy():
    seen = set()
    for cubin in embedded_cubins(pathlib.Path(_native.load().__file__).read_bytes()):
        arch = cubin_arch(cubin)
        barriers = barrier_counts(cubin)
        for kernel, registers in register_counts(cubin).items():
            if (found := occupancy(kernel)) is not None:
                family, ctas, threads = found
                seen.add((arch, family))
                limit = max_registers(ctas, threads)
                assert registers <= limit, f"{arch} {kernel}: {registers} registers > {limit}"
                # Named barriers count too: a barrier id computed at run time reserves all 16 of a
                # CTA's, and then no more than four CTAs share an SM.
                assert 0 < barriers[kernel] <= max_barriers(ctas), f"{arch} {kernel}: {barriers[kernel]} barriers"
    # Every kernel family found on every architecture (so that a parse that finds nothing fails).
    families = ["recurrence"] + ["prepare_chunks " + g for g in contract.GATE_DTYPES]
    assert seen == {(arch, family) for arch in _native.compiled_archs() for family in families}


@pytest.mark.parametrize(
    ("built", "runtime", "compatible"),
    [
        ((0, 4), (0, 4), True),
        ((0, 4), (0, 5), True),  # a newer jaxlib keeps accepting older handlers of the same major
        ((0, 5), (0, 4), False),  # built against newer headers than the running jaxlib
        ((0, 4), (1, 0), False),
        ((1, 0), (0, 9), False),
    ],
)
def test_ffi_api_compatibility_rule(built, runtime, compatible):
    reason = _native.ffi_api_incompatibility(built, runtime)
    if compatible:
        assert reason is None
    else:
        assert f"{built[0]}.{built[1]}" in reason and f"{runtime[0]}.{runtime[1]}" in reason
        assert "rebuild jax_kda" in reason


@pytest.mark.parametrize(("driver", "runtime", "has_gpu", "ok"), [
    (13000, 13000, True, True), (13020, 13000, True, True), (12080, 13000, True, False), (0, 13000, True, False),
    (0, 13000, False, True),  # no GPU: the kernels still lower (export), nothing to check
])
def test_driver_rule(driver, runtime, has_gpu, ok):
    reason = _native.driver_incompatibility(driver, runtime, has_gpu)
    assert (reason is None) == ok
    if not ok:
        assert "need an NVIDIA driver" in reason and "13.0" in reason


@requires_extension
def test_extension_reports_the_cuda_runtime_it_links():
    assert _native.load().cuda_runtime_version() // 1000 == 13
    assert _native.load().cuda_driver_version() >= 0


@requires_extension
def test_the_target_is_registered_for_cuda_once():
    _native.load()
    _native.load()
    assert _native.registered_targets() == frozenset({contract.FFI_TARGET})
    # Without a CUDA backend in the process, jaxlib queues CUDA registrations until one starts; the
    # queue is the only view of the registry there is. With a GPU they go straight to XLA.
    if "CUDA" not in xla_client._custom_callback_handler:
        queued = [entry[0] for entry in xla_client._custom_callback.get("CUDA", [])]
        assert queued.count(contract.FFI_TARGET) == 1


def test_the_contract_header_carries_every_constant_and_enum_value():
    """csrc/ includes this rendering (build/aot_compile.py --header): every contract fact C++ uses."""
    header = contract.render_header()
    for name, value in (("kHeadDim", contract.HEAD_DIM), ("kChunk", contract.CHUNK),
                        ("kMaxGridYZ", contract.MAX_GRID_YZ), ("kMaxWorkspaceRows", contract.MAX_WORKSPACE_ROWS),
                        ("kMaxSegments", contract.MAX_SEGMENTS),
                        ("kWorkspaceBytesPerRow", contract.WORKSPACE_BYTES_PER_ROW),
                        ("kVSplit", contract.V_SPLIT), ("kStateBytes", contract.STATE_BYTES),
                        ("kUnitTableEntryBytes", contract.UNIT_TABLE_ENTRY_BYTES)):
        assert f"inline constexpr int64_t {name} = {value};" in header
    for enum in (contract.Flag, contract.GateMode, contract.Phase, contract.Kernels):
        for member in enum:
            assert f" = {int(member)}," in header.split(f"enum class {enum.__name__} ")[1].split("};")[0]
    objects = contract.render_kernel_objects_header()
    for i, e in enumerate(contract.KERNEL_EXPORTS):
        assert f'#include "{e.name}.h"' in objects
        assert f'X({e.name}, "{e.object.name}", "{e.object.arch.name}", {i % len(contract.GATE_VARIANTS)})' in objects
    variants = header.split("kGateVariants[] = {")[1].split("};")[0]
    assert [line.strip() for line in variants.splitlines()[1:]] == [
        f"{{GateDtype::k{v.g.capitalize()}, GateDtype::k{v.beta.capitalize()}}}," for v in contract.GATE_VARIANTS]


def test_no_csrc_file_restates_a_contract_constant():
    """The contract's numbers reach C++ only through kda_contract.h: none is spelled out in csrc/."""
    root = pathlib.Path(__file__).resolve().parent.parent / "csrc"
    spelled = [str(v) for v in (contract.MAX_GRID_YZ, contract.MAX_WORKSPACE_ROWS, contract.WORKSPACE_BYTES_PER_ROW,
                                contract.STATE_BYTES)] + ["1 << 20", "3 * 4096"]
    for path in list(root.glob("*.cc")) + list(root.glob("*.h")):
        text = path.read_text()
        for literal in spelled:
            assert literal not in text, f"{path.name} spells out {literal!r}"


def test_importing_jax_kda_leaves_jax_unconfigured():
    """`import jax_kda` registers the custom call target but starts no jax backend, so jax can still
    be configured after it (e.g. the number of CPU devices)."""
    import subprocess
    import sys

    code = ("import jax_kda, jax\nfrom jax._src import xla_bridge\n"
            "assert not xla_bridge.backends_are_initialized()\n"
            "jax.config.update('jax_num_cpu_devices', 3)\nassert len(jax.devices('cpu')) == 3\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"},
                         cwd=pathlib.Path(__file__).resolve().parent)
    assert run.returncode == 0, run.stderr[-2000:]


def _load_aot_compile():
    """build/aot_compile.py as a module (the build script is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "aot_compile_for_test", pathlib.Path(__file__).resolve().parent.parent / "build" / "aot_compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_build_check_reads_registers_spills_and_wgmma_serialization_off_ptxas():
    """`aot_compile.py --check` fails a kernel whose warpgroup MMAs ptxas serialized (C7511: each wgmma
    then waits for the one before; a recurrence built that way ran 30-45 % slower) or made wait (C7517:
    a wait injected before code that touches an in-flight wgmma's registers): the log below is
    ptxas's own wording, kernel names shortened."""
    aot_compile = _load_aot_compile()
    log = """\
ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the wgmma pipeline in the function 'kernel_recurrence_5'
ptxas info    : (C7517) warpgroup.wait is injected in around line 9202 by compiler to allow use of registers defined by GMMA in function 'kernel_recurrence_4'
ptxas info    : Compiling entry function 'kernel_recurrence_5' for 'sm_90a'
ptxas info    : Function properties for kernel_recurrence_5
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 146 registers, used 3 barriers
ptxas info    : Compiling entry function 'kernel_prepare_chunks_0' for 'sm_90a'
ptxas info    : Function properties for kernel_prepare_chunks_0
    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers
ptxas info    : Compiling entry function 'kernel_recurrence_4' for 'sm_90a'
ptxas info    : Function properties for kernel_recurrence_4
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 150 registers, used 3 barriers
"""
    assert aot_compile.parse_ptxas_log(log) == {
        "kernel_recurrence_5": (146, 0, 0, True, False), "kernel_prepare_chunks_0": (128, 8, 4, False, False),
        "kernel_recurrence_4": (150, 0, 0, False, True)}


def test_the_build_check_finds_the_recurrence_chunk_loop_in_sass():
    """`aot_compile.py --check` prints each sm_90a recurrence kernel's chunk loop from `cuobjdump -sass`:
    the shortest backward branch holding the function's most tensor-core instructions (the mbarrier
    spin loop inside it holds none). The listing below is cuobjdump's format, code shortened."""
    aot_compile = _load_aot_compile()
    enc = "/* 0x0000000000000000 */"
    listing = f"""
Fatbin elf code:
================
arch = sm_90a
	code for sm_90a
		Function : kernel_recurrence_5
	.headerflags	@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   S2R R0, SR_TID.X ;                         {enc}
        /*0010*/                   USHF.L.U32 UR6, UR4, 0x1f, URZ ;           {enc}
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R9+URZ], R3 ; {enc}
        /*0030*/              @!P1 BRA 0x20 ;                                 {enc}
        /*0040*/                   LDS.64 R8, [R162+0xfc00] ;                 {enc}
        /*0050*/                   FMUL R24, R24, R8 ;                        {enc}
        /*0060*/                   F2FP.BF16.F32.PACK_AB R2, R25, R24 ;       {enc}
        /*0070*/                   HGMMA.64x16x16.F32.BF16 R104, gdesc[UR8].tnspA, RZ, !UPT ; {enc}
        /*0080*/                   HGMMA.64x128x16.F32.BF16 R24, R2, gdesc[UR12], R24, gsb0 ; {enc}
        /*0090*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x80 ;        {enc}
        /*00a0*/               @P0 BRA 0x10 ;                                 {enc}
        /*00b0*/                   EXIT ;                                     {enc}
        /*00c0*/                   BRA 0xc0 ;                                 {enc}
		..........


		Function : kernel_combine_segments_2
	.headerflags	@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDG.E R2, desc[UR4][R2.64] ;               {enc}
        /*0010*/              @!P0 BRA 0x0 ;                                  {enc}
        /*0020*/                   EXIT ;                                     {enc}
"""
    assert aot_compile.chunk_loops(listing) == {
        "kernel_recurrence_5": (10, dict(MMA=2, FMUL=1, convert=1, uniform=1, shared=1, barrier=1))}
    assert aot_compile.describe_loop((10, dict(MMA=2, FMUL=1))) == "chunk loop 10 SASS instructions (MMA 2, FMUL 1)"
