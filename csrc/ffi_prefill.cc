// XLA FFI binding of the KDA prefill kernels: the one custom call target, contract::kFfiTarget
// ("jax_kda_prefill").
//
// Operands, results and attributes are those jax_kda/kernel.py emits (absent optional operands come
// as empty arrays, and the flags say which are read). The `kernels` attribute says which kernel
// object the call asks for (contract::Kernels), and the dtypes of g and beta which of its gate variants
// (contract::kGateVariants): the handler resolves both against the device the call runs on, so one lowered program serves Hopper and Blackwell, and a device the kernels do not
// support gets an error that says so. The `phase` attribute selects what the call does
// (contract::Phase): the whole prefill, or one of the two calls of a segmented prefill, which run
// over num_sequences x num_segments segments (cu_seqlens then holds their offsets; the apply call's
// workspace operand is the summary call's workspace, aliased to its own workspace result).
//
// The handler reads only shapes, pointers and static attributes, allocates nothing (the workspace is
// an XLA-allocated result), never synchronizes and never reads device data on the host, so its launch
// replays unchanged from a CUDA graph: it is marked command-buffer compatible.

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "ffi_handlers.h"
#include "kda_contract.h"
#include "kernel_module.h"
#include "prefill.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_kda {
namespace {

using contract::Flag;
using contract::GateMode;
using contract::Phase;

ffi::Error InvalidArgument(const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(contract::kFfiTarget) + ": " + message);
}

