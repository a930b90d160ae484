"""The native path: the extension, its FFI registration, and the gate activation kernel.

CPU tests check what can be checked without a GPU: the extension's FFI API version and architectures,
the cubins really embedded in it, the version-compatibility rule, registration, and the custom call in
the HLO lowered for CUDA. Tests marked ``gpu`` run the kernel against a float64 NumPy formula.
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxlib import xla_client

from jax_kda import _native
from jax_kda._cubin import cubin_arch, embedded_cubins, max_registers, register_counts
from jax_kda.config import GateMode
from jax_kda.gate_kernel import FFI_TARGET, gate_activation

KERNEL_MODES = (GateMode.SOFTPLUS, GateMode.LOWER_BOUND_A_LOG, GateMode.LOWER_BOUND)

# A build without a CUDA toolkit is pure Python (backend="xla" only); CI builds with
# JAX_KDA_BUILD_KERNELS=ON, so there a missing extension fails the install instead of skipping here.
requires_extension = pytest.mark.skipif(
    _native.unavailable_reason() is not None, reason=f"kernels not built: {_native.unavailable_reason()}"
)


# --- The extension -----------------------------------------------------------------------------------


@requires_extension
def test_extension_is_built_against_ffi_api_0_4_for_both_architectures():
    extension = _native.load()
    assert _native.unavailable_reason() is None
    assert tuple(extension.ffi_api_version()) == (0, 4)
    assert _native.compiled_archs() == ("sm_90a", "sm_100a")


@requires_extension
def test_running_jaxlib_accepts_the_extension_ffi_api():
    built = tuple(_native.load().ffi_api_version())
    assert _native.ffi_api_incompatibility(built, _native.runtime_ffi_api_version()) is None


@requires_extension
def test_extension_embeds_a_cubin_for_each_compiled_architecture():
    # One cubin per exported (kernel, arch): the gate kernel for both architectures, the prefill
    # for each (wgmma on sm_90a, warp-level MMAs on sm_100a), and the sm_100a prefill's kernels
    # built for sm_90a as well (so that Hopper can test them).
    archs = [cubin_arch(c) for c in embedded_cubins(pathlib.Path(_native.load().__file__).read_bytes())]
    assert sorted(archs) == ["sm_100a", "sm_100a", "sm_90a", "sm_90a", "sm_90a"]
    assert set(archs) == set(_native.compiled_archs())


# The occupancy each prefill kernel is built around, as (CTAs per SM, threads per CTA): prepare's
# persistent grid assumes 4 CTAs of 128 threads (csrc/kernels/sm90/prepare_chunks.py, CTAS_PER_SM),
# the recurrence two CTAs of 160 threads per SM. That allows 128 and 168 registers a thread
# (jax_kda._cubin.max_registers). A compiler update (e.g. of the pinned nvidia-cutlass-dsl) or an
# edit that crossed them would silently halve the speed; nothing else would notice. The margins are
# small on purpose: today prepare uses 126-127 and the sm90 recurrence exactly 168.
OCCUPANCY = {"prepare_chunks": (4, 128), "chunk_recurrence": (2, 160)}


@requires_extension
def test_embedded_prefill_kernels_fit_their_occupancy():
    seen = set()
    for cubin in embedded_cubins(pathlib.Path(_native.load().__file__).read_bytes()):
        arch = cubin_arch(cubin)
        for kernel, registers in register_counts(cubin).items():
            for part, (ctas, threads) in OCCUPANCY.items():
                if part in kernel:
                    seen.add((arch, part))
                    limit = max_registers(ctas, threads)
                    assert registers <= limit, f"{arch} {kernel}: {registers} registers > {limit}"
    # Every kernel family found on every architecture (so that a parse that finds nothing fails).
    assert seen == {(arch, part) for arch in _native.compiled_archs() for part in OCCUPANCY}


@pytest.mark.parametrize(
    ("built", "runtime", "compatible"),
    [
        ((0, 4), (0, 4), True),
        ((0, 4), (0, 5), True),  # a newer jaxlib keeps accepting older handlers of the same major
        ((0, 5), (0, 4), False),  # built against newer headers than the running jaxlib
        ((0, 4), (1, 0), False),
        ((1, 0), (0, 9), False),
    ],
)
def test_ffi_api_compatibility_rule(built, runtime, compatible):
    reason = _native.ffi_api_incompatibility(built, runtime)
    if compatible:
        assert reason is None
    else:
        assert f"{built[0]}.{built[1]}" in reason and f"{runtime[0]}.{runtime[1]}" in reason
        assert "rebuild jax_kda" in reason


@requires_extension
def test_gate_target_is_registered_for_cuda_once():
    _native.load()
    _native.load()
    assert FFI_TARGET in _native.registered_targets()
    # Without a CUDA backend in the process, jaxlib queues CUDA registrations until one starts; the
    # queue is the only view of the registry there is. With a GPU they go straight to XLA.
    if "CUDA" not in xla_client._custom_callback_handler:
        queued = [entry[0] for entry in xla_client._custom_callback.get("CUDA", [])]
        assert queued.count(FFI_TARGET) == 1


# --- The custom call, lowered for CUDA on any machine ------------------------------------------------


@requires_extension
@pytest.mark.parametrize(
    ("mode", "lower_bound", "lowered_bound"),
    [
        pytest.param(GateMode.SOFTPLUS, None, "0.000000e+00", id="SOFTPLUS"),
        pytest.param(GateMode.LOWER_BOUND_A_LOG, -5.0, "-5.000000e+00", id="LOWER_BOUND_A_LOG"),
        pytest.param(GateMode.LOWER_BOUND, -0.5, "-5.000000e-01", id="LOWER_BOUND"),
    ],
)
def test_lowering_emits_the_custom_call_with_32_bit_attributes(mode, lower_bound, lowered_bound):
    batch, tokens, heads, head_dim = 2, 5, 3, 16
    with_a_log = mode != GateMode.LOWER_BOUND

    def fn(g, a_log, dt_bias):
        return gate_activation(
            g, a_log if with_a_log else None, dt_bias, lower_bound=lower_bound, gate_mode=mode
        )

    lowered = jax.jit(fn).trace(
        jax.ShapeDtypeStruct((batch, tokens, heads, head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((heads,), jnp.float32),
        jax.ShapeDtypeStruct((heads, head_dim), jnp.float32),
    ).lower(lowering_platforms=("cuda",))
    hlo = lowered.as_text()
    assert f"stablehlo.custom_call @{FFI_TARGET}(" in hlo
    assert f"gate_mode = {int(mode)} : i32" in hlo
    assert f"lower_bound = {lowered_bound} : f32" in hlo
    # Leading dimensions are flattened into one token axis; the result is float32.
    assert f"tensor<{batch * tokens}x{heads}x{head_dim}xbf16>" in hlo
    assert f"-> tensor<{batch * tokens}x{heads}x{head_dim}xf32>" in hlo


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(g=jnp.zeros((4, 2, 8), jnp.float32)), "g must be bfloat16"),
        (dict(g=jnp.zeros((8,), jnp.bfloat16)), "g must be"),
        (dict(gate_mode=GateMode.PREACTIVATED), "gate_mode must be one of"),
        (dict(gate_mode=7), "gate_mode must be one of"),
        (dict(A_log=None), "A_log [HV=2] is required"),
        (dict(A_log=jnp.zeros((3,), jnp.float32)), "A_log must have shape [2]"),
        (dict(A_log=jnp.zeros((2,), jnp.bfloat16)), "A_log must be float32"),
        (dict(dt_bias=jnp.zeros((2, 4), jnp.float32)), "dt_bias must have shape [2, 8] or [16]"),
        (dict(lower_bound=0.0), "lower_bound must be a float in [-5, 0)"),
        (dict(lower_bound=None), "lower_bound must be a float in [-5, 0)"),
        (dict(gate_mode=GateMode.LOWER_BOUND), "A_log must be None"),
    ],
)
def test_invalid_arguments_raise_naming_the_argument(kwargs, message):
    args = dict(
        g=jnp.zeros((4, 2, 8), jnp.bfloat16),
        A_log=jnp.zeros((2,), jnp.float32),
        dt_bias=jnp.zeros((2, 8), jnp.float32),
        lower_bound=-1.0,
        gate_mode=GateMode.LOWER_BOUND_A_LOG,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        gate_activation(args.pop("g"), args.pop("A_log"), args.pop("dt_bias"), **args)


# --- The kernel on a GPU -------------------------------------------------------------------------------


def _log_decay_float64(g, a_log, dt_bias, lower_bound, mode):
    """SPEC.md §1's gate activation in float64 NumPy, on the inputs the kernel saw."""
    x = g.astype(np.float64) + dt_bias.astype(np.float64).reshape(g.shape[-2:])
    if mode == GateMode.LOWER_BOUND:
        return lower_bound * (1.0 / (1.0 + np.exp(-x)))
    rate = np.exp(a_log.astype(np.float64))[:, None]
    if mode == GateMode.SOFTPLUS:
        return -rate * np.logaddexp(0.0, x)
    return lower_bound * (1.0 / (1.0 + np.exp(-rate * x)))


