"""KDA gate activation as a CuTe DSL kernel: raw gate ``g`` -> natural-log decay (SPEC.md §1).

Build-time only: ``build/aot_compile.py`` compiles :func:`gate_activation` for each target architecture and
exports it to a C header and object that the extension links. Nothing here is imported when jax_kda runs.

For token ``m``, value head ``h`` and key channel ``k`` (``x = g[m, h, k] + dt_bias[h, k]``)::

    GATE_SOFTPLUS            -exp(A_log[h]) * softplus(x)               Kimi-Linear (unbounded below)
    GATE_LOWER_BOUND_A_LOG   lower_bound * sigmoid(exp(A_log[h]) * x)   Kimi K3, FlashKDA
    GATE_LOWER_BOUND         lower_bound * sigmoid(x)                   FLA >= 0.6 (A_log is not read)

``softplus(x) = x if x > 20 else log1p(exp(x))``, the torch form FLA uses: exact in fp32 for large positive
``x`` (log1p(exp(x)) == x to fp32 precision there) and accurate for very negative ``x``, where ``log1p``
keeps exp(x) instead of rounding 1 + exp(x) to 1.

The tensors are viewed flat: ``g`` and ``out`` are ``[M * HV * K]`` and ``dt_bias`` is ``[HV * K]``, so
every thread moves one 16-byte vector of ``g`` whatever K is, and the (head, channel) of each element is
tracked by counters instead of a division per element. The flat length is 64-bit: M * HV * K passes 2^31
for realistic prefills (1M tokens x 32 heads x 128).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

# The gate modes: jax_kda.config.GateMode's values, also used by csrc/gate_activation.h.
GATE_SOFTPLUS = 1
GATE_LOWER_BOUND_A_LOG = 2
GATE_LOWER_BOUND = 3

# 8 bf16 = one 16-byte load of g; 8 fp32 = two 16-byte stores of the decay.
VALUES_PER_THREAD = 8
THREADS_PER_BLOCK = 256
ELEMENTS_PER_BLOCK = VALUES_PER_THREAD * THREADS_PER_BLOCK

SOFTPLUS_THRESHOLD = 20.0

# Base-pointer alignment the kernel assumes for g and out; the FFI handler checks it before launching.
VECTOR_ALIGN_BYTES = 16


def _softplus(x: cute.TensorSSA) -> cute.TensorSSA:
    return cute.where(x > SOFTPLUS_THRESHOLD, x, cute.math.log1p(cute.math.exp(x)))


def _sigmoid(x: cute.TensorSSA) -> cute.TensorSSA:
    # exp(-x) overflows to inf for x < -88 and the quotient goes to 0: the correct limit.
    return 1.0 / (1.0 + cute.math.exp(-x))


@cute.kernel
def gate_activation_kernel(
    g: cute.Tensor,
    a_log: cute.Tensor,
    dt_bias: cute.Tensor,
    out: cute.Tensor,
    head_dim: cutlass.Int32,
    gate_mode: cutlass.Int32,
    lower_bound: cutlass.Float32,
):
    thread, _, _ = cute.arch.thread_idx()
    block, _, _ = cute.arch.block_idx()
    num_elements = cute.size(g)
    row_length = cute.size(dt_bias)  # HV * K: one token's worth of gate values

    vector_index = cutlass.Int64(block) * THREADS_PER_BLOCK + cutlass.Int64(thread)
    first = vector_index * VALUES_PER_THREAD
    g_vector = cute.zipped_divide(g, (VALUES_PER_THREAD,))[(None, vector_index)]
    out_vector = cute.zipped_divide(out, (VALUES_PER_THREAD,))[(None, vector_index)]
    is_full_vector = first + VALUES_PER_THREAD <= num_elements

    # Registers: 4 x 8 fp32 per thread.
    raw = cute.make_rmem_tensor((VALUES_PER_THREAD,), cutlass.Float32)
    bias = cute.make_rmem_tensor((VALUES_PER_THREAD,), cutlass.Float32)
    rate = cute.make_rmem_tensor((VALUES_PER_THREAD,), cutlass.Float32)  # exp(A_log[h])
    decay = cute.make_rmem_tensor((VALUES_PER_THREAD,), cutlass.Float32)
    raw.fill(0.0)

    if is_full_vector:
        raw.store(g_vector.load().to(cutlass.Float32))
    else:
        # Only the last vector of the tensor can be partial; the lanes past the end stay 0 and are not stored.
        for i in cutlass.range_constexpr(VALUES_PER_THREAD):
            if first + i < num_elements:
                raw[i] = g_vector[i].to(cutlass.Float32)

    # Position of the first element inside its token row; later elements advance it by one, wrapping at
    # the end of a head (k) and of the row (head). Indices stay inside dt_bias and A_log even for lanes
    # past the end of g.
    column = cutlass.Int32(first % cutlass.Int64(row_length))
    head = column // head_dim
    channel = column - head * head_dim
    for i in cutlass.range_constexpr(VALUES_PER_THREAD):
        bias[i] = dt_bias[column]
        if gate_mode != GATE_LOWER_BOUND:
            rate[i] = cute.math.exp(a_log[head])
        column += 1
        channel += 1
        if channel == head_dim:
            channel = cutlass.Int32(0)
            head += 1
        if column == row_length:
            column = cutlass.Int32(0)
            head = cutlass.Int32(0)

    x = raw.load() + bias.load()
    if gate_mode == GATE_SOFTPLUS:
        decay.store(-rate.load() * _softplus(x))
    elif gate_mode == GATE_LOWER_BOUND_A_LOG:
        decay.store(lower_bound * _sigmoid(rate.load() * x))
    else:
        decay.store(lower_bound * _sigmoid(x))

    if is_full_vector:
        out_vector.store(decay.load())
    else:
        for i in cutlass.range_constexpr(VALUES_PER_THREAD):
            if first + i < num_elements:
                out_vector[i] = decay[i]


@cute.jit
def gate_activation(
    g: cute.Tensor,
    a_log: cute.Tensor,
    dt_bias: cute.Tensor,
    out: cute.Tensor,
    head_dim: cutlass.Int32,
    gate_mode: cutlass.Int32,
    lower_bound: cutlass.Float32,
    stream: cuda.CUstream,
):
    """Host entry point. The caller must not launch with an empty ``g``: a grid of 0 blocks is invalid."""
    num_blocks = (cute.size(g) + ELEMENTS_PER_BLOCK - 1) // ELEMENTS_PER_BLOCK
    gate_activation_kernel(g, a_log, dt_bias, out, head_dim, gate_mode, lower_bound).launch(
        grid=(cutlass.Int32(num_blocks), 1, 1),
        block=(THREADS_PER_BLOCK, 1, 1),
        stream=stream,
    )


def compile_arguments() -> tuple:
    """Placeholder arguments for ``cute.compile``: sizes are symbolic, so one object serves every shape."""
    num_elements = cute.sym_int64(symbol="M_HV_K")
    num_heads = cute.sym_int32(symbol="HV")
    row_length = cute.sym_int32(symbol="HV_K")
    return (
        make_fake_tensor(cutlass.BFloat16, (num_elements,), (1,), assumed_align=VECTOR_ALIGN_BYTES),
        make_fake_tensor(cutlass.Float32, (num_heads,), (1,), assumed_align=4),
        make_fake_tensor(cutlass.Float32, (row_length,), (1,), assumed_align=4),
        make_fake_tensor(cutlass.Float32, (num_elements,), (1,), assumed_align=VECTOR_ALIGN_BYTES),
        cutlass.Int32(0),
        cutlass.Int32(0),
        cutlass.Float32(0.0),
        cuda.CUstream(0),
    )
