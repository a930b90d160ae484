"""KDA prefill for Blackwell (sm_100a, K = V = 128): the AOT entry point that launches both kernels.

The same entry point, arguments, workspace and flags as `sm90/kda_prefill.py` (see there and
`sm90/README.md`): `prepare_chunks` (warp-level TF32 MMAs and cp.async, which sm_100a runs as
they are), then the recurrence on warp-level MMAs (`sm100/chunk_recurrence.py`) instead of
Hopper's warpgroup MMAs. Build-time only (imports the DSL).
"""

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int32

from sm90.kda_prefill import compile_arguments, launch_prefill, workspace_bytes  # noqa: F401
from sm100.chunk_recurrence import ChunkRecurrenceMma


@cute.jit
def prefill(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
            a_log: cute.Tensor, dt_bias: cute.Tensor, cu_seqlens: cute.Tensor,
            initial_state: cute.Tensor, o: cute.Tensor, final_state: cute.Tensor,
            workspace: cute.Tensor, num_seqs: Int32, dense_len: Int32, flags: Int32,
            scale: Float32, lower_bound: Float32, num_sms: Int32, stream: cuda.CUstream):
    launch_prefill(q, k, v, g, beta, a_log, dt_bias, cu_seqlens, initial_state, o, final_state,
                   workspace, num_seqs, dense_len, flags, scale, lower_bound, num_sms, stream,
                   ChunkRecurrenceMma)