std::string Dims(ffi::Span<const int64_t> dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

std::string PrefillAttrsError(const PrefillAttrs& a) {
  if (a.gate_mode < 0 || a.gate_mode > contract::kGateModeMask) {
    return "gate_mode must be 0.." + std::to_string(contract::kGateModeMask) + ", got " + std::to_string(a.gate_mode);
  }
  if (a.kernels < 0 || a.kernels >= contract::kNumKernels) {
    return "kernels must be 0.." + std::to_string(contract::kNumKernels - 1) + ", got " + std::to_string(a.kernels) +
           " (a jax_kda Python/extension version mismatch?)";
  }
  const bool segmented = a.phase == static_cast<int32_t>(Phase::kSummary) ||
                         a.phase == static_cast<int32_t>(Phase::kApply);
  if (a.chunk_size != contract::kChunk || a.v_split != contract::kVSplit || a.num_sequences < 0 ||
      a.num_sequences > contract::kMaxGridYZ || a.num_segments < 1 || a.num_segments > contract::kMaxSegments ||
      !(segmented || a.phase == static_cast<int32_t>(Phase::kWhole)) ||
      (a.order_units && !a.varlen) ||
      (segmented && (!a.varlen || a.state_v_first || a.num_segments < 2)) ||
      (!segmented && a.num_segments != 1)) {
    return "this build supports chunk_size=" + std::to_string(contract::kChunk) + ", v_split=" +
           std::to_string(contract::kVSplit) + ", num_segments 1 (phase 0) or 2.." +
           std::to_string(contract::kMaxSegments) +
           " (phases 1, 2: packed, state K-first), order_units only when packed; got chunk_size " +
           std::to_string(a.chunk_size) + ", v_split " + std::to_string(a.v_split) + ", num_segments " +
           std::to_string(a.num_segments) + ", phase " + std::to_string(a.phase) + ", varlen " +
           std::to_string(a.varlen) + ", order_units " + std::to_string(a.order_units) +
           " (a jax_kda Python/extension version mismatch?)";
  }
  return "";
}

namespace {

ffi::Error CheckAttrs(const PrefillAttrs& attrs) {
  const std::string error = PrefillAttrsError(attrs);
  return error.empty() ? ffi::Error::Success() : InvalidArgument(error);
}

// Runs once per call site when XLA builds the executable, outside any CUDA graph capture, which is
// where loading cubins onto devices is allowed. The loader also resolves, per device, which export
// serves each `kernels` request and gate variant; the execute stage looks its device up.
ffi::Error PrefillInstantiate(PrefillAttrs attrs) {
  if (ffi::Error error = CheckAttrs(attrs); error.failure()) return error;
  if (const std::string& error = PrefillModules().Load(); !error.empty()) return ffi::Error::Internal(error);
  return ffi::Error::Success();
}

// The gate variant (index into contract::kGateVariants) reading g and beta in these dtypes, or -1.
// contract::GateDtype's values are bf16 and fp32, in that order (jax_kda/contract.py GATE_DTYPES).
static_assert(static_cast<int>(contract::GateDtype::kFloat32) == 1 && contract::kNumGateVariants == 4,
              "a gate dtype was added to the contract: map its ffi::DataType here");
int GateVariantOf(ffi::DataType g, ffi::DataType beta) {
  auto gate_dtype = [](ffi::DataType t) {
    switch (t) {
      case ffi::DataType::BF16:
        return static_cast<int>(contract::GateDtype::kBfloat16);
      case ffi::DataType::F32:
        return static_cast<int>(contract::GateDtype::kFloat32);
      default:
        return -1;
    }
  };
  const int gd = gate_dtype(g), bd = gate_dtype(beta);
  for (int i = 0; i < contract::kNumGateVariants; ++i) {
    if (static_cast<int>(contract::kGateVariants[i].g) == gd && static_cast<int>(contract::kGateVariants[i].beta) == bd) {
      return i;
    }
  }
  return -1;
}

ffi::Error PrefillExecute(cudaStream_t stream, int32_t device, ffi::BufferR4<ffi::BF16> q,
                          ffi::BufferR4<ffi::BF16> k, ffi::BufferR4<ffi::BF16> v, ffi::AnyBuffer g,
                          ffi::AnyBuffer beta, ffi::BufferR1<ffi::F32> a_log,
                          ffi::BufferR1<ffi::F32> dt_bias, ffi::BufferR1<ffi::S32> cu_seqlens,
                          ffi::Buffer<ffi::F32> initial_state, ffi::BufferR1<ffi::U8> workspace_in,
                          ffi::ResultBufferR4<ffi::BF16> o, ffi::Result<ffi::Buffer<ffi::F32>> final_state,
                          ffi::ResultBufferR1<ffi::U8> workspace, PrefillAttrs attrs) {
  if (ffi::Error error = CheckAttrs(attrs); error.failure()) return error;
  const auto phase = static_cast<Phase>(attrs.phase);
  const auto gate_mode = static_cast<GateMode>(attrs.gate_mode);
  const auto qd = q.dimensions();
  const auto vd = v.dimensions();
  const int64_t b = qd[0], t = qd[1], h = qd[2], hv = vd[2];
  const int64_t d = contract::kHeadDim;
  if (qd[3] != d || vd[3] != d || !(k.dimensions() == qd) || vd[0] != b || vd[1] != t ||
      !(g.dimensions() == vd) || !(phase == Phase::kSummary ? o->element_count() == 0 : o->dimensions() == vd)) {
    return InvalidArgument("expected q, k [B, T, H, 128] and v, g, o [B, T, HV, 128]; got q " + Dims(qd) + ", v " +
                           Dims(vd));
  }
  if (beta.dimensions().size() != 3 || beta.dimensions()[0] != b || beta.dimensions()[1] != t ||
      beta.dimensions()[2] != hv) {
    return InvalidArgument("beta must be [B, T, HV], got " + Dims(beta.dimensions()));
  }
  const int gate_variant = GateVariantOf(g.element_type(), beta.element_type());
  if (gate_variant < 0) return InvalidArgument("g and beta must each be bfloat16 or float32");
  if (h == 0 || hv % h != 0) return InvalidArgument("HV must be a multiple of H");
  const int64_t n = attrs.num_sequences, s = attrs.num_segments, units = n * s;
  if (attrs.varlen ? (b != 1 || static_cast<int64_t>(cu_seqlens.element_count()) != units + 1) : n != b) {
    return InvalidArgument("num_sequences " + std::to_string(n) + " x num_segments " + std::to_string(s) +
                           " must match the operands: B sequences when dense, B == 1 and units + 1 = " +
                           std::to_string(units + 1) + " cu_seqlens entries when packed (got B = " +
                           std::to_string(b) + ", " + std::to_string(cu_seqlens.element_count()) + " entries)");
  }
  // The recurrence's grid is [V slices, HV, units].
  if (units > contract::kMaxGridYZ || hv > contract::kMaxGridYZ) {
    return InvalidArgument("at most " + std::to_string(contract::kMaxGridYZ) +
                           " sequences (x segments) and value heads per call, got " + std::to_string(units) +
                           ", HV = " + std::to_string(hv));
  }
  if (ReadsALog(gate_mode) && static_cast<int64_t>(a_log.element_count()) != hv) {
    return InvalidArgument("A_log must have HV elements");
  }
  if (ReadsDtBias(gate_mode) && static_cast<int64_t>(dt_bias.element_count()) != hv * d) {
    return InvalidArgument("dt_bias must have HV * 128 elements (zeros when absent)");
  }
  const int64_t state_elements = hv * d * d;
  if (attrs.has_initial_state && static_cast<int64_t>(initial_state.element_count()) != n * state_elements) {
    return InvalidArgument("initial_state must be [num_sequences, HV, 128, 128]");
  }
  if (phase == Phase::kApply && attrs.has_initial_state) {
    return InvalidArgument("the apply call starts from the workspace: it takes no initial_state");
  }
  const int64_t final_entries = phase == Phase::kSummary || !attrs.output_final_state ? 0 : units;
  if (static_cast<int64_t>(final_state->element_count()) != final_entries * state_elements) {
    return InvalidArgument("final_state must be [" + std::to_string(final_entries) + ", HV, 128, 128]");
  }
  if (phase == Phase::kApply ? workspace_in.untyped_data() != workspace->untyped_data()
                             : workspace_in.element_count() != 0) {
    return InvalidArgument("the workspace operand must be empty, or in the apply call alias the workspace result");
  }
  const int64_t tokens = b * t;
  const int64_t rows = PrefillWorkspaceRows(tokens, n, s, hv);
  if (tokens > INT32_MAX) {
    return InvalidArgument("B * T must be < 2^31, got " + std::to_string(tokens));
  }
  if (rows >= contract::kMaxWorkspaceRows) {
    return InvalidArgument("((B*T) // 16 + N * S) * HV must be < " + std::to_string(contract::kMaxWorkspaceRows) +
                           ", got " + std::to_string(rows));
  }
  const int64_t workspace_needed = PrefillWorkspaceBytes(tokens, n, s, hv);
  if (static_cast<int64_t>(workspace->element_count()) < workspace_needed) {
    return InvalidArgument("workspace has " + std::to_string(workspace->element_count()) + " bytes, needs " +
                           std::to_string(workspace_needed));
  }
  // o is empty in the summary call and never written there; the kernels still take a view of v's shape.
  void* o_data = phase == Phase::kSummary ? const_cast<void*>(v.untyped_data()) : o->untyped_data();
  // The kernels take every view as 16-byte aligned (the DSL's assumed_align): each buffer they read
  // or write is checked; one the flags say is never touched may be anywhere (it is often empty).
  const auto touched = [&](bool used, const void* p) { return used ? p : q.untyped_data(); };
  for (const void* p : std::initializer_list<const void*>{
           q.untyped_data(), k.untyped_data(), v.untyped_data(), g.untyped_data(), beta.untyped_data(), o_data,
           touched(attrs.has_initial_state, initial_state.untyped_data()),
           touched(final_entries > 0, final_state->untyped_data()),
           touched(ReadsALog(gate_mode), a_log.untyped_data()),
           touched(ReadsDtBias(gate_mode), dt_bias.untyped_data()),
           touched(attrs.varlen, cu_seqlens.untyped_data()), workspace->untyped_data()}) {
    if (!Aligned16(p)) return InvalidArgument("every buffer must be 16-byte aligned");
  }

  // Already done by the instantiate stage; repeated (a no-op after the first call) so that a call
  // without that stage still reports a load failure instead of launching an unloaded kernel.
  KernelModules& modules = PrefillModules();
  if (const std::string& error = modules.Load(); !error.empty()) return ffi::Error::Internal(error);
  std::string resolve_error;
  const int object =
      modules.Resolve(static_cast<contract::Kernels>(attrs.kernels), gate_variant, device, &resolve_error);
  if (object < 0) return ffi::Error::Internal(resolve_error);

  int32_t flags = attrs.gate_mode << contract::kGateModeShift;
  for (auto [set, flag] : {std::pair{attrs.use_qk_l2norm, Flag::kQkL2norm},
                           std::pair{attrs.use_beta_sigmoid, Flag::kBetaSigmoid},
                           std::pair{attrs.varlen, Flag::kVarlen},
                           std::pair{attrs.order_units, Flag::kOrderUnits},
                           std::pair{attrs.has_initial_state, Flag::kHasInitialState},
                           std::pair{attrs.output_final_state, Flag::kOutputFinalState},
                           std::pair{attrs.state_v_first, Flag::kStateVFirst}}) {
    if (set) flags |= static_cast<int32_t>(flag);
  }

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
      .num_sequences = static_cast<int32_t>(n),
      .num_segments = static_cast<int32_t>(s),
      .dense_len = static_cast<int32_t>(t),
      .flags = flags,
      .phase = phase,
      .scale = attrs.scale,
      .lower_bound = attrs.lower_bound,
      .num_sms = modules.MultiprocessorCount(device),
  };
  if (cudaError_t status = LaunchPrefill(params, object, stream); status != cudaSuccess) {
    return ffi::Error::Internal(std::string(contract::kFfiTarget) + ": launching " +
                                modules.objects()[object].name + " failed: " + CudaErrorText(status));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_kda

// The attribute struct is decoded from the call's attributes by name.
// PrefillAttrs' fields by name, in their order (contract.CALL_ATTRIBUTES).
#define JAX_KDA_ATTR_MEMBER(type, name) xla::ffi::StructMember<type>(#name)
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_kda::PrefillAttrs, JAX_KDA_PREFILL_ATTR_LIST(JAX_KDA_ATTR_MEMBER));
#undef JAX_KDA_ATTR_MEMBER

namespace jax_kda {

XLA_FFI_DEFINE_HANDLER_SYMBOL(kPrefillInstantiate, PrefillInstantiate,
                              ffi::Ffi::BindInstantiate().Attrs<PrefillAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kPrefillExecute, PrefillExecute,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this call; the kernels go on it
        .Ctx<ffi::DeviceOrdinal>()                 // the stream's CUDA device: which object serves it
        .Arg<ffi::BufferR4<ffi::BF16>>()           // q [B, T, H, 128]
        .Arg<ffi::BufferR4<ffi::BF16>>()           // k [B, T, H, 128]
        .Arg<ffi::BufferR4<ffi::BF16>>()           // v [B, T, HV, 128]
        .Arg<ffi::AnyBuffer>()                     // g [B, T, HV, 128], bf16 or fp32: raw gate or log-decay
        .Arg<ffi::AnyBuffer>()                     // beta [B, T, HV], bf16 or fp32
        .Arg<ffi::BufferR1<ffi::F32>>()            // A_log [HV], or [0]
        .Arg<ffi::BufferR1<ffi::F32>>()            // dt_bias [HV * 128] (zeros when absent), or [0] for gate 0
        .Arg<ffi::BufferR1<ffi::S32>>()            // cu_seqlens [units + 1], or [0] when dense
        .Arg<ffi::Buffer<ffi::F32>>()              // initial_state [N, HV, 128, 128] (either layout), or [0]
        .Arg<ffi::BufferR1<ffi::U8>>()             // workspace_in: [0], or (apply call) the workspace result's buffer
        .Ret<ffi::BufferR4<ffi::BF16>>()           // o [B, T, HV, 128]; [0, 0, 0, 0] in the summary call
        .Ret<ffi::Buffer<ffi::F32>>()              // final_state [units, HV, 128, 128] (may alias initial_state), or [0]
        .Ret<ffi::BufferR1<ffi::U8>>()             // workspace: prepare -> recurrence hand-off
        .Attrs<PrefillAttrs>(),                    // the static attributes (flags and plan), by name
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_kda
