"""Training recipes against hand-written JAX doing the same thing (issue 24).

Run: ``python benchmarks/recipes.py`` (``--quick`` for a smoke run).

The model is the transformer of ``benchmarks/depth.py`` (``--blocks`` pre-LN blocks,
d_model 64, 4 heads, MLP 256, batch 8 x 32 tokens) applied by one ``lax.scan``, then a
``Dense(64)`` head; loss ``mean(y**2)``, one Adam step per call. Rows, each against its
own hand-written anchor measured in the same run, the variants taking turns step by step:

* EMA: ``ps.function`` step + ``ema.apply(model)`` (``ps.ExponentialMovingAverage(0.999)``
  of every parameter) vs ``jax.jit`` step (params, Adam state and the averages donated) +
  a ``jax.tree.map`` EMA.
* frozen: every block frozen (``blocks.trainable = False``, the optimizer built over the
  whole model *before* the freeze), only the head trains, vs a ``jax.jit`` step
  differentiating only the head (the blocks' params a non-donated argument, Adam over the
  head only). Also counted in the compiled programs: Adam's per-parameter ``sqrt`` (its
  second-moment update), for the frozen step, the hand-written one and the unfrozen step:
  the frozen step does no slot work for frozen variables. A third row, ``ps.function``
  with no freeze and an optimizer over the head alone, is what freezing should cost
  nothing over.

Columns: first call (build + trace + compile + one step, s), median and minimum step (ms),
and the median of the per-step ratios to the anchor's adjacent step (robust to a shared
machine's load, which hits both steps of a pair alike).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from depth import LR, Block, D, block_fn, data, init_layer, step_times

import paramstore as ps

DECAY = 0.999
Step = Callable[[], jax.Array]


def _ps_model(n: int) -> tuple[Any, Any, jax.Array]:
    x = data()
    blocks = ps.nn.Repeat(Block, n)
    head = ps.nn.Dense(D, name="head")
    model = ps.nn.Sequential([blocks, head])
    model(x)
    return model, blocks, x


def ps_ema(n: int) -> Step:
    with ps.VariableStore():
        model, _, x = _ps_model(n)
        opt = ps.Optimizer(optax.adam(LR), model)
        ema = ps.ExponentialMovingAverage(DECAY)
        ema.apply(model)

        @ps.function
        def step() -> jax.Array:
            loss, grads = ps.value_and_grad(lambda: jnp.mean(model(x) ** 2), model)()
            opt.apply_gradients(grads)
            ema.apply(model)
            return loss

    return step


def ps_frozen(n: int, *, freeze: bool = True) -> tuple[Step, Callable[[], str]]:
    with ps.VariableStore():
        model, blocks, x = _ps_model(n)
        opt = ps.Optimizer(optax.adam(LR), model)  # built before the freeze
        if freeze:
            blocks.trainable = False

        @ps.function
        def step() -> jax.Array:
            loss, grads = ps.value_and_grad(lambda: jnp.mean(model(x) ** 2), model)()
            opt.apply_gradients(grads)
            return loss

    return step, lambda: step.lower().compile().as_text()


def ps_head_optimizer(n: int) -> Step:
    """No freeze: an optimizer over the head alone, the same work as the frozen step."""
    with ps.VariableStore():
        model, _, x = _ps_model(n)
        head = model.layers[1]
        opt = ps.Optimizer(optax.adam(LR), head)

        @ps.function
        def step() -> jax.Array:
            loss, grads = ps.value_and_grad(lambda: jnp.mean(model(x) ** 2), head)()
            opt.apply_gradients(grads)
            return loss

    return step


def _jax_params(n: int) -> tuple[Any, Any, jax.Array]:
    x = data()
    body = jax.jit(jax.vmap(init_layer))(jax.random.split(jax.random.key(0), n))
    k = jax.random.key(1)
    head = {"k": jax.random.uniform(k, (D, D), jnp.float32, -0.2, 0.2), "b": jnp.zeros(D)}
    return body, head, x


def _forward(body: Any, head: Any, x: jax.Array) -> jax.Array:
    y, _ = jax.lax.scan(lambda h, lp: (block_fn(lp, h), None), x, body)
    return jnp.mean((y @ head["k"] + head["b"]) ** 2)


def jax_ema(n: int) -> Step:
    body, head, x = _jax_params(n)
    params = {"body": body, "head": head}
    tx = optax.adam(LR)

    def _step(p: Any, s: Any, avg: Any) -> Any:
        loss, grads = jax.value_and_grad(lambda q: _forward(q["body"], q["head"], x))(p)
        updates, s = tx.update(grads, s, p)
        p = optax.apply_updates(p, updates)
        avg = jax.tree.map(lambda a, v: a - (a - v) * (1.0 - DECAY), avg, p)
        return p, s, avg, loss

    step_jit = jax.jit(_step, donate_argnums=(0, 1, 2))
    state = [params, tx.init(params), jax.tree.map(jnp.copy, params)]

    def step() -> jax.Array:
        state[0], state[1], state[2], loss = step_jit(*state)
        return loss

    return step


def jax_head_only(n: int) -> tuple[Step, Callable[[], str]]:
    body, head, x = _jax_params(n)
    tx = optax.adam(LR)

    def _step(h: Any, s: Any, b: Any) -> Any:
        loss, grads = jax.value_and_grad(lambda q: _forward(b, q, x))(h)
        updates, s = tx.update(grads, s, h)
        return optax.apply_updates(h, updates), s, loss

    step_jit = jax.jit(_step, donate_argnums=(0, 1))
    state = [head, tx.init(head)]

    def step() -> jax.Array:
        state[0], state[1], loss = step_jit(state[0], state[1], body)
        return loss

    return step, lambda: step_jit.lower(state[0], state[1], body).compile().as_text()


def sqrt_ops(hlo: str) -> int:
    """Adam's per-parameter second-moment sqrt in a compiled program."""
    return hlo.count(" sqrt(")


