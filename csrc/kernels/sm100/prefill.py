"""The Blackwell prefill: `common/prefill.py` with the warp-level-MMA recurrence.

prepare_chunks and combine_segments (warp-level TF32 MMAs, cp.async) run on the Blackwell families as they are;
wgmma does not exist there, so the recurrence uses mma.sync. The same source is built for sm_90a
too (`kda_contract.KERNEL_OBJECTS`), which is how a Hopper GPU tests it.
"""

from sm100.mma_sync_recurrence import MmaSyncRecurrence

RECURRENCE = MmaSyncRecurrence
