"""Backend choice: "auto" falls back to "xla" with discoverable reasons; explicit kernels raise."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import pytest

import jax_kda
from jax_kda import dispatch
from jax_kda.config import validate

S = jax.ShapeDtypeStruct


@dataclasses.dataclass
class FakeGpu:
    compute_capability: str
    platform: str = "gpu"
    device_kind: str = "NVIDIA H200"
    core_count: int = 132


def _cfg(dtype=jnp.bfloat16, d=128):
    arrays = [S((1, 32, 2, d), dtype)] * 2 + [S((1, 32, 2, d), dtype), S((1, 32, 2, d), jnp.float32), S((1, 32, 2), jnp.float32)]
    return validate(*arrays, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                    lower_bound=None, use_beta_sigmoid_in_kernel=False, state_v_first=False, backend="auto")


def test_auto_on_cpu_uses_xla_and_says_why(caplog):
    cpu = jax.devices("cpu")[0]
    with caplog.at_level(logging.DEBUG, logger="jax_kda"):
        d = dispatch.choose_backend(_cfg(), "auto", device=cpu)
    assert d.backend == "xla"
    assert "no jax_kda kernel for the default device: cpu device" in d.reasons[0]
    assert "backend='xla'" in caplog.text


@pytest.mark.parametrize("cc,backend", [("9.0", "sm90"), ("10.0", "sm100"), ("10.3", None)])
def test_auto_maps_compute_capability_to_kernel_backend(cc, backend):
    assert dispatch.device_backend(FakeGpu(cc))[0] == backend


@pytest.mark.parametrize("cc", ["8.0", "8.9", "10.3", "12.0"])
def test_auto_on_other_gpus_uses_xla(cc):
    d = dispatch.choose_backend(_cfg(), "auto", device=FakeGpu(cc))
    assert d.backend == "xla" and f"compute capability {cc}" in d.reasons[0]


def test_argument_limits_name_argument_and_limit():
    reasons = dispatch.argument_limits(_cfg(dtype=jnp.float32, d=64), "sm90")
    assert "sm90 needs K == V == 128, got K=64, V=64" in reasons
    assert "sm90 needs q, k, v in bfloat16, got float32" in reasons


def test_auto_on_hopper_falls_back_with_reason_when_ineligible():
    d = dispatch.choose_backend(_cfg(dtype=jnp.float32), "auto", device=FakeGpu("9.0"))
    assert d.backend == "xla" and d.reasons and all(r.startswith("sm90") for r in d.reasons)


def test_explain_reports_the_decision():
    x = jnp.zeros((1, 4, 2, 8), jnp.float32)
    d = jax_kda.explain(x, x, x, x, x[..., 0])
    assert d.requested == "auto" and d.backend == "xla" and d.reasons
    assert "backend='xla'" in str(d)
    d = jax_kda.explain(x, x, x, x, x[..., 0], backend="sm90")
    assert d.backend == "unavailable" and d.reasons
