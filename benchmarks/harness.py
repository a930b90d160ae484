"""What the benchmark scripts share: the workloads and their input sets, timing, and the reports.

  * Workloads: `workload(name)`: a case of `jax_kda.testing.BENCHMARK_CASES`, or any name of the
    grid's form (`h2_fixed256`, `h4_3x1k`, `h8_mixed`), built with the grid's flags; `input_sets`
    draws the first input set and derives the others from it (`derived_set`).
  * Timing: `measure(run, calls, reps)`: device time from CUPTI through `torch.profiler` (the span of
    all GPU activity of `run()`, and the same profiled runs summed per kernel kind: `by_kernel`),
    and wall time; without torch or CUDA, wall time only. `gpu_activities` is the profiler part.
  * Reports: `write_results` (results.json, table.md, prefill.png), `render_report` (the markdown
    page, e.g. benchmarks/BENCHMARK_H200.md), `run_metadata` (date, GPU, build commit, versions).

torch is imported only inside the functions that need it: the scripts import this module (and parse
their arguments) on a machine without torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import json
import math
import os
import pathlib
import re
import shlex
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda import contract

# gpu_clock is this folder's module: the scripts put the folder on sys.path.
from gpu_clock import INTERVAL_MS as CLOCK_INTERVAL_MS, ClockLog, gpu_facts
from jax_kda.testing import BENCHMARK_CASES, MIXED_SEQLENS, Workload, hbm_floor_bytes, make_inputs

# Bytes/s of a device-to-device copy (bytes read + written), the memory system's practical ceiling, as
# measured by measure_copy_bandwidth on each GPU the committed reports come from. A run on a GPU with
# torch measures its own (run_metadata's `copy_bandwidth`) and uses that; these serve a run without
# one (a report redrawn from an older run) and name the GPUs' figures in the docs.
COPY_BANDWIDTHS = {
    "NVIDIA H200": 4.3e12,  # 2026-11-30, torch copy of bf16 tensors, 8.6 GB in 2.0 ms
    # 2026-12-05, measure_copy_bandwidth on one H100 SXM (GPU-3d25316f), three runs: 2.975-2.980 TB/s
    "NVIDIA H100 80GB HBM3": 2.98e12,
}
REFERENCE_GPU = "NVIDIA H200"  # whose figure a GPU without one of its own is held to, said so in the report
COPY_BYTES = 2**30  # each of the copy's source and destination (1 GiB: far past any L2)
L2_BYTES = 60 * 2**20  # the H200's L2
MIN_SETS, MAX_SETS = 8, 16  # input sets per timed program (enough to exceed 4x L2, within limits)
PROFILED_RUNS = 3  # runs under the profiler per measurement (device time: their median)
COMMIT_ENV = "JAX_KDA_COMMIT"  # the jax_kda build's git commit, when not given as --commit

_FLOOR_SENTENCE = ("over the GPU's copy bandwidth (a device-to-device copy, bytes read + written; the report names "
                   "the figure and where it was measured).")
METHOD = (
    "Each implementation runs K back-to-back calls on K distinct input sets (K >= 8, and enough that the sets "
    "exceed 4x the 60 MB L2, so no call finds its inputs in cache; at most 16): jax_kda as one jitted XLA "
    "program holding the K calls, FLA and FlashKDA as K eager torch calls, then one synchronisation. Device "
    "time: the span from the start of the first to the end of the last GPU activity of the K calls, recorded "
    "by CUPTI through torch.profiler (it sees every kernel of the process, jax's included; idle gaps between "
    "kernels count), / K, median of 3 profiled runs, after a warm-up. Wall time / K (median of --reps runs) is "
    "recorded too (*_wall_us in results.json); where no device time can be taken (no torch with CUDA) the "
    "tables show wall time. Per kernel: the durations of the profiled runs' GPU activities summed by name "
    "(prepare_chunks, the recurrence, combine_segments, everything else: order_units, which orders a packed "
    "batch's sequences longest first, and XLA's own ops and copies) / K, median of the 3 runs; they need not "
    "add up to the span (gaps, overlap). A peer's GPU busy time: the same durations summed over all its "
    "activities (*_busy_us), which leaves out the gaps between its launches; the tables charge a peer the "
    "least of its device time, wall time and busy time, jax_kda its device time. XLA does not preallocate "
    "GPU memory here, so the peers' torch allocator is not confined to a quarter of it; its retries during a "
    "peer's timed calls are recorded (*_alloc_retries). The first input set is a "
    "fresh random draw (never zeros), made on the GPU by jax.random from a seed drawn fresh each run; the "
    "others are that set with every floating-point array rolled along its longest axis (a packed batch's "
    "cu_seqlens is one array, shared by the K sets and, as one torch tensor, by a peer's K calls, as a "
    "model's layers share it). All implementations get the same arrays (torch tensors shared with "
    "JAX by DLPack), and their outputs are compared with jax_kda's (err_ratio of o and of the final state) "
    "before anything is timed. HBM floor: the fewest bytes a prefill moves (q, k, v, raw g, beta read once, "
    f"o written once, states read and written once) {_FLOOR_SENTENCE} The XLA path "
    "(backend=\"xla\", with --xla) is timed the same way on 2 of the sets (its calls take milliseconds, so L2 "
    "plays no part; a case whose program does not fit in device memory is marked not run). GPU clock: the SM "
    f"clock, power draw and throttle reasons nvidia-smi reports every {CLOCK_INTERVAL_MS} ms during each "
    "implementation's profiled runs are kept per case (*_clock in results.json, with the GPU's UUID and "
    "power limit in the run's metadata), so that a difference between two runs can be checked against the clock."
)


# --- Workloads and input sets ------------------------------------------------------------------------------

_GRID_NAME = re.compile(r"h(\d+)_(?:fixed(\d+)(k?)|(\d+)x(\d+)(k?)|(mixed))")


# The benchmark grid's flags, for the scripts that draw their own (larger) inputs on the device:
# lower-bound gate -5 with A_log, gate, beta sigmoid and l2norm in the kernel.
GRID_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0,
                  use_beta_sigmoid_in_kernel=True)


def device_inputs(key, tokens: int, heads: int, num_states: int = 0):
    """Random inputs for one B = 1 call of `tokens` tokens at `heads` heads (K = V = 128), drawn on
    the device (jax.random): ((q, k, v, g, beta) in bf16, with g of scale 2, and dict(A_log,
    dt_bias) in fp32, plus initial_state [num_states, heads, 128, 128] (scale 0.5) if num_states)."""
    ks = jax.random.split(key, 8)
    d = contract.HEAD_DIM

    def draw(k, shape, s=1.0):
        return (s * jax.random.normal(k, shape)).astype(jnp.bfloat16)

    arrays = (draw(ks[0], (1, tokens, heads, d)), draw(ks[1], (1, tokens, heads, d)),
              draw(ks[2], (1, tokens, heads, d)), draw(ks[3], (1, tokens, heads, d), 2.0),
              draw(ks[4], (1, tokens, heads)))
    params = dict(A_log=jax.random.uniform(ks[5], (heads,), minval=-1.0, maxval=1.0),
                  dt_bias=0.5 * jax.random.normal(ks[6], (heads, d)))
    if num_states:
        params["initial_state"] = 0.5 * jax.random.normal(ks[7], (num_states, heads, d, d))
    return arrays, params


def workload(name: str) -> Workload:
    """A benchmark case by name: one of `testing.BENCHMARK_CASES`, or a name of the grid's form, built
    with the grid's flags (D = 128, bf16, lower-bound gate, fp32 states, [N, H, V, K] layout):
    `h<H>_fixed<T>` (one sequence of T tokens; `k` = 1024: `h2_fixed1k`), `h<H>_<N>x<T>` (N packed
    sequences of T), `h<H>_mixed` (the packed mixed batch)."""
    if name in BENCHMARK_CASES:
        return BENCHMARK_CASES[name]
    m = _GRID_NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"unknown case {name!r}: not in testing.BENCHMARK_CASES ({', '.join(BENCHMARK_CASES)}) "
                         "and not of the form h<H>_fixed<T>, h<H>_<N>x<T> or h<H>_mixed")
    heads, fixed, fixed_k, count, length, length_k, mixed = m.groups()
    template = BENCHMARK_CASES["h96_fixed8k"]
    if fixed is not None:
        return dataclasses.replace(template, name=name, heads=int(heads), seqlen=int(fixed) * (1024 if fixed_k else 1))
    seqlens = MIXED_SEQLENS if mixed else (int(length) * (1024 if length_k else 1),) * int(count)
    return dataclasses.replace(template, name=name, heads=int(heads), seqlen=0, seqlens=seqlens)


def num_sequences(w: Workload) -> int:
    return len(w.seqlens) if w.seqlens is not None else w.batch


def derived_set(args, kwargs, i: int):
    """Input set i > 0: every floating-point array of the first set rolled along its longest axis
    by a shift that depends on i (integer arrays such as cu_seqlens are kept)."""

    def roll(x):
        if not isinstance(x, jax.Array) or not jnp.issubdtype(x.dtype, jnp.floating) or x.size < 2:
            return x
        axis = int(np.argmax(x.shape))
        return jnp.roll(x, max(1, (7919 * i) % x.shape[axis]), axis=axis)

    return tuple(roll(a) for a in args), {key: roll(v) for key, v in kwargs.items()}


def input_bytes(args, kwargs) -> int:
    arrays = list(args) + [v for v in kwargs.values() if hasattr(v, "nbytes")]
    return sum(int(a.nbytes) for a in arrays)


def split_kwargs(kwargs):
    """(the array kwargs, the static ones): arrays travel through jit, flags are closed over."""
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    return arrays, static


def set_count(set_bytes: int) -> int:
    """Input sets per timed program: at least MIN_SETS and > 4x L2 in all, at most MAX_SETS."""
    return min(max(MIN_SETS, math.ceil(4 * L2_BYTES / max(set_bytes, 1))), MAX_SETS)


@dataclasses.dataclass
class InputSets:
    """A case's inputs: the first set as `prefill` takes it (`args`, `kwargs`), and all K sets as
    (args, array kwargs) pairs with the flags in `static` (`prefill(*a, **kw, **static)`)."""

    workload: Workload
    args: tuple
    kwargs: dict
    static: dict
    sets: list

    def __len__(self) -> int:
        return len(self.sets)


def by_tuning_group(cases: list[Workload]) -> list[Workload]:
    """The cases with those that share FLA's autotuning keys (heads, packed or not, dtypes; not the
    length) next to each other, in order of each group's first case: FLA tunes once per process and
    group (50-100 s), so a peers-only run reaches more cases in its time."""
    first = {}
    for w in cases:
        first.setdefault(_tuning_key(w), len(first))
    return sorted(cases, key=lambda w: first[_tuning_key(w)])  # stable: within a group, the given order


def _tuning_key(w: Workload) -> tuple:
    return (w.heads, w.num_v_heads, w.seqlens is not None, w.dtype, w.g_dtype, w.beta_dtype)


def input_sets(w: Workload, rng: np.random.Generator, count: int | None = None) -> InputSets:
    """The first set drawn by `testing.make_inputs` on JAX's default device (numpy on the host took
    33 ns a value on the development machine, 13 s for a 96-head 8K-token set), the others derived there;
    `count` None: `set_count` of the set's bytes."""
    args, kwargs = make_inputs(w, rng, on_device=True)
    k = count or set_count(input_bytes(args, kwargs))
    raw = [(args, kwargs)] + [derived_set(args, kwargs, i) for i in range(1, k)]
    sets = [(a, split_kwargs(kw)[0]) for a, kw in raw]
    jax.block_until_ready(sets)
    return InputSets(w, args, kwargs, split_kwargs(kwargs)[1], sets)


