// The KDA gate activation kernel (csrc/kernels/gate_activation.py) behind a plain C++ interface:
// a parameters struct, and one launch function that picks the object compiled for the device.

#ifndef JAX_KDA_CSRC_GATE_ACTIVATION_H_
#define JAX_KDA_CSRC_GATE_ACTIVATION_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernel_module.h"

namespace jax_kda {

// The gate modes: jax_kda.config.GateMode's values, also used by csrc/kernels/gate_activation.py.
enum GateMode : int32_t {
  kGateSoftplus = 1,          // -exp(A_log[h]) * softplus(g + dt_bias)
  kGateLowerBoundALog = 2,    // lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias))
  kGateLowerBound = 3,        // lower_bound * sigmoid(g + dt_bias); A_log is not read
};

// Base-pointer alignment the kernel's vector loads and stores assume for `g` and `decay`.
inline constexpr uintptr_t kGateVectorAlignBytes = 16;

struct GateActivationParams {
  const void* g;          // bf16 [num_tokens, num_heads, head_dim], row-major
  const float* a_log;     // [num_heads]; unused (may be empty) for kGateLowerBound
  const float* dt_bias;   // [num_heads * head_dim]
  float* decay;           // [num_tokens, num_heads, head_dim], row-major
  int64_t num_tokens;
  int32_t num_heads;
  int32_t head_dim;
  int32_t gate_mode;      // a GateMode
  float lower_bound;      // used by the lower-bound modes
};

// The process-wide loader of the gate activation objects (one per compiled architecture).
KernelModules& GateActivationModules();

// Enqueues the kernel on `stream`. The caller has validated `params`, has loaded the modules, and does
// not call this for an empty tensor. Returns the launch status.
cudaError_t LaunchGateActivation(const GateActivationParams& params, Arch arch, cudaStream_t stream);

}  // namespace jax_kda

#endif  // JAX_KDA_CSRC_GATE_ACTIVATION_H_
