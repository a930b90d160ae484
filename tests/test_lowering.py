"""The kernel primitive's lowering, on a machine without a GPU: the custom call for CUDA, the XLA path
for every other platform, whatever the tracing process's default device; `jax.export` from a CPU host;
the segmented pair of calls."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jax_kda
from jax_kda import _native, contract, planner
from jax_kda.config import validate
from jax_kda.contract import GateMode, Kernels, Phase
from jax_kda.testing import prefill_with_kernels

S = jax.ShapeDtypeStruct
TARGET = contract.FFI_TARGET
NO_TARGET_CHECK = [jax.export.DisabledSafetyCheck.custom_call(TARGET)]

# "auto" binds the kernel primitive only where the extension is installed (CI builds it).
pytestmark = pytest.mark.skipif(_native.unavailable_reason() is not None,
                                reason=f"kernels not built: {_native.unavailable_reason()}")


def _call(*, packed=False, initial_state=True, output_final_state=True, d=128, g_dtype=jnp.bfloat16,
          beta_dtype=jnp.bfloat16, **flags):
    """(function of the arrays, their ShapeDtypeStructs) for a prefill with the given flags."""
    b, t, h, hv = (1, 300, 4, 12) if packed else (2, 100, 4, 12)
    n = 5 if packed else b
    arrays = dict(q=S((b, t, h, d), jnp.bfloat16), k=S((b, t, h, d), jnp.bfloat16), v=S((b, t, hv, d), jnp.bfloat16),
                  g=S((b, t, hv, d), g_dtype), beta=S((b, t, hv), beta_dtype),
                  A_log=S((hv,), jnp.float32), dt_bias=S((hv * d,), jnp.float32))
    if packed:
        arrays["cu_seqlens"] = S((n + 1,), jnp.int32)
    if initial_state:
        arrays["initial_state"] = S((n, hv, d, d), jnp.float32)
    static = dict(scale=0.125, output_final_state=output_final_state, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True)
    static.update(flags)
    names = list(arrays)

    def f(*values):
        kw = dict(zip(names, values))
        return jax_kda.prefill(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("g"), kw.pop("beta"), **kw, **static)

    return f, list(arrays.values())


def _lower(f, specs, platforms=("cuda",)) -> str:
    return jax.jit(f).trace(*specs).lower(lowering_platforms=platforms).as_text()


def _custom_calls(text: str) -> list[str]:
    return [line for line in text.splitlines() if f"stablehlo.custom_call @{TARGET}" in line]


def test_custom_call_target_and_typed_attributes():
    f, specs = _call()
    (call,) = _custom_calls(_lower(f, specs))
    assert "mhlo.backend_config = {" in call  # typed FFI attributes (custom-call API version 4)
    expected = {
        "gate_mode": f"{int(GateMode.LOWER_BOUND_A_LOG)} : i32",
        "lower_bound": "-5.000000e+00 : f32",
        "scale": "1.250000e-01 : f32",
        "use_qk_l2norm": "1 : i32",
        "use_beta_sigmoid": "1 : i32",
        "state_v_first": "0 : i32",
        "has_initial_state": "1 : i32",
        "output_final_state": "1 : i32",
        "varlen": "0 : i32",
        "order_units": "0 : i32",  # dense: index order, the plain recurrence
        "chunk_size": f"{contract.CHUNK} : i32",
        "v_split": f"{contract.V_SPLIT} : i32",
        "num_sequences": "2 : i32",
        "num_segments": "1 : i32",
        "phase": f"{int(Phase.WHOLE)} : i32",
        "kernels": f"{int(Kernels.FOR_DEVICE)} : i32",  # auto: the device's kernels, resolved at run time
    }
    for name, value in expected.items():
        assert re.search(rf"\b{name} = {re.escape(value)}", call), f"{name} = {value} not in {call}"
    # By default the final state is a new buffer: a state that is not donated needs no copy.
    assert "output_operand_aliases" not in call
    # o in bf16, the final state in fp32, the workspace as uint8 (whole 16-token chunk slots, then
    # a 16-byte unit-table entry per sequence).
    workspace = contract.workspace_bytes(200, 2, 1, 12)
    assert workspace == (200 // 16 + 2) * 12 * contract.WORKSPACE_BYTES_PER_ROW + 2 * 16
    assert "tensor<2x100x12x128xbf16>" in call and "tensor<2x12x128x128xf32>" in call
    assert f"tensor<{workspace}xui8>" in call


@pytest.mark.parametrize("packed", [False, True])
def test_state_in_place_aliases_the_initial_state_to_the_final_state(packed):
    f, specs = _call(packed=packed, state_in_place=True)
    (call,) = _custom_calls(_lower(f, specs))
    # The initial state (operand 8) is updated in place as the final state (result 1).
    assert "output_operand_aliases" in call and "operand_index = 8" in call and "output_tuple_indices = [1]" in call


def test_pieces_along_t_carry_the_state_in_place_after_the_first():
    """A call cut along T: each later piece updates the state the one before produced (an
    intermediate) in place; the first piece reads the caller's state and, by default, writes a new one."""
    s = jax.ShapeDtypeStruct
    hv, t = 96, 180_224  # ((T // 16) + 1) * HV >= 2^20 rows: more than one kernel call's workspace
    x = s((1, t, hv, 128), jnp.bfloat16)
    specs = [x, x, x, x, s((1, t, hv), jnp.bfloat16), s((1, hv, 128, 128), jnp.float32)]

    def f(q, k, v, g, beta, h0):
        return jax_kda.prefill(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    calls = _custom_calls(_lower(f, specs))
    assert len(calls) >= 2
    assert "output_operand_aliases" not in calls[0]
    assert all("output_operand_aliases" in c and "operand_index = 8" in c for c in calls[1:])


def test_packed_call_passes_cu_seqlens_and_skips_absent_state():
    f, specs = _call(packed=True, initial_state=False, output_final_state=False, backend="sm100")
    (call,) = _custom_calls(_lower(f, specs))
    assert re.search(r"\bvarlen = 1 : i32", call) and re.search(r"\bhas_initial_state = 0 : i32", call)
    assert re.search(r"\border_units = 1 : i32", call)  # packed: longest first
    assert re.search(rf"\bkernels = {int(Kernels.SM100)} : i32", call)
    assert "tensor<6xi32>" in call  # cu_seqlens, N + 1 = 6
    assert "output_operand_aliases" not in call


@pytest.mark.parametrize("segments", [None, 3])
def test_packed_call_with_no_sequence_returns_an_empty_state_of_the_declared_shape(segments):
    """cu_seqlens = [0] over T > 0 tokens (N = 0): the custom calls' final state is [0, HV, 128, 128],
    the shape the primitive declares, one call or segmented."""
    t, h, hv, d = 100, 3, 6, 128
    x, v, beta = S((1, t, h, d), jnp.bfloat16), S((1, t, hv, d), jnp.bfloat16), S((1, t, hv), jnp.bfloat16)

    def f(q, k, v, g, beta, cu, state):
        return prefill_with_kernels(Kernels.SM90, q, k, v, g, beta, cu_seqlens=cu, initial_state=state,
                                    num_segments=segments, output_final_state=True)

    specs = [x, x, v, v, beta, S((1,), jnp.int32), S((0, hv, d, d), jnp.float32)]
    lowered = jax.jit(f).trace(*specs)
    assert lowered.out_info[1].shape == (0, hv, d, d)
    calls = _custom_calls(lowered.lower(lowering_platforms=("cuda",)).as_text())
    assert len(calls) == (1 if segments is None else 2)
    assert all("num_sequences = 0 : i32" in c for c in calls)
    assert f"tensor<0x{hv}x128x128xf32>" in calls[-1].split("->")[1]


def test_auto_lowers_to_the_kernels_for_cuda_and_the_xla_path_elsewhere():
    f, specs = _call(packed=True)
    assert len(_custom_calls(_lower(f, specs, ("cuda",)))) == 1
    assert _custom_calls(_lower(f, specs, ("cpu",))) == []


@pytest.mark.parametrize(("platforms", "calls"), [(["cuda"], 1), (["cpu"], 0), (["cuda", "cpu"], 1)])
def test_export_from_a_cpu_host_carries_the_kernels_for_cuda(platforms, calls):
    f, specs = _call(packed=True)
    exported = jax.export.export(jax.jit(f), platforms=platforms, disabled_checks=NO_TARGET_CHECK)(*specs)
    assert len(_custom_calls(exported.mlir_module())) == calls
    assert exported.platforms == tuple(platforms)


@pytest.mark.parametrize("g_dtype,beta_dtype", [(jnp.float32, jnp.float32), (jnp.float32, jnp.bfloat16),
                                                 (jnp.bfloat16, jnp.float32)])
@pytest.mark.parametrize("packed", [False, True])
def test_fp32_and_mixed_gates_export_for_cuda_as_the_kernel_reading_them_as_given(g_dtype, beta_dtype, packed):
    """fp32 g / beta (a separately computed gate) go to the kernel as they are: no convert before the call."""
    f, specs = _call(packed=packed, g_dtype=g_dtype, beta_dtype=beta_dtype)
    exported = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=NO_TARGET_CHECK)(*specs)
    text = exported.mlir_module()
    (call,) = _custom_calls(text)
    g_type = "f32" if g_dtype == jnp.float32 else "bf16"
    beta_type = "f32" if beta_dtype == jnp.float32 else "bf16"
    b, t = (1, 300) if packed else (2, 100)
    assert f"tensor<{b}x{t}x12x128x{g_type}>" in call and f"tensor<{b}x{t}x12x{beta_type}>" in call
    assert "stablehlo.convert" not in text


