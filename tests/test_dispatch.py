"""Backend choice (`dispatch.decide`, shared by `prefill` and `explain`): argument and build limits
with reasons, "auto" choosing the kernels at lowering, explicit kernel backends raising."""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kda
from jax_kda import contract, dispatch
from jax_kda.config import validate
from jax_kda.contract import Kernels

S = jax.ShapeDtypeStruct
HOPPER = dispatch.Device("gpu", "9.0", 132, "NVIDIA H200")


def _cfg(dtype=jnp.bfloat16, d=128, g_dtype=jnp.bfloat16):
    arrays = [S((1, 32, 2, d), dtype)] * 3 + [S((1, 32, 2, d), g_dtype), S((1, 32, 2), jnp.bfloat16)]
    return validate(*arrays)


@pytest.fixture
def built(monkeypatch):
    """As if the extension were installed (the decision must not depend on this machine's build)."""
    monkeypatch.setattr(dispatch, "build_limits", lambda: [])


def test_auto_on_a_cpu_host_binds_the_kernels_for_cuda(built):
    d = dispatch.decide(_cfg(), "auto", "cpu")
    assert d.kernels == Kernels.FOR_DEVICE and d.backend == "xla" and d.plan is not None
    assert ("lowered for CUDA: the kernels (sm90 on compute capability 9.0, sm100 on compute capability "
            "10.0 / 10.3 / 11.0)") in str(d)


@pytest.mark.parametrize("cc,backend", [("9.0", "sm90"), ("10.0", "sm100"), ("10.3", "sm100"), ("11.0", "sm100")])
def test_auto_names_the_kernels_a_gpu_runs(built, cc, backend):
    d = dispatch.decide(_cfg(), "auto", cc)
    assert d.backend == backend and d.kernels == Kernels.FOR_DEVICE


@pytest.mark.parametrize("cc", ["8.0", "8.9", "12.0", "12.1"])
def test_auto_on_a_gpu_without_kernels_takes_the_xla_path_and_says_why(built, cc, caplog):
    with caplog.at_level(logging.DEBUG, logger="jax_kda"):
        d = dispatch.decide(_cfg(), "auto", cc)
    assert d.backend == "xla" and d.kernels is None and f"compute capability {cc}" in d.reasons[0]
    assert "backend='xla'" in caplog.text


def test_argument_limits_name_argument_and_limit():
    reasons = dispatch.argument_limits(_cfg(dtype=jnp.float32, d=64, g_dtype=jnp.float16))
    assert "the kernels need K == V == 128, got K=64, V=64" in reasons
    assert "the kernels need q, k, v in bfloat16, got float32" in reasons
    assert "the kernels need g in bfloat16 or float32, got float16" in reasons
    assert dispatch.argument_limits(_cfg()) == []
    assert dispatch.argument_limits(_cfg(g_dtype=jnp.float32)) == []  # fp32 gates: the kernels read them


def test_argument_limits_name_the_grid_limit_on_sequences(built):
    # 70 000 packed sequences fit the workspace limit but not the recurrence's grid (z <= 65535).
    arrays = [S((1, 70_000, 2, 128), jnp.bfloat16)] * 4 + [S((1, 70_000, 2), jnp.bfloat16)]
    cfg = validate(*arrays, cu_seqlens=S((70_001,), jnp.int32))
    assert dispatch.argument_limits(cfg) == [
        "the kernels support at most 65535 sequences and 65535 value heads per call (CUDA grid limits), "
        "got N=70000, HV=2"]
    d = dispatch.decide(cfg, "auto", HOPPER)
    assert d.backend == "xla" and d.kernels is None


def test_an_ineligible_auto_call_takes_the_xla_path_on_every_platform(built):
    d = dispatch.decide(_cfg(dtype=jnp.float32), "auto", HOPPER)
    assert d.backend == "xla" and d.kernels is None and d.reasons


def test_explicit_kernel_backend_names_the_argument_limit(built):
    with pytest.raises(ValueError, match=r"backend='sm90': the kernels need K == V == 128, got K=64, V=64; "
                                         r"the kernels need q, k, v in bfloat16, got float32"):
        dispatch.decide(_cfg(dtype=jnp.float32, d=64), "sm90", HOPPER)


