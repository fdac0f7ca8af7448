"""K training steps as K separate compiled calls against one ``lax.scan`` over K batches.

Pure JAX (``jax.jit`` + optax), no paramstore: the question is XLA's, and the answer
decides the advice in docs/guides/performance.md. Two models, the same 42 steps of batch 32
(an epoch of scikit-learn's digits at that batch size):

* ``conv``: two 3x3 ``lax.conv_general_dilated`` layers (32, 64 filters) on 8x8x1 inputs
  and a dense head. On CPU the scanned program is many times slower: XLA's code for the
  convolutions inside a ``while`` loop body is far slower than in the standalone step.
* ``mlp``: two dense layers (64 -> 256 -> 256 -> 10). Here the scan saves the per-call
  dispatch.

Prints, for each model, the median time of an epoch both ways and the ratio
scan / separate; then, for the CNN, the same for the forward pass alone and for its gradient
alone (no optimizer), which shows where the time goes. ``--repeats N`` (default 5).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

STEPS, BATCH = 42, 32
DN = ("NHWC", "HWIO", "NHWC")


def conv_model(key: jax.Array) -> tuple[dict[str, jax.Array], Callable[..., jax.Array], tuple]:
    k1, k2, k3 = jax.random.split(key, 3)
    params = {
        "c1": jax.random.normal(k1, (3, 3, 1, 32)) * 0.1,
        "c2": jax.random.normal(k2, (3, 3, 32, 64)) * 0.05,
        "d": jax.random.normal(k3, (8 * 8 * 64, 10)) * 0.01,
    }

    def apply(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        y = jax.nn.relu(
            jax.lax.conv_general_dilated(x, p["c1"], (1, 1), "SAME", dimension_numbers=DN)
        )
        y = jax.nn.relu(
            jax.lax.conv_general_dilated(y, p["c2"], (1, 1), "SAME", dimension_numbers=DN)
        )
        return y.reshape(y.shape[0], -1) @ p["d"]

    return params, apply, (8, 8, 1)


def mlp_model(key: jax.Array) -> tuple[dict[str, jax.Array], Callable[..., jax.Array], tuple]:
    k1, k2, k3 = jax.random.split(key, 3)
    params = {
        "w1": jax.random.normal(k1, (64, 256)) * 0.1,
        "w2": jax.random.normal(k2, (256, 256)) * 0.05,
        "w3": jax.random.normal(k3, (256, 10)) * 0.05,
    }

    def apply(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        y = jax.nn.relu(x @ p["w1"])
        return jax.nn.relu(y @ p["w2"]) @ p["w3"]

    return params, apply, (64,)


def measure(make: Callable[..., Any], repeats: int) -> tuple[float, float]:
    key = jax.random.key(0)
    params, apply, shape = make(key)
    tx = optax.adam(1e-3)

    def step(carry: Any, batch: tuple[jax.Array, jax.Array]) -> tuple[Any, jax.Array]:
        p, s = carry
        x, y = batch

        def loss_fn(p: Any) -> jax.Array:
            logits = apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, g = jax.value_and_grad(loss_fn)(p)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), loss

    xs = jax.random.normal(key, (STEPS, BATCH, *shape))
    ys = jax.random.randint(key, (STEPS, BATCH), 0, 10)
    one = jax.jit(step)
    fused = jax.jit(lambda c, xs, ys: jax.lax.scan(step, c, (xs, ys)))
    start = (params, tx.init(params))
    jax.block_until_ready(one(start, (xs[0], ys[0])))  # compile both first
    jax.block_until_ready(fused(start, xs, ys))
    separate, scanned = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        c = start
        for i in range(STEPS):
            c, _ = one(c, (xs[i], ys[i]))
        jax.block_until_ready(c)
        separate.append(time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(fused(start, xs, ys))
        scanned.append(time.perf_counter() - t)
    return statistics.median(separate), statistics.median(scanned)


def measure_part(make: Callable[..., Any], repeats: int, part: str) -> tuple[float, float]:
    """The same comparison for the forward pass alone or its gradient alone (no optimizer):
    which part of the step makes the scanned program slow."""
    key = jax.random.key(0)
    params, apply, shape = make(key)

    def forward(p: Any, x: jax.Array) -> jax.Array:
        return apply(p, x).sum()

    fn = forward if part == "forward" else jax.grad(forward)
    xs = jax.random.normal(key, (STEPS, BATCH, *shape))

    def body(c: Any, x: jax.Array) -> tuple[Any, None]:
        return jax.tree.map(jnp.add, c, fn(params, x)), None

    zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, params, xs[0]))
    one = jax.jit(fn)
    fused = jax.jit(lambda xs: jax.lax.scan(body, zero, xs)[0])
    jax.block_until_ready(one(params, xs[0]))
    jax.block_until_ready(fused(xs))
    separate, scanned = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready([one(params, xs[i]) for i in range(STEPS)])
        separate.append(time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(fused(xs))
        scanned.append(time.perf_counter() - t)
    return statistics.median(separate), statistics.median(scanned)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {STEPS} steps of batch {BATCH}")
    print("| model | 42 separate steps (s) | one lax.scan (s) | scan / separate |")
    print("|---|---:|---:|---:|")
    for name, make in (("conv", conv_model), ("mlp", mlp_model)):
        a, b = measure(make, args.repeats)
        print(f"| {name}: training step | {a:.3f} | {b:.3f} | {b / a:.2f}x |")
    for part in ("forward", "gradient"):
        a, b = measure_part(conv_model, args.repeats, part)
        print(f"| conv: {part} only | {a:.3f} | {b:.3f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
