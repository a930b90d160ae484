"""backend="sm90": the Hopper kernels against the float64 recurrence, on a GPU (marked `gpu`).

The matrix is SPEC.md section 5 at the kernels' shape (K = V = 128, bf16): both gate forms and
pre-activated gates down to -60 per token, long memory, T = 0, 1, 15, 16, 17, 33 and long, H = 1
and H = 12, packed sequences with zero-length ones, B > 1, both state layouts; the same through
the segmented (context-parallel) path. Plus the FFI
contract: inside a jitted program with other ops (command buffers), new buffers on every call,
bitwise-identical results run to run, the initial state donated and updated in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kda
from jax_kda import gold
from jax_kda.primitive import FFI_TARGETS
from jax_kda.testing import MMA_ON_HOPPER_TARGET, Workload, as_numpy64, gold_kwargs, make_inputs, prefill_on_target

pytestmark = pytest.mark.gpu

BAR = 5e-3  # SPEC.md section 5, tests
D = dict(head_k=128, head_v=128)


def _hopper():
    d = jax.devices()[0]
    return d.platform == "gpu" and getattr(d, "compute_capability", None) == "9.0"


requires_hopper = pytest.mark.skipif(not _hopper(), reason="needs a compute capability 9.0 GPU")

W = Workload
CASES = [
    W("t0", seqlen=0, **D),
    W("t1", seqlen=1, **D),
    W("t15", seqlen=15, **D),
    W("t16", seqlen=16, **D),
    W("t17", seqlen=17, **D),
    W("t33_h1", seqlen=33, heads=1, **D),
    W("h12_t100", seqlen=100, heads=12, **D),
    W("batch3_t70", batch=3, seqlen=70, **D),
    W("softplus", seqlen=300, gate="softplus", **D),
    W("lower_bound_no_a_log", seqlen=300, gate="lower_bound_no_a_log", **D),
    W("pre_minus30", seqlen=300, gate="preactivated", decay_floor=-30.0, **D),
    W("pre_minus60", seqlen=300, gate="preactivated", decay_floor=-60.0, **D),
    W("long_memory_lb", seqlen=4096, heads=2, long_memory=True, lower_bound=-1.0, **D),
    W("long_memory_softplus", seqlen=2048, heads=2, gate="softplus", long_memory=True, **D),
    W("gqa_v_first", seqlen=200, heads=2, v_heads=8, state_v_first=True, **D),
    W("no_initial_state", seqlen=100, initial_state=False, **D),
    W("no_final_state", seqlen=100, output_final_state=False, **D),
    W("flags_off", seqlen=100, l2norm=False, beta_sigmoid=False, gate="preactivated", **D),
    W("packed_mixed", seqlens=(13, 0, 64, 1, 100, 0, 31, 16, 17), heads=3, v_heads=12, **D),
    W("packed_leading_empty", seqlens=(0, 0, 250, 17), gate="softplus", state_v_first=True, **D),
    W("packed_all_empty", seqlens=(0, 0), **D),
]


def _assert_matches_gold(label: str, w: Workload, args, kwargs, o, final):
    """o and the final state against the float64 recurrence at the SPEC's bar; prints the
    err_ratio lines tests/run_gpu.sh collects."""
    gold_o, gold_final = gold.recurrence(*as_numpy64(args), **gold_kwargs(kwargs))
    o32 = np.asarray(jnp.asarray(o, jnp.float32))
    assert o.dtype == jnp.bfloat16 and o.shape == gold_o.shape
    assert np.all(np.isfinite(o32))
    o_err = gold.err_ratio(o32, gold_o)
    print(f"{label}: o err_ratio {o_err:.2e}")
    assert o_err <= BAR
    if w.output_final_state:
        s_err = gold.err_ratio(np.asarray(final), gold_final)
        print(f"{label}: state err_ratio {s_err:.2e}")
        assert final.dtype == jnp.float32 and final.shape == gold_final.shape and s_err <= BAR
    else:
        assert final is None


def _run(w: Workload, seed: int, **extra):
    args, kwargs = make_inputs(w, np.random.default_rng(seed))
    o, final = jax_kda.prefill(*args, backend="sm90", **kwargs, **extra)
    return args, kwargs, o, final


@requires_hopper
@pytest.mark.parametrize("w", CASES, ids=lambda w: w.name)
def test_kernel_matches_float64_recurrence(w, fresh_seed):
    args, kwargs, o, final = _run(w, fresh_seed)
    _assert_matches_gold(w.name, w, args, kwargs, o, final)


@requires_hopper
@pytest.mark.parametrize("w", CASES, ids=lambda w: w.name)
def test_blackwell_kernels_built_for_hopper_match_float64_recurrence(w, fresh_seed):
    """The sm_100a prefill (warp-level MMA recurrence) cannot run here, but the same kernels built
    for sm_90a can: the whole accuracy matrix through them."""
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    o, final = prefill_on_target(MMA_ON_HOPPER_TARGET, *args, **kwargs)
    _assert_matches_gold(f"{w.name} (mma)", w, args, kwargs, o, final)


# Intracard context parallelism forced onto small shapes: (workload, segments per sequence).
SEGMENTED_CASES = [
    (W("seg_dense_b2", batch=2, seqlen=300, heads=2, **D), 3),
    (W("seg_packed", seqlens=(13, 0, 250, 1, 100), heads=3, v_heads=6, gate="softplus", **D), 4),
    (W("seg_long_memory", seqlen=2048, heads=2, long_memory=True, lower_bound=-1.0, **D), 8),
    (W("seg_h12_v_first_no_initial", seqlen=500, heads=12, state_v_first=True, initial_state=False, **D), 5),
    (W("seg_pre_minus60", seqlen=200, gate="preactivated", decay_floor=-60.0, **D), 2),
    (W("seg_no_final_state", seqlen=200, output_final_state=False, **D), 2),
    (W("seg_gqa_v_first_state", seqlen=400, heads=2, v_heads=8, state_v_first=True, **D), 3),
    # A long combine chain (16 segments, two sequences, a given state; 80-token segments, the last
    # shorter).
    (W("seg_16_dense_b2", batch=2, seqlen=1250, heads=3, **D), 16),
]


@requires_hopper
@pytest.mark.parametrize("target", [FFI_TARGETS["sm90"], MMA_ON_HOPPER_TARGET])
@pytest.mark.parametrize("w,segments", SEGMENTED_CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_segmented_prefill_matches_float64_recurrence(w, segments, target, fresh_seed):
    """The summary call, the combine and the apply call together, against the float64 recurrence."""
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    o, final = prefill_on_target(target, *args, num_segments=segments, **kwargs)
    tag = "" if target == FFI_TARGETS["sm90"] else " (mma)"
    _assert_matches_gold(f"{w.name} x{segments}{tag}", w, args, kwargs, o, final)


@requires_hopper
def test_planner_segments_a_long_few_head_call_and_it_stays_exact(fresh_seed):
    """jax_kda.prefill itself picks segments for a long sequence with few heads."""
    w = W("auto_segments", seqlen=4096, heads=2, **D)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    text = jax.jit(lambda *a: jax_kda.prefill(*a, backend="sm90", **kwargs)).lower(*args).as_text()
    assert "phase = 1 : i32" in text and "phase = 2 : i32" in text
    o, final = jax_kda.prefill(*args, backend="sm90", **kwargs)
    _assert_matches_gold(w.name, w, args, kwargs, o, final)


@requires_hopper
@pytest.mark.parametrize("target", [FFI_TARGETS["sm90"], MMA_ON_HOPPER_TARGET])
@pytest.mark.parametrize("change", ["scaled", "non_finite"])
@pytest.mark.parametrize("segments", [None, 2])
def test_packed_tokens_never_leak_between_sequences(segments, change, target, fresh_seed):
    """Changing one sequence's inputs changes no other sequence's outputs or states, bit for bit;
    also when the change makes them NaN or infinite. (The recurrence reads v straight from the
    input in 16-token tiles: the last, partial chunk of the sequence before ends inside the
    changed one, and those rows must count as exact zeros.) segments=2: the same through the
    segmented (context-parallel) path."""
    w = W("packed", seqlens=(40, 0, 17, 33), **D)
    args, kwargs = make_inputs(w, np.random.default_rng(fresh_seed))
    o1, f1 = prefill_on_target(target, *args, num_segments=segments, **kwargs)
    cu = np.asarray(kwargs["cu_seqlens"])
    lo, hi = int(cu[2]), int(cu[3])  # the third sequence (17 tokens), after one of 40
    if change == "scaled":
        changed = [x.at[:, lo:hi].set(x[:, lo:hi] * 0.5 + 0.25) for x in args]
    else:
        changed = [x.at[:, lo:hi].set(jnp.nan) for x in args]
        changed[2] = args[2].at[:, lo:hi].set(jnp.inf)  # v
    o2, f2 = prefill_on_target(target, *changed, num_segments=segments, **kwargs)
    o1, o2 = np.asarray(jnp.asarray(o1, jnp.float32)), np.asarray(jnp.asarray(o2, jnp.float32))
    assert np.all(np.isfinite(o2[:, :lo])) and np.all(np.isfinite(o2[:, hi:]))
    np.testing.assert_array_equal(o1[:, :lo], o2[:, :lo])
    np.testing.assert_array_equal(o1[:, hi:], o2[:, hi:])
    for n in (0, 1, 3):
        np.testing.assert_array_equal(np.asarray(f1[n]), np.asarray(f2[n]))


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
        lambda s, a: jax_kda.prefill(*a, backend="sm90", initial_state=s, **kwargs)[1], donate_argnums=0
    )
    donated = jnp.array(state)
    pointer = donated.unsafe_buffer_pointer()
    new_state = step(donated, args)
    assert new_state.unsafe_buffer_pointer() == pointer  # the kernel wrote the final state in place
    assert donated.is_deleted()
    np.testing.assert_array_equal(np.asarray(new_state), np.asarray(expected))


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