def test_explicit_kernel_backend_is_bound_on_any_host(built):
    """An explicit backend does not need its GPU at trace time (a CPU host exports for it); on the
    wrong device explain says it fails there."""
    for device in ("cpu", "10.0", HOPPER):
        assert dispatch.decide(_cfg(), "sm90", device).kernels == Kernels.SM90
    d = dispatch.decide(_cfg(), "sm90", "10.0")
    assert d.backend == "unavailable" and "sm90 runs on compute capability 9.0" in d.reasons[0]
    assert dispatch.decide(_cfg(), "sm90", HOPPER).backend == "sm90"


def test_a_missing_extension_is_a_reason(monkeypatch):
    monkeypatch.setattr(dispatch._native, "unavailable_reason", lambda: "not built")
    assert dispatch.decide(_cfg(), "auto", HOPPER).kernels is None
    with pytest.raises(ValueError, match="the kernels are unavailable: not built"):
        dispatch.decide(_cfg(), "sm90", HOPPER)


def test_explain_reports_the_decision_and_every_reason():
    x = jnp.zeros((1, 4, 2, 8), jnp.float32)
    d = jax_kda.explain(x, x, x, x, x[..., 0])
    assert d.requested == "auto" and d.backend == "xla" and d.reasons
    assert "backend='xla'" in str(d)
    d = jax_kda.explain(x, x, x, x, x[..., 0], backend="sm90", device="9.0")
    assert d.backend == "unavailable" and any("K == V == 128" in r for r in d.reasons)


def test_explain_judges_numpy_inputs_as_prefill_computes_with_them():
    """numpy float64 gates become float32 in prefill (x64 off), so explain must not call them float64."""
    x = jnp.zeros((1, 64, 2, 128), jnp.bfloat16)
    g64, beta64 = np.zeros((1, 64, 2, 128)), np.zeros((1, 64, 2))
    reasons = jax_kda.explain(x, x, x, g64, beta64, device="9.0").reasons
    assert not any("float64" in r for r in reasons), reasons
    assert reasons == jax_kda.explain(x, x, x, g64.astype(np.float32), beta64.astype(np.float32),
                                      device="9.0").reasons


def test_explain_shows_the_kernel_plan_and_its_segments(built):
    """A kernel decision carries the planner's plan; a few-head long call is segmented."""
    x = S((1, 65536, 8, 128), jnp.bfloat16)
    beta = S((1, 65536, 8), jnp.bfloat16)
    d = jax_kda.explain(x, x, x, x, beta, device="9.0")
    assert d.backend == "sm90" and d.plan is not None and d.plan.num_segments > 1
    assert f"{d.plan.num_segments} segments of {d.plan.segment_len} tokens" in str(d)
    d = jax_kda.explain(x, x, x, x, beta, backend="xla")
    assert d.plan is None and "plan" not in str(d)


def test_prefill_and_explain_make_the_same_decision(built, monkeypatch):
    """prefill binds what explain reports (one decision function)."""
    seen = []
    original = dispatch.decide
    monkeypatch.setattr(dispatch, "decide", lambda *a, **k: seen.append(original(*a, **k)) or seen[-1])
    x = S((1, 64, 2, 128), jnp.bfloat16)
    beta = S((1, 64, 2), jnp.bfloat16)
    jax.jit(jax_kda.prefill).trace(x, x, x, x, beta)
    assert seen[-1].kernels == jax_kda.explain(x, x, x, x, beta).kernels


def test_default_device_honours_jax_default_device(monkeypatch):
    """Without jax.default_device, the first device (here a stand-in GPU listed first); with it, that
    device (the CPU), as a jax device or as a platform name."""
    import types

    gpu = types.SimpleNamespace(platform="gpu", compute_capability="9.0", core_count=132, device_kind="NVIDIA H200")
    cpu = jax.devices("cpu")[0]
    real_devices = jax.devices
    monkeypatch.setattr(jax, "devices", lambda *a: real_devices(*a) if a else [gpu, cpu])
    assert dispatch.default_device() == HOPPER
    for default in (cpu, "cpu"):
        with jax.default_device(default):
            assert dispatch.default_device().platform == "cpu"