def test_explicit_kernel_backend_exports_for_cuda_and_refuses_other_platforms():
    f, specs = _call(backend="sm90")
    exported = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=NO_TARGET_CHECK)(*specs)
    (call,) = _custom_calls(exported.mlir_module())
    assert re.search(rf"\bkernels = {int(Kernels.SM90)} : i32", call)
    with pytest.raises(ValueError, match=r"backend='sm90' runs only on CUDA GPUs.*lowered for cpu"):
        _lower(f, specs, ("cpu",))


def test_an_ineligible_call_lowers_to_the_xla_path_even_for_cuda():
    f, specs = _call(d=64)
    assert _custom_calls(_lower(f, specs, ("cuda",))) == []


def test_gradient_lowers_the_kernel_forward_for_cuda():
    """A training step's loss and gradient: the forward is the kernel (the derivatives are the XLA
    path's, so a plain jax.grad whose cotangents do not read o drops the kernel call as dead code)."""
    f, specs = _call()

    def loss(q, *rest):
        o, final = f(q, *rest)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    assert len(_custom_calls(_lower(jax.value_and_grad(loss), specs, ("cuda",)))) == 1
    squared = lambda *a: jnp.sum(f(*a)[0].astype(jnp.float32) ** 2)  # noqa: E731  the cotangent reads o
    assert len(_custom_calls(_lower(jax.grad(squared), specs, ("cuda",)))) == 1


