"""The kernels' FFI contract on a Hopper GPU (marked `gpu`): what the accuracy matrix
(tests/test_prefill_matrix.py) does not check. Sequences never leak into each other, bit for bit;
a packed batch's results do not depend on the order of its sequences; bitwise-identical results
run to run; inside a jitted program with other ops and new buffers on every call, also in CUDA
graphs; the initial state donated and updated in place; the planner's own segmentation;
backend="auto" choosing the kernels; agreement with the XLA path; gradients under "auto" (the XLA
path's, around the kernel forward).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kda
from jax_kda import gold
from jax_kda.contract import Kernels
from jax_kda.testing import (
    ERR_RATIO_BAR as BAR,
    Workload,
    as_numpy64,
    check_against_gold,
    gold_kwargs,
    make_inputs,
    prefill_with_kernels,
)

pytestmark = pytest.mark.gpu

D = dict(head_k=128, head_v=128)
W = Workload


def _hopper():
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return False
    return d.platform == "gpu" and getattr(d, "compute_capability", None) == "9.0"


requires_hopper = pytest.mark.skipif(not _hopper(), reason="needs a compute capability 9.0 GPU")
HOPPER_KERNELS = [Kernels.SM90, Kernels.MMA_SYNC_ON_SM90]


def _run(w: Workload, seed: int, **extra):
    args, kwargs = make_inputs(w, np.random.default_rng(seed))
    o, final = jax_kda.prefill(*args, backend="sm90", **kwargs, **extra)
    return args, kwargs, o, final


@requires_hopper
def test_planner_segments_a_long_few_head_call_and_it_stays_exact(fresh_seed):
    """jax_kda.prefill itself picks segments for a long sequence with few heads."""
    w = W("auto_segments", seqlen=4096, heads=2, **D)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    text = jax.jit(lambda *a: jax_kda.prefill(*a, backend="sm90", **kwargs)).lower(*args).as_text()
    assert "phase = 1 : i32" in text and "phase = 2 : i32" in text
    o, final = jax_kda.prefill(*args, backend="sm90", **kwargs)
    check_against_gold(w.name, w, args, kwargs, o, final)


@requires_hopper
@pytest.mark.parametrize("kernels", HOPPER_KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("change", ["scaled", "non_finite"])
@pytest.mark.parametrize("segments", [None, 2])
def test_packed_tokens_never_leak_between_sequences(segments, change, kernels, fresh_seed):
    """Changing one sequence's inputs changes no other sequence's outputs or states, bit for bit;
    also when the change makes them NaN or infinite. (The recurrence reads v straight from the
    input in 16-token tiles: the last, partial chunk of the sequence before ends inside the
    changed one, and those rows must count as exact zeros.) segments=2: the same through the
    segmented (context-parallel) path."""
    w = W("packed", seqlens=(40, 0, 17, 33), **D)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    o1, f1 = prefill_with_kernels(kernels, *args, num_segments=segments, **kwargs)
    cu = np.asarray(kwargs["cu_seqlens"])
    lo, hi = int(cu[2]), int(cu[3])  # the third sequence (17 tokens), after one of 40
    if change == "scaled":
        changed = [x.at[:, lo:hi].set(x[:, lo:hi] * 0.5 + 0.25) for x in args]
    else:
        changed = [x.at[:, lo:hi].set(jnp.nan) for x in args]
        changed[2] = args[2].at[:, lo:hi].set(jnp.inf)  # v
    o2, f2 = prefill_with_kernels(kernels, *changed, num_segments=segments, **kwargs)
    o1, o2 = np.asarray(jnp.asarray(o1, jnp.float32)), np.asarray(jnp.asarray(o2, jnp.float32))
    assert np.all(np.isfinite(o2[:, :lo])) and np.all(np.isfinite(o2[:, hi:]))
    np.testing.assert_array_equal(o1[:, :lo], o2[:, :lo])
    np.testing.assert_array_equal(o1[:, hi:], o2[:, hi:])
    for n in (0, 1, 3):
        np.testing.assert_array_equal(np.asarray(f1[n]), np.asarray(f2[n]))


def _reorder_packed(args, kwargs, perm):
    """The packed batch of (args, kwargs) with its sequences in the order `perm` (new i = old perm[i])."""
    cu = np.asarray(kwargs["cu_seqlens"])
    tokens = np.concatenate([np.arange(cu[n], cu[n + 1]) for n in perm] + [np.zeros(0, np.int64)])
    lengths = np.diff(cu)[perm]
    out = dict(kwargs, cu_seqlens=jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)))
    if kwargs.get("initial_state") is not None:
        out["initial_state"] = kwargs["initial_state"][np.asarray(perm)]
    return tuple(x[:, tokens] for x in args), out


@requires_hopper
@pytest.mark.parametrize("kernels", HOPPER_KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("segments", [None, 3])
@pytest.mark.parametrize("count", [8, 1027])
def test_a_packed_batch_gives_the_same_results_in_any_order(count, segments, kernels, fresh_seed):
    """The recurrence runs a packed batch's sequences longest first (a table the call computes on
    the device); each sequence's results are bitwise the same whichever order the batch packs
    them in, and match the float64 recurrence. count=1027: more units than the ordering handles
    (contract.UNIT_ORDER_MAX_UNITS), run in index order; with segments, 24 and 3081 units."""
    rng = np.random.default_rng(fresh_seed)
    if count == 8:  # a long one last, an empty one, tails of every length
        seqlens = (17, 0, 48, 5, 131, 16, 33, 400)
    else:
        seqlens = tuple(int(x) for x in rng.integers(0, 40, count))
    w = W("order", seqlens=seqlens, heads=1, **D)
    args, kwargs = make_inputs(w, rng)
    o1, f1 = prefill_with_kernels(kernels, *args, num_segments=segments, **kwargs)
    check_against_gold(w.name, w, args, kwargs, o1, f1)
    perm = rng.permutation(count)
    args2, kwargs2 = _reorder_packed(args, kwargs, perm)
    o2, f2 = prefill_with_kernels(kernels, *args2, num_segments=segments, **kwargs2)
    cu, cu2 = np.asarray(kwargs["cu_seqlens"]), np.asarray(kwargs2["cu_seqlens"])
    o1, o2, f1, f2 = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (o1, o2, f1, f2))
    for i, n in enumerate(perm):
        np.testing.assert_array_equal(o1[:, cu[n]:cu[n + 1]], o2[:, cu2[i]:cu2[i + 1]])
        np.testing.assert_array_equal(f1[n], f2[i])


@requires_hopper
def test_bitwise_identical_run_to_run(fresh_seed):
    w = W("det", seqlens=(100, 0, 37), heads=12, **D)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    first = jax_kda.prefill(*args, backend="sm90", **kwargs)
    for _ in range(3):
        again = jax_kda.prefill(*args, backend="sm90", **kwargs)
        np.testing.assert_array_equal(np.asarray(first[0]), np.asarray(again[0]))
        np.testing.assert_array_equal(np.asarray(first[1]), np.asarray(again[1]))


@requires_hopper
def test_inside_a_jitted_program_with_new_buffers_every_call(fresh_seed):
    """Surrounded by other ops (so XLA may put the call in a command buffer), called repeatedly
    with freshly allocated inputs; each result checked against the gold."""
    w = W("graph", seqlens=(64, 0, 50), heads=2, gate="softplus", **D)
    rng = np.random.default_rng(fresh_seed)
    args, kwargs = make_inputs(w, rng)
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}

    @jax.jit
    def layer(a, kw):
        q, k, v, g, beta = a
        q = (q.astype(jnp.float32) * 1.0).astype(q.dtype)  # ops before and after the custom call
        k = jnp.flip(jnp.flip(k, 1), 1)
        o, final = jax_kda.prefill(q, k, v, g, beta, **kw, **static, backend="sm90")
        return o.astype(jnp.float32) + 0.0, final * 1.0, jnp.sum(final)

    for i in range(4):
        a, kw = make_inputs(w, rng) if i else (args, kwargs)
        kw = {k: v for k, v in kw.items() if k in arrays}
        o, final, total = layer(a, kw)
        gold_o, gold_final = gold.recurrence(*as_numpy64(a), **gold_kwargs({**static, **kw}))
        assert gold.err_ratio(np.asarray(o), gold_o) <= BAR
        assert gold.err_ratio(np.asarray(final), gold_final) <= BAR
        # The in-program reduction saw the kernel's state: compare with a float64 sum, to a
        # tolerance relative to the magnitudes summed (the sum itself may cancel).
        final64 = np.asarray(final, np.float64)
        assert abs(float(total) - final64.sum()) <= 1e-5 * np.abs(final64).sum()


@requires_hopper
def test_donated_initial_state_is_updated_in_place(fresh_seed):
    w = W("donate", seqlen=64, batch=2, **D)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    state = kwargs.pop("initial_state")
    expected = jax_kda.prefill(*args, backend="sm90", initial_state=state, **kwargs)[1]
    step = jax.jit(
        lambda s, a: jax_kda.prefill(*a, backend="sm90", initial_state=s, state_in_place=True, **kwargs)[1],
        donate_argnums=0,
    )
    donated = jnp.array(state)
    pointer = donated.unsafe_buffer_pointer()
    new_state = step(donated, args)
    assert new_state.unsafe_buffer_pointer() == pointer  # the kernel wrote the final state in place
    assert donated.is_deleted()
    np.testing.assert_array_equal(np.asarray(new_state), np.asarray(expected))


def _state_copies(compiled_text: str, shape) -> list[str]:
    """The lines of a compiled program that copy an fp32 array of the state's shape."""
    dims = ",".join(map(str, shape))
    return [line for line in compiled_text.splitlines() if re.search(rf"= f32\[{dims}\]\S* copy\(", line)]