def measure_copy_bandwidth(reps: int = 20) -> float | None:
    """Bytes/s (read + written) of a device-to-device copy of COPY_BYTES, torch's vectorized copy of a
    random bf16 tensor, timed by CUDA events, the median of `reps` after three warm-up copies; None
    without torch with CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / float(np.median(seconds))


def copy_bandwidth(meta: dict) -> tuple[float, str]:
    """The copy bandwidth a run's floors and rates are held to, and where it comes from: the run's own
    measurement, else COPY_BANDWIDTHS for its GPU, else the reference GPU's (said so)."""
    if meta.get("copy_bandwidth"):
        return meta["copy_bandwidth"], "measured in this run"
    if COPY_BANDWIDTHS.get(meta.get("device")):
        return COPY_BANDWIDTHS[meta["device"]], f"measured on the {meta['device']} before this run"
    return COPY_BANDWIDTHS[REFERENCE_GPU], f"the {REFERENCE_GPU}'s, none measured on this device"


def hbm_floor_us(w: Workload, bandwidth: float) -> float:
    return hbm_floor_bytes(w) / bandwidth * 1e6


# METHOD's HBM floor sentence in runs saved before each run measured its GPU's copy bandwidth (up to
# 2026-12-05): it named the H200's figure whatever the GPU. A redraw states the floor as METHOD does now.
_FLOOR_SENTENCE_BEFORE = "over 4.3 TB/s, the copy bandwidth measured on the H200."