def test_blackwell_kernels_for_hopper_are_requested_by_name():
    q = jnp.zeros((1, 40, 2, 128), jnp.bfloat16)
    beta = jnp.zeros((1, 40, 2), jnp.bfloat16)
    state = jnp.zeros((3, 2, 128, 128), jnp.float32)
    cu = jnp.array([0, 7, 7, 40], jnp.int32)

    def f(q, k, v, g, beta, state, cu):
        return prefill_with_kernels(Kernels.MMA_SYNC_ON_SM90, q, k, v, g, beta, initial_state=state, cu_seqlens=cu,
                                    output_final_state=True, state_in_place=True)

    (call,) = _custom_calls(_lower(f, [q, q, q, q, beta, state, cu]))
    assert re.search(rf"\bkernels = {int(Kernels.MMA_SYNC_ON_SM90)} : i32", call) and "operand_index = 8" in call


def test_segmented_packed_call_runs_its_segments_longest_first():
    """Both calls of a segmented packed call ask for the order (the apply call reads the table the
    summary call wrote)."""
    x = S((1, 300, 3, 128), jnp.bfloat16)

    def f(q, k, v, g, beta, cu):
        return prefill_with_kernels(Kernels.SM90, q, k, v, g, beta, cu_seqlens=cu, num_segments=3,
                                    output_final_state=True)

    calls = _custom_calls(_lower(f, [x, x, x, x, S((1, 300, 3), jnp.bfloat16), S((6,), jnp.int32)]))
    assert len(calls) == 2
    assert all(re.search(r"\bvarlen = 1 : i32", c) and re.search(r"\border_units = 1 : i32", c) for c in calls)


