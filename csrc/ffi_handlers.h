// The XLA FFI handler symbols of jax_kda, registered from Python through the nanobind module.
//
// The custom call target (contract::kFfiTarget) has an instantiate handler (validates the static
// attributes and loads the kernel objects, once per process, outside any CUDA graph capture) and an
// execute handler (resolves the object for the device and launches).

#ifndef JAX_KDA_CSRC_FFI_HANDLERS_H_
#define JAX_KDA_CSRC_FFI_HANDLERS_H_

#include <cstdint>
#include <string>

#include "kda_contract.h"
#include "xla/ffi/api/ffi.h"

namespace jax_kda {

XLA_FFI_DECLARE_HANDLER_SYMBOL(kPrefillInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kPrefillExecute);

// The call's static attributes (contract.CALL_ATTRIBUTES, in that order), decoded by name.
struct PrefillAttrs {
#define JAX_KDA_ATTR_FIELD(type, name) type name;
  JAX_KDA_PREFILL_ATTR_FIELDS(JAX_KDA_ATTR_FIELD)
#undef JAX_KDA_ATTR_FIELD
};

// Why this build cannot run a call with these attributes (the ranges and combinations it supports),
// or an empty string. Both handler stages check it; the extension module exposes it to the CPU tests.
std::string PrefillAttrsError(const PrefillAttrs& a);

}  // namespace jax_kda

#endif  // JAX_KDA_CSRC_FFI_HANDLERS_H_