def first_call(make: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    built = make()
    step = built[0] if isinstance(built, tuple) else built
    jax.block_until_ready(step())
    return built, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="2 blocks, 3 steps")
    args = parser.parse_args()
    n = 2 if args.quick else args.blocks
    count = 3 if args.quick else args.steps
    print(
        f"# recipes.py {datetime.date.today()} {platform.machine()} "
        f"{jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}, "
        f"{n} blocks, {count} steps (median)"
    )
    groups = {
        "EMA of every parameter": {
            "jax.jit + jax.tree.map EMA [reference]": lambda: jax_ema(n),
            "ps.function + ps.ExponentialMovingAverage": lambda: ps_ema(n),
        },
        "all but the head frozen": {
            "jax.jit, grad of the head only [reference]": lambda: jax_head_only(n),
            "ps.function, blocks.trainable = False": lambda: ps_frozen(n),
            "ps.function, no freeze, optimizer over the head": lambda: ps_head_optimizer(n),
        },
    }
    built: dict[str, Any] = {}
    print(
        "| row | variant | first call s | step ms (median) | step ms (min) | / reference "
        "(median of paired ratios) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    ratios = []
    for group, variants in groups.items():
        steps: dict[str, Step] = {}
        firsts: dict[str, float] = {}
        for name, make in variants.items():
            built[name], firsts[name] = first_call(make)
            b = built[name]
            steps[name] = b[0] if isinstance(b, tuple) else b
        times = step_times(steps, count)
        ref_times = times[next(iter(variants))]
        for name, ts in times.items():
            # the median of per-step ratios to the reference's adjacent step (the variants
            # take turns, so a shared machine's load hits both sides of a pair alike)
            paired = statistics.median(t / r for t, r in zip(ts, ref_times))
            print(
                f"| {group} | {name} | {firsts[name]:.2f} | {statistics.median(ts):.2f} | "
                f"{min(ts):.2f} | {paired:.3f} |"
            )
        ours = times[list(variants)[1]]
        ratios.append((group, statistics.median(t / r for t, r in zip(ours, ref_times))))
    frozen_hlo = built["ps.function, blocks.trainable = False"][1]()
    hand_hlo = built["jax.jit, grad of the head only [reference]"][1]()
    _, unfrozen_hlo = ps_frozen(n, freeze=False)
    print()
    print("| compiled program | Adam sqrt ops |")
    print("|---|---:|")
    print(f"| ps.function, blocks frozen | {sqrt_ops(frozen_hlo)} |")
    print(f"| jax.jit, head only [reference] | {sqrt_ops(hand_hlo)} |")
    print(f"| ps.function, nothing frozen | {sqrt_ops(unfrozen_hlo())} |")
    print()
    for group, r in ratios:
        print(f"target: {group}, ps / reference = {r:.3f} (<= 1.05)")


if __name__ == "__main__":
    main()
