"""The build step: CuTe DSL kernels -> C headers and objects linked into the extension, and the C++
view of the kernel contract.

CMake runs it at build time, on a machine that needs no GPU:

    aot_compile.py --header DIR       writes DIR/kda_contract.h and DIR/kda_kernel_objects.h, rendered
                                      from jax_kda/contract.py (the one definition of the contract)
    aot_compile.py --out-dir DIR      compiles every kda_contract.KERNEL_EXPORTS entry (a kernel object
                                      for one pair of gate dtypes) with symbolic sizes and exports it
                                      (export_to_c) as DIR/<name>.h and .o, one process per export
                                      (JAX_KDA_BUILD_JOBS of them at once; default: the CPUs it may use)
    aot_compile.py --out-dir DIR --check
                                      the same, keeping the PTX and cubins under DIR/dump, then prints
                                      each kernel's registers (and spills, with a local ptxas) and
                                      fails if a kernel needs more registers than its occupancy
                                      allows, or an sm_90a kernel spills, or ptxas serialized a kernel's
                                      warpgroup MMAs or injected a wait for them (C7517); with
                                      cuobjdump and nvdisasm (PATH, or their pip packages
                                      nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) it also
                                      prints each sm_90a recurrence kernel's chunk loop: SASS
                                      instructions an iteration, by class
    aot_compile.py --out-dir DIR --list-outputs
                                      the files --out-dir writes, one per line; compiles nothing

The exported C symbols carry the prefix jax_kda_<name>: an exported module is process-global, so every
export needs its own. The kernel sources (csrc/kernels/) import the contract as `kda_contract`: this
file loads jax_kda/contract.py under that name, by path, since the build environment has no jax.
"""

import argparse
import concurrent.futures
import ctypes
import importlib
import importlib.util
import multiprocessing
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNEL_SOURCE_DIR = ROOT / "csrc" / "kernels"


def load_by_path(name: str, relative: str):
    """A standard-library-only file of the package, imported as module `name` without jax_kda."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


contract = load_by_path("kda_contract", "jax_kda/contract.py")


def output_paths(out_dir: pathlib.Path) -> list[pathlib.Path]:
    return [out_dir / f"{e.name}{suffix}" for e in contract.KERNEL_EXPORTS for suffix in (".h", ".o")]


def write_headers(out_dir: pathlib.Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("kda_contract.h", contract.render_header()),
                       ("kda_kernel_objects.h", contract.render_kernel_objects_header())):
        path = out_dir / name
        if not path.is_file() or path.read_text() != text:  # keep the timestamp when nothing changed
            path.write_text(text)


def compile_export(index: int, out_dir: str, dump_dir: str | None) -> str:
    """Compiles and exports KERNEL_EXPORTS[index], in a process of its own (the DSL reads its
    environment, the dump folder included, at import). Returns the line to print; a failure comes
    back as a RuntimeError carrying the worker's traceback (DSL errors do not pickle)."""
    try:
        return _compile_export(contract.KERNEL_EXPORTS[index], out_dir, dump_dir)
    except BaseException:
        raise RuntimeError(f"compiling {contract.KERNEL_EXPORTS[index].name} failed:\n{traceback.format_exc()}") from None


def _compile_export(export, out_dir: str, dump_dir: str | None) -> str:
    # The build must not depend on what an earlier build left in the DSL's on-disk cache.
    os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"
    if dump_dir:  # --check: the PTX and cubin the DSL keeps, in the export's own folder
        os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"
        os.environ["CUTE_DSL_DUMP_DIR"] = str(pathlib.Path(dump_dir) / export.name)
        pathlib.Path(os.environ["CUTE_DSL_DUMP_DIR"]).mkdir(parents=True, exist_ok=True)
    import cutlass.cute as cute
    import cutlass.runtime

    # export_to_c resolves symbols of the DSL runtime library; on a machine without a GPU nothing else
    # has loaded it, so load it globally first.
    runtime_library = cutlass.runtime.find_runtime_libraries(enable_tvm_ffi=False)[0]
    ctypes.CDLL(runtime_library, mode=ctypes.RTLD_GLOBAL)

    sys.path.insert(0, str(KERNEL_SOURCE_DIR))
    from common import prefill

    obj = export.object
    recurrence = importlib.import_module(obj.source).RECURRENCE
    started = time.perf_counter()
    # Always pinned: without --gpu-arch the DSL silently targets sm_100a.
    compiled = cute.compile(prefill.prefill, *prefill.compile_arguments(recurrence, export.gates),
                            options=f"--gpu-arch {obj.arch.name}")
    compiled.export_to_c(out_dir, export.name, function_prefix=f"jax_kda_{export.name}")
    return f"aot_compile: {export.name} in {time.perf_counter() - started:.2f} s"


