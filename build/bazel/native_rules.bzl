"""Stand-ins for @rules_cc and @rules_java, whose defs.bzl Bazel 4's own toolchain files load (the C++
toolchain's, and the Java toolchains' that toolchain resolution reads): Bazel would download them
(DEFAULT.WORKSPACE.SUFFIX), since Debian's bazel-bootstrap does not embed them. In Bazel 4 their rules
are the native ones, so PACKAGE/defs.bzl here forwards each of `rules` to it."""

def _native_rules_impl(rctx):
    rctx.file("WORKSPACE", "workspace(name = \"{}\")\n".format(rctx.name))
    rctx.file(rctx.attr.package + "/BUILD.bazel", "")
    rctx.file(rctx.attr.package + "/defs.bzl", "".join([
        "def {0}(**kwargs):\n    native.{0}(**kwargs)\n\n".format(rule)
        for rule in rctx.attr.rules
    ]))

native_rules = repository_rule(
    implementation = _native_rules_impl,
    attrs = {
        "package": attr.string(mandatory = True),
        "rules": attr.string_list(mandatory = True),
    },
)
