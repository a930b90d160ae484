// The nanobind module jax_kda._jax_kda_ext: what Python needs to register the FFI handlers.
// jax_kda/_native.py loads it, checks the FFI API version and registers the targets.

#include <nanobind/nanobind.h>

#include <type_traits>

#include "ffi_handlers.h"
#include "kernel_module.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace jax_kda {
namespace {

template <typename Handler>
nb::capsule EncapsulateHandler(Handler* handler) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Handler, XLA_FFI_CallFrame*>,
                "an FFI handler takes XLA_FFI_CallFrame* and returns XLA_FFI_Error*");
  return nb::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace
}  // namespace jax_kda

// At global scope: the module's PyInit function must have external linkage.
NB_MODULE(_jax_kda_ext, m) {
  m.doc() = "jax_kda native kernels: XLA FFI handlers for AOT-compiled CuTe DSL kernels.";

  m.def(
      "ffi_api_version",
      [] { return nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); },
      "The XLA FFI API version (major, minor) of the headers this module was compiled against.");

  m.def(
      "registrations",
      [] {
        nb::dict targets;
        nb::dict gate_activation;
        gate_activation["instantiate"] = jax_kda::EncapsulateHandler(jax_kda::kGateActivationInstantiate);
        gate_activation["execute"] = jax_kda::EncapsulateHandler(jax_kda::kGateActivationExecute);
        targets["jax_kda_gate_activation"] = gate_activation;
        auto add = [&targets](const char* name, auto instantiate, auto execute) {
          nb::dict stages;
          stages["instantiate"] = jax_kda::EncapsulateHandler(instantiate);
          stages["execute"] = jax_kda::EncapsulateHandler(execute);
          targets[name] = stages;
        };
        add("jax_kda_prefill_sm90", jax_kda::kPrefillInstantiateSm90, jax_kda::kPrefillExecuteSm90);
        add("jax_kda_prefill_sm90_mma", jax_kda::kPrefillInstantiateSm90Mma, jax_kda::kPrefillExecuteSm90Mma);
        add("jax_kda_prefill_sm100", jax_kda::kPrefillInstantiateSm100, jax_kda::kPrefillExecuteSm100);
        return targets;
      },
      "Custom call target name -> {FFI stage name: handler capsule}, for jax.ffi.register_ffi_target.");

  m.def(
      "compiled_archs",
      [] {
        nb::list archs;
        for (jax_kda::Arch arch : jax_kda::kCompiledArchs) archs.append(jax_kda::ArchName(arch));
        return archs;
      },
      "The GPU architectures the kernels were compiled for, e.g. ['sm_90a', 'sm_100a'].");
}
