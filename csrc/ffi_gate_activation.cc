// XLA FFI binding of the gate activation kernel: custom call target "jax_kda_gate_activation".
//
// The handler only reads shapes, pointers and static attributes, allocates nothing, never synchronizes
// and never reads device data on the host, so its launch replays unchanged from a CUDA graph: it is
// marked command-buffer compatible.

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "ffi_handlers.h"
#include "gate_activation.h"
#include "kernel_module.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_kda {
namespace {

constexpr char kTarget[] = "jax_kda_gate_activation";

ffi::Error InvalidArgument(const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(kTarget) + ": " + message);
}

ffi::Error CheckGateMode(int32_t gate_mode) {
  if (gate_mode == kGateSoftplus || gate_mode == kGateLowerBoundALog || gate_mode == kGateLowerBound) {
    return ffi::Error::Success();
  }
  return InvalidArgument(
      "gate_mode must be 1 (softplus), 2 (lower bound with A_log) or 3 (lower bound), got " +
      std::to_string(gate_mode));
}

// Runs once per call site when XLA builds the executable: before any execution and so outside any
// CUDA graph capture, which is where loading cubins onto devices is allowed. `lower_bound` is bound
// only because a binding must name every attribute of the call.
ffi::Error GateActivationInstantiate(int32_t gate_mode, [[maybe_unused]] float lower_bound) {
  if (ffi::Error error = CheckGateMode(gate_mode); error.failure()) return error;
  if (const std::string& error = GateActivationModules().Load(); !error.empty()) {
    return ffi::Error::Internal(error);
  }
  return ffi::Error::Success();
}

ffi::Error GateActivationExecute(cudaStream_t stream, int32_t device, ffi::BufferR3<ffi::BF16> g,
                                 ffi::BufferR1<ffi::F32> a_log, ffi::BufferR1<ffi::F32> dt_bias,
                                 ffi::ResultBufferR3<ffi::F32> decay, int32_t gate_mode, float lower_bound) {
  if (ffi::Error error = CheckGateMode(gate_mode); error.failure()) return error;

  const auto dims = g.dimensions();
  const int64_t num_tokens = dims[0];
  const int64_t num_heads = dims[1];
  const int64_t head_dim = dims[2];
  const int64_t row_length = num_heads * head_dim;
  if (!(decay->dimensions() == dims)) {
    return InvalidArgument("the result must have the shape of g [M, HV, K]");
  }
  if (row_length > std::numeric_limits<int32_t>::max()) {
    return InvalidArgument("HV * K must fit in int32, got HV=" + std::to_string(num_heads) +
                           " K=" + std::to_string(head_dim));
  }
  if (static_cast<int64_t>(dt_bias.element_count()) != row_length) {
    return InvalidArgument("dt_bias must have HV * K = " + std::to_string(row_length) + " elements, got " +
                           std::to_string(dt_bias.element_count()));
  }
  if (gate_mode != kGateLowerBound && static_cast<int64_t>(a_log.element_count()) != num_heads) {
    return InvalidArgument("A_log must have HV = " + std::to_string(num_heads) + " elements, got " +
                           std::to_string(a_log.element_count()));
  }
  if (num_tokens * row_length == 0) return ffi::Error::Success();  // a grid of 0 blocks is invalid

  if (reinterpret_cast<uintptr_t>(g.untyped_data()) % kGateVectorAlignBytes != 0 ||
      reinterpret_cast<uintptr_t>(decay->untyped_data()) % kGateVectorAlignBytes != 0) {
    return InvalidArgument("g and the result must be 16-byte aligned");
  }

  // Already done by the instantiate stage; repeated here (a no-op after the first call) so that a call
  // without that stage still reports a load failure instead of launching an unloaded kernel.
  KernelModules& modules = GateActivationModules();
  if (const std::string& error = modules.Load(); !error.empty()) return ffi::Error::Internal(error);
  std::string arch_error;
  const std::optional<Arch> arch = modules.ArchOfDevice(device, &arch_error);
  if (!arch) return ffi::Error::Internal(arch_error);

  const GateActivationParams params{
      .g = g.untyped_data(),
      .a_log = a_log.typed_data(),
      .dt_bias = dt_bias.typed_data(),
      .decay = decay->typed_data(),
      .num_tokens = num_tokens,
      .num_heads = static_cast<int32_t>(num_heads),
      .head_dim = static_cast<int32_t>(head_dim),
      .gate_mode = gate_mode,
      .lower_bound = lower_bound,
  };
  if (cudaError_t status = LaunchGateActivation(params, *arch, stream); status != cudaSuccess) {
    return ffi::Error::Internal(std::string(kTarget) + ": launching the " + ArchName(*arch) +
                                " kernel failed: " + CudaErrorText(status));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kGateActivationInstantiate, GateActivationInstantiate,
    ffi::Ffi::BindInstantiate()
        .Attr<int32_t>("gate_mode")     // 1, 2 or 3: checked when the executable is built
        .Attr<float>("lower_bound"));  // not used at this stage

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kGateActivationExecute, GateActivationExecute,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this call; the kernel goes on it
        .Ctx<ffi::DeviceOrdinal>()                 // the stream's CUDA device: picks sm_90a or sm_100a
        .Arg<ffi::BufferR3<ffi::BF16>>()           // g [M, HV, K]: the raw gate
        .Arg<ffi::BufferR1<ffi::F32>>()            // A_log [HV]; may be [0] for gate_mode 3
        .Arg<ffi::BufferR1<ffi::F32>>()            // dt_bias [HV * K]
        .Ret<ffi::BufferR3<ffi::F32>>()            // the log-decay [M, HV, K]
        .Attr<int32_t>("gate_mode")                // 1 softplus, 2 lower bound with A_log, 3 lower bound
        .Attr<float>("lower_bound"),               // read by modes 2 and 3
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_kda