def with_current_floor_sentence(method: str) -> str:
    """A saved run's method text with its HBM floor sentence as METHOD states it now."""
    return method.replace(_FLOOR_SENTENCE_BEFORE, _FLOOR_SENTENCE)


def with_floor(row: dict, meta: dict) -> dict:
    """`row` with its HBM floor at the run's copy bandwidth (copy_bandwidth), for a redraw."""
    return dict(row, hbm_floor_us=hbm_floor_us(workload(row["case"]), copy_bandwidth(meta)[0]))


# --- Timing -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Activity:
    """One GPU activity (kernel, copy, memset) recorded by CUPTI; times in µs."""

    name: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def cuda_profiler_available() -> bool:
    try:
        import torch
        import torch.profiler  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def gpu_activities(run) -> list[Activity] | None:
    """Every GPU activity of one `run()` (which must wait for its work), sorted by start, recorded by
    CUPTI through the PyTorch profiler (it sees every kernel of the process, jax's included). None
    where torch with CUDA is unavailable or nothing was recorded."""
    if not cuda_profiler_available():
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle": one run per profile
        warnings.filterwarnings("ignore", message="Profiler clears events")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
        events = [Activity(e.name, e.time_range.start, e.time_range.end)
                  for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(events, key=lambda a: a.start) or None


# Kernel kinds by a part of the kernel's name (lower case): jax_kda's kernels are named after their
# CuTe DSL classes and functions (prepare_chunks, WgmmaRecurrence / MmaSyncRecurrence, combine_segments;
# order_units, a few µs, counts as "other").
KERNEL_KINDS = (("prepare", "prepare_chunks"), ("recurrence", "recurrence"), ("combine", "combine_segments"))
KERNEL_PARTS = tuple(kind for kind, _ in KERNEL_KINDS) + ("other",)


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, key in KERNEL_KINDS if key in lower), "other")


def by_kernel(activities: list[Activity], calls: int) -> dict[str, float]:
    """µs per call of each kernel kind (KERNEL_PARTS): durations summed by name / `calls`."""
    out = dict.fromkeys(KERNEL_PARTS, 0.0)
    for a in activities:
        out[kernel_kind(a.name)] += a.duration / calls
    return out


def span_us(activities: list[Activity]) -> float:
    return max(a.end for a in activities) - min(a.start for a in activities)


def measure(run, calls: int, reps: int, profiled: int = PROFILED_RUNS) -> dict:
    """Per-call times of `run` (which makes `calls` calls and waits for them), after one warm-up run:
    `wall_us` (median of `reps` runs), `device_us` (median CUPTI span of `profiled` runs, None without
    torch/CUDA), `busy_us` (the median of those runs' GPU activities' durations summed: the GPU's busy
    time, without the gaps between launches; None likewise), `kernels` (µs per call per KERNEL_PARTS
    kind, the median of those runs; None likewise) and `gpu_clock` (what nvidia-smi reported during the profiled runs: `gpu_clock.summarize`;
    None without it)."""
    run()
    wall = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        wall.append((time.perf_counter() - start) / calls * 1e6)
    out = dict(wall_us=statistics.median(wall), device_us=None, busy_us=None, kernels=None)
    with ClockLog() as clock:
        profiles = [gpu_activities(run) for _ in range(profiled)]
    out["gpu_clock"] = clock.summary()
    if profiles and all(profiles):
        out["device_us"] = statistics.median(span_us(p) / calls for p in profiles)
        out["busy_us"] = statistics.median(sum(a.duration for a in p) / calls for p in profiles)
        parts = [by_kernel(p, calls) for p in profiles]
        out["kernels"] = {kind: statistics.median(p[kind] for p in parts) for kind in KERNEL_PARTS}
    return out


def best_us(timing: dict) -> float:
    """The figure the tables use: device time where measured, else wall time."""
    return timing["device_us"] if timing["device_us"] is not None else timing["wall_us"]


def to_torch(sets):
    """The input sets as torch tensors sharing the JAX buffers (DLPack); cu_seqlens as int64 (and a
    host copy as `cu_seqlens_cpu`), converted once for every set that shares the JAX array, so that
    the peers see one cu_seqlens object across the calls, as a model's layers would. (FLA caches what
    it derives from cu_seqlens by the tensor's identity in a few slots: a new tensor per set missed
    every time and made each call rebuild its chunk indices with a blocking host-to-device copy.)"""
    import torch

    converted = {}  # id(JAX cu_seqlens) -> (int64 tensor, its host copy)
    out = []
    for a, kw in sets:
        ta = [torch.from_dlpack(x) for x in a]
        tkw = {k: torch.from_dlpack(v) for k, v in kw.items() if k != "cu_seqlens"}
        if "cu_seqlens" in kw:
            if id(kw["cu_seqlens"]) not in converted:
                cu = torch.from_dlpack(kw["cu_seqlens"]).long()
                converted[id(kw["cu_seqlens"])] = (cu, cu.cpu())
            tkw["cu_seqlens"], tkw["cu_seqlens_cpu"] = converted[id(kw["cu_seqlens"])]
        out.append((ta, tkw))
    return out


# --- Run metadata -------------------------------------------------------------------------------------------


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def module_file_digest(name: str) -> str | None:
    """The first 12 hex digits of the sha256 of an importable module's file (a source build's compiled
    extension, which has no package version), or None where it does not import or has no file."""
    try:
        path = getattr(importlib.import_module(name), "__file__", None)
    except ImportError:
        return None
    return None if path is None else hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()[:12]


def run_command() -> str:
    """This process's command line, the script's path relative to the working directory where it lies below it."""
    script = sys.argv[0]
    try:
        rel = os.path.relpath(script)
        script = rel if not rel.startswith("..") else script
    except ValueError:
        pass
    return "python " + shlex.join([script] + sys.argv[1:])


def run_metadata(commit: str | None = None, method: str = METHOD) -> dict:
    """Date, command, GPU and software of this run. `commit`: the jax_kda build's git commit (the
    installed wheel has no .git), default the JAX_KDA_COMMIT environment variable, else "unknown".
    `method`: how the script measures (default: bench_prefill's METHOD)."""
    import jax_kda

    device = jax.devices()[0]
    versions = {"jax": jax.__version__, "jaxlib": package_version("jaxlib"), "jax_kda": jax_kda.__version__}
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        versions["torch"] = torch.__version__
        versions["triton"] = package_version("triton")
        versions["fla-core"] = package_version("fla-core")
    return dict(
        date=time.strftime("%Y-%m-%d", time.gmtime()),
        command=run_command(),
        commit=commit or os.environ.get(COMMIT_ENV) or "unknown",
        device=device.device_kind,
        platform=device.platform,
        sms=getattr(device, "core_count", None),
        compute_capability=getattr(device, "compute_capability", None),
        versions={k: v for k, v in versions.items() if v},
        gpu=gpu_facts() if device.platform == "gpu" else None,
        method=method,
    )


