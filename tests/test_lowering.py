"""The kernel primitive lowers, on a machine without a GPU, to the FFI custom call for CUDA."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jax_kda import planner
from jax_kda.config import GateMode, validate
from jax_kda.primitive import FFI_TARGETS, kernel_operands, prefill_call

S = jax.ShapeDtypeStruct


def _lower(backend="sm90", *, packed=False, initial_state=True, output_final_state=True, **flags):
    b, t, h, hv, d = (1, 300, 4, 12, 128) if packed else (2, 100, 4, 12, 128)
    arrays = dict(
        q=S((b, t, h, d), jnp.bfloat16),
        k=S((b, t, h, d), jnp.bfloat16),
        v=S((b, t, hv, d), jnp.bfloat16),
        g=S((b, t, hv, d), jnp.bfloat16),
        beta=S((b, t, hv), jnp.bfloat16),
    )
    n = 5 if packed else b
    extra = dict(
        A_log=S((hv,), jnp.float32),
        dt_bias=S((hv * d,), jnp.float32),
        cu_seqlens=S((n + 1,), jnp.int32) if packed else None,
        initial_state=S((n, hv, d, d), jnp.float32) if initial_state else None,
    )
    kwargs = dict(
        scale=0.125,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        lower_bound=-5.0,
        use_beta_sigmoid_in_kernel=True,
        state_v_first=False,
    )
    kwargs.update(flags)
    cfg = validate(*arrays.values(), backend=backend, **extra, **kwargs)
    plan = planner.plan_prefill(cfg, num_sms=132)

    def f(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state):
        ops = kernel_operands(cfg, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state)
        return prefill_call(cfg, plan, FFI_TARGETS[backend], *ops)

    lowered = jax.jit(f).trace(*arrays.values(), *extra.values()).lower(lowering_platforms=("cuda",))
    return cfg, plan, lowered.as_text()


def _custom_call(text: str) -> str:
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1, calls
    return calls[0]


def test_custom_call_target_and_typed_attributes():
    cfg, plan, text = _lower("sm90")
    call = _custom_call(text)
    assert "@jax_kda_prefill_sm90" in call
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
        "has_dt_bias": "1 : i32",
        "varlen": "0 : i32",
        "chunk_size": f"{plan.chunk_size} : i32",
        "v_split": f"{plan.v_split} : i32",
        "num_segments": "1 : i32",
        "segment_len": "0 : i32",
        "phase": "0 : i32",
    }
    for name, value in expected.items():
        assert re.search(rf"\b{name} = {re.escape(value)}", call), f"{name} = {value} not in {call}"
    # The initial state (operand 8) is updated in place as the final state (result 1).
    assert "output_operand_aliases" in call and "operand_index = 8" in call and "output_tuple_indices = [1]" in call
    # o in bf16, the final state in fp32, the workspace as uint8.
    assert "tensor<2x100x12x128xbf16>" in call and "tensor<2x12x128x128xf32>" in call
    assert f"tensor<{plan.workspace_bytes}xui8>" in call


def test_packed_call_passes_cu_seqlens_and_skips_absent_state():
    cfg, plan, text = _lower("sm100", packed=True, initial_state=False, output_final_state=False)
    call = _custom_call(text)
    assert "@jax_kda_prefill_sm100" in call
    assert re.search(r"\bvarlen = 1 : i32", call) and re.search(r"\bhas_initial_state = 0 : i32", call)
    assert "tensor<6xi32>" in call  # cu_seqlens, N + 1 = 6
    assert "output_operand_aliases" not in call


def test_plan_sizes_workspace_in_whole_chunk_slots():
    cfg, plan, _ = _lower("sm90", packed=True)
    # 300 tokens in 5 packed sequences, 12 value heads: (300 // 16 + 5) slots per head.
    assert plan.workspace_bytes == (300 // 16 + 5) * 12 * planner.WORKSPACE_BYTES_PER_SLOT
    assert plan.v_split == 2 and plan.chunk_size == 16 and plan.num_segments == 1


def test_kernel_primitive_is_forward_only():
    cfg, plan, _ = _lower("sm90")
    with pytest.raises(NotImplementedError, match="forward-only"):
        jax.jvp(lambda x: prefill_call(cfg, plan, "t", x, x, x, x, x, x, x, x, x, x)[0], (jnp.ones(1),), (jnp.ones(1),))


def test_prefill_on_target_lowers_to_that_target():
    from jax_kda.testing import MMA_ON_HOPPER_TARGET, prefill_on_target

    q = jnp.zeros((1, 40, 2, 128), jnp.bfloat16)
    beta = jnp.zeros((1, 40, 2), jnp.bfloat16)
    state = jnp.zeros((3, 2, 128, 128), jnp.float32)
    cu = jnp.array([0, 7, 7, 40], jnp.int32)

    def f(q, k, v, g, beta, state, cu):
        return prefill_on_target(MMA_ON_HOPPER_TARGET, q, k, v, g, beta, initial_state=state,
                                 cu_seqlens=cu, output_final_state=True)

    text = jax.jit(f).trace(q, q, q, q, beta, state, cu).lower(lowering_platforms=("cuda",)).as_text()
    call = _custom_call(text)
    assert f"@{MMA_ON_HOPPER_TARGET}" in call and "operand_index = 8" in call
