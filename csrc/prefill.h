// The KDA prefill kernels (csrc/kernels/) behind a plain C++ interface: a parameters struct
// (pointers, sizes, flags; no framework types) and one launch function. The contract constants
// (kda_contract.h) are generated from jax_kda/contract.py at build time.

#ifndef JAX_KDA_CSRC_PREFILL_H_
#define JAX_KDA_CSRC_PREFILL_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "kda_contract.h"
#include "kernel_module.h"

namespace jax_kda {

struct PrefillParams {
  // Inputs. Token-major, row-major, contiguous; total_tokens = B * T.
  const void* q;              // bf16 [total_tokens, num_qk_heads, 128]
  const void* k;              // bf16 [total_tokens, num_qk_heads, 128]
  const void* v;              // bf16 [total_tokens, num_v_heads, 128]
  const void* g;              // bf16 or fp32 [total_tokens, num_v_heads, 128] (the export's gate variant)
  const void* beta;           // bf16 or fp32 [total_tokens, num_v_heads] (likewise)
  const float* a_log;         // [num_v_heads]; read by the gate modes of kGateModesWithALog
  const float* dt_bias;       // [num_v_heads * 128]; read by every gate mode but kPreactivated
  const int32_t* cu_seqlens;  // [units + 1] offsets (units = num_sequences * num_segments); with kVarlen
  const float* initial_state; // [num_sequences, num_v_heads, 128, 128]; with kHasInitialState
  // Outputs.
  void* o;                    // bf16 [total_tokens, num_v_heads, 128]; not written in phase kSummary
  float* final_state;         // [units, num_v_heads, 128, 128] (may alias initial_state); with
                              // kOutputFinalState, never in phase kSummary
  void* workspace;            // workspace_bytes, 16-byte aligned
  int64_t workspace_bytes;
  // Sizes.
  int64_t total_tokens;
  int32_t num_qk_heads;
  int32_t num_v_heads;
  int32_t num_sequences;      // N: B for dense inputs, len(cu_seqlens) - 1 when packed
  int32_t num_segments;       // S segments per sequence (1 in phase kWhole)
  int32_t dense_len;          // T per sequence for dense inputs (ignored with kVarlen)
  // Flags and scalars.
  int32_t flags;              // contract::Flag bits | gate mode << kGateModeShift
  contract::Phase phase;
  float scale;
  float lower_bound;
  // Launch shape: the device's SM count (sizes the persistent prepare grid; any value >= 1 is
  // correct, the real count is fastest).
  int32_t num_sms;
};

// Workspace bytes the kernels use (jax_kda/contract.py workspace_bytes, which the CPU tests compare
// with this through the extension).
inline int64_t PrefillWorkspaceRows(int64_t total_tokens, int64_t num_sequences, int64_t num_segments,
                                    int64_t num_v_heads) {
  return (total_tokens / contract::kChunk + num_sequences * num_segments) * num_v_heads;
}
inline int64_t PrefillWorkspaceBytes(int64_t total_tokens, int64_t num_sequences, int64_t num_segments,
                                     int64_t num_v_heads) {
  const int64_t units = num_sequences * num_segments;
  return PrefillWorkspaceRows(total_tokens, num_sequences, num_segments, num_v_heads) *
             contract::kWorkspaceBytesPerRow +
         (num_segments > 1 ? contract::kSegmentStates * units * num_v_heads * contract::kStateBytes : 0) +
         units * contract::kUnitTableEntryBytes;
}

// Whether a gate mode reads A_log / dt_bias (contract GATE_MODES_WITH_A_LOG / _DT_BIAS): the FFI
// handler checks those operands' sizes and alignment, and the launch gives the kernels their views,
// from the same answer.
inline bool ReadsALog(contract::GateMode mode) {
  for (contract::GateMode m : contract::kGateModesWithALog) if (m == mode) return true;
  return false;
}
inline bool ReadsDtBias(contract::GateMode mode) {
  for (contract::GateMode m : contract::kGateModesWithDtBias) if (m == mode) return true;
  return false;
}

// The process-wide loader of the prefill kernel objects (kda_kernel_objects.h).
KernelModules& PrefillModules();

// Enqueues the call's kernels on `stream` with the export `object` (an index into PrefillModules()'s
// objects). The caller has validated `params`, loaded the modules and resolved `object` for the
// device and the dtypes of g and beta. Returns the launch status.
cudaError_t LaunchPrefill(const PrefillParams& params, int object, cudaStream_t stream);

}  // namespace jax_kda

#endif  // JAX_KDA_CSRC_PREFILL_H_