def test_segmented_call_lowers_to_a_summary_call_then_an_apply_call():
    b, t, h, d = 2, 100, 3, 128
    x = S((b, t, h, d), jnp.bfloat16)
    beta = S((b, t, h), jnp.bfloat16)
    state = S((b, h, d, d), jnp.float32)

    def f(q, k, v, g, beta, state):
        return prefill_with_kernels(Kernels.SM90, q, k, v, g, beta, initial_state=state, num_segments=3,
                                    output_final_state=True, state_v_first=True)

    calls = _custom_calls(_lower(f, [x, x, x, x, beta, state]))
    assert len(calls) == 2
    summary, apply = calls
    assert f"phase = {int(Phase.SUMMARY)} : i32" in summary and f"phase = {int(Phase.APPLY)} : i32" in apply
    # Both calls name the sequences and their segments; neither has to divide one by the other.
    assert all("num_sequences = 2 : i32" in c and "num_segments = 3 : i32" in c and "varlen = 1 : i32" in c
               for c in calls)
    # Dense input: its segments are of one length, so neither call orders them.
    assert all(re.search(r"\border_units = 0 : i32", c) for c in calls)
    # The summary call takes the 2 sequences' initial state (K-first) and returns an empty o and an
    # empty final state: B, M and the start states stay in its workspace.
    summary_in, summary_out = summary.split("->")
    assert "tensor<2x3x128x128xf32>" in summary_in and "tensor<7xi32>" in summary_in  # 2 x 3 segments + 1
    assert "tensor<0x0x0x0xbf16>" in summary_out and "tensor<0xf32>" in summary_out
    assert "output_operand_aliases" not in summary
    # The apply call has no initial state operand, reuses the summary's workspace in place and
    # returns the 6 segments' final states.
    apply_in, apply_out = apply.split("->")
    assert "tensor<0xf32>" in apply_in and "tensor<6x3x128x128xf32>" in apply_out
    assert "operand_index = 8" not in apply and "operand_index = 9" in apply
    assert "tensor<1x200x3x128xbf16>" in apply_out
    cfg = validate(x, x, x, x, beta, initial_state=state, output_final_state=True, state_v_first=True)
    workspace = planner.plan_prefill(cfg, num_segments=3).workspace_bytes
    assert workspace == contract.workspace_bytes(200, 2, 3, 3) and f"tensor<{workspace}xui8>" in apply_out


