// The XLA FFI handler symbols of jax_kda, registered from Python through the nanobind module.
//
// The custom call target (contract::kFfiTarget) has an instantiate handler (validates the static
// attributes and loads the kernel objects, once per process, outside any CUDA graph capture) and an
// execute handler (resolves the object for the device and launches).

#ifndef JAX_KDA_CSRC_FFI_HANDLERS_H_
#define JAX_KDA_CSRC_FFI_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

namespace jax_kda {

XLA_FFI_DECLARE_HANDLER_SYMBOL(kPrefillInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kPrefillExecute);

}  // namespace jax_kda

#endif  // JAX_KDA_CSRC_FFI_HANDLERS_H_
