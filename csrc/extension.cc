// The nanobind module jax_kda._jax_kda_ext: what Python needs to register the FFI handlers, and what
// the CPU tests read back from the build (its FFI API version, kernel objects, workspace formula).
// jax_kda/_native.py loads it, checks the FFI API version and registers the target.

#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>
#include <type_traits>

#include "ffi_handlers.h"
#include "kda_contract.h"
#include "prefill.h"
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
        nb::dict stages;
        stages["instantiate"] = jax_kda::EncapsulateHandler(jax_kda::kPrefillInstantiate);
        stages["execute"] = jax_kda::EncapsulateHandler(jax_kda::kPrefillExecute);
        nb::dict targets;
        targets[jax_kda::contract::kFfiTarget] = stages;
        return targets;
      },
      "Custom call target name -> {FFI stage name: handler capsule}, for jax.ffi.register_ffi_target.");

  m.def(
      "kernel_objects",
      [] {
        nb::list objects;
        for (const jax_kda::ExportedObject& object : jax_kda::PrefillModules().objects()) {
          objects.append(nb::make_tuple(object.name, object.object, object.arch, object.gate_variant));
        }
        return objects;
      },
      "The kernel exports linked into this module, as (export name, kernel object, compiler target, gate "
      "variant) tuples.");

  m.def(
      "arch_for_compute_capability",
      [](int major, int minor) -> nb::object {
        const char* arch = jax_kda::ArchForComputeCapability(major, minor);
        if (arch == nullptr) return nb::none();
        return nb::str(arch);
      },
      "The compiler target whose objects serve a device of this compute capability, or None.");

  m.def(
      "cuda_driver_version",
      [] {
        int version = 0;  // 0: no driver (cudaDriverGetVersion reports that without failing)
        if (cudaDriverGetVersion(&version) != cudaSuccess) version = 0;
        return version;
      },
      "The installed CUDA driver's version as 1000 * major + 10 * minor (0 without a driver).");
  m.def("cuda_runtime_version", [] { return CUDART_VERSION; },
        "The CUDA runtime version the extension links statically (1000 * major + 10 * minor).");

  m.def(
      "prefill_attributes_error",
      [](nb::dict attrs) -> std::string {
        jax_kda::PrefillAttrs decoded{};
        size_t fields = 0;
#define JAX_KDA_ATTR_FIELD(type, name)                                                       \
  if (!attrs.contains(#name)) throw nb::key_error("missing attribute " #name);               \
  decoded.name = nb::cast<type>(attrs[#name]);                                              \
  ++fields;
        JAX_KDA_PREFILL_ATTR_FIELDS(JAX_KDA_ATTR_FIELD)
#undef JAX_KDA_ATTR_FIELD
        if (attrs.size() != fields) throw nb::value_error("attributes the handler does not decode");
        return jax_kda::PrefillAttrsError(decoded);
      },
      "Why the FFI handler would refuse a call with these static attributes (name -> number, exactly "
      "the ones it decodes), or an empty string.");

  m.def("workspace_bytes", &jax_kda::PrefillWorkspaceBytes,
        "The workspace bytes the handler requires for (total_tokens, num_sequences, num_segments, HV).");
}
