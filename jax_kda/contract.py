"""The kernel contract: every fact the Python package, the C++ FFI handler and the CuTe DSL kernels
must agree on, defined once.

Who reads it:
  * the Python package (`planner`, `dispatch`, `kernel`) imports it as `jax_kda.contract`;
  * the CuTe DSL kernels import it as `kda_contract`: `build/aot_compile.py` loads this file by
    path under that name (the build environment has no jax, so the package is not imported);
  * the C++ side includes `kda_contract.h`, which `build/aot_compile.py --header` renders from
    this file into the build tree (`render_header`), so C++ cannot disagree and still compile.

Standard library only, for the same reason.
"""

from __future__ import annotations

import dataclasses
import enum

# --- Shapes the kernels are compiled for --------------------------------------------------------------

HEAD_DIM = 128  # K == V: the only head size the kernels serve
CHUNK = 16  # tokens per chunk; the workspace is sized in chunk slots of this many tokens
V_PER_CTA = 64  # state columns (of V) one recurrence CTA owns
V_SPLIT = HEAD_DIM // V_PER_CTA  # recurrence CTAs per (sequence, value head)
STATE_BYTES = HEAD_DIM * HEAD_DIM * 4  # one fp32 state [128, 128]
DTYPE = "bfloat16"  # q, k, v and o
# g and beta, each in either: every (g, beta) pair is its own compiled variant (GATE_VARIANTS), so an
# fp32 gate (what a separately computed pre-activated gate usually is) is read as it is.
GATE_DTYPES = ("bfloat16", "float32")
STATE_DTYPE = "float32"  # initial and final state

# --- Limits --------------------------------------------------------------------------------------------

# The recurrence's grid is [V slices, HV, sequences x segments]: CUDA allows 65535 blocks along y, z.
MAX_GRID_YZ = 65535
# The kernels index each workspace region with 32-bit element offsets: rows * 2048 < 2^31, where a
# row is one (chunk slot, value head) pair.
MAX_WORKSPACE_ROWS = 1 << 20
# Segments per sequence in intracard context parallelism (the planner's choices stop here).
MAX_SEGMENTS = 64

# --- Occupancy the kernels are built around -------------------------------------------------------------

# prepare_chunks runs a persistent grid of PREPARE_CTAS_PER_SM CTAs per SM; the recurrence's CTAs
# are sized so that RECURRENCE_CTAS_PER_SM share an SM. The build's register counts must allow
# both (tests/test_native.py reads them out of the built extension); the planner's wave model
# assumes the recurrence's.
PREPARE_THREADS = 128
# By the dtype of g, whose tiles fill most of prepare's input stages: five CTAs of bf16 g fit an
# SM's shared memory (and 96 registers a thread its register file), four of fp32 g.
PREPARE_CTAS_PER_SM = {"bfloat16": 5, "float32": 4}
RECURRENCE_THREADS = 160  # 4 MMA warps + 1 TMA producer warp
RECURRENCE_CTAS_PER_SM = 2


# --- The workspace: prepare -> recurrence hand-off ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Region:
    """One region of the workspace: per row (chunk slot x value head), a [rows, cols] tile."""

    name: str
    dtype: str  # "bfloat16" | "float32"
    rows: int
    cols: int

    @property
    def bytes_per_row(self) -> int:
        return self.rows * self.cols * (2 if self.dtype == "bfloat16" else 4)


# In this order, each region for all R rows before the next (byte offset = R * the bytes per row of
# the regions before it). W = (I + L)^-1 diag(beta) = w_hi + w_lo; v is not copied (the recurrence
# reads it from the input).
WORKSPACE_REGIONS = (
    Region("neg_kw", "bfloat16", CHUNK, HEAD_DIM),  # -W (k 2^G)
    Region("qd", "bfloat16", CHUNK, HEAD_DIM),  # scale q 2^G
    Region("kr", "bfloat16", CHUNK, HEAD_DIM),  # k 2^(G_last - G)
    Region("mqk", "bfloat16", CHUNK, CHUNK),  # scale q_i k_j 2^(G_i - G_j), j <= i
    Region("w_hi", "bfloat16", CHUNK, CHUNK),
    Region("w_lo", "bfloat16", CHUNK, CHUNK),
    Region("decay", "float32", 1, HEAD_DIM),  # 2^G_last
)
WORKSPACE_BYTES_PER_ROW = sum(r.bytes_per_row for r in WORKSPACE_REGIONS)
# A segmented call's workspace also holds, after the regions, three fp32 states per (segment, value
# head): B (its zero-start state) and M (its transition) for every segment, then its start state.
SEGMENT_STATES = 3
# Last in every workspace: the recurrence's unit table, one entry (int32 unit, bos, eos, 0) per unit,
# longest unit first (csrc/kernels/common/unit_order.py). Used by calls with Flag.ORDER_UNITS of at
# most UNIT_ORDER_MAX_UNITS units: the kernel that ranks them holds every unit's chunk count in
# shared memory (4 KB); larger batches run in index order.
UNIT_TABLE_ENTRY_BYTES = 16
UNIT_ORDER_MAX_UNITS = 1024


