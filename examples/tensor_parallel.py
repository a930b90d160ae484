"""A KDA attention layer run tensor-parallel over heads, two ways: jax.jit with NamedSharding'd
parameters, and jax.shard_map. Checks both against the same layer on one device and prints the
time per call.

    python examples/tensor_parallel.py                       # every GPU (or CPU device) of the machine
    python examples/tensor_parallel.py --cpu-devices 8       # 8 fake CPU devices, anywhere

The layer is the KDA block of a Kimi-Linear-style model: q, k, v, gate and beta projections,
`jax_kda.prefill` over packed prompts, and the output projection. Tensor parallelism splits the heads:
the q/k/v/gate/beta projection columns, A_log and dt_bias, and the rows of the output projection
go to the devices by head, so each device runs the prefill for its own heads (no collective inside
it) and one all-reduce sums the output projection's partial products, as in any tensor-parallel
attention block. The same functions are what a Flax module's `__call__` would hold.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cpu-devices", type=int, default=0, help="run on this many fake CPU devices")
parser.add_argument("--tokens", type=int, default=2048)
parser.add_argument("--heads", type=int, default=32, help="KDA heads (a multiple of the device count)")
parser.add_argument("--d-model", type=int, default=1024)
args = parser.parse_args()
if args.cpu_devices:  # before jax starts
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.cpu_devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_kda  # noqa: E402
from jax_kda import gold  # noqa: E402

HEAD_DIM = 128


def init_params(key, d_model: int, heads: int) -> dict:
    """The layer's weights (bf16 projections; fp32 gate parameters)."""
    keys = jax.random.split(key, 8)
    dense = lambda k, shape: (jax.random.normal(k, shape) / np.sqrt(shape[0])).astype(jnp.bfloat16)  # noqa: E731
    hd = heads * HEAD_DIM
    return dict(
        w_q=dense(keys[0], (d_model, hd)), w_k=dense(keys[1], (d_model, hd)), w_v=dense(keys[2], (d_model, hd)),
        w_g=dense(keys[3], (d_model, hd)), w_beta=dense(keys[4], (d_model, heads)),
        A_log=jax.random.uniform(keys[5], (heads,), minval=-1.0, maxval=1.0),
        dt_bias=0.5 * jax.random.normal(keys[6], (heads, HEAD_DIM)),
        w_o=dense(keys[7], (hd, d_model)),
    )


def kda_heads(params: dict, x, cu_seqlens):
    """The layer up to the output projection, for the heads `params` holds: [1, T, heads * 128]."""
    t = x.shape[1]
    heads = params["w_beta"].shape[1]
    split = lambda y: y.reshape(1, t, heads, HEAD_DIM)  # noqa: E731
    o, _ = jax_kda.prefill(
        split(x @ params["w_q"]), split(x @ params["w_k"]), split(x @ params["w_v"]), split(x @ params["w_g"]),
        x @ params["w_beta"], cu_seqlens=cu_seqlens, A_log=params["A_log"], dt_bias=params["dt_bias"],
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True)
    return o.reshape(1, t, heads * HEAD_DIM)


def kda_layer(params: dict, x, cu_seqlens):
    """The whole layer: [1, T, d_model] -> [1, T, d_model]."""
    return kda_heads(params, x, cu_seqlens) @ params["w_o"]


# How tensor parallelism splits each weight: by head, over mesh axis "model".
PARAM_SPECS = dict(w_q=P(None, "model"), w_k=P(None, "model"), w_v=P(None, "model"), w_g=P(None, "model"),
                   w_beta=P(None, "model"), A_log=P("model"), dt_bias=P("model", None), w_o=P("model", None))


def tp_jit(mesh):
    """Tensor parallel by sharding annotations: XLA partitions the projections, jax_kda the prefill."""
    return jax.jit(kda_layer, in_shardings=({k: NamedSharding(mesh, s) for k, s in PARAM_SPECS.items()},
                                            NamedSharding(mesh, P()), NamedSharding(mesh, P())),
                   out_shardings=NamedSharding(mesh, P()))


def tp_shard_map(mesh):
    """Tensor parallel by hand: each device runs the layer on its heads, then one psum."""

    def local(params, x, cu_seqlens):
        return jax.lax.psum(kda_heads(params, x, cu_seqlens) @ params["w_o"], "model")

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(PARAM_SPECS, P(), P()), out_specs=P()))


def per_call_ms(fn, *a, reps: int = 5) -> float:
    jax.block_until_ready(fn(*a))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*a))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main():
    devices = jax.devices()
    n = len(devices)
    if args.heads % n:
        sys.exit(f"--heads {args.heads} must be a multiple of the {n} devices")
    mesh = jax.sharding.Mesh(np.array(devices), ("model",), axis_types=(AxisType.Auto,))
    key = jax.random.key(0)
    params = init_params(key, args.d_model, args.heads)
    x = jax.random.normal(jax.random.fold_in(key, 1), (1, args.tokens, args.d_model), jnp.bfloat16)
    lengths = np.array([args.tokens // 2, args.tokens // 4, args.tokens - args.tokens // 2 - args.tokens // 4])
    cu_seqlens = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)

    one_device = jax.jit(kda_layer)
    want = np.asarray(jnp.asarray(one_device(params, x, cu_seqlens), jnp.float32))
    S = jax.ShapeDtypeStruct
    local = args.heads // n
    shapes = [S((1, args.tokens, local, HEAD_DIM), jnp.bfloat16)] * 4 + [S((1, args.tokens, local), jnp.bfloat16)]
    print(f"jax {jax.__version__}, {n} x {devices[0].device_kind}; {args.heads} heads, {args.tokens} tokens in "
          f"{len(lengths)} prompts; each device's prefill: "
          + str(jax_kda.explain(*shapes, cu_seqlens=cu_seqlens, use_gate_in_kernel=True, A_log=S((local,), jnp.float32),
                                lower_bound=-5.0)).splitlines()[0])
    print(f"1 device: {per_call_ms(one_device, params, x, cu_seqlens):.2f} ms per call")
    for name, fn in (("jit + NamedSharding", tp_jit(mesh)), ("shard_map", tp_shard_map(mesh))):
        got = np.asarray(jnp.asarray(fn(params, x, cu_seqlens), jnp.float32))
        err = gold.err_ratio(got, want)
        print(f"{name} over {n} devices: {per_call_ms(fn, params, x, cu_seqlens):.2f} ms per call, "
              f"err_ratio vs 1 device {err:.1e}")
        if not err < 1e-2:  # bf16 projections summed in another order (the all-reduce): ~1e-3
            sys.exit(f"{name}: the tensor-parallel layer disagrees with the 1-device layer")


if __name__ == "__main__":
    main()
