"""The public entry points: `prefill` (KDA forward over whole prompts) and `explain`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_kda import context_parallel, dispatch, xla_backend
from jax_kda.config import validate
from jax_kda.primitive import FFI_TARGETS, kernel_operands, prefill_call


@functools.partial(jax.jit, static_argnames=("cfg",))
def _xla_prefill(cfg, q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias):
    return xla_backend.prefill(
        cfg, q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias
    )


def prefill(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    use_beta_sigmoid_in_kernel=False,
    state_v_first=False,
    backend="auto",
):
    """KDA (Kimi Delta Attention) forward over whole sequences. The contract is SPEC.md.

    Per sequence and value head, with state S (K x V) starting at `initial_state` or zeros:
    S <- Diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = scale S^T q_t.
    Argument names follow `fla.ops.kda.chunk_kda`.

    Args:
      q, k: `[B, T, H, K]`.
      v: `[B, T, HV, V]`, same dtype as q; HV a multiple of H (value head h uses q/k head
        h // (HV // H)).
      g: `[B, T, HV, K]`: the log-decay (<= 0), or the raw gate with `use_gate_in_kernel`.
      beta: `[B, T, HV]`: the update strength, or its logits with `use_beta_sigmoid_in_kernel`.
      scale: output scale; default K ** -0.5.
      initial_state: `[N, HV, K, V]` (or `[N, HV, V, K]` with `state_v_first`), fp32.
      output_final_state: also return the state after the last token of each sequence.
      cu_seqlens: `[N + 1]` int32/int64 offsets of packed sequences in T (requires B == 1). May be
        traced; its values are never read on the host. Zero-length sequences are allowed (their
        final state is their initial state). Malformed values (decreasing, or outside [0, T])
        cannot be checked at trace time; they never cause out-of-bounds memory access, but the
        outputs are then unspecified. Tokens outside [cu_seqlens[0], cu_seqlens[N]) belong to no
        sequence: their o is unspecified (the XLA path writes 0, the kernels leave it unwritten).
      use_qk_l2norm_in_kernel: L2-normalise q and k per head (eps 1e-6 inside the sqrt).
      use_gate_in_kernel: compute the log-decay from the raw gate g: with `A_log` and no
        `lower_bound`, -exp(A_log) softplus(g + dt_bias); with `lower_bound`,
        lower_bound * sigmoid(exp(A_log) (g + dt_bias)), or without `A_log`
        lower_bound * sigmoid(g + dt_bias).
      A_log: `[HV]` fp32. dt_bias: `[HV, K]` or `[HV * K]` fp32 (default zeros).
      lower_bound: float in [-5, 0).
      use_beta_sigmoid_in_kernel: apply sigmoid to beta.
      state_v_first: states are laid out `[N, HV, V, K]`.
      backend: "auto" (the kernel for the default device when the call is eligible, else "xla";
        see `explain`), "xla" (pure JAX, any platform, differentiable), "sm90" or "sm100".

    Returns:
      `(o, final_state)`: o `[B, T, HV, V]` in q's dtype; final_state like initial_state in fp32,
      or None unless `output_final_state`.

    Raises:
      ValueError: an argument violates the contract, or an explicitly requested kernel backend
        cannot serve the call (the message names the argument and the limit).
      TypeError: a static argument is traced or of the wrong type. To jit `prefill` itself, use
        `jax.jit(jax_kda.prefill, static_argnames=jax_kda.STATIC_ARGNAMES)`.
    """
    if cu_seqlens is not None:
        cu_seqlens = jnp.asarray(cu_seqlens)
    cfg = validate(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        state_v_first=state_v_first,
        backend=backend,
    )
    decision = dispatch.choose_backend(cfg, backend)
    if decision.backend == "xla":
        return _xla_prefill(cfg, q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
    plan = dispatch.plan_for(cfg)
    return kernel_prefill(cfg, plan, FFI_TARGETS[decision.backend], q, k, v, g, beta, A_log, dt_bias,
                          cu_seqlens, initial_state)


def kernel_prefill(cfg, plan, target, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state):
    """The kernels behind custom call `target` under `plan`: one call, or the segmented pair."""
    if plan.num_segments > 1:
        return context_parallel.segmented_prefill(cfg, plan, target, q, k, v, g, beta, A_log, dt_bias,
                                                  cu_seqlens, initial_state)
    operands = kernel_operands(cfg, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state)
    return prefill_call(cfg, plan, target, *operands)


def explain(q, k, v, g, beta, **kwargs) -> dispatch.Decision:
    """Which backend `prefill(q, k, v, g, beta, **kwargs)` would run, and why.

    Takes exactly `prefill`'s arguments (arrays or `jax.ShapeDtypeStruct`s). Validates them like
    `prefill`, but never raises for an ineligible kernel backend: the reasons are in the result.
    When a kernel backend serves the call, the result also carries the planner's `plan` (V split,
    and the segments of intracard context parallelism when it segments the call).
    """
    requested = kwargs.pop("backend", "auto")
    cfg = validate(q, k, v, g, beta, backend=requested, **kwargs)
    if requested in ("auto", "xla"):
        decision = dispatch.choose_backend(cfg, requested)
    else:
        device = dispatch.default_device()
        reasons = dispatch.kernel_limits(cfg, requested, device)
        decision = dispatch.Decision(
            requested, "unavailable" if reasons else requested, tuple(reasons), dispatch.device_backend(device)[1]
        )
    if decision.backend in FFI_TARGETS:
        decision = dataclasses.replace(decision, plan=dispatch.plan_for(cfg))
    return decision