# --- Tables, plot and report --------------------------------------------------------------------------------


# The peers a run may time: the key that prefixes their fields in a row (`fla_us`, `flashkda_err_o`,
# ...), and the name the tables give them.
PEER_LABELS = {"flashkda": "FlashKDA", "fla": "FLA"}


def peer_us(row: dict, peer: str) -> float | None:
    """A peer's time in the tables: the least of its device time (`{peer}_us`, the span), its wall time
    and, where recorded, its GPU busy time (`{peer}_busy_us`) per call. The peers run as eager torch
    calls: under the profiler the gaps between their launches grow (FLA's most: 6.1 ms device span
    against 3.0 ms wall time a call on 64 heads x 6 mixed prompts), and where a peer is bound by its
    host those gaps are in its span and its wall time alike; its busy time (its GPU activities'
    durations summed) leaves every gap out, what a CUDA graph of its calls could at best reach. So a
    peer is charged neither for the profiler nor for its host. jax_kda's figure stays its device span
    (one jitted program: the gaps between its kernels are charged to it)."""
    us, wall, busy = row.get(f"{peer}_us"), row.get(f"{peer}_wall_us"), row.get(f"{peer}_busy_us")
    if us is None:
        return None
    return min(t for t in (us, wall, busy) if t is not None)


def with_ratios(row: dict) -> dict:
    """The row plus its derived figures: floor / jax_kda, and per peer its table time (`{peer}_best_us`:
    peer_us) and that / jax_kda's."""
    out = dict(row, floor_fraction=row["hbm_floor_us"] / row["jax_kda_us"])
    for peer in PEER_LABELS:
        best = peer_us(row, peer)
        if best is not None:
            out[f"{peer}_best_us"] = best
            out[f"speedup_vs_{peer}"] = best / row["jax_kda_us"]
    return out


def _fmt(value, spec=".0f", suffix=""):
    return "—" if value is None else format(value, spec) + suffix


def _us(value) -> str:
    """µs: whole numbers, one decimal below 10 (tiny cases' floors)."""
    return _fmt(value, ".1f" if value is not None and abs(value) < 10 else ".0f")


def _tokens(r: dict) -> str:
    n = r.get("sequences", 1)
    return f"{r['tokens']} ({n} seqs)" if n > 1 else str(r["tokens"])


def _plan(r: dict) -> str:
    p = r.get("plan")
    return "— (xla)" if not p else f"{p['v_split']} / {p['num_segments']}"


