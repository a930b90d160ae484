"""Reading CUDA ELF images (cubins): the ones embedded in a host binary, their architecture, and the
registers each kernel uses. Standard library only, so that build-time tools can load this file
by path without importing jax_kda (build/aot_compile.py --check does); the tests use it to
check the built extension.
"""

from __future__ import annotations

import struct

EM_CUDA = 190
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 0x01, 0x02, 0x03, 0x04
_EIATTR_REGCOUNT = 0x2F
_EIATTR_NUM_BARRIERS = 0x4C  # in a kernel's own .nv.info.<kernel> section (the sm_100 ELF ABI)
# Named barriers an SM has for its CTAs, as Nsight Compute's "Block Limit Barriers" shows on the
# H200: 4 CTAs an SM for a kernel using all 16 of a CTA's barriers, 21 for one using 3.
SM_NAMED_BARRIERS = 64
_RENAMED_SMS = {101: 110}  # the ELF's SM number -> the compiler target's


def _section_headers(elf: bytes, start: int = 0) -> list[tuple]:
    """The ELF64 section headers of the image at `start` (offsets relative to it)."""
    (shoff,) = struct.unpack_from("<Q", elf, start + 0x28)
    shentsize, shnum, _ = struct.unpack_from("<HHH", elf, start + 0x3A)
    return [struct.unpack_from("<IIQQQQIIQQ", elf, start + shoff + i * shentsize) for i in range(shnum)]


def embedded_cubins(data: bytes) -> list[bytes]:
    """Every CUDA ELF image inside `data` (an extension module, an object file), as its own bytes.

    The AOT-exported objects embed each cubin whole, so the images are found by their ELF header
    (e_machine EM_CUDA) and end where the last of their sections, section headers or program
    headers ends."""
    cubins = []
    start = data.find(b"\x7fELF")
    while start >= 0:
        (machine,) = struct.unpack_from("<H", data, start + 18)
        if machine == EM_CUDA:
            (shoff,) = struct.unpack_from("<Q", data, start + 0x28)
            shentsize, shnum, _ = struct.unpack_from("<HHH", data, start + 0x3A)
            (phoff,) = struct.unpack_from("<Q", data, start + 0x20)
            phentsize, phnum = struct.unpack_from("<HH", data, start + 0x36)
            end = max(shoff + shnum * shentsize, phoff + phnum * phentsize)
            for h in _section_headers(data, start):
                if h[1] != 8:  # SHT_NOBITS occupies no bytes in the file
                    end = max(end, h[4] + h[5])
            cubins.append(data[start:start + end])
        start = data.find(b"\x7fELF", start + 4)
    return cubins


def cubin_arch(cubin: bytes) -> str:
    """`sm_90a`, `sm_100f`, ...: the architecture in e_flags, encoded per CUDA ELF ABI. Before sm_100
    (EI_OSABI 0x33) the SM is bits 0-7 and 0x800 marks an "a" (arch-specific) target; from sm_100
    (EI_OSABI 0x41) the SM is bits 8-15, 0x8 marks "a" and 0x2 without 0x8 a family ("f") target
    (read off cubins of sm_100a, sm_100f and sm_100 built by nvidia-cutlass-dsl 4.8.1). The SM of
    sm_110f cubins reads 101, its number before CUDA 13 renamed it."""
    (flags,) = struct.unpack_from("<I", cubin, 48)
    if cubin[7] == 0x41:
        sm = _RENAMED_SMS.get((flags >> 8) & 0xFF, (flags >> 8) & 0xFF)
        suffix = "a" if flags & 0x8 else "f" if flags & 0x2 else ""
    else:
        sm, suffix = flags & 0xFF, "a" if flags & 0x800 else ""
    return f"sm_{sm}{suffix}"


def _section_names(cubin: bytes) -> list[tuple[str, tuple]]:
    """(name, header) of every section of `cubin`."""
    headers = _section_headers(cubin)
    (shstrndx,) = struct.unpack_from("<H", cubin, 0x3E)
    names_off = headers[shstrndx][4]
    out = []
    for h in headers:
        end = cubin.index(b"\0", names_off + h[0])
        out.append((cubin[names_off + h[0]:end].decode(), h))
    return out