def region_offsets_per_row() -> dict[str, int]:
    """{region name: its byte offset in the workspace, divided by the row count R}."""
    offsets, at = {}, 0
    for region in WORKSPACE_REGIONS:
        offsets[region.name] = at
        at += region.bytes_per_row
    return offsets


def workspace_rows(total_tokens: int, num_sequences: int, num_segments: int, num_v_heads: int) -> int:
    """Chunk slots x value heads. Unit u (a sequence, or a segment of one) owns the slots
    bos_u // 16 + u + c for its chunks c: (B*T) // 16 + units slots cover any packing, tails included."""
    return (total_tokens // CHUNK + num_sequences * num_segments) * num_v_heads


def workspace_bytes(total_tokens: int, num_sequences: int, num_segments: int, num_v_heads: int) -> int:
    """The workspace a call needs (num_segments = 1: unsegmented): the regions, the segment states
    of a segmented call, then the unit table."""
    units = num_sequences * num_segments
    size = workspace_rows(total_tokens, num_sequences, num_segments, num_v_heads) * WORKSPACE_BYTES_PER_ROW
    if num_segments > 1:
        size += SEGMENT_STATES * units * num_v_heads * STATE_BYTES
    return size + units * UNIT_TABLE_ENTRY_BYTES


# --- Runtime flags and modes ----------------------------------------------------------------------------


class Flag(enum.IntFlag):
    """Bits of the kernels' runtime `flags` argument."""

    QK_L2NORM = 1 << 0
    BETA_SIGMOID = 1 << 1
    VARLEN = 1 << 2
    HAS_INITIAL_STATE = 1 << 3
    OUTPUT_FINAL_STATE = 1 << 4
    STATE_V_FIRST = 1 << 5
    # With VARLEN: run the units longest first through the unit table (`UNIT_ORDER_MAX_UNITS`). Set
    # when the caller's input is packed; a segmented call of dense input leaves it clear: its
    # segments have one length (each sequence's last may be shorter), which no order helps.
    ORDER_UNITS = 1 << 6


GATE_MODE_SHIFT = 8  # flags bits 8..9 hold the GateMode
GATE_MODE_MASK = 3


class GateMode(enum.IntEnum):
    """How the log-decay is obtained from `g`."""

    PREACTIVATED = 0  # g is already the log-decay (<= 0)
    SOFTPLUS = 1  # -exp(A_log[h]) * softplus(g + dt_bias[h])                 (Kimi-Linear-48B)
    LOWER_BOUND_A_LOG = 2  # lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))  (Kimi K3)
    LOWER_BOUND = 3  # lower_bound * sigmoid(g + dt_bias[h])                       (FLA >= 0.6)


# Gate modes whose activation reads A_log, and those that read dt_bias.
GATE_MODES_WITH_A_LOG = (GateMode.SOFTPLUS, GateMode.LOWER_BOUND_A_LOG)
GATE_MODES_WITH_DT_BIAS = (GateMode.SOFTPLUS, GateMode.LOWER_BOUND_A_LOG, GateMode.LOWER_BOUND)


class Phase(enum.IntEnum):
    """What one kernel call does. A segmented prefill (intracard context parallelism) is two calls."""

    WHOLE = 0  # prepare, then the recurrence from initial_state: o and the final state
    SUMMARY = 1  # prepare, every segment's B and M, then every segment's start state (workspace only)
    APPLY = 2  # the recurrence alone, from the start states in the SUMMARY call's workspace


# --- Kernel builds and how a call picks one ---------------------------------------------------------------


class Recurrence(enum.IntEnum):
    """The MMA instructions of the serial recurrence kernel (prepare and combine are shared)."""

    WGMMA = 0  # warpgroup MMAs (wgmma): sm_90a only
    MMA_SYNC = 1  # warp-level mma.sync: any architecture from sm_80


@dataclasses.dataclass(frozen=True)
class Arch:
    """A GPU architecture the kernels are compiled for, and the compute capabilities it runs on."""

    name: str  # the compiler's target, e.g. "sm_90a"
    compute_capabilities: tuple[tuple[int, int], ...]


SM90A = Arch("sm_90a", ((9, 0),))
# Family cubins: sm_100f runs on every SM100-family device, 10.0 (B200) and 10.3 (B300); an sm_100a
# cubin would run on 10.0 only. sm_110f serves 11.0 (Thor). The Blackwell kernels use no tcgen05, only
# mma.sync, TMA and mbarriers, so the family targets lose nothing. Not built: sm_120f (12.x, RTX
# Blackwell): it compiles, but those SMs have 100 KB of shared memory and prepare compiles to 152
# registers there, so neither prepare's 4-5 CTAs per SM nor the recurrence's 2 fit, which is what the
# kernels are built around; the XLA path serves them.
SM100F = Arch("sm_100f", ((10, 0), (10, 3)))
SM110F = Arch("sm_110f", ((11, 0),))
ARCHS = (SM90A, SM100F, SM110F)


@dataclasses.dataclass(frozen=True)
class KernelObject:
    """One prefill kernel object: `source` (a module under csrc/kernels/) compiled for `arch`, once per
    gate variant (KERNEL_EXPORTS)."""

    name: str
    source: str
    recurrence: Recurrence
    arch: Arch


KERNEL_OBJECTS = (
    KernelObject("prefill_wgmma_sm_90a", "sm90.prefill", Recurrence.WGMMA, SM90A),
    KernelObject("prefill_mma_sync_sm_100f", "sm100.prefill", Recurrence.MMA_SYNC, SM100F),
    KernelObject("prefill_mma_sync_sm_110f", "sm100.prefill", Recurrence.MMA_SYNC, SM110F),
    # The Blackwell kernels built for Hopper, so that a Hopper GPU can test them (not a user backend).
    KernelObject("prefill_mma_sync_sm_90a", "sm100.prefill", Recurrence.MMA_SYNC, SM90A),
)


@dataclasses.dataclass(frozen=True)
class GateDtypes:
    """The dtypes of g and beta one compiled variant of a kernel object reads."""

    g: str
    beta: str

    @property
    def suffix(self) -> str:
        short = {"bfloat16": "bf16", "float32": "f32"}
        return f"g_{short[self.g]}_beta_{short[self.beta]}"


# Index = GATE_DTYPES.index(g) * len(GATE_DTYPES) + GATE_DTYPES.index(beta); the FFI handler picks the
# variant from the operands' dtypes.
GATE_VARIANTS = tuple(GateDtypes(g, beta) for g in GATE_DTYPES for beta in GATE_DTYPES)


def gate_variant(g_dtype: str, beta_dtype: str) -> int:
    """The index in GATE_VARIANTS of the variant reading g and beta in these dtypes."""
    return GATE_VARIANTS.index(GateDtypes(g_dtype, beta_dtype))


@dataclasses.dataclass(frozen=True)
class KernelExport:
    """One compiled and exported module: a kernel object's variant for one pair of gate dtypes."""

    object: KernelObject
    gates: GateDtypes

    @property
    def name(self) -> str:  # the export's stem; its C symbols carry the prefix jax_kda_<name>
        return f"{self.object.name}_{self.gates.suffix}"


# Object-major, variant-minor: export index = object index * len(GATE_VARIANTS) + variant.
KERNEL_EXPORTS = tuple(KernelExport(obj, gates) for obj in KERNEL_OBJECTS for gates in GATE_VARIANTS)


class Kernels(enum.IntEnum):
    """Which prefill object a call asks for: the custom call's `kernels` attribute. The FFI handler
    resolves it against the device the call runs on."""

    FOR_DEVICE = 0  # backend="auto": the default object for the device's architecture
    SM90 = 1  # backend="sm90": wgmma on sm_90a; a device of another architecture is an error
    SM100 = 2  # backend="sm100": mma.sync on the Blackwell families (10.0, 10.3, 11.0); likewise
    MMA_SYNC_ON_SM90 = 3  # testing: the Blackwell kernels built for sm_90a, on a Hopper GPU


# What each request resolves to: {Kernels: {arch name: object name}}.
_BLACKWELL = {"sm_100f": "prefill_mma_sync_sm_100f", "sm_110f": "prefill_mma_sync_sm_110f"}
KERNEL_CHOICES = {
    Kernels.FOR_DEVICE: {"sm_90a": "prefill_wgmma_sm_90a", **_BLACKWELL},
    Kernels.SM90: {"sm_90a": "prefill_wgmma_sm_90a"},
    Kernels.SM100: dict(_BLACKWELL),
    Kernels.MMA_SYNC_ON_SM90: {"sm_90a": "prefill_mma_sync_sm_90a"},
}
# The user-facing kernel backends.
BACKEND_KERNELS = {"sm90": Kernels.SM90, "sm100": Kernels.SM100}

FFI_TARGET = "jax_kda_prefill"  # the one custom call target of the prefill

# The target's static attributes, (name, type: "i32" or "f32"), in the order the FFI handler's
# PrefillAttrs holds them (kda_contract.h renders this list for its fields and its decoding by name).
# jax_kda/kernel.py emits exactly these; the handler checks their values (PrefillAttrsError).
CALL_ATTRIBUTES = (
    ("gate_mode", "i32"),           # GateMode
    ("lower_bound", "f32"),         # the lower-bound gates' bound (ln units)
    ("scale", "f32"),               # the query scale
    ("use_qk_l2norm", "i32"),       # 0 / 1, like the other flags
    ("use_beta_sigmoid", "i32"),
    ("state_v_first", "i32"),
    ("has_initial_state", "i32"),
    ("output_final_state", "i32"),
    ("varlen", "i32"),              # the kernels see a packed batch (cu_seqlens)
    ("order_units", "i32"),         # run the packed units longest first (Flag.ORDER_UNITS); only with varlen
    ("chunk_size", "i32"),          # the plan's
    ("v_split", "i32"),
    ("num_sequences", "i32"),
    ("num_segments", "i32"),
    ("phase", "i32"),               # Phase
    ("kernels", "i32"),             # Kernels
)
_CXX_TYPES = {"i32": "int32_t", "f32": "float"}


def compute_capabilities(kernels: Kernels) -> tuple[str, ...]:
    """The compute capabilities (e.g. "9.0") a request can run on."""
    archs = {a.name: a for a in ARCHS}
    return tuple(f"{major}.{minor}" for arch in KERNEL_CHOICES[kernels] for major, minor in archs[arch].compute_capabilities)


# --- The C++ view ---------------------------------------------------------------------------------------------


def render_header() -> str:
    """`kda_contract.h`: this module's facts as C++ constants, for csrc/."""
    lines = [
        "// Generated by build/aot_compile.py --header from jax_kda/contract.py. Do not edit.",
        "#ifndef JAX_KDA_KDA_CONTRACT_H_",
        "#define JAX_KDA_KDA_CONTRACT_H_",
        "",
        "#include <cstdint>",
        "",
        "namespace jax_kda::contract {",
        "",
    ]
    for name, value in (("kHeadDim", HEAD_DIM), ("kChunk", CHUNK), ("kVPerCta", V_PER_CTA), ("kVSplit", V_SPLIT),
                        ("kStateBytes", STATE_BYTES), ("kMaxGridYZ", MAX_GRID_YZ),
                        ("kMaxWorkspaceRows", MAX_WORKSPACE_ROWS), ("kMaxSegments", MAX_SEGMENTS),
                        ("kWorkspaceBytesPerRow", WORKSPACE_BYTES_PER_ROW), ("kSegmentStates", SEGMENT_STATES),
                        ("kUnitTableEntryBytes", UNIT_TABLE_ENTRY_BYTES),
                        ("kGateModeShift", GATE_MODE_SHIFT), ("kGateModeMask", GATE_MODE_MASK)):
        lines.append(f"inline constexpr int64_t {name} = {value};")
    lines.append(f'inline constexpr const char* kFfiTarget = "{FFI_TARGET}";')
    lines.append(f"inline constexpr int kNumKernels = {len(Kernels)};  // values of enum Kernels")

    def enum_class(name, members, base="int32_t"):
        lines.append("")
        lines.append(f"enum class {name} : {base} {{")
        lines.extend(f"  k{''.join(p.capitalize() for p in m.name.split('_'))} = {int(m.value)}," for m in members)
        lines.append("};")

    enum_class("Flag", Flag)
    enum_class("GateMode", GateMode)
    enum_class("Phase", Phase)
    enum_class("Recurrence", Recurrence)
    enum_class("Kernels", Kernels)
    lines.append("")
    lines.append("enum class GateDtype : int32_t {")
    lines.extend(f"  k{name.capitalize()} = {i}," for i, name in enumerate(GATE_DTYPES))
    lines.append("};")
    lines.append(f"inline constexpr int kNumGateVariants = {len(GATE_VARIANTS)};")
    lines.append("struct GateVariant { GateDtype g; GateDtype beta; };")
    lines.append("inline constexpr GateVariant kGateVariants[] = {  // index: the variant of an export")
    for v in GATE_VARIANTS:
        lines.append(f"  {{GateDtype::k{v.g.capitalize()}, GateDtype::k{v.beta.capitalize()}}},")
    lines.append("};")
    lines.append("")
    lines.append("inline constexpr GateMode kGateModesWithALog[] = {" + ", ".join(
        f"GateMode(int32_t{{{int(m)}}})" for m in GATE_MODES_WITH_A_LOG) + "};")
    lines.append("inline constexpr GateMode kGateModesWithDtBias[] = {" + ", ".join(
        f"GateMode(int32_t{{{int(m)}}})" for m in GATE_MODES_WITH_DT_BIAS) + "};")

    # Architectures, exported objects and what each request resolves to.
    lines.append("")
    lines.append("struct ArchInfo { const char* name; int major; int minor; };")
    lines.append("inline constexpr ArchInfo kArchs[] = {")
    for arch in ARCHS:
        for major, minor in arch.compute_capabilities:
            lines.append(f'  {{"{arch.name}", {major}, {minor}}},')
    lines.append("};")
    lines.append("struct KernelChoice { Kernels kernels; const char* arch; const char* object; };")
    lines.append("inline constexpr KernelChoice kKernelChoices[] = {")
    for kernels, by_arch in KERNEL_CHOICES.items():
        for arch, obj in by_arch.items():
            lines.append(f'  {{Kernels(int32_t{{{int(kernels)}}}), "{arch}", "{obj}"}},')
    lines.append("};")
    lines += ["", "}  // namespace jax_kda::contract", ""]
    # The custom call's attributes (CALL_ATTRIBUTES) as two X-macros calling X(C++ type, name) for each,
    # in order: one after another (the handler's struct fields), and separated by commas (its decoding).
    attrs = [f"X({_CXX_TYPES[kind]}, {name})" for name, kind in CALL_ATTRIBUTES]
    lines.append("// The custom call's static attributes, in order: X(C++ type, name) for each.")
    lines.append("#define JAX_KDA_PREFILL_ATTR_FIELDS(X) \\\n  " + " \\\n  ".join(attrs))
    lines.append("#define JAX_KDA_PREFILL_ATTR_LIST(X) \\\n  " + ", \\\n  ".join(attrs))
    lines += ["", "#endif  // JAX_KDA_KDA_CONTRACT_H_", ""]
    return "\n".join(lines)


def render_kernel_objects_header() -> str:
    """`kda_kernel_objects.h`: includes every export's header and lists the exports (KERNEL_EXPORTS
    order) as an X-macro, `JAX_KDA_FOR_EACH_KERNEL_OBJECT(X)` calling `X(export name, object name, arch
    name, gate variant index)` once per export."""
    lines = [
        "// Generated by build/aot_compile.py --header from jax_kda/contract.py. Do not edit.",
        "#ifndef JAX_KDA_KDA_KERNEL_OBJECTS_H_",
        "#define JAX_KDA_KDA_KERNEL_OBJECTS_H_",
        "",
    ]
    lines += [f'#include "{e.name}.h"' for e in KERNEL_EXPORTS]
    lines += ["", "#define JAX_KDA_FOR_EACH_KERNEL_OBJECT(X) \\"]
    lines += [f'  X({e.name}, "{e.object.name}", "{e.object.arch.name}", {GATE_VARIANTS.index(e.gates)}) \\'
              for e in KERNEL_EXPORTS]
    lines += ["", "#endif  // JAX_KDA_KDA_KERNEL_OBJECTS_H_", ""]
    return "\n".join(lines)
