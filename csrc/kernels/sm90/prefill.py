"""The Hopper prefill (sm_90a): `common/prefill.py` with the warpgroup-MMA recurrence."""

from sm90.wgmma_recurrence import WgmmaRecurrence

RECURRENCE = WgmmaRecurrence
