"""A Flax (linen) KDA layer trained with jax_kda.prefill and no backend argument.

    pip install flax          # not a jax_kda dependency: this example alone needs it
    python examples/flax_training_step.py [--steps 5] [--tokens 1024] [--heads 4]

The layer projects its input to bf16 q, k, v and fp32 gate and beta logits, runs the prefill with
the gate, beta sigmoid and l2norm in the kernel, and projects o back. A few SGD steps run under
`jax.jit(jax.value_and_grad(...))`. On a GPU with the kernels the forward is the kernel and the
gradients the XLA path's (docs/prefill.md, "Transformations"); on a CPU everything is the XLA path.
It prints which backend the prefill lowers to, the loss per step (the relative error against a teacher layer of
other weights; it must fall), and the first
step's gradients against the same layer run with backend="xla" (err_ratio per parameter).
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jax_kda
from jax_kda import contract, gold

D = contract.HEAD_DIM


class KDALayer(nn.Module):
    heads: int
    hidden: int
    backend: str | None = None  # None: prefill's default ("auto")

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        hd = self.heads * D

        def proj(name, width, dtype):
            return nn.Dense(width, use_bias=False, name=name)(x).astype(dtype)

        q, k, v = (proj(n, hd, jnp.bfloat16).reshape(b, t, self.heads, D) for n in ("q", "k", "v"))
        g = proj("g", hd, jnp.float32).reshape(b, t, self.heads, D)
        beta = proj("beta", self.heads, jnp.float32)
        a_log = self.param("A_log", nn.initializers.zeros, (self.heads,), jnp.float32)
        dt_bias = self.param("dt_bias", nn.initializers.zeros, (self.heads, D), jnp.float32)
        extra = {} if self.backend is None else dict(backend=self.backend)
        o, _ = jax_kda.prefill(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0,
                               use_beta_sigmoid_in_kernel=True, **extra)
        return nn.Dense(self.hidden, use_bias=False, name="out")(o.astype(jnp.float32).reshape(b, t, hd))


def train_step(model: nn.Module, lr: float):
    def loss(params, x, y):  # relative squared error
        return jnp.mean((model.apply(params, x) - y) ** 2) / jnp.mean(y**2)

    @jax.jit
    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return value, grads, jax.tree.map(lambda p, d: p - lr * d, params, grads)

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((2, args.tokens, args.hidden)), jnp.float32)
    model = KDALayer(args.heads, args.hidden)
    student_key, teacher_key = jax.random.split(jax.random.key(int(rng.integers(1 << 31))))
    params = model.init(student_key, x)
    # The target: the same layer with other weights (a teacher the student can learn to match).
    y = jax.jit(model.apply)(model.init(teacher_key, x), x)
    step = train_step(model, args.lr)
    lowered = step.lower(params, x, y).as_text()
    on_kernel = f"stablehlo.custom_call @{contract.FFI_TARGET}" in lowered
    print(f"device: {jax.devices()[0].device_kind}; the prefill lowers to "
          f"{'the kernels (custom call ' + contract.FFI_TARGET + ')' if on_kernel else 'the XLA path'}")

    first_grads = None
    losses = []
    p = params
    for i in range(args.steps):
        value, grads, p = step(p, x, y)
        first_grads = grads if first_grads is None else first_grads
        losses.append(float(value))
        print(f"step {i}: loss {losses[-1]:.4f}")
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"

    _, want, _ = train_step(KDALayer(args.heads, args.hidden, backend="xla"), args.lr)(params, x, y)
    worst = 0.0
    for (path, got), ref in zip(jax.tree_util.tree_flatten_with_path(first_grads)[0], jax.tree.leaves(want)):
        err = gold.err_ratio(np.asarray(got, np.float64), np.asarray(ref, np.float64))
        worst = max(worst, err)
        print(f"grad {jax.tree_util.keystr(path)}: err_ratio vs backend='xla' {err:.2e}")
    assert worst < 1e-2, f"gradients disagree with the XLA path's: {worst:.2e}"
    print("ok")


if __name__ == "__main__":
    main()
