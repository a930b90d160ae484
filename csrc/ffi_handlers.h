// The XLA FFI handler symbols of jax_kda, registered from Python through the nanobind module.
//
// Each custom call target has an instantiate handler (validates the static attributes and loads the
// kernel objects, once per process, outside any CUDA graph capture) and an execute handler (launches).

#ifndef JAX_KDA_CSRC_FFI_HANDLERS_H_
#define JAX_KDA_CSRC_FFI_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

namespace jax_kda {

// Target "jax_kda_gate_activation".
XLA_FFI_DECLARE_HANDLER_SYMBOL(kGateActivationInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kGateActivationExecute);

// Target "jax_kda_prefill_sm90".
XLA_FFI_DECLARE_HANDLER_SYMBOL(kPrefillInstantiateSm90);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kPrefillExecuteSm90);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kPrefillInstantiateSm90Mma);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kPrefillExecuteSm90Mma);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kPrefillInstantiateSm100);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kPrefillExecuteSm100);

}  // namespace jax_kda

#endif  // JAX_KDA_CSRC_FFI_HANDLERS_H_
