// XLA FFI binding of the KDA prefill kernels: custom call targets "jax_kda_prefill_sm90" (Hopper),
// "jax_kda_prefill_sm100" (Blackwell) and "jax_kda_prefill_sm90_mma" (the Blackwell kernels built for
// Hopper, for testing them there). One handler body; the target fixes the kernel object.
//
// Operands and attributes are those emitted by jax_kda/primitive.py (absent optional operands come
// as empty arrays, and the flags say which are read). The `phase` attribute selects what one call
// does: 0 the whole prefill; 1 and 2 the two calls of a segmented prefill (jax_kda/context_parallel.py):
// 1 = prepare, the per-segment summaries and every segment's start state, all into the workspace
// (o and final_state are empty; initial_state has one entry per sequence), 2 = the recurrence alone,
// from those starts, on the workspace operand (phase 1's workspace, aliased to this call's workspace
// result). In both, N counts segments (sequences x num_segments). The handler reads only shapes, pointers and
// static attributes, allocates nothing (the workspace is an XLA-allocated result), never
// synchronizes and never reads device data on the host, so its launch replays unchanged from a CUDA
// graph: it is marked command-buffer compatible.

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "ffi_handlers.h"
#include "kernel_module.h"
#include "prefill.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_kda {
namespace {

constexpr const char* TargetName(PrefillKernels kernels) {
  switch (kernels) {
    case PrefillKernels::kSm90a:
      return "jax_kda_prefill_sm90";
    case PrefillKernels::kMmaSm90a:
      return "jax_kda_prefill_sm90_mma";
    case PrefillKernels::kSm100a:
      return "jax_kda_prefill_sm100";
  }
  return "jax_kda_prefill";
}

ffi::Error InvalidArgument(const char* target, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + message);
}