@requires_hopper
@pytest.mark.parametrize("donate", [False, True])
def test_the_state_is_never_copied_when_in_place_matches_donation(donate):
    """No XLA copy of the state around the kernel: a state that is not donated gets a new final-state
    buffer (the default), a donated one is updated in place (state_in_place=True)."""
    w = W("copies", seqlen=64, batch=4, **D)
    args, kwargs = make_inputs(w, np.random.default_rng(0))
    state = kwargs.pop("initial_state")
    step = jax.jit(lambda s, a: jax_kda.prefill(*a, initial_state=s, state_in_place=donate, **kwargs)[1],
                   donate_argnums=(0,) if donate else ())
    text = step.lower(state, args).compile().as_text()
    assert "jax_kda_prefill" in text
    # The state's arrays are in the text in the form _state_copies matches (so an empty list means
    # no copy, not a pattern that never matches).
    assert re.search(rf"= f32\[{','.join(map(str, state.shape))}\]\S* ", text)
    copies = _state_copies(text, state.shape)
    assert copies == [], copies


@requires_hopper
def test_auto_uses_the_kernel_on_hopper():
    x = jax.ShapeDtypeStruct((1, 32, 2, 128), jnp.bfloat16)
    beta = jax.ShapeDtypeStruct((1, 32, 2), jnp.bfloat16)
    d = jax_kda.explain(x, x, x, x, beta)
    assert d.backend == "sm90", str(d)