def render_table(rows: list[dict]) -> str:
    """The markdown table: one row per case. Per-kernel and XLA-path columns only where measured."""
    rows = [with_ratios(r) for r in rows]
    kernels = any(r.get("kernels") for r in rows)
    xla = any(r.get("xla_us") is not None for r in rows)
    head = ["case", "tokens", "H", "plan (V split / segments)", "jax_kda µs", "FlashKDA µs", "FLA µs",
            "vs FlashKDA", "vs FLA", "HBM floor µs", "floor / jax_kda"]
    if kernels:
        head += ["prepare µs", "recurrence µs", "combine µs", "other µs"]
    if xla:
        head += ["XLA path µs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["case"], _tokens(r), str(r["heads"]), _plan(r), _us(r["jax_kda_us"]),
                 _us(r.get("flashkda_best_us")), _us(r.get("fla_best_us")),
                 _fmt(r.get("speedup_vs_flashkda"), ".2f", "x"), _fmt(r.get("speedup_vs_fla"), ".2f", "x"),
                 _us(r["hbm_floor_us"]), _fmt(r["floor_fraction"], ".1%")]
        if kernels:
            parts = r.get("kernels") or {}
            cells += [_us(parts.get(kind)) for kind in KERNEL_PARTS]
        if xla:
            cells += [_us(r.get("xla_us"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The performance goals the report checks: a time bound for the 96-head 8K prefill on the H200 (the
# reference GPU; no other GPU is held to it), and 2x FlashKDA on the same GPU wherever sequences x
# heads fill it, on batches of short prompts and on 96 heads at 32K tokens.
GOAL_H96_FIXED8K_US = 700.0
GOAL_VS_FLASHKDA = 2.0
GOAL_CASES_VS_FLASHKDA = ("h32_128x128", "h32_short_mixed", "h96_fixed32k")


def render_clocks(rows: list[dict], key: str = "jax_kda_clock") -> str | None:
    """One sentence on the SM clock during jax_kda's profiled runs (busy nvidia-smi samples): the range of
    the cases' medians, the lowest sample and its case, and any throttle reason seen; None when no row
    has a clock."""
    clocked = [(r["case"], r[key]) for r in rows if r.get(key) and r[key].get("sm_mhz_median") is not None]
    if not clocked:
        return None
    medians = [c["sm_mhz_median"] for _, c in clocked]
    low_case, low = min(clocked, key=lambda item: item[1]["sm_mhz_min"])
    spread = (f"{min(medians):.0f} MHz" if min(medians) == max(medians)
              else f"{min(medians):.0f}-{max(medians):.0f} MHz")
    text = (f"SM clock during jax_kda's profiled runs (nvidia-smi every {CLOCK_INTERVAL_MS} ms, samples while "
            f"busy): median {spread} across the cases, lowest sample {low['sm_mhz_min']:.0f} MHz ({low_case})")
    reasons: dict[str, list[str]] = {}
    for case, c in clocked:
        for reason in c.get("reasons", []):
            reasons.setdefault(reason, []).append(case)
    if reasons:
        text += "; throttle reasons seen: " + "; ".join(f"{reason} ({', '.join(cases)})"
                                                         for reason, cases in reasons.items())
    return text + "."


def _flashkda_goal_applies(r: dict) -> bool:
    """Whether the 2x FlashKDA goal covers the row's case: sequences x heads fill the GPU, or one of
    GOAL_CASES_VS_FLASHKDA."""
    return r.get("sequences", 1) * r["heads"] >= 64 or r["case"] in GOAL_CASES_VS_FLASHKDA


def goal_time_us(r: dict, device: str = REFERENCE_GPU) -> float | None:
    """The longest call that meets every goal on the row's case (µs): half of FlashKDA's time where
    the 2x goal applies and FlashKDA ran, and GOAL_H96_FIXED8K_US at h96_fixed8k on the reference
    GPU; None without a goal."""
    bounds = []
    flashkda = peer_us(r, "flashkda")
    if flashkda is not None and _flashkda_goal_applies(r):
        bounds.append(flashkda / GOAL_VS_FLASHKDA)
    if r["case"] == "h96_fixed8k" and device == REFERENCE_GPU:
        bounds.append(GOAL_H96_FIXED8K_US)
    return min(bounds) if bounds else None


def flashkda_unsupported(w: Workload) -> str | None:
    """Why FlashKDA cannot run the workload (None: it can): it has only the lower-bound gate with A_log,
    always applies l2norm and beta sigmoid, and needs K = V = 128, HV == H, bf16 inputs, g and beta."""
    reasons = []
    if w.gate != "lower_bound":
        reasons.append(f"gate {w.gate!r} (it has only the lower-bound gate with A_log)")
    if not (w.l2norm and w.beta_sigmoid):
        reasons.append("l2norm and beta sigmoid off (it always applies both)")
    if (w.head_k, w.head_v) != (128, 128):
        reasons.append(f"K={w.head_k}, V={w.head_v} (it needs 128)")
    if w.num_v_heads != w.heads:
        reasons.append("grouped value heads (it needs HV == H)")
    if w.dtype != "bfloat16":
        reasons.append(f"{w.dtype} inputs (it needs bfloat16)")
    if (w.g_dtype or "bfloat16") != "bfloat16" or (w.beta_dtype or "bfloat16") != "bfloat16":
        reasons.append("fp32 g or beta (it needs bfloat16)")
    if not -5.0 <= w.lower_bound <= 0.0:
        reasons.append(f"lower_bound {w.lower_bound} outside [-5, 0]")
    return "; ".join(reasons) or None


def _goal_row(case: str) -> dict:
    """What the goals read off a row (case, heads, sequences), for a case of `BENCHMARK_CASES`."""
    w = BENCHMARK_CASES[case]
    return dict(case=case, heads=w.heads, sequences=num_sequences(w))


def _flashkda_can_run(case: str) -> bool:
    """Whether FlashKDA runs the case (`flashkda_unsupported`); a name `workload` does not know is
    taken as runnable."""
    try:
        w = workload(case)
    except ValueError:
        return True
    return flashkda_unsupported(w) is None


def flashkda_goal_cases() -> list[str]:
    """The benchmark cases the 2x FlashKDA goal covers: those of `BENCHMARK_CASES` that
    `_flashkda_goal_applies` to and FlashKDA can run."""
    return [name for name in BENCHMARK_CASES if _flashkda_can_run(name) and _flashkda_goal_applies(_goal_row(name))]


def _flashkda_goal_label(r: dict) -> str:
    wide = r.get("sequences", 1) * r["heads"] >= 64
    why = "N x H >= 64" if wide else "short prompts / long 96-head prompt"
    return f">= {GOAL_VS_FLASHKDA:.0f}x FlashKDA ({why})"


def render_goals(rows: list[dict], device: str = REFERENCE_GPU) -> str | None:
    """Each goal with the measured value and whether it is met (None when no row bears on one). Where
    a row bears on one, every other goal is listed too, as not measured: a case the run did not reach
    (a run cut short, or `--cases`), or a row without FlashKDA, is named, not left out."""
    rows = [with_ratios(r) for r in rows]
    by_case = {r["case"]: r for r in rows}
    lines = ["| goal | case | measured | met |", "|---|---|---|---|"]
    missing = []
    time_goal = f"<= {GOAL_H96_FIXED8K_US:.0f} µs"
    if device == REFERENCE_GPU:
        if "h96_fixed8k" in by_case:
            t = by_case["h96_fixed8k"]["jax_kda_us"]
            lines.append(f"| {time_goal} | h96_fixed8k | {t:.0f} µs | "
                         f"{'yes' if t <= GOAL_H96_FIXED8K_US else f'no ({t - GOAL_H96_FIXED8K_US:.0f} µs over)'} |")
        else:
            missing.append(f"| {time_goal} | h96_fixed8k | — | not in this run |")
    for r in rows:
        if not (_flashkda_goal_applies(r) and _flashkda_can_run(r["case"])):
            continue
        ratio = r.get("speedup_vs_flashkda")
        if ratio is None:
            missing.append(f"| {_flashkda_goal_label(r)} | {r['case']} | — | FlashKDA not run |")
            continue
        # Two decimals, or three where two would round a miss up to the goal (1.997x is not 2.00x).
        digits = 2 if ratio >= GOAL_VS_FLASHKDA or round(ratio, 2) < GOAL_VS_FLASHKDA else 3
        verdict = "yes" if ratio >= GOAL_VS_FLASHKDA else f"no ({GOAL_VS_FLASHKDA / ratio:.{digits}f}x short)"
        lines.append(f"| {_flashkda_goal_label(r)} | {r['case']} | {ratio:.{digits}f}x | {verdict} |")
    if len(lines) == 2:
        return None
    for case in flashkda_goal_cases():
        if case not in by_case:
            missing.append(f"| {_flashkda_goal_label(_goal_row(case))} | {case} | — | not in this run |")
    return "\n".join(lines + missing)


def chunk_heads(case: str) -> int | None:
    """Chunks of the case's call x value heads: its sequences' 16-token chunks (a partial one counts),
    the units of the kernels' work; None for a case `workload` does not know."""
    try:
        w = workload(case)
    except ValueError:
        return None
    lengths = w.seqlens if w.seqlens is not None else (w.seqlen,) * w.batch
    return sum(-(-length // contract.CHUNK) for length in lengths) * w.num_v_heads


def render_gpu_time_per_chunk(rows: list[dict], sms: int | None, device: str = REFERENCE_GPU) -> str | None:
    """Each kernel's GPU time per chunk-head: its µs x the GPU's SMs / the call's chunk-heads (SM-µs:
    what one 16-token chunk of one value head costs the GPU, whatever the shape), their sum, and the
    same for the goal's time (`goal_time_us`): the budget all kernels of a call must fit. None without
    an SM count or a row with per-kernel times."""
    if not sms:
        return None
    head = ["case", "chunk-heads", "prepare", "recurrence", "combine + other", "all", "goal's budget",
            "prepare / budget"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        parts, count = r.get("kernels"), chunk_heads(r["case"])
        if not parts or not count:
            continue
        per = {kind: parts.get(kind, 0.0) * sms / count for kind in KERNEL_PARTS}
        rest = per["combine"] + per["other"]
        goal = goal_time_us(r, device)
        budget = None if goal is None else goal * sms / count
        lines.append("| " + " | ".join([
            r["case"], str(count), _fmt(per["prepare"], ".2f"), _fmt(per["recurrence"], ".2f"), _fmt(rest, ".2f"),
            _fmt(per["prepare"] + per["recurrence"] + rest, ".2f"), _fmt(budget, ".2f"),
            _fmt(None if budget is None else per["prepare"] / budget, ".0%")]) + " |")
    return "\n".join(lines) if len(lines) > 2 else None


def render_bytes_per_token_head() -> str:
    """What the two kernels move per (token, value head) at H == HV, from the contract: the inputs
    prepare reads, the workspace it writes and the recurrence reads back, v and o."""
    from jax_kda import contract

    d = contract.HEAD_DIM
    workspace = contract.WORKSPACE_BYTES_PER_ROW // contract.CHUNK
    qk = 2 * d * 2
    rows = [("prepare reads q, k (bf16)", qk), ("prepare reads g (bf16 / fp32)", f"{d * 2} / {d * 4}"),
            ("prepare reads beta (bf16 / fp32)", "2 / 4"), ("prepare writes the workspace", workspace),
            ("recurrence reads the workspace (once from HBM; each V slice's CTA reads it)", workspace),
            ("recurrence reads v (bf16)", d * 2), ("recurrence writes o (bf16)", d * 2)]
    lines = ["| what | bytes per token-head |", "|---|---|"] + [f"| {what} | {n} |" for what, n in rows]
    floor = qk + d * 2 + 2 + 2 * d * 2
    total = qk + d * 2 + 2 + 2 * workspace + 2 * d * 2
    lines += ["", f"With bf16 gates: {total} B per token-head in all, against {floor} B for the inputs and "
                  f"output alone (the HBM floor, states aside): the workspace hand-off is {2 * workspace} B of it."]
    return "\n".join(lines)


def kernel_bytes(case: str) -> dict[str, int] | None:
    """The fewest bytes each kernel of an unsegmented call of `case` moves to and from HBM: prepare
    reads q, k, g, beta and writes the workspace (contract.WORKSPACE_BYTES_PER_ROW a chunk-head); the
    recurrence reads the workspace once, v and the initial states, writes o and the final states.
    None for a case `workload` does not know."""
    from jax_kda import contract

    try:
        w = workload(case)
    except ValueError:
        return None
    t, h, hv, d = w.total_tokens, w.heads, w.num_v_heads, contract.HEAD_DIM
    size = jnp.dtype(w.dtype).itemsize
    g_size = jnp.dtype(w.g_dtype).itemsize if w.g_dtype else size
    beta_size = jnp.dtype(w.beta_dtype).itemsize if w.beta_dtype else size
    workspace = chunk_heads(case) * contract.WORKSPACE_BYTES_PER_ROW
    sequences = len(w.seqlens) if w.seqlens is not None else w.batch
    state = sequences * hv * d * d * 4
    return {
        "prepare": t * (2 * h * d * size + hv * d * g_size + hv * beta_size) + workspace,
        "recurrence": workspace + 2 * t * hv * d * size + state * (int(w.initial_state) + int(w.output_final_state)),
    }


def render_kernel_bandwidth(rows: list[dict], copy_rate: float) -> str | None:
    """Per unsegmented case: each kernel's fewest bytes (`kernel_bytes`) and the rate its measured time
    gives them, against the copy bandwidth `copy_rate` (bytes/s); None without per-kernel times."""
    head = ["case", "prepare MB", "prepare TB/s", "of copy", "recurrence MB", "recurrence TB/s", "of copy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        parts, moved = r.get("kernels"), kernel_bytes(r["case"])
        if not parts or not moved or r.get("plan", {}).get("num_segments", 1) != 1:
            continue
        rate = {k: moved[k] / (parts[k] * 1e-6) / 1e12 if parts.get(k) else None for k in moved}
        cells = [r["case"]]
        for kind in ("prepare", "recurrence"):
            cells += [f"{moved[kind] / 1e6:.0f}", _fmt(rate[kind], ".2f"),
                      _fmt(None if rate[kind] is None else rate[kind] * 1e12 / copy_rate, ".0%")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else None


def render_goal_bytes(rows: list[dict], copy_rate: float, device: str = REFERENCE_GPU) -> str | None:
    """Per goal case with a known byte count (unsegmented): the kernels' fewest bytes (`kernel_bytes`,
    both kernels), the time they take at the copy rate `copy_rate` (bytes/s; no call moving them can be
    faster), the goal's time (`goal_time_us`), the share of the copy rate the goal asks of them, the
    bytes the goal allows at that rate, and the share of today's bytes that must go before the goal
    can be met at all. None without such a row."""
    head = ["case", "kernels' bytes MB", "at the copy rate µs", "goal µs", "of the copy rate the goal asks",
            "bytes the goal allows MB", "fewer bytes needed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        goal, moved = goal_time_us(r, device), kernel_bytes(r["case"])
        if goal is None or not moved or r.get("plan", {}).get("num_segments", 1) != 1:
            continue
        total, allowed = sum(moved.values()), goal * 1e-6 * copy_rate
        cut = 1 - allowed / total
        need = "none" if cut <= 0 else f"{cut:.0%}" if cut >= 0.01 else f"{cut:.1%}"
        lines.append(f"| {r['case']} | {total / 1e6:.0f} | {total / copy_rate * 1e6:.0f} | {goal:.0f} | "
                     f"{total / allowed:.0%} | {allowed / 1e6:.0f} | {need} |")
    return "\n".join(lines) if len(lines) > 2 else None


def render_agreement(rows: list[dict]) -> str | None:
    """The agreement table (err_ratio of each peer's o and final state against jax_kda's)."""
    peers = [(p, label) for p, label in PEER_LABELS.items() if any(r.get(f"{p}_err_o") is not None for r in rows)]
    if not peers:
        return None
    head = ["case"] + [f"{label} {what}" for _, label in peers for what in ("o", "state")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["case"]] + [_fmt(r.get(f"{p}_err_{what}"), ".2e") for p, _ in peers for what in ("o", "state")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_plot(rows: list[dict], path: pathlib.Path, device: str) -> bool:
    """Time per case (log scale) per implementation, the HBM floor drawn; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return False
    fig, ax = plt.subplots(figsize=(12, 4.5))
    x = np.arange(len(rows))
    series = [("jax_kda_us", "jax_kda"), ("flashkda_best_us", "FlashKDA"), ("fla_best_us", "FLA chunk_kda"),
              ("xla_us", "jax_kda XLA path")]
    present = [(key, label) for key, label in series if any(r.get(key) is not None for r in rows)]
    width = 0.8 / max(len(present), 1)
    for i, (key, label) in enumerate(present):
        ax.bar(x + i * width, [r.get(key) or np.nan for r in rows], width, label=label)
    centre = x + 0.4 - width / 2
    ax.scatter(centre, [r["hbm_floor_us"] for r in rows], marker="_", s=400, c="k", label="HBM floor", zorder=3)
    ax.set_yscale("log")
    ax.set_xticks(centre, [r["case"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("µs per call (log)")
    ax.set_title(f"KDA prefill on {device}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # beside the bars
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def print_table(method: str, columns: list[str], lines: list[list[str]]) -> None:
    """Prints how the rows were measured, then a markdown table of `columns` and the cells of `lines`."""
    print(f"method: {method}")
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for cells in lines:
        print("| " + " | ".join(cells) + " |")


def save_rows(out: pathlib.Path | None, name: str, rows: list[dict], method: str = METHOD) -> None:
    """out/name: this run's metadata (run_metadata, with `method`) and its rows; nothing if out is None."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(dict(meta=run_metadata(method=method), rows=rows), indent=1))


def write_results(out: pathlib.Path, rows: list[dict], meta: dict) -> str:
    """out/results.json (meta + rows with their ratios), out/table.md, out/prefill.png. Returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    full = [with_ratios(r) for r in rows]
    (out / "results.json").write_text(json.dumps(dict(meta, rows=full), indent=1) + "\n")
    table = render_table(rows)
    (out / "table.md").write_text(table + "\n")
    meta["plot"] = write_plot(full, out / "prefill.png", meta["device"])
    return table


class PeerRunMismatch(ValueError):
    """A peers-only run that cannot be merged into this run's table (another build, GPU or day)."""


def merge_peer_runs(rows: list[dict], meta: dict, runs: list[dict], timed_here: set[str]) -> tuple[list, dict]:
    """`rows` with the peer fields (`fla_us`, `fla_err_o`, ...) of `runs`, the saved output of
    `bench_prefill.py --peers-only` commands (dicts with `meta` and `rows`), and `meta` with
    `peer_runs`: what each one timed, where and with which command, for the report.

    A peer whose first calls autotune for minutes (FLA) may so be timed by its own command of the same
    machine visit. Such a run must have timed the same jax_kda build (it compares the peer's outputs with
    that build's before timing), on the same GPU (its UUID) on the same day, and no peer may be both
    timed here and merged; otherwise PeerRunMismatch. A case this run lacks is left out; where two runs
    timed the same peer on a case, the later one in `runs` counts."""
    merged = [dict(r) for r in rows]
    by_case = {r["case"]: r for r in merged}
    records = []
    for run in runs:
        theirs = run["meta"]
        command = theirs.get("command", "?")
        for fact, mine, other in (("build", meta.get("commit"), theirs.get("commit")),
                                  ("GPU", (meta.get("gpu") or {}).get("uuid"), (theirs.get("gpu") or {}).get("uuid")),
                                  ("day", meta.get("date"), theirs.get("date"))):
            if mine != other:
                raise PeerRunMismatch(f"peers-only run `{command}`: another {fact} ({other}) than this run's ({mine})")
        peers = list(theirs.get("peers", []))
        both = sorted(set(peers) & set(timed_here))
        if both:
            raise PeerRunMismatch(f"peers-only run `{command}` timed {', '.join(both)}, which this run times too")
        cases = []
        for their_row in run["rows"]:
            row = by_case.get(their_row["case"])
            if row is None:
                continue
            for peer in peers:
                row.update({k: v for k, v in their_row.items() if k.startswith(peer + "_")})
            cases.append(their_row["case"])
        records.append(dict(command=command, date=theirs.get("date"), peers=peers, cases=cases))
    return merged, dict(meta, peer_runs=records)


def _unique(items: list) -> list:
    """items without repeats (an item equal to an earlier one), in their first order."""
    return [x for i, x in enumerate(items) if x not in items[:i]]


def merge_saved_peer_runs(rows: list[dict], meta: dict, runs: list[dict], command: str) -> tuple[list, dict]:
    """merge_peer_runs on a saved run (results.json's rows and facts), after the fact: `command` is the
    `--redraw --peer-results` command that merges them, named in the report beside the run's own. Peer
    runs merged before (at run time, or by an earlier merge) are kept; a case timed by both counts the
    newer. The peers' package versions the run lacks are added. Merging the same runs again (a
    visit's merge step repeated) changes nothing: a peer run or merge command already recorded is not
    recorded twice."""
    merged, merged_meta = merge_peer_runs(rows, meta, runs, set(meta.get("peers", [])))
    merged_meta["peer_runs"] = _unique(list(meta.get("peer_runs") or []) + merged_meta["peer_runs"])
    merged_meta["merge_commands"] = _unique(list(meta.get("merge_commands") or []) + [command])
    versions = dict(meta.get("versions", {}))
    for run in runs:
        versions.update({k: v for k, v in run["meta"].get("versions", {}).items() if k not in versions})
    merged_meta["versions"] = versions
    return merged, merged_meta


GENERATED = ("Generated by `benchmarks/bench_prefill.py --report` from one run of one build in one process: "
             "do not edit by hand, rerun the command below.")


def render_report(rows: list[dict], meta: dict, results_dir: str | None = None, notes: tuple[str, ...] = (),
                  provenance: str = GENERATED) -> str:
    """The markdown report of one run (e.g. benchmarks/BENCHMARK_H200.md). `results_dir`: the results
    folder as a path relative to the report (for its links); `notes`: paragraphs placed after the
    run's facts; `provenance`: the sentence under the title saying where the page comes from."""
    sms = f", {meta['sms']} SMs" if meta.get("sms") else ""
    cc = f", compute capability {meta['compute_capability']}" if meta.get("compute_capability") else ""
    versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items())
    gpu = meta.get("gpu")
    peer_runs = meta.get("peer_runs") or []
    copy_rate, copy_source = copy_bandwidth(meta)
    if peer_runs:
        merged = sorted({PEER_LABELS.get(p, p) for run in peer_runs for p in run["peers"]})
        provenance += (f" The {' and '.join(merged)} column comes from a command of its own in the same machine "
                       "visit, with the same build (named below).")
    lines = [
        f"# jax_kda prefill on the {meta['device']}",
        "",
        provenance,
        "",
        f"- Date: {meta['date']}",
        f"- jax_kda build: commit `{meta['commit']}`",
        f"- {'GPU' if meta.get('platform', 'gpu') == 'gpu' else 'Device'}: {meta['device']}{sms}{cc}",
        *([f"- GPU settings: power limit {_fmt(gpu['power_limit_w'], '.0f', ' W')}, highest SM clock "
           f"{_fmt(gpu['max_sm_mhz'], '.0f', ' MHz')}, driver {gpu['driver']}"] if gpu else []),
        f"- Software: {versions}",
        f"- Copy bandwidth (the HBM floor's and the kernels' rates' yardstick): {copy_rate / 1e12:.2f} TB/s, "
        f"{copy_source}",
        f"- Command: `{meta['command']}`",
    ]
    for run in peer_runs:
        labels = " and ".join(PEER_LABELS.get(p, p) for p in run["peers"])
        lines.append(f"- {labels}: timed by its own command on the same GPU and build, the same visit "
                     f"({len(run['cases'])} case{'s' if len(run['cases']) != 1 else ''}, each peer's outputs compared with jax_kda's first), merged "
                     f"with `--peer-results`: `{run['command']}`")
    def link(name):
        return name if results_dir in (None, "", ".") else f"{results_dir}/{name}"

    for command in meta.get("merge_commands", []):
        lines.append(f"- Merged into this run's rows after it (nothing timed): `{command}`")
    if meta.get("drawn_by") and meta["drawn_by"] not in meta.get("merge_commands", []):
        lines.append(f"- This report drawn from the saved rows (nothing timed): `{meta['drawn_by']}`")
    if results_dir is not None:
        lines.append(f"- Raw rows: `{link('results.json')}`; the table alone: `{link('table.md')}`")
    lines.append("")
    for note in notes:
        lines += [note, ""]
    wall = [r["case"] for r in rows
            if "wall" in (r.get("timing"), r.get("fla_timing"), r.get("flashkda_timing"))]
    timing = ("device time" if not wall else
              f"device time, except wall time where none could be taken ({', '.join(wall)}; see results.json)")
    lines += [
        "Cases: `jax_kda.testing.BENCHMARK_CASES` (D = K = V = 128, bf16 q / k / v / raw g / beta (fp32 g and "
        "beta in the `_f32gates` cases), lower-bound gate -5 with A_log, gate + beta sigmoid + q/k l2norm in the "
        f"kernel, fp32 initial and final state in the `[N, H, V, K]` layout). Times are µs per call, {timing}; "
        "a peer's is the least of its device time, its wall time and, where recorded (`*_busy_us` in "
        "results.json), its GPU busy time, its GPU activities' durations summed (`*_best_us`: the peers run "
        "as eager torch calls, and the profiler and their host widen the gaps between their kernels, which the "
        "busy time leaves out); "
        "\"vs X\" is X's time / jax_kda's; plan is the kernels' V split and segments per sequence (intracard "
        "context parallelism: where a sequence is cut into segments, its pieces run on more SMs than the peers, "
        "which run a sequence's head in one CTA, can use); per-kernel columns are jax_kda's kernels; — means "
        "not measured in this run (a peer's command lines above name the cases it ran).",
        "",
        render_table(rows),
        "",
    ]
    clocks = render_clocks(rows)
    if clocks:
        lines += [clocks, ""]
    if results_dir is not None and meta.get("plot", True):
        lines += [f"![time per case, log scale, with the HBM floor]({link('prefill.png')})", ""]
    device = meta.get("device")
    goals = render_goals(rows, device)
    if goals:
        scope = ("" if device == REFERENCE_GPU else
                 f" (the {GOAL_H96_FIXED8K_US:.0f} µs bound on h96_fixed8k is the {REFERENCE_GPU}'s, not applied here)")
        lines += ["## Goals", "", f"The project's performance targets on this GPU{scope}, checked against this run:",
                  "", goals, ""]
        goal_bytes = render_goal_bytes(rows, copy_rate, device)
        if goal_bytes:
            lines += [f"What the goals leave for bytes: both kernels' fewest bytes per call (as in \"Bytes moved per "
                      f"token-head\" below) at the {copy_rate / 1e12:.2f} TB/s copy rate, the least time any call "
                      "moving them can take, against the goal's time; over 100 % of the copy rate, the goal allows fewer bytes than the "
                      "kernels move, and no schedule or faster arithmetic meets it: the workspace hand-off must shrink "
                      "first, by the share in the last column.", "", goal_bytes, ""]
    per_chunk = render_gpu_time_per_chunk(rows, meta.get("sms"), device)
    if per_chunk:
        lines += ["## GPU time per chunk", "",
                  "SM-µs per chunk-head: each kernel's time x the GPU's SMs / the call's chunk-heads (its sequences' "
                  "16-token chunks, a partial one counted, x value heads), what one chunk of one head costs the whole "
                  "GPU. The goal's budget is the same for the longest call that meets the case's goals (half of "
                  f"FlashKDA's time; on the {REFERENCE_GPU}, {GOAL_H96_FIXED8K_US:.0f} µs at h96_fixed8k): prepare, the recurrence and the rest must fit in it "
                  "together, and where prepare's share is large no recurrence alone can close the gap.", "",
                  per_chunk, ""]
    lines += ["## Bytes moved per token-head", "", render_bytes_per_token_head(), ""]
    bandwidth = render_kernel_bandwidth(rows, copy_rate)
    if bandwidth:
        lines += ["Per call (unsegmented cases): the fewest bytes each kernel moves, the inputs and the workspace "
                  "for prepare, the workspace once, v, o and the fp32 states for the recurrence, and the rate its "
                  f"measured time gives them, against the {copy_rate / 1e12:.2f} TB/s of a device-to-device "
                  f"copy ({copy_source}). A kernel near that rate can only go faster by moving fewer bytes; where two CTAs of the "
                  "recurrence share an SM, each V slice's CTA reading the workspace at its own pace, part of it "
                  "comes from HBM twice (not counted here).", "", bandwidth, ""]
    agreement = render_agreement(rows)
    if agreement:
        lines += ["## Agreement (checked before timing)", "",
                  "err_ratio (RMS of the difference / RMS of jax_kda's) of each peer's o and final state against "
                  "jax_kda's, on the same inputs:", "", agreement, ""]
    lines += [
        "## Method",
        "",
        meta["method"],
        "",
        "Peers: FLA is `fla.ops.kda.chunk_kda` (`pip install fla-core==0.6.0`, Triton; `FLA_FLASH_KDA=0` so it "
        "does not hand off to another library), called with the same flags (gate, beta sigmoid and l2norm in "
        "kernel, `safe_gate`, `lower_bound`, `state_v_first`). FlashKDA is `flash_kda.fwd` from MoonshotAI's "
        "FlashKDA repository (https://github.com/MoonshotAI/FlashKDA), built from source (CUTLASS; bf16 state "
        "inside, fp32 states in and out), which always applies the lower-bound gate, beta sigmoid and l2norm.",
        "",
        "## Reproduce",
        "",
        "On the GPU machine, with the jax_kda wheel of the commit above installed and FLA and FlashKDA "
        f"importable (the script uses each peer it can import), the build's commit in `{COMMIT_ENV}` or "
        "`--commit`:",
        "",
        "```bash",
        *[run["command"] for run in peer_runs],
        meta["command"],
        *meta.get("merge_commands", []),
        *([meta["drawn_by"]] if meta.get("drawn_by") and meta["drawn_by"] not in meta.get("merge_commands", [])
          else []),
        "```",
        "",
    ]
    return "\n".join(lines)
