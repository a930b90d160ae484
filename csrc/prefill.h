// The KDA prefill kernels (csrc/kernels/sm90/) behind a plain C++ interface: a parameters struct
// (pointers, sizes, flags; no framework types) and one launch function.

#ifndef JAX_KDA_CSRC_PREFILL_H_
#define JAX_KDA_CSRC_PREFILL_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernel_module.h"

namespace jax_kda {

// Head dimension the kernels are compiled for (K == V).
inline constexpr int64_t kPrefillHeadDim = 128;
// Tokens per chunk in the kernels; the workspace is sized in chunk slots of this many tokens.
inline constexpr int64_t kPrefillChunk = 16;
// Workspace bytes per (chunk slot, value head): neg_kw, qd, kr (bf16 16x128), mqk, w_hi, w_lo
// (bf16 16x16), decay (fp32 128); the recurrence reads v from the input. Mirrored by
// jax_kda/planner.py.
inline constexpr int64_t kPrefillWorkspaceBytesPerRow = 3 * 4096 + 4 * 512;
// The kernels index workspace regions with 32-bit element offsets: rows * 2048 < 2^31.
inline constexpr int64_t kPrefillMaxWorkspaceRows = int64_t{1} << 20;
// The recurrence's grid is [V slices, HV, N]: CUDA's limit on grid y and z. Mirrored by planner.py.
inline constexpr int64_t kMaxGridYZ = 65535;

// Bits of the kernels' runtime `flags` argument (csrc/kernels/sm90/kda_prefill.py).
enum PrefillFlag : int32_t {
  kFlagQkL2Norm = 1 << 0,
  kFlagBetaSigmoid = 1 << 1,
  kFlagVarlen = 1 << 2,
  kFlagHasInitialState = 1 << 3,
  kFlagOutputFinalState = 1 << 4,
  kFlagStateVFirst = 1 << 5,
  // The two calls of a segmented prefill (intracard context parallelism, jax_kda/context_parallel.py),
  // whose num_seqs counts segments (N sequences x S segments, S in the kSegmentsShift bits):
  // kFlagSummary writes each segment's zero-start state and transition into the workspace (no o,
  // no final_state), then every segment's start state from them and initial_state ([N, HV, 128,
  // 128], one per sequence, with kFlagHasInitialState); kFlagSkipPrepare runs only the
  // recurrence, from those start states, on a workspace that already holds prepare's operands.
  kFlagSummary = 1 << 6,
  kFlagSkipPrepare = 1 << 7,
};
inline constexpr int kGateModeShift = 8;     // bits 8..9
inline constexpr int kSegmentsShift = 16;    // bits 16..23: S in segmented calls
inline constexpr int32_t kMaxSegments = 255;
// Bytes of one fp32 state [128, 128]; a segmented call's workspace holds 3 per segment and value
// head after the prepare regions (B, M and the start state).
inline constexpr int64_t kPrefillStateBytes = kPrefillHeadDim * kPrefillHeadDim * 4;

struct PrefillParams {
  // Inputs. Token-major, row-major, contiguous; total_tokens = B * T.
  const void* q;              // bf16 [total_tokens, num_qk_heads, 128]
  const void* k;              // bf16 [total_tokens, num_qk_heads, 128]
  const void* v;              // bf16 [total_tokens, num_v_heads, 128]
  const void* g;              // bf16 [total_tokens, num_v_heads, 128]
  const void* beta;           // bf16 [total_tokens, num_v_heads]
  const float* a_log;         // [num_v_heads]; read for gate modes 1 and 2
  const float* dt_bias;       // [num_v_heads * 128]; read for gate modes 1, 2, 3
  const int32_t* cu_seqlens;  // [num_seqs + 1]; read with kFlagVarlen
  const float* initial_state; // [num_seqs, num_v_heads, 128, 128]; read with kFlagHasInitialState
                              // ([num_seqs / S, ...] with kFlagSummary)
  // Outputs.
  void* o;                    // bf16 [total_tokens, num_v_heads, 128]; not written with kFlagSummary
  float* final_state;         // like initial_state (may be the same buffer); with kFlagOutputFinalState,
                              // never with kFlagSummary
  void* workspace;            // workspace_bytes, 16-byte aligned
  int64_t workspace_bytes;
  // Sizes.
  int64_t total_tokens;
  int32_t num_qk_heads;
  int32_t num_v_heads;
  int32_t num_seqs;           // N: B for dense inputs, len(cu_seqlens) - 1 when packed
  int32_t dense_len;          // T per sequence for dense inputs (ignored with kFlagVarlen)
  // Flags and scalars.
  int32_t flags;              // PrefillFlag bits | gate_mode << kGateModeShift | S << kSegmentsShift
  float scale;
  float lower_bound;
  // Launch shape: the device's SM count (sizes the persistent prepare grid; any value >= 1 is
  // correct, the real count is fastest).
  int32_t num_sms;
};

// Workspace rows (chunk slots x value heads) the kernels use for these sizes.
inline int64_t PrefillWorkspaceRows(int64_t total_tokens, int64_t num_seqs, int64_t num_v_heads) {
  return (total_tokens / kPrefillChunk + num_seqs) * num_v_heads;
}

// Workspace bytes the kernels use (num_seqs: segments in the calls of a segmented prefill).
inline int64_t PrefillWorkspaceBytes(int64_t total_tokens, int64_t num_seqs, int64_t num_v_heads, bool segmented) {
  return PrefillWorkspaceRows(total_tokens, num_seqs, num_v_heads) * kPrefillWorkspaceBytesPerRow +
         (segmented ? 3 * num_seqs * num_v_heads * kPrefillStateBytes : 0);
}

// The exported prefill objects (build/aot_compile.py KERNELS).
enum class PrefillKernels {
  kSm90a,     // csrc/kernels/sm90: the recurrence on warpgroup MMAs (Hopper)
  kMmaSm90a,  // csrc/kernels/sm100 built for sm_90a: the Blackwell kernels, testable on Hopper
  kSm100a,    // csrc/kernels/sm100: the recurrence on warp-level MMAs (Blackwell)
};

// The architecture a PrefillKernels object runs on.
Arch PrefillKernelsArch(PrefillKernels kernels);

// The process-wide loader of the prefill kernel objects.
KernelModules& PrefillModules();

// Enqueues the prefill (prepare, then recurrence) on `stream` with `kernels`. The caller has
// validated `params`, loaded the modules and checked the device's architecture. Returns the launch
// status.
cudaError_t LaunchPrefill(const PrefillParams& params, PrefillKernels kernels, cudaStream_t stream);

}  // namespace jax_kda

#endif  // JAX_KDA_CSRC_PREFILL_H_