@requires_hopper
def test_kernel_agrees_with_xla_path(fresh_seed):
    w = W("vs_xla", seqlens=(300, 5, 129), heads=4, gate="lower_bound", **D)
    args, kwargs, o, final = _run(w, fresh_seed)
    o_x, final_x = jax_kda.prefill(*args, backend="xla", **kwargs)
    assert gold.err_ratio(np.asarray(jnp.asarray(o, jnp.float32)), np.asarray(jnp.asarray(o_x, jnp.float32))) < BAR
    assert gold.err_ratio(np.asarray(final), np.asarray(final_x)) < BAR


@requires_hopper
def test_vmap_runs_the_kernel_once_per_element(fresh_seed):
    """jax.vmap of a kernel call (q, k mapped along axis 0, v along axis 2; g, beta and the state
    unmapped): the batching rule's calls are the kernel's own, so each element's results equal a
    direct call on that element, bit for bit."""
    rng = np.random.default_rng(fresh_seed)
    n, b, t, h, d = 3, 2, 70, 2, 128
    q, k = (jnp.asarray(rng.standard_normal((n, b, t, h, d)) / np.sqrt(d), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, t, n, h, d)), jnp.bfloat16)
    g = jnp.asarray(-rng.uniform(0.0, 0.5, (b, t, h, d)), jnp.bfloat16)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (b, t, h)), jnp.bfloat16)
    state = jnp.asarray(rng.standard_normal((b, h, d, d)), jnp.float32)

    def f(q, k, v):
        return jax_kda.prefill(q, k, v, g, beta, initial_state=state, output_final_state=True)

    lowered = jax.jit(jax.vmap(f, in_axes=(0, 0, 2))).lower(q, k, v).as_text()
    assert "stablehlo.custom_call @jax_kda_prefill" in lowered
    o, final = jax.jit(jax.vmap(f, in_axes=(0, 0, 2)))(q, k, v)
    for i in range(n):
        o_i, final_i = jax.jit(f)(q[i], k[i], v[:, :, i])
        np.testing.assert_array_equal(np.asarray(o[i]), np.asarray(o_i))
        np.testing.assert_array_equal(np.asarray(final[i]), np.asarray(final_i))
    check_against_gold("vmap element 0", W("vmap", batch=b, seqlen=t, heads=h, **D),
                       (q[0], k[0], v[:, :, 0], g, beta), {"initial_state": state}, o[0], final[0])