def _random_gate_inputs(rng, shape, with_a_log):
    """bf16 g with normal values and planted tails (|g| up to 100), fp32 A_log and dt_bias."""
    heads, head_dim = shape[-2:]
    g = rng.normal(0.0, 4.0, size=shape)
    tails = np.array([-100.0, -60.0, -30.0, -21.0, 21.0, 30.0, 60.0, 100.0])
    flat = g.reshape(-1)
    if flat.size:
        picks = rng.choice(flat.size, size=min(flat.size, 4 * tails.size), replace=False)
        flat[picks] = rng.choice(tails, size=picks.size)
    g = jnp.asarray(g, jnp.bfloat16)
    a_log = rng.uniform(-1.0, 1.0, size=(heads,)).astype(np.float32) if with_a_log else None
    dt_bias = rng.normal(0.0, 1.0, size=(heads, head_dim)).astype(np.float32)
    return g, a_log, dt_bias


# fp32 evaluation of exp/sigmoid at arguments up to |x| ~ 100 loses up to ~|x| ulp relative; below about
# 1e-38 the kernel flushes fp32 denormals to zero.
RTOL, ATOL = 1e-4, 1e-35


def _assert_matches_formula(decay, g, a_log, dt_bias, lower_bound, mode):
    gold = _log_decay_float64(np.asarray(g, np.float64), a_log, dt_bias, lower_bound, mode)
    assert decay.dtype == jnp.float32 and decay.shape == g.shape
    np.testing.assert_allclose(np.asarray(decay, np.float64), gold, rtol=RTOL, atol=ATOL)