def test_a_dense_batch_too_wide_for_one_slot_takes_the_xla_path(built):
    """A dense piece of 16 tokens holds B slots per value head, so the kernels need 2 * B * HV < 2^20
    (packed: (N + 1) * HV): past it "auto" takes the XLA path with the reason instead of failing in
    the planner, and just under it the planner cuts the call into pieces that fit."""
    def cfg(b, t=64, hv=16):
        return validate(*[S((b, t, hv, 128), jnp.bfloat16)] * 4, S((b, t, hv), jnp.bfloat16))

    limit = contract.MAX_WORKSPACE_ROWS // (2 * 16)  # B at which 2 * B * HV reaches the limit (HV = 16)
    d = dispatch.decide(cfg(limit), "auto", "cpu")
    assert d.kernels is None and d.backend == "xla"
    assert any("2 * B * HV (dense)" in r for r in d.reasons), d.reasons
    assert dispatch.decide(cfg(limit), "sm90", "9.0", strict=False).backend == "unavailable"
    d = dispatch.decide(cfg(limit - 1), "auto", "cpu")
    assert d.kernels == Kernels.FOR_DEVICE and not d.reasons
    assert d.plan.piece_len == 16 and (2 * (limit - 1)) * 16 < contract.MAX_WORKSPACE_ROWS


@pytest.mark.parametrize("name", ["gpu", "cuda", "GPU"])
def test_explain_takes_the_cuda_platform_by_either_name(built, name):
    """jax calls the CUDA platform "gpu" and also accepts "cuda": both mean the GPU, never "some
    other platform" (which would report the XLA path with no reason). On a host without a GPU its
    compute capability is unknown, and the reason says how to give it."""
    x = S((1, 1024, 4, 128), jnp.bfloat16)
    beta = S((1, 1024, 4), jnp.bfloat16)
    d = jax_kda.explain(x, x, x, x, beta, device=name)
    try:
        gpu = dispatch.as_device(jax.devices("gpu")[0])
    except RuntimeError:
        gpu = None
    if gpu is not None:  # this host's first GPU: its compute capability is read off the device
        assert re.fullmatch(r"\d+\.\d+", gpu.compute_capability or "")
        assert d.device == str(gpu) and "unknown" not in d.device
        assert not any("unknown" in r or "not known" in r for r in d.reasons)
        return
    assert d.backend == "xla" and d.device == "CUDA GPU of unknown compute capability"
    assert d.reasons == ('no jax_kda kernel for a CUDA GPU of unknown compute capability (pass the device, '
                         'or its compute capability such as device="9.0")',)
    d = jax_kda.explain(x, x, x, x, beta, device=name, backend="sm90")
    assert d.backend == "unavailable" and "this GPU's is not known" in d.reasons[0]


def test_explain_names_the_default_device_only_when_it_used_it(built, monkeypatch):
    x = S((1, 1024, 4, 128), jnp.bfloat16)
    beta = S((1, 1024, 4), jnp.bfloat16)
    rtx_blackwell = dispatch.Device("gpu", "12.0", 84, "NVIDIA RTX PRO")
    monkeypatch.setattr(dispatch, "default_device", lambda: rtx_blackwell)
    assert jax_kda.explain(x, x, x, x, beta).reasons == (
        "no jax_kda kernel for the default device, a NVIDIA RTX PRO (compute capability 12.0)",)
    assert jax_kda.explain(x, x, x, x, beta, device=rtx_blackwell).reasons == (
        "no jax_kda kernel for a NVIDIA RTX PRO (compute capability 12.0)",)


def test_explain_says_how_an_explicit_backend_fails_off_its_gpu(built):
    """Lowered for another platform, an explicit kernel backend is a lowering error; on a GPU of
    another compute capability, the custom call's error at run time."""
    x = S((1, 1024, 4, 128), jnp.bfloat16)
    beta = S((1, 1024, 4), jnp.bfloat16)
    (reason,) = jax_kda.explain(x, x, x, x, beta, backend="sm90", device=dispatch.Device("cpu")).reasons
    assert reason == "sm90 runs on compute capability 9.0; lowering it for the cpu platform is an error (ValueError)"
    with pytest.raises(ValueError, match="lowered for cpu"):
        jax.jit(lambda *a: jax_kda.prefill(*a, backend="sm90")).lower(x, x, x, x, beta)
    (reason,) = jax_kda.explain(x, x, x, x, beta, backend="sm90", device="10.0").reasons
    assert reason == ("sm90 runs on compute capability 9.0; on a NVIDIA GPU (compute capability 10.0) the "
                      "kernels' custom call fails at run time")