_GRAPH_SCRIPT = r"""
import sys, numpy as np, jax, jax.numpy as jnp
import jax_kda
from jax_kda import gold
from jax_kda.testing import Workload, as_numpy64, gold_kwargs, make_inputs

w = Workload("graph", seqlens=(40, 0, 70), heads=2, gate="softplus", head_k=128, head_v=128)
rng = np.random.default_rng(int(sys.argv[1]))
arrays_of = lambda kw: {k: v for k, v in kw.items() if isinstance(v, jax.Array)}
_, kw0 = make_inputs(w, rng)
static = {k: v for k, v in kw0.items() if k not in arrays_of(kw0)}

@jax.jit
def layer(a, kw):
    o, final = jax_kda.prefill(*a, **kw, **static, backend="sm90")
    return jnp.tanh(o.astype(jnp.float32)), final * 2.0

a, kw = make_inputs(w, rng)
text = layer.lower(a, arrays_of(kw)).compile().as_text()
print("command_buffer in compiled HLO:", "command_buffer" in text)
for i in range(4):
    a, kw = make_inputs(w, rng)  # new buffers every call: XLA must re-record or update the graph
    o, final = layer(a, arrays_of(kw))
    gold_o, gold_final = gold.recurrence(*as_numpy64(a), **gold_kwargs({**static, **arrays_of(kw)}))
    e_o = gold.err_ratio(np.asarray(o), np.tanh(gold_o))
    e_s = gold.err_ratio(np.asarray(final), 2.0 * gold_final)
    print(f"call {i}: o {e_o:.2e} state {e_s:.2e}")
    assert e_o <= 5e-3 and e_s <= 5e-3
"""


@requires_hopper
def test_correct_inside_a_cuda_graph(fresh_seed, tmp_path):
    """With XLA flags asking for custom calls in command buffers (CUDA graphs) from one command on,
    repeated calls with new input buffers stay correct. (The script prints whether the compiled
    HLO holds a command buffer; XLA decides that, not us.)"""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
    )
    script = tmp_path / "graph.py"
    script.write_text(_GRAPH_SCRIPT)
    run = subprocess.run([sys.executable, str(script), str(fresh_seed)], env=env, capture_output=True, text=True)
    print(run.stdout, run.stderr[-3000:])
    assert run.returncode == 0
    assert run.stdout.count("call ") == 4


@requires_hopper
def test_auto_lowers_to_the_kernel_and_its_gradients_are_the_xla_paths(fresh_seed):
    """backend="auto" on Hopper: the forward is the kernel custom call; jax.grad and jax.jvp work,
    with the XLA path's derivatives (packed sequences and an initial state)."""
    w = W("grad", seqlens=(40, 0, 70), heads=2, gate="softplus", **D)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}

    def loss(backend, q, v, g, state):
        kw = {**arrays, "initial_state": state}
        o, final = jax_kda.prefill(q, args[1], v, g, args[4], **kw, **static, backend=backend)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final * final)

    primals = (args[0], args[2], args[3], arrays["initial_state"])
    text = jax.jit(jax.grad(lambda *p: loss("auto", *p), argnums=(0, 1, 2, 3))).lower(*primals).as_text()
    assert "stablehlo.custom_call @jax_kda_prefill" in text
    got = jax.grad(lambda *p: loss("auto", *p), argnums=(0, 1, 2, 3))(*primals)
    want = jax.grad(lambda *p: loss("xla", *p), argnums=(0, 1, 2, 3))(*primals)
    for name, a, b in zip(("q", "v", "g", "initial_state"), got, want):
        err = gold.err_ratio(np.asarray(jnp.asarray(a, jnp.float32)), np.asarray(jnp.asarray(b, jnp.float32)))
        print(f"grad d/d{name}: err_ratio vs the XLA path {err:.2e}")
        assert err < 1e-2, f"d/d{name}: {err:.2e}"
    # Along the gradient, so that the directional derivative (|grad|^2) has no cancellation: along
    # all-ones tangents it summed terms of both signs to 0.06-0.6 % of their magnitudes (seeds 0-7 on
    # the XLA path), and the kernel forward's rounding of o alone could then miss a 1e-2 relative bar.
    tangents = tuple(b.astype(p.dtype) for b, p in zip(want, primals))
    (_, t_auto) = jax.jvp(lambda *p: loss("auto", *p), primals, tangents)
    (_, t_xla) = jax.jvp(lambda *p: loss("xla", *p), primals, tangents)
    print(f"jvp along the gradient: auto {float(t_auto):.6g}, xla {float(t_xla):.6g}")
    assert abs(float(t_auto) - float(t_xla)) <= 1e-2 * abs(float(t_xla))