def text_digests(cubin: bytes) -> dict[str, str]:
    """{kernel: md5 of its `.text` section}: the machine code alone, to show that a change left the
    kernels byte for byte as they were (build/kernel_digests.py prints them for a built file)."""
    import hashlib

    return {name[len(".text."):]: hashlib.md5(cubin[h[4]:h[4] + h[5]]).hexdigest()
            for name, h in _section_names(cubin) if name.startswith(".text.")}


def register_counts(cubin: bytes) -> dict[str, int]:
    """{kernel name: registers per thread}: the EIATTR_REGCOUNT entries of `.nv.info` (keyed by
    symbol index), matched to the `.text.<kernel>` sections through their sh_info."""
    regs_by_symbol, kernel_by_symbol = {}, {}
    for section, h in _section_names(cubin):
        if section.startswith(".text."):
            kernel_by_symbol[h[7]] = section[len(".text."):]
        if section == ".nv.info":
            i, stop = h[4], h[4] + h[5]
            while i < stop:
                fmt, attr = cubin[i], cubin[i + 1]
                if fmt == _EIFMT_SVAL:  # u16 size, then the payload
                    (size,) = struct.unpack_from("<H", cubin, i + 2)
                    if attr == _EIATTR_REGCOUNT:  # (symbol index, registers)
                        symbol, regs = struct.unpack_from("<II", cubin, i + 4)
                        regs_by_symbol[symbol] = regs
                    i += 4 + size
                elif fmt in (_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL):  # format, attribute, 2 bytes
                    i += 4
                else:
                    raise ValueError(f".nv.info: unknown attribute format {fmt:#x} at byte {i}")
            if i != stop:
                raise ValueError(".nv.info: attribute walk overran its section")
    return {kernel_by_symbol[s]: r for s, r in regs_by_symbol.items() if s in kernel_by_symbol}


def barrier_counts(cubin: bytes) -> dict[str, int]:
    """{kernel name: named barriers it reserves (ptxas's "used N barriers")}. The sm_90 ELF ABI keeps
    the count in bits 20-26 of the `.text.<kernel>` section's flags, the sm_100 ABI as
    EIATTR_NUM_BARRIERS in `.nv.info.<kernel>`. An id computed at run time (`bar.sync r, n`)
    reserves all 16."""
    counts = {}
    for section, h in _section_names(cubin):
        if section.startswith(".text."):
            kernel = section[len(".text."):]
            counts[kernel] = max(counts.get(kernel, 0), (h[2] >> 20) & 0x7F)
        elif section.startswith(".nv.info."):
            kernel = section[len(".nv.info."):]
            i, stop = h[4], h[4] + h[5]
            while i < stop:
                fmt, attr = cubin[i], cubin[i + 1]
                if fmt == _EIFMT_SVAL:
                    (size,) = struct.unpack_from("<H", cubin, i + 2)
                    i += 4 + size
                else:  # format, attribute, 2 bytes of value
                    if fmt == _EIFMT_BVAL and attr == _EIATTR_NUM_BARRIERS:
                        counts[kernel] = max(counts.get(kernel, 0), cubin[i + 2])
                    i += 4
    return counts


def max_barriers(ctas_per_sm: int) -> int:
    """The most named barriers a kernel may reserve for `ctas_per_sm` of its CTAs to share an SM."""
    return min(16, SM_NAMED_BARRIERS // ctas_per_sm)


def max_registers(ctas_per_sm: int, threads_per_cta: int, registers_per_sm: int = 65536,
                  schedulers: int = 4) -> int:
    """The most registers a thread may use for `ctas_per_sm` CTAs to fit on one SM (sm_90, sm_100):
    each of the 4 schedulers has a quarter of the register file, allocated per warp in units of
    256 registers, and a CTA's warps are spread over them (two 5-warp CTAs: 168, not 204)."""
    warps = -(-threads_per_cta // 32)
    for registers in range(255, 0, -1):
        per_warp = -(-32 * registers // 256) * 256
        if (registers_per_sm // schedulers // per_warp) * schedulers // warps >= ctas_per_sm:
            return registers
    return 0