def test_a_million_token_call_exports_for_cuda_in_pieces():
    """T = 1M at 32 heads is past one kernel call's workspace: the CUDA program cuts it along T into
    pieces (state carried), each with a workspace under 4 GB."""
    x, beta = S((1, 1 << 20, 32, 128), jnp.bfloat16), S((1, 1 << 20, 32), jnp.bfloat16)
    state = S((1, 32, 128, 128), jnp.float32)
    f = lambda *a: jax_kda.prefill(*a[:5], initial_state=a[5], output_final_state=True)  # noqa: E731
    exported = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=NO_TARGET_CHECK)(x, x, x, x, beta, state)
    calls = _custom_calls(exported.mlir_module())
    pieces = -(-(1 << 20) // planner.plan_prefill(validate(x, x, x, x, beta)).piece_len)
    assert pieces > 1 and len(calls) >= pieces
    workspaces = [int(m) for c in calls for m in re.findall(r"tensor<(\d+)xui8>", c)]
    assert max(workspaces) < 4e9


def _attributes(call: str) -> dict:
    """The custom call's static attributes (name -> number) from its MLIR line."""
    config = re.search(r"mhlo\.backend_config = \{([^}]*)\}", call).group(1)
    return {name: float(value) if kind == "f32" else int(value)
            for name, value, kind in re.findall(r"(\w+) = (-?[0-9.]+(?:e[+-]?[0-9]+)?) : (i32|f32)", config)}


def test_the_handler_accepts_every_call_the_lowering_emits():
    """Python's attributes and the C++ handler's check, on the CPU: a dense, a packed and a segmented
    call's attributes are exactly contract.CALL_ATTRIBUTES, and the handler's check passes them all."""
    f, specs = _call()
    calls = _custom_calls(_lower(f, specs))
    f, specs = _call(packed=True)
    calls += _custom_calls(_lower(f, specs))
    x, beta = S((2, 100, 3, 128), jnp.bfloat16), S((2, 100, 3), jnp.bfloat16)
    calls += _custom_calls(_lower(lambda q, k, v, g, b: prefill_with_kernels(Kernels.SM90, q, k, v, g, b, num_segments=3),
                                  [x, x, x, x, beta]))
    assert len(calls) == 4
    names = [name for name, _ in contract.CALL_ATTRIBUTES]
    for call in calls:
        attrs = _attributes(call)
        assert sorted(attrs) == sorted(names), call
        assert _native.load().prefill_attributes_error(attrs) == "", attrs


@pytest.mark.parametrize("change, message", [
    (dict(gate_mode=contract.GATE_MODE_MASK + 1), "gate_mode must be 0.."),
    (dict(kernels=len(Kernels)), "kernels must be 0.."),
    (dict(chunk_size=2 * contract.CHUNK), f"got chunk_size {2 * contract.CHUNK}"),
    (dict(v_split=1), "v_split 1"),
    (dict(order_units=1), "order_units only when packed"),
    (dict(phase=int(Phase.SUMMARY), num_segments=2), "phase 1, varlen 0"),
    (dict(num_segments=2), "num_segments 2, phase 0"),
    (dict(phase=7), "phase 7"),
])
def test_the_handler_refuses_attributes_this_build_cannot_run(change, message):
    """What CheckAttrs refuses at instantiation (a GPU run would fail with it), checked on the CPU: each
    change to a valid dense call's attributes."""
    f, specs = _call()
    (call,) = _custom_calls(_lower(f, specs))
    error = _native.load().prefill_attributes_error(dict(_attributes(call), **change))
    assert message in error, error


def test_the_handler_check_takes_exactly_the_decoded_attributes():
    f, specs = _call()
    attrs = _attributes(_custom_calls(_lower(f, specs))[0])
    with pytest.raises(KeyError, match="missing attribute order_units"):
        _native.load().prefill_attributes_error({k: v for k, v in attrs.items() if k != "order_units"})
    with pytest.raises(ValueError, match="does not decode"):
        _native.load().prefill_attributes_error(dict(attrs, extra=1))


def test_call_attributes_must_be_the_contracts():
    from jax_kda.kernel import call_attributes

    values = {name: 1 for name, _ in contract.CALL_ATTRIBUTES}
    typed = call_attributes(**values)
    assert list(typed) == [name for name, _ in contract.CALL_ATTRIBUTES]
    assert typed["scale"].dtype == jnp.float32 and typed["phase"].dtype == jnp.int32
    with pytest.raises(ValueError, match="not contract.CALL_ATTRIBUTES"):
        call_attributes(**values, extra=1)
