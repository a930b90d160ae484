"""Compile and export every SM90 KDA kernel for sm_90a, then print each kernel's resource usage.

    python csrc/kernels/sm90/compile_check.py OUT_DIR

Writes OUT_DIR/<export name>.{h,o} and keeps the PTX/cubin under OUT_DIR/dump. Registers and
spills: the register count stored in the exported cubin (what runs), and ptxas -v of the local
toolkit on the kept PTX for spills (its register count can differ from the DSL's bundled ptxas);
cuobjdump -res-usage is printed too where cuobjdump is installed.
Exits non-zero when compilation fails or a kernel spills.
"""

import ctypes
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys


def load_cubin_module():
    """jax_kda/_cubin.py, loaded by path: this tool runs where jax_kda need not be importable."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    spec = importlib.util.spec_from_file_location("jax_kda_cubin", os.path.join(repo, "jax_kda", "_cubin.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cubin_register_counts(path):
    """{kernel name: registers} stored in the cubin at `path`."""
    with open(path, "rb") as f:
        return load_cubin_module().register_counts(f.read())


def ptxas_usage(ptx_path):
    """{kernel name: (registers, spill store bytes, spill load bytes)} from ptxas -v."""
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", ptx_path, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    usage, current = {}, None
    for line in out.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            usage.setdefault(current, [0, 0, 0])[1:] = [int(m.group(1)), int(m.group(2))]
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            usage.setdefault(current, [0, 0, 0])[0] = int(m.group(1))
        if "C7517" in line or "C7519" in line or "serialized" in line:
            print("ptxas:", line.strip())
    return usage


def short_name(kernel):
    for known, short in (("prepare_chunks_kernel", "prepare_chunks"), ("ChunkRecurrence", "chunk_recurrence"),
                         ("combine_segments_kernel", "combine_segments")):
        if known in kernel:
            return short
    return kernel[:60]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out_dir = os.path.abspath(sys.argv[1])
    dump_dir = os.path.join(out_dir, "dump")
    shutil.rmtree(dump_dir, ignore_errors=True)
    os.makedirs(dump_dir)
    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"
    os.environ["CUTE_DSL_DUMP_DIR"] = dump_dir
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"

    import cutlass
    ctypes.CDLL(cutlass.runtime.find_runtime_libraries(enable_tvm_ffi=False)[0], mode=ctypes.RTLD_GLOBAL)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # csrc/kernels
    import cutlass.cute as cute
    from sm90 import chunk_recurrence, combine_segments, kda_prefill, prepare_chunks

    compiled = cute.compile(kda_prefill.prefill, *kda_prefill.compile_arguments(), options="--gpu-arch sm_90a")
    compiled.export_to_c(out_dir, "prefill_sm_90a", function_prefix="jax_kda_prefill_sm_90a")
    print(f"exported {out_dir}/prefill_sm_90a.h and .o")

    smem = {
        "prepare_chunks": prepare_chunks.shared_memory_bytes(),
        "chunk_recurrence": chunk_recurrence.shared_memory_bytes(),
        "combine_segments": " / ".join(str(combine_segments.shared_memory_bytes(c)) for c in combine_segments.V_BLOCKS),
    }
    # Registers a thread may use and keep the occupancy the kernels are built around: prepare's
    # persistent grid assumes CTAS_PER_SM CTAs per SM, the recurrence two per SM (the same check
    # as tests/test_native.py's on the built extension, which also covers sm_100a).
    occupancy = load_cubin_module().max_registers
    max_registers = {
        "prepare_chunks": occupancy(prepare_chunks.CTAS_PER_SM, prepare_chunks.THREADS),
        "chunk_recurrence": occupancy(2, chunk_recurrence.THREADS),
    }
    ok = True
    for ptx in glob.glob(os.path.join(dump_dir, "*.ptx")):
        usage = ptxas_usage(ptx)
        cubins = glob.glob(os.path.splitext(ptx)[0] + ".cubin")
        stored = cubin_register_counts(cubins[0]) if cubins else {}
        for kernel, (regs, spill_st, spill_ld) in sorted(usage.items(), key=lambda kv: short_name(kv[0])):
            name = short_name(kernel)
            print(f"{name:18s} registers {stored.get(kernel)} in cubin ({regs} with local ptxas), "
                  f"spills {spill_st}/{spill_ld} B store/load, dynamic smem {smem.get(name, 0)} B")
            ok &= spill_st == 0 and spill_ld == 0
            used = stored.get(kernel) or regs
            if used > max_registers.get(name, 255):
                print(f"{name}: {used} registers, more than the {max_registers[name]} its occupancy needs")
                ok = False
        if cubins and shutil.which("cuobjdump"):
            print(subprocess.run(["cuobjdump", "-res-usage", cubins[0]], capture_output=True,
                                 text=True).stdout)
    if not ok:
        sys.exit("compile check failed: a kernel spills or needs more registers than its occupancy allows")
    print("compile check passed")


if __name__ == "__main__":
    main()