def compile_all(out_dir: pathlib.Path, dump_dir: pathlib.Path | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    # The CPUs this process may use (a container's limit, not the host's count), at most one per export.
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    requested = int(os.environ.get("JAX_KDA_BUILD_JOBS") or 0)
    jobs = max(1, min(requested if requested >= 1 else usable, len(contract.KERNEL_EXPORTS)))
    started = time.perf_counter()
    print(f"aot_compile: compiling {len(contract.KERNEL_EXPORTS)} kernel exports, {jobs} at a time", flush=True)
    # Spawned workers, one export each: nothing of the DSL is shared between compilations.
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                                max_tasks_per_child=1) as pool:
        futures = [pool.submit(compile_export, i, str(out_dir), dump_dir and str(dump_dir))
                   for i in range(len(contract.KERNEL_EXPORTS))]
        for future in concurrent.futures.as_completed(futures):
            print(future.result(), flush=True)
    print(f"aot_compile: done in {time.perf_counter() - started:.1f} s", flush=True)


# --- --check ------------------------------------------------------------------------------------------------


def kernel_family(kernel: str) -> str:
    for family in ("prepare_chunks", "combine_segments", "order_units", "recurrence"):
        if family in kernel:
            return family
    return kernel[:60]


def ptxas_usage(ptx_path: str, arch: str) -> dict[str, tuple[int, int, int, bool, bool]]:
    """{kernel: (registers, spill store bytes, spill load bytes, wgmma serialized, wait injected)}
    from the local ptxas -v. "Serialized" is ptxas's C7510/C7511 note: it could not pipeline the
    kernel's warpgroup MMAs (for want of registers, say) and made every wgmma wait for the one before;
    the kernel still runs correctly, only much slower (a recurrence measured 30-45 % slower that way).
    "Wait injected" is its C7517 note: code touches registers that an in-flight wgmma defines, so
    ptxas made it wait for the MMAs first, which takes away the overlap the code was written for
    (the exp/vw-first recurrence of 2026-12-01 got it in every sm_90a variant)."""
    out = subprocess.run(["ptxas", f"-arch={arch}", "-v", ptx_path, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    return parse_ptxas_log(out)


def parse_ptxas_log(out: str) -> dict[str, tuple[int, int, int, bool, bool]]:
    """ptxas_usage's reading of a `ptxas -v` log (its stderr)."""
    usage, current = {}, None

    def entry(kernel: str) -> list:
        return usage.setdefault(kernel, [0, 0, 0, False, False])

    for line in out.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            current = m.group(1)
        if (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)) and current:
            entry(current)[1:3] = [int(m.group(1)), int(m.group(2))]
        if (m := re.search(r"Used (\d+) registers", line)) and current:
            entry(current)[0] = int(m.group(1))
        if m := re.search(r"wgmma.mma_async instructions are serialized.* in the function '([^']+)'", line):
            entry(m.group(1))[3] = True
        if m := re.search(r"\(C7517\) warpgroup.wait is injected.* in function '([^']+)'", line):
            entry(m.group(1))[4] = True
        if "C7517" in line or "C7519" in line or "serialized" in line:
            print("ptxas:", line.strip())
    return {k: tuple(v) for k, v in usage.items()}


def find_tool(name: str) -> str | None:
    """A CUDA binary tool (cuobjdump, nvdisasm) from PATH, else from its pip package
    (`nvidia-cuda-<name>`: nvidia/cu*/bin/ on sys.path; no CUDA toolkit needed), else None."""
    found = shutil.which(name)
    if found:
        return found
    for entry in sys.path:
        for candidate in sorted(pathlib.Path(entry or ".").glob(f"nvidia/cu*/bin/{name}")):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def find_disassembler() -> tuple[str, dict] | None:
    """(cuobjdump, the environment to run it in) when both cuobjdump and the nvdisasm it runs are
    found, else None."""
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if not (cuobjdump and nvdisasm):
        return None
    env = dict(os.environ, PATH=os.pathsep.join([str(pathlib.Path(nvdisasm).parent), os.environ.get("PATH", "")]))
    return cuobjdump, env


# SASS instruction classes the chunk-loop report counts (by opcode prefix, before the first dot).
MMA_OPCODES = ("HGMMA", "HMMA")  # warpgroup (sm_90a) and warp-level tensor-core MMAs
LOOP_CLASSES = (("MMA", MMA_OPCODES), ("FMUL", ("FMUL",)), ("convert", ("F2FP", "F2F")),
                ("uniform", ("U",)), ("shared", ("LDS", "STS", "LDSM", "STSM")), ("barrier", ("BAR",)))


def chunk_loops(sass: str) -> dict[str, tuple[int, dict[str, int]]]:
    """{kernel: (instructions an iteration, {class: count})} for each function of a `cuobjdump -sass`
    listing that has a loop with tensor-core instructions: the shortest backward branch's body
    that holds the function's largest number of them (the recurrence's chunk loop; the mbarrier
    spin loops inside it hold none)."""
    loops = {}
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        name = part.split("\n", 1)[0].strip()
        code = [(int(m.group(1), 16), m.group(2)) for m in
                re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", part)]
        index = {address: i for i, (address, _) in enumerate(code)}
        best = None
        for i, (address, instruction) in enumerate(code):
            target = re.search(r"\bBRA\s+(?:`?\(?)(0x[0-9a-f]+)", instruction)
            if not target or int(target.group(1), 16) >= address or int(target.group(1), 16) not in index:
                continue
            body = [ins for _, ins in code[index[int(target.group(1), 16)]:i + 1]]
            opcodes = [re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0] for ins in body]
            mma = sum(op in MMA_OPCODES for op in opcodes)
            if mma and (best is None or (mma, -len(body)) > (best[0], -len(best[1]))):
                best = (mma, opcodes)
        if best:
            opcodes = best[1]
            counts = {label: sum(any(op.startswith(prefix) for prefix in prefixes) for op in opcodes)
                      for label, prefixes in LOOP_CLASSES}
            loops[name] = (len(opcodes), counts)
    return loops


def cubin_chunk_loops(cubin_path: pathlib.Path,
                      disassembler: tuple[str, dict]) -> dict[str, tuple[int, dict[str, int]]]:
    """chunk_loops of one cubin, disassembled by cuobjdump (find_disassembler); {} if that fails,
    with its message printed."""
    cuobjdump, env = disassembler
    listing = subprocess.run([cuobjdump, "-sass", str(cubin_path)], capture_output=True, text=True, env=env)
    if listing.returncode != 0:
        print(f"cuobjdump -sass {cubin_path.name}: {listing.stderr.strip()[:300]}")
        return {}
    return chunk_loops(listing.stdout)


def describe_loop(loop: tuple[int, dict[str, int]]) -> str:
    length, counts = loop
    return f"chunk loop {length} SASS instructions (" + ", ".join(f"{k} {n}" for k, n in counts.items()) + ")"


def check(dump_dir: pathlib.Path) -> bool:
    """Registers and spills of every kernel kept under `dump_dir`; False if one breaks a limit."""
    cubin = load_by_path("kda_cubin", "jax_kda/_cubin.py")
    gates = {e.name: e.gates for e in contract.KERNEL_EXPORTS}

    def occupancy(export: str) -> dict[str, tuple[int, int]]:  # family -> (CTAs an SM, threads a CTA)
        return {
            "prepare_chunks": (contract.PREPARE_CTAS_PER_SM[gates[export].g], contract.PREPARE_THREADS),
            "recurrence": (contract.RECURRENCE_CTAS_PER_SM, contract.RECURRENCE_THREADS),
        }
    sys.path.insert(0, str(KERNEL_SOURCE_DIR))
    from common import combine_segments, prepare_chunks

    print(f"shared memory a CTA: prepare_chunks {prepare_chunks.shared_memory_bytes(2)} B (bf16 g) / "
          f"{prepare_chunks.shared_memory_bytes(4)} B (fp32 g), combine_segments "
          + " / ".join(f"{combine_segments.shared_memory_bytes(c)} B" for c in combine_segments.V_BLOCKS)
          + f" ({' / '.join(map(str, combine_segments.V_BLOCKS))} columns)")
    ok = True
    disassembler = find_disassembler()
    if not disassembler:
        print("no cuobjdump and nvdisasm (PATH, or `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`): "
              "the chunk-loop report is left out")
    for path in sorted(dump_dir.glob("*/*.cubin")):
        image = path.read_bytes()
        arch = cubin.cubin_arch(image)
        ptx = path.with_suffix(".ptx")
        spills = ptxas_usage(str(ptx), arch) if ptx.is_file() and shutil.which("ptxas") else {}
        # The recurrence's chunk loop, what a recurrence change moves first (sm_90a: the H200's code).
        loops = cubin_chunk_loops(path, disassembler) if disassembler and arch == "sm_90a" else {}
        targets = occupancy(path.parent.name)
        limits = {family: cubin.max_registers(*target) for family, target in targets.items()}
        barrier_limits = {family: cubin.max_barriers(ctas) for family, (ctas, _) in targets.items()}
        barriers = cubin.barrier_counts(image)
        for kernel, registers in sorted(cubin.register_counts(image).items(), key=lambda kv: kernel_family(kv[0])):
            family = kernel_family(kernel)
            _, spill_st, spill_ld, serialized, waits = spills.get(kernel, (0, None, None, False, False))
            print(f"{path.parent.name:26s} {arch} {family:18s} registers {registers:3d} (limit {limits.get(family, 255)}), "
                  f"barriers {barriers.get(kernel, 0)} (limit {barrier_limits.get(family, 16)}), "
                  f"spills {spill_st}/{spill_ld} B store/load" + (", wgmma serialized" if serialized else "")
                  + (", warpgroup.wait injected" if waits else "")
                  + (f"; {describe_loop(loops[kernel])}" if family == "recurrence" and kernel in loops else ""))
            if registers > limits.get(family, 255):
                print(f"  {family}: more registers than its occupancy allows")
                ok = False
            if barriers.get(kernel, 0) > barrier_limits.get(family, 16):
                print(f"  {family}: more named barriers than its occupancy allows (a barrier id computed at run time?)")
                ok = False
            if arch == "sm_90a" and (spill_st or spill_ld):
                print(f"  {family}: spills on sm_90a")
                ok = False
            if serialized:
                print(f"  {family}: ptxas serialized its warpgroup MMAs")
                ok = False
            if waits:
                print(f"  {family}: ptxas injected a warpgroup.wait (C7517): an MMA overlap is lost")
                ok = False
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=pathlib.Path)
    parser.add_argument("--header", type=pathlib.Path, metavar="DIR")
    parser.add_argument("--list-outputs", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.header is not None:
        write_headers(args.header)
    if args.out_dir is None:
        if args.header is None:
            parser.error("give --out-dir, --header or both")
        return
    if args.list_outputs:
        print("\n".join(str(path) for path in output_paths(args.out_dir)))
        return
    dump_dir = args.out_dir / "dump"
    if args.check:
        shutil.rmtree(dump_dir, ignore_errors=True)
        dump_dir.mkdir(parents=True)
    compile_all(args.out_dir, dump_dir if args.check else None)
    missing = [path for path in output_paths(args.out_dir) if not path.is_file()]
    if missing:
        sys.exit(f"aot_compile: export did not write {', '.join(map(str, missing))}")
    if args.check and not check(dump_dir):
        sys.exit("aot_compile --check: a kernel breaks its register or spill limit, or has serialized wgmma "
                 "or a ptxas-injected warpgroup.wait")


if __name__ == "__main__":
    main()