@requires_hopper
@pytest.mark.parametrize("kernels", HOPPER_KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("w", [W("pieces_dense", batch=2, seqlen=300, heads=2, **D),
                               W("pieces_packed", seqlens=(40, 0, 170, 33), heads=3, state_v_first=True, **D)],
                         ids=lambda w: w.name)
def test_a_call_cut_along_t_carries_the_state_between_pieces(w, kernels, monkeypatch, fresh_seed):
    """The long-context path (calls past one workspace are cut along T) forced onto small shapes:
    pieces of 64 tokens, sequences crossing piece boundaries, against the float64 recurrence."""
    from jax_kda import planner

    monkeypatch.setattr(planner, "piece_length", lambda cfg: 64 if cfg.seqlen > 64 else 0)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    o, final = prefill_with_kernels(kernels, *args, **kwargs)
    check_against_gold(f"{w.name} in pieces of 64 [{kernels.name}]", w, args, kwargs, o, final)


_CONTRACT_FAULTS = {
    # What prefill's own custom call gets instead of what the contract asks, and the handler's answer.
    "A_log one element too many": ("A_log", "A_log must have HV elements"),
    "dt_bias one element too many": ("dt_bias", r"dt_bias must have HV \* 128 elements"),
    "workspace 16 bytes short": ("workspace", r"workspace has \d+ bytes, needs \d+"),
}


@requires_hopper
@pytest.mark.parametrize("fault", list(_CONTRACT_FAULTS))
def test_the_handler_refuses_operands_off_the_contract(fault, monkeypatch, fresh_seed):
    """The FFI handler checks every operand's size against the call's shape before it launches
    anything: prefill's own custom call, with one operand off by a little, fails with the handler's
    message instead of running the kernels over a buffer of the wrong size."""
    from jax_kda import kernel

    operand, message = _CONTRACT_FAULTS[fault]
    real = kernel._custom_call

    def off_the_contract(cfg, plan, kernels, phase, operands, **flags):
        if operand == "workspace":
            plan = dataclasses.replace(plan, workspace_bytes=plan.workspace_bytes - 16)
        else:
            operands = dict(operands, **{operand: jnp.concatenate([operands[operand], jnp.zeros((1,), jnp.float32)])})
        return real(cfg, plan, kernels, phase, operands, **flags)

    w = W("contract", seqlens=(40, 17), gate="lower_bound", **D)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    o, final = jax_kda.prefill(*args, backend="sm90", **kwargs)  # the contract kept: it runs
    check_against_gold(w.name, w, args, kwargs, o, final)
    monkeypatch.setattr(kernel, "_custom_call", off_the_contract)
    call = jax.jit(lambda *a: jax_kda.prefill(*a, backend="sm90", **kwargs))  # a new jit: lowered anew
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(call(*args))


@requires_hopper
@pytest.mark.parametrize("w", [W("xla_dense", batch=2, seqlen=200, heads=2, **D),
                               W("xla_packed_f32_gates", seqlens=(40, 0, 170), heads=2, g_dtype="float32",
                                 beta_dtype="float32", state_v_first=True, **D),
                               W("xla_long_memory", seqlen=300, heads=2, long_memory=True, **D)],
                         ids=lambda w: w.name)
def test_the_xla_path_on_the_gpu_meets_the_same_bar(w, fresh_seed):
    """backend="xla" on the GPU (its matmuls at HIGHEST precision, not the GPU's TF32 default)
    against the float64 recurrence, with the kernels' bar: the fallback and the derivatives' path."""
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    o, final = jax.jit(lambda *a: jax_kda.prefill(*a, backend="xla", **kwargs))(*args)
    assert o.devices() == {jax.devices()[0]}
    check_against_gold(f"{w.name} [xla on the GPU]", w, args, kwargs, o, final)
