"""The build environment of the extension as a local repository: links to the files of a Python 3.12
virtualenv that has pyproject.toml's build requirements (the CuTe DSL, jaxlib's XLA FFI headers,
nanobind, NVIDIA's CUDA runtime packages). Nothing is downloaded.

The virtualenv's Python is named by the environment variable JAX_KDA_PYTHON, given to Bazel with
--repo_env (build/bazel_build.sh does). The repository has:
  python               that Python, for the genrule that compiles the kernels
  aot_outputs.bzl      AOT_EXPORT_HEADERS: the headers `build/aot_compile.py --out-dir` writes, one per
                       export of jax_kda/contract.py, so that BUILD.bazel lists none of them
  BUILD.bazel          build_env.BUILD: the headers and static libraries as cc_library targets
"""

def _execute(rctx, arguments):
    result = rctx.execute(arguments)
    if result.return_code != 0:
        fail("jax_kda: `{}` failed:\n{}{}".format(" ".join([str(a) for a in arguments]), result.stdout, result.stderr))
    return result.stdout

def _build_env_impl(rctx):
    python = rctx.os.environ.get("JAX_KDA_PYTHON")
    if not python:
        fail("jax_kda: set JAX_KDA_PYTHON (bazel build --repo_env=JAX_KDA_PYTHON=...) to the Python of a " +
             "virtualenv with the build requirements of pyproject.toml; build/bazel_build.sh makes one")
    for line in _execute(rctx, [python, rctx.path(rctx.attr._query)]).splitlines():
        name, directory = line.split("\t")
        rctx.symlink(directory, name)

    # -I: nothing from the user's site-packages or environment; -B: no .pyc files in the source tree.
    rctx.file("python", "#!/bin/sh\nexec '{}' -I -B \"$@\"\n".format(python), executable = True)

    # The exports are those of jax_kda/contract.py: both files are attributes, so that a change to
    # either makes this repository again.
    rctx.path(rctx.attr._contract)
    outputs = _execute(rctx, [python, "-I", rctx.path(rctx.attr._aot_compile), "--out-dir", "aot", "--list-outputs"])
    headers = [path[len("aot/"):] for path in outputs.splitlines() if path.endswith(".h")]
    rctx.file("aot_outputs.bzl", "AOT_EXPORT_HEADERS = {}\n".format(headers))

    rctx.template("BUILD.bazel", rctx.attr._build_file)

build_env = repository_rule(
    implementation = _build_env_impl,
    attrs = {
        "_query": attr.label(default = "//build/bazel:build_env.py"),
        "_build_file": attr.label(default = "//build/bazel:build_env.BUILD"),
        "_aot_compile": attr.label(default = "//:build/aot_compile.py"),
        "_contract": attr.label(default = "//:jax_kda/contract.py"),
    },
    environ = ["JAX_KDA_PYTHON"],
    local = True,
)
