"""The public entry points: `prefill` (KDA forward over whole prompts) and `explain`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_kda import debug, dispatch, kernel, sharding
from jax_kda.config import Operands, validate


def _as_array(x):
    """x as prefill computes with it: jax arrays, tracers and ShapeDtypeStructs as they are, None as
    None, anything else (lists, numpy arrays, scalars) through jnp.asarray."""
    if x is None or isinstance(x, (jax.Array, jax.core.Tracer, jax.ShapeDtypeStruct)):
        return x
    return jnp.asarray(x)


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
    state_in_place=False,
    backend="auto",
):
    """KDA (Kimi Delta Attention) forward over whole sequences; the contract is docs/prefill.md.

    Per sequence and value head, with state S (K x V) starting at `initial_state` or zeros:
    S <- Diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = scale S^T q_t.
    Argument names follow `fla.ops.kda.chunk_kda`. To jit it directly:
    `jax.jit(jax_kda.prefill, static_argnames=jax_kda.STATIC_ARGNAMES)`.

    The kernels (Hopper: compute capability 9.0; Blackwell: 10.0, 10.3, 11.0) serve K == V == 128,
    q, k, v in bfloat16, g and beta each in bfloat16 or float32, an fp32 state, (N + 1) * HV < 2^20
    (dense: 2 * B * HV) and at most 65535 sequences and value heads, any T (a call past one
    workspace is cut along T, the state carried); everything else runs on the XLA path. Their
    forward is a kernel; derivatives (`jax.grad`, `jax.vjp`, `jax.jvp`) are the XLA path's,
    recomputed (there is no backward kernel).

    Args:
      q, k: `[B, T, H, K]`.
      v: `[B, T, HV, V]`, same dtype as q; HV a multiple of H (value head h uses q/k head
        h // (HV // H)).
      g: `[B, T, HV, K]`: the log-decay (<= 0), or the raw gate with `use_gate_in_kernel`.
      beta: `[B, T, HV]`: the update strength, or its logits with `use_beta_sigmoid_in_kernel`.
      scale: output scale; default K ** -0.5.
      initial_state: `[N, HV, K, V]` (or `[N, HV, V, K]` with `state_v_first`), any float (fp32
        for the kernels); the final state is fp32.
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
      A_log: `[HV]`. dt_bias: `[HV, K]` or `[HV * K]` (default zeros). Any float (the kernels
        read them as fp32).
      lower_bound: float in [-5, 0).
      use_beta_sigmoid_in_kernel: apply sigmoid to beta.
      state_v_first: states are laid out `[N, HV, V, K]`.
      state_in_place: the kernels write the final state into initial_state's buffer (needs both).
        Pair it with donating initial_state (`jax.jit(..., donate_argnums=...)`); a state that is
        not donated is then first copied by XLA, a full read and write of the state. Default
        False: the final state is a new buffer, so a state that is not donated costs no copy.
        The XLA path and segmented kernel calls ignore it (docs/prefill.md, "Donation").
      backend: "auto": the kernels when the call is within their limits and they are installed,
        lowered for CUDA (the FFI handler picks the Hopper or Blackwell build on the device it runs
        on) and the XLA path when lowered for any other platform; the XLA path at once when the
        default device is a GPU without kernels. `explain` says which and why. "xla": pure JAX, any
        platform, any shape and float dtype. "sm90" / "sm100": those kernels or a ValueError; on a
        GPU of another compute capability the call fails at run time, and lowering them for a
        platform other than CUDA raises.

    Returns:
      `(o, final_state)`: o `[B, T, HV, V]` in q's dtype; final_state like initial_state in fp32
      (float64 for float64 inputs), or None unless `output_final_state`. Lists and numpy arrays are
      taken through `jnp.asarray` first, so float64 ones become float32 unless jax_enable_x64 is on.
      `jax_kda.debug_checks()` adds run-time checks of the values (positive pre-activated gates,
      malformed cu_seqlens) for use under `jax.experimental.checkify`.

    Raises:
      ValueError: an argument violates the contract, or an explicitly requested kernel backend
        cannot serve the call (the message names the argument and the limit).
      TypeError: a static argument is traced or of the wrong type (see `STATIC_ARGNAMES`).
    """
    # Python lists and numpy arrays become jax arrays first (float64 becomes float32 unless
    # jax_enable_x64 is on), so that validation sees the dtypes the computation will have.
    q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias = (
        _as_array(x) for x in (q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias))
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
        state_in_place=state_in_place,
        backend=backend,
    )
    ops = Operands(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state)
    if debug.enabled():
        debug.check_inputs(cfg, g, cu_seqlens)
    decision = dispatch.decide(cfg, backend)
    leaves, tree = jax.tree.flatten(ops)
    explicit = sharding.explicit_split(cfg, kernel.fields_of(ops), leaves)
    if explicit is None:
        return kernel.prefill(ops, cfg, decision.kernels, decision.num_sms)
    # Shardings in the types (jax.set_mesh, Explicit axes): one local call per device, by shard_map.

    def local(local_cfg, *xs):
        return kernel.bind(xs, tree, local_cfg, decision.kernels, decision.num_sms)

    out = sharding.explicit_shard_map(local, cfg, kernel.fields_of(ops), leaves, *explicit)
    return out[0], (out[1] if cfg.output_final_state else None)


def explain(q, k, v, g, beta, *, device=None, **kwargs) -> dispatch.Decision:
    """Which backend `prefill(q, k, v, g, beta, **kwargs)` runs on `device`, and why.

    Takes exactly `prefill`'s arguments (arrays or `jax.ShapeDtypeStruct`s), plus `device`: a jax
    device, a compute capability such as "9.0" or "10.3", or a platform name: "gpu" (or "cuda") is
    this host's first GPU, "cpu", "tpu", ... that platform (default: the default device). It makes
    the same decision as `prefill` (`dispatch.decide`) but never raises for an ineligible kernel
    backend: every reason is in the result, the argument limits even on a CPU host. When the call
    lowers to the kernels on CUDA, the result carries the planner's `plan` (V split, and the
    segments of intracard context parallelism).
    """
    # The arrays as prefill computes with them (numpy float64 becomes float32 unless x64 is on).
    q, k, v, g, beta = (_as_array(x) for x in (q, k, v, g, beta))
    for name in ("initial_state", "cu_seqlens", "A_log", "dt_bias"):
        if name in kwargs:
            kwargs[name] = _as_array(kwargs[name])
    requested = kwargs.get("backend", "auto")
    cfg = validate(q, k, v, g, beta, **kwargs)
    return dispatch.decide(cfg, requested, device, strict=False)
