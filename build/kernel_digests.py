"""The md5 of every kernel's machine code (cubin `.text` section) in built files, one line each.

    python build/kernel_digests.py EXTENSION_OR_OBJECT...

Sorted by architecture and digest, without the kernel names (the DSL's names embed module paths and
object addresses), so that two builds of unchanged kernels print identical lines: `diff` the output
of two builds to show that a change did not touch the kernels.
"""

import importlib.util
import pathlib
import sys

spec = importlib.util.spec_from_file_location(
    "kda_cubin", pathlib.Path(__file__).resolve().parent.parent / "jax_kda" / "_cubin.py")
cubin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cubin)

lines = []
for path in sys.argv[1:]:
    for image in cubin.embedded_cubins(pathlib.Path(path).read_bytes()):
        arch = cubin.cubin_arch(image)
        lines += [f"{arch} {digest}" for digest in cubin.text_digests(image).values()]
print("\n".join(sorted(lines)))