@pytest.fixture
def kernel_device():
    reason = _native.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    device = jax.devices("gpu")[0]
    if device.compute_capability not in ("9.0", "10.0"):
        pytest.skip(f"the gate kernel has cubins for 9.0 and 10.0, not {device.compute_capability}")
    return device


@pytest.mark.gpu
@pytest.mark.parametrize("mode", KERNEL_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize(
    "shape",
    [
        (1, 2, 3),  # a token row (6 values) shorter than one 8-value vector
        (5, 3, 7),  # 105 values: a partial last vector
        (37, 12, 128),  # HV = 12, not a multiple of 8
        (2, 33, 4, 64),  # [B, T, HV, K]
        (0, 4, 128),  # no tokens: nothing is launched
    ],
    ids=lambda s: "x".join(map(str, s)),
)
def test_kernel_matches_float64_formula(kernel_device, fresh_seed, mode, shape):
    rng = np.random.default_rng(fresh_seed)
    g, a_log, dt_bias = _random_gate_inputs(rng, shape, mode != GateMode.LOWER_BOUND)
    lower_bound = None if mode == GateMode.SOFTPLUS else float(rng.uniform(-5.0, -0.1))
    decay = gate_activation(g, a_log, dt_bias, lower_bound=lower_bound, gate_mode=mode)
    _assert_matches_formula(decay, g, a_log, dt_bias, lower_bound, mode)


@pytest.mark.gpu
def test_kernel_inside_jit_with_new_buffers_each_call(kernel_device, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    mode, lower_bound = GateMode.LOWER_BOUND_A_LOG, -5.0

    @jax.jit
    def step(g, a_log, dt_bias):
        # Ops feeding the custom calls, and two calls, so that XLA schedules them among other work.
        doubled = g * 2  # exact in bf16
        decay = gate_activation(doubled, a_log, dt_bias, lower_bound=lower_bound, gate_mode=mode)
        again = gate_activation(g, a_log, dt_bias + 1.0, lower_bound=lower_bound, gate_mode=mode)
        return decay, again

    for _ in range(2):
        g, a_log, dt_bias = _random_gate_inputs(rng, (64, 6, 128), with_a_log=True)
        g, a_log, dt_bias = (jax.device_put(x, kernel_device) for x in (g, a_log, dt_bias))
        decay, again = step(g, a_log, dt_bias)
        a_log_np, dt_bias_np = np.asarray(a_log), np.asarray(dt_bias)
        _assert_matches_formula(decay, g * 2, a_log_np, dt_bias_np, lower_bound, mode)
        _assert_matches_formula(again, g, a_log_np, dt_bias_np + 1.0, lower_bound, mode)


@requires_extension
def test_every_prefill_target_is_registered():
    # Hopper, Blackwell, and the Blackwell kernels built for Hopper (to test them there).
    from jax_kda.testing import MMA_ON_HOPPER_TARGET

    targets = _native.registered_targets()
    for name in ("jax_kda_prefill_sm90", "jax_kda_prefill_sm100", MMA_ON_HOPPER_TARGET):
        assert name in targets