std::string Dims(ffi::Span<const int64_t> dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The static attributes of a call; every one the lowering emits must be bound.
struct PrefillAttrs {
  int32_t gate_mode;
  float lower_bound;
  float scale;
  int32_t use_qk_l2norm;
  int32_t use_beta_sigmoid;
  int32_t state_v_first;
  int32_t has_initial_state;
  int32_t output_final_state;
  int32_t has_dt_bias;
  int32_t varlen;
  int32_t chunk_size;
  int32_t v_split;
  int32_t num_segments;
  int32_t segment_len;
  int32_t phase;
};

enum Phase : int32_t { kWhole = 0, kSummary = 1, kApply = 2 };

ffi::Error CheckAttrs(const char* target, const PrefillAttrs& a) {
  if (a.gate_mode < 0 || a.gate_mode > 3) {
    return InvalidArgument(target, "gate_mode must be 0..3, got " + std::to_string(a.gate_mode));
  }
  if (a.chunk_size != kPrefillChunk || a.v_split != 2 || a.num_segments < 1 || a.num_segments > kMaxSegments ||
      a.phase < kWhole || a.phase > kApply ||
      (a.phase != kWhole && (!a.varlen || a.state_v_first || a.num_segments < 2))) {
    return InvalidArgument(target, "this build supports chunk_size=16, v_split=2, num_segments 1..255, phase 0..2 "
                           "(1, 2 packed, state K-first, >= 2 segments); got " + std::to_string(a.chunk_size) + ", " +
                           std::to_string(a.v_split) + ", " + std::to_string(a.num_segments) + ", phase " +
                           std::to_string(a.phase) + " (a jax_kda Python/extension version mismatch?)");
  }
  return ffi::Error::Success();
}

// Runs once per call site when XLA builds the executable, outside any CUDA graph capture, which is
// where loading cubins onto devices is allowed.
template <PrefillKernels kKernels>
ffi::Error PrefillInstantiate(PrefillAttrs attrs) {
  if (ffi::Error error = CheckAttrs(TargetName(kKernels), attrs); error.failure()) return error;
  if (const std::string& error = PrefillModules().Load(); !error.empty()) return ffi::Error::Internal(error);
  return ffi::Error::Success();
}

template <PrefillKernels kKernels>
ffi::Error PrefillExecute(cudaStream_t stream, int32_t device, ffi::BufferR4<ffi::BF16> q,
                          ffi::BufferR4<ffi::BF16> k, ffi::BufferR4<ffi::BF16> v, ffi::BufferR4<ffi::BF16> g,
                          ffi::BufferR3<ffi::BF16> beta, ffi::BufferR1<ffi::F32> a_log,
                          ffi::BufferR1<ffi::F32> dt_bias, ffi::BufferR1<ffi::S32> cu_seqlens,
                          ffi::Buffer<ffi::F32> initial_state, ffi::BufferR1<ffi::U8> workspace_in,
                          ffi::ResultBufferR4<ffi::BF16> o,
                          ffi::Result<ffi::Buffer<ffi::F32>> final_state, ffi::ResultBufferR1<ffi::U8> workspace,
                          PrefillAttrs attrs) {
  constexpr const char* target = TargetName(kKernels);
  if (ffi::Error error = CheckAttrs(target, attrs); error.failure()) return error;
  const auto qd = q.dimensions();
  const auto vd = v.dimensions();
  const int64_t b = qd[0], t = qd[1], h = qd[2], hv = vd[2];
  const int64_t d = kPrefillHeadDim;
  if (qd[3] != d || vd[3] != d || !(k.dimensions() == qd) || vd[0] != b || vd[1] != t ||
      !(g.dimensions() == vd) || !(attrs.phase == kSummary ? o->element_count() == 0 : o->dimensions() == vd)) {
    return InvalidArgument(target, "expected q, k [B, T, H, 128] and v, g, o [B, T, HV, 128]; got q " + Dims(qd) +
                           ", v " + Dims(vd));
  }
  if (beta.dimensions()[0] != b || beta.dimensions()[1] != t || beta.dimensions()[2] != hv) {
    return InvalidArgument(target, "beta must be [B, T, HV], got " + Dims(beta.dimensions()));
  }
  if (h == 0 || hv % h != 0) return InvalidArgument(target, "HV must be a multiple of H");
  const int64_t n = attrs.varlen ? cu_seqlens.element_count() - 1 : b;
  if (n < 0 || (attrs.varlen && b != 1)) return InvalidArgument(target, "packed sequences need B == 1 and N + 1 >= 1 offsets");
  // The recurrence's grid is [V slices, HV, N]: CUDA allows at most 65535 blocks along y and z.
  if (n > kMaxGridYZ || hv > kMaxGridYZ) {
    return InvalidArgument(target, "at most 65535 sequences and 65535 value heads per call, got N = " +
                           std::to_string(n) + ", HV = " + std::to_string(hv));
  }
  if (attrs.gate_mode == 1 || attrs.gate_mode == 2) {
    if (static_cast<int64_t>(a_log.element_count()) != hv) return InvalidArgument(target, "A_log must have HV elements");
  }
  if (attrs.gate_mode != 0 && static_cast<int64_t>(dt_bias.element_count()) != hv * d) {
    return InvalidArgument(target, "dt_bias must have HV * 128 elements (zeros when absent)");
  }
  const int64_t state_elements = n * hv * d * d;
  const bool segmented = attrs.phase != kWhole;
  if (segmented && n % attrs.num_segments != 0) {
    return InvalidArgument(target, "a segmented call's N counts segments: a multiple of num_segments");
  }
  // A summary call's initial state has one entry per sequence, N / num_segments.
  const int64_t initial_elements = attrs.phase == kSummary ? state_elements / attrs.num_segments : state_elements;
  if (attrs.has_initial_state && static_cast<int64_t>(initial_state.element_count()) != initial_elements) {
    return InvalidArgument(target, "initial_state must be [N, HV, 128, 128] (phase 1: N / num_segments)");
  }
  if (attrs.phase == kSummary) {
    if (final_state->element_count() != 0) return InvalidArgument(target, "phase 1: final_state must be empty");
  } else if (attrs.output_final_state && static_cast<int64_t>(final_state->element_count()) != state_elements) {
    return InvalidArgument(target, "final_state must be [N, HV, 128, 128]");
  }
  if (attrs.phase == kApply ? workspace_in.untyped_data() != workspace->untyped_data()
                            : workspace_in.element_count() != 0) {
    return InvalidArgument(target, "the workspace operand must be empty, or with phase 2 alias the workspace result");
  }
  const int64_t tokens = b * t;
  const int64_t rows = PrefillWorkspaceRows(tokens, n, hv);
  if (rows >= kPrefillMaxWorkspaceRows || tokens > INT32_MAX) {
    return InvalidArgument(target, "((B*T) // 16 + N) * HV must be < 2^20, got " + std::to_string(rows));
  }
  if (attrs.phase == kApply && attrs.has_initial_state) {
    return InvalidArgument(target, "phase 2 starts from the workspace: it takes no initial_state");
  }
  const int64_t workspace_needed = PrefillWorkspaceBytes(tokens, n, hv, segmented);
  if (static_cast<int64_t>(workspace->element_count()) < workspace_needed) {
    return InvalidArgument(target, "workspace has " + std::to_string(workspace->element_count()) + " bytes, needs " +
                           std::to_string(workspace_needed));
  }
  // o is empty in phase 1 and never written there; the kernels still take a view of v's shape.
  void* o_data = attrs.phase == kSummary ? const_cast<void*>(v.untyped_data()) : o->untyped_data();
  const void* initial_data = attrs.has_initial_state ? initial_state.untyped_data() : q.untyped_data();
  for (const void* p : std::initializer_list<const void*>{q.untyped_data(), k.untyped_data(), v.untyped_data(),
                                                         g.untyped_data(), beta.untyped_data(), o_data,
                                                         initial_data, workspace->untyped_data()}) {
    if (!Aligned16(p)) return InvalidArgument(target, "every buffer must be 16-byte aligned");
  }

  // Already done by the instantiate stage; repeated (a no-op after the first call) so that a call
  // without that stage still reports a load failure instead of launching an unloaded kernel.
  KernelModules& modules = PrefillModules();
  if (const std::string& error = modules.Load(); !error.empty()) return ffi::Error::Internal(error);
  std::string arch_error;
  const std::optional<Arch> arch = modules.ArchOfDevice(device, &arch_error);
  if (!arch) return ffi::Error::Internal(arch_error);
  if (*arch != PrefillKernelsArch(kKernels)) {
    return ffi::Error::Internal(std::string(target) + ": CUDA device " + std::to_string(device) +
                                " is " + ArchName(*arch) + ", these kernels are built for " +
                                ArchName(PrefillKernelsArch(kKernels)));
  }

  int32_t flags = attrs.gate_mode << kGateModeShift;
  if (attrs.use_qk_l2norm) flags |= kFlagQkL2Norm;
  if (attrs.use_beta_sigmoid) flags |= kFlagBetaSigmoid;
  if (attrs.varlen) flags |= kFlagVarlen;
  if (attrs.has_initial_state) flags |= kFlagHasInitialState;
  if (attrs.output_final_state) flags |= kFlagOutputFinalState;
  if (attrs.state_v_first) flags |= kFlagStateVFirst;
  if (attrs.phase == kSummary) flags |= kFlagSummary;
  if (attrs.phase == kApply) flags |= kFlagSkipPrepare;
  if (segmented) flags |= attrs.num_segments << kSegmentsShift;

  const PrefillParams params{
      .q = q.untyped_data(),
      .k = k.untyped_data(),
      .v = v.untyped_data(),
      .g = g.untyped_data(),
      .beta = beta.untyped_data(),
      .a_log = a_log.typed_data(),
      .dt_bias = dt_bias.typed_data(),
      .cu_seqlens = cu_seqlens.typed_data(),
      .initial_state = initial_state.typed_data(),
      .o = o_data,
      .final_state = final_state->typed_data(),
      .workspace = workspace->untyped_data(),
      .workspace_bytes = static_cast<int64_t>(workspace->element_count()),
      .total_tokens = tokens,
      .num_qk_heads = static_cast<int32_t>(h),
      .num_v_heads = static_cast<int32_t>(hv),
      .num_seqs = static_cast<int32_t>(n),
      .dense_len = static_cast<int32_t>(t),
      .flags = flags,
      .scale = attrs.scale,
      .lower_bound = attrs.lower_bound,
      .num_sms = modules.MultiprocessorCount(device),
  };
  if (cudaError_t status = LaunchPrefill(params, kKernels, stream); status != cudaSuccess) {
    return ffi::Error::Internal(std::string(target) + ": launching the kernels failed: " + CudaErrorText(status));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_kda

// The attribute struct is decoded from the call's attributes by name.
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_kda::PrefillAttrs, xla::ffi::StructMember<int32_t>("gate_mode"),
    xla::ffi::StructMember<float>("lower_bound"), xla::ffi::StructMember<float>("scale"),
    xla::ffi::StructMember<int32_t>("use_qk_l2norm"), xla::ffi::StructMember<int32_t>("use_beta_sigmoid"),
    xla::ffi::StructMember<int32_t>("state_v_first"), xla::ffi::StructMember<int32_t>("has_initial_state"),
    xla::ffi::StructMember<int32_t>("output_final_state"), xla::ffi::StructMember<int32_t>("has_dt_bias"),
    xla::ffi::StructMember<int32_t>("varlen"), xla::ffi::StructMember<int32_t>("chunk_size"),
    xla::ffi::StructMember<int32_t>("v_split"), xla::ffi::StructMember<int32_t>("num_segments"),
    xla::ffi::StructMember<int32_t>("segment_len"), xla::ffi::StructMember<int32_t>("phase"));

namespace jax_kda {

// One binding for every prefill target: the operands, results and attributes of
// jax_kda/primitive.py.
auto PrefillBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this call; the kernels go on it
      .Ctx<ffi::DeviceOrdinal>()                 // the stream's CUDA device (its architecture must match)
      .Arg<ffi::BufferR4<ffi::BF16>>()           // q [B, T, H, 128]
      .Arg<ffi::BufferR4<ffi::BF16>>()           // k [B, T, H, 128]
      .Arg<ffi::BufferR4<ffi::BF16>>()           // v [B, T, HV, 128]
      .Arg<ffi::BufferR4<ffi::BF16>>()           // g [B, T, HV, 128]: raw gate or log-decay
      .Arg<ffi::BufferR3<ffi::BF16>>()           // beta [B, T, HV]
      .Arg<ffi::BufferR1<ffi::F32>>()            // A_log [HV], or [0]
      .Arg<ffi::BufferR1<ffi::F32>>()            // dt_bias [HV * 128] (zeros when absent), or [0] for gate 0
      .Arg<ffi::BufferR1<ffi::S32>>()            // cu_seqlens [N + 1], or [0] when dense
      .Arg<ffi::Buffer<ffi::F32>>()              // initial_state [N, HV, 128, 128] (either layout), or [0]
      .Arg<ffi::BufferR1<ffi::U8>>()             // workspace_in: [0], or (phase 2) the workspace result's buffer
      .Ret<ffi::BufferR4<ffi::BF16>>()           // o [B, T, HV, 128]
      .Ret<ffi::Buffer<ffi::F32>>()              // final_state like initial_state (aliases it), or [0]; [0] in phase 1
      .Ret<ffi::BufferR1<ffi::U8>>()             // workspace: prepare -> recurrence hand-off
      .Attrs<PrefillAttrs>();                    // the static attributes (flags and plan), by name
}

#define JAX_KDA_PREFILL_HANDLERS(Name, Kernels)                                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(kPrefillInstantiate##Name, PrefillInstantiate<Kernels>,             \
                                ffi::Ffi::BindInstantiate().Attrs<PrefillAttrs>());                 \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(kPrefillExecute##Name, PrefillExecute<Kernels>, PrefillBinding(),   \
                                {ffi::Traits::kCmdBufferCompatible});

JAX_KDA_PREFILL_HANDLERS(Sm90, PrefillKernels::kSm90a)
JAX_KDA_PREFILL_HANDLERS(Sm90Mma, PrefillKernels::kMmaSm90a)
JAX_KDA_PREFILL_HANDLERS(Sm100, PrefillKernels::kSm100a)
#undef JAX_KDA_PREFILL_HANDLERS

}  // namespace jax_kda
