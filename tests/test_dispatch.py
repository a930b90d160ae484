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
    arrays = [S((1, 32, 2, d), dtype)] * 3 + [S((1, 32, 2, d), jnp.bfloat16), S((1, 32, 2), jnp.bfloat16)]
    return validate(*arrays)


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


def test_argument_limits_name_the_grid_limit_on_sequences():
    # 70 000 packed sequences fit the workspace limit but not the recurrence's grid (z <= 65535).
    arrays = [S((1, 70_000, 2, 128), jnp.bfloat16)] * 4 + [S((1, 70_000, 2), jnp.bfloat16)]
    cfg = validate(*arrays, cu_seqlens=S((70_001,), jnp.int32))
    reasons = dispatch.argument_limits(cfg, "sm90")
    assert reasons == ["sm90 supports at most 65535 sequences and 65535 value heads per call "
                       "(CUDA grid limits), got N=70000, HV=2"]
    assert dispatch.choose_backend(cfg, "auto", device=FakeGpu("9.0")).backend == "xla"
    assert dispatch.argument_limits(_cfg(), "sm90") == []


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


def test_explain_shows_the_kernel_plan_and_its_segments(monkeypatch):
    """A kernel decision carries the planner's plan; a few-head long call is segmented."""
    monkeypatch.setattr(dispatch, "choose_backend", lambda cfg, requested, device=None: dispatch.Decision(requested, "sm90" if requested == "auto" else requested))
    x = jax.ShapeDtypeStruct((1, 65536, 8, 128), jnp.bfloat16)
    beta = jax.ShapeDtypeStruct((1, 65536, 8), jnp.bfloat16)
    d = jax_kda.explain(x, x, x, x, beta)
    assert d.plan is not None and d.plan.num_segments > 1
    assert f"{d.plan.num_segments} segments of {d.plan.segment_len} tokens" in str(d)
    d = jax_kda.explain(x, x, x, x, beta, backend="xla")
    assert d.plan is None and "plan" not in str(d)


def test_explicit_kernel_backend_on_the_wrong_device_raises_naming_the_device():
    with pytest.raises(ValueError, match=r"sm90 needs a GPU of compute capability 9.0; the default device is a NVIDIA H200 \(compute capability 8.0\)"):
        dispatch.choose_backend(_cfg(), "sm90", device=FakeGpu("8.0"))
    with pytest.raises(ValueError, match=r"sm100 needs a GPU of compute capability 10.0; the default device is a cpu device"):
        dispatch.choose_backend(_cfg(), "sm100", device=jax.devices("cpu")[0])


def test_explicit_kernel_backend_on_hopper_names_the_argument_limit(monkeypatch):
    monkeypatch.setattr(dispatch, "build_limits", lambda backend: [])
    with pytest.raises(ValueError, match=r"sm90 needs K == V == 128, got K=64, V=64; sm90 needs q, k, v in bfloat16, got float32"):
        dispatch.choose_backend(_cfg(dtype=jnp.float32, d=64), "sm90", device=FakeGpu("9.0"))
    assert dispatch.choose_backend(_cfg(), "sm90", device=FakeGpu("9.0")).backend == "sm90"


def test_auto_honours_jax_default_device(monkeypatch):
    """With a (fake) Hopper listed first, jax.default_device(cpu) still makes the CPU the target."""
    cpu = jax.devices("cpu")[0]
    monkeypatch.setattr(dispatch.jax, "devices", lambda *a: [FakeGpu("9.0")] if not a else [cpu])
    assert dispatch.default_device().platform == "gpu"
    with jax.default_device(cpu):
        assert dispatch.default_device() is cpu
        assert dispatch.choose_backend(_cfg(), "auto").backend == "xla"
