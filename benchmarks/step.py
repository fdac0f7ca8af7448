"""One optax Adam training step, per step, side by side with the alternatives.

Run: ``python benchmarks/step.py`` (``--quick`` for a short run, ``--models dispatch``...).

Each variant trains the same MLP with ``optax.adam``; every step is timed two ways:
* blocking: wait for the loss after every step (latency of one step);
* async: dispatch all steps, wait once at the end (throughput when dispatch overlaps).
The variants are interleaved call by call (async: in blocks of 100 calls), alternating
their order between ``--repeats`` rounds of a pinned ``--steps`` steps each; each figure
is the median of the per-call samples, with its interquartile range; ratios are to the
reference (hand-written ``jax.jit`` over ``(params, opt_state)`` with donation) measured
in the same run, as the median of the ratios of each call to the reference's call next to
it (so load that changes during the run cancels out). ``first call`` is trace + compile + one step, against ``jax.jit``'s.

Variants needing packages that are not installed (flax, equinox, tensorflow) are skipped.
On the dispatch-bound model two more rows run FUSED (200) steps per call through a plain
``lax.scan`` over stacked batches (hand-written ``jax.jit``, and ``ps.function`` whose scan
body calls ``opt.apply_gradients``); their figures are per step, against the reference's
one-step-per-call time.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

import paramstore as ps

LR = 1e-3


@dataclass(frozen=True)
class Config:
    name: str
    layers: int
    width: int
    batch: int


MODELS = {
    "dispatch": Config("dispatch-bound (4 x 32, batch 8)", 4, 32, 8),
    "many": Config("many-variable (100 x 16, batch 8)", 100, 16, 8),
    "compute": Config("compute-bound (4 x 1024, batch 256)", 4, 1024, 256),
}


def init_params(cfg: Config) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    scale = 1.0 / np.sqrt(cfg.width)
    return [
        (
            (rng.standard_normal((cfg.width, cfg.width)) * scale).astype(np.float32),
            np.zeros(cfg.width, np.float32),
        )
        for _ in range(cfg.layers)
    ]


def data(cfg: Config) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((cfg.batch, cfg.width)).astype(np.float32)
    y = rng.standard_normal((cfg.batch, cfg.width)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def mlp(params, x):
    for i, (w, b) in enumerate(params):
        x = x @ w + b
        if i < len(params) - 1:
            x = jnp.tanh(x)
    return x


# A variant: build(cfg) -> step() that runs one step and returns the loss (a jax.Array).
Variant = Callable[[Config], Callable[[], jax.Array]]


def jax_reference(donate: bool) -> Variant:
    def build(cfg: Config) -> Callable[[], jax.Array]:
        tx = optax.adam(LR)
        params = [(jnp.asarray(w), jnp.asarray(b)) for w, b in init_params(cfg)]
        state = [params, tx.init(params)]
        x, y = data(cfg)

        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(lambda p: jnp.mean((mlp(p, x) - y) ** 2))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        jitted = jax.jit(step, donate_argnums=(0, 1) if donate else ())

        def run() -> jax.Array:
            state[0], state[1], loss = jitted(state[0], state[1], x, y)
            return loss

        return run

    return build


class MLP(ps.Module):
    def __init__(self, cfg: Config):
        self.layers = [
            (ps.Variable(w, name=f"w{i}"), ps.Variable(b, name=f"b{i}"))
            for i, (w, b) in enumerate(init_params(cfg))
        ]

    def __call__(self, x):
        return mlp(self.layers, x)


def paramstore_function(cfg: Config) -> Callable[[], jax.Array]:
    model = MLP(cfg)
    x, y = data(cfg)
    tx = optax.adam(LR)
    if hasattr(ps.Optimizer, "apply_gradients"):
        opt = ps.Optimizer(tx, model)

        @ps.function
        def step(x, y):
            loss, grads = ps.value_and_grad(lambda: jnp.mean((model(x) - y) ** 2), model)()
            opt.apply_gradients(grads)
            return loss

    else:  # manual optax update, until ps.Optimizer exists
        params = model.trainable_variables
        leaves, treedef = jax.tree_util.tree_flatten(tx.init(tuple(p.value() for p in params)))
        slots = [ps.Variable(leaf, trainable=False, name="adam") for leaf in leaves]

        @ps.function
        def step(x, y):
            loss, grads = ps.value_and_grad(lambda: jnp.mean((model(x) - y) ** 2), params)()
            opt_state = jax.tree_util.tree_unflatten(treedef, [s.value() for s in slots])
            updates, opt_state = tx.update(grads, opt_state, tuple(p.value() for p in params))
            for p, u in zip(params, updates):
                p.assign_add(u)
            for s, v in zip(slots, jax.tree_util.tree_leaves(opt_state)):
                s.assign(v)
            return loss

    return lambda: step(x, y)


def flax_nnx(cfg: Config, fast: bool = False) -> Callable[[], jax.Array]:
    """nnx.jit in its default graph mode, or (fast) nnx.jit_partial in tree mode, donated."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            self.layers = nnx.List(
                [
                    nnx.List([nnx.Param(jnp.asarray(w)), nnx.Param(jnp.asarray(b))])
                    for w, b in init_params(cfg)
                ]
            )

        def __call__(self, x):
            return mlp([(w[...], b[...]) for w, b in self.layers], x)

    model = Model()
    opt = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    x, y = data(cfg)

    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        return loss

    if fast:
        partial = nnx.jit_partial(step, model, opt, graph=False, donate_argnums=(0, 1))
        return lambda: partial(x, y)
    jitted = nnx.jit(step)
    return lambda: jitted(model, opt, x, y)


def equinox_filter_jit(cfg: Config) -> Callable[[], jax.Array]:
    import equinox as eqx

    class Model(eqx.Module):
        layers: list

        def __call__(self, x):
            return mlp(self.layers, x)

    model = Model([(jnp.asarray(w), jnp.asarray(b)) for w, b in init_params(cfg)])
    tx = optax.adam(LR)
    state = [model, tx.init(eqx.filter(model, eqx.is_array))]
    x, y = data(cfg)

    @eqx.filter_jit(donate="all")
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        updates, opt_state = tx.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    def run() -> jax.Array:
        state[0], state[1], loss = step(state[0], state[1], x, y)
        return loss

    return run


def tf_function(cfg: Config) -> Callable[[], object]:
    import tensorflow as tf

    params = [(tf.Variable(w), tf.Variable(b)) for w, b in init_params(cfg)]
    flat = [v for pair in params for v in pair]
    opt = tf.keras.optimizers.Adam(LR)
    xn, yn = (np.asarray(a) for a in data(cfg))
    x, y = tf.constant(xn), tf.constant(yn)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = x
            for i, (w, b) in enumerate(params):
                h = h @ w + b
                if i < len(params) - 1:
                    h = tf.tanh(h)
            loss = tf.reduce_mean((h - y) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, flat), flat))
        return loss

    return step


FUSED = 200  # steps per call of the fused variants (lax.scan over stacked batches)


def stacked(cfg: Config) -> tuple[jax.Array, jax.Array]:
    x, y = data(cfg)
    return jnp.broadcast_to(x, (FUSED, *x.shape)), jnp.broadcast_to(y, (FUSED, *y.shape))


def jax_fused(cfg: Config) -> Callable[[], jax.Array]:
    """Hand-written: FUSED Adam steps in one donated jax.jit call, a lax.scan over batches."""
    tx = optax.adam(LR)
    params = [(jnp.asarray(w), jnp.asarray(b)) for w, b in init_params(cfg)]
    state = [params, tx.init(params)]
    xs, ys = stacked(cfg)

    def steps(params, opt_state, xs, ys):
        def body(carry, batch):
            params, opt_state = carry
            x, y = batch
            loss, grads = jax.value_and_grad(lambda p: jnp.mean((mlp(p, x) - y) ** 2))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), (xs, ys))
        return params, opt_state, losses[-1]

    jitted = jax.jit(steps, donate_argnums=(0, 1))

    def run() -> jax.Array:
        state[0], state[1], loss = jitted(state[0], state[1], xs, ys)
        return loss

    run.steps_per_call = FUSED  # type: ignore[attr-defined]
    return run


def paramstore_fused(cfg: Config) -> Callable[[], jax.Array]:
    """FUSED steps in one ps.function call: a plain lax.scan whose body calls
    opt.apply_gradients, as eager code would loop."""
    model = MLP(cfg)
    opt = ps.Optimizer(optax.adam(LR), model)
    xs, ys = stacked(cfg)

    @ps.function
    def steps(xs, ys):
        def body(_, batch):
            x, y = batch
            loss, grads = ps.value_and_grad(lambda: jnp.mean((model(x) - y) ** 2), model)()
            opt.apply_gradients(grads)
            return None, loss

        return jax.lax.scan(body, None, (xs, ys))[1][-1]

    def run() -> jax.Array:
        return steps(xs, ys)

    run.steps_per_call = FUSED  # type: ignore[attr-defined]
    return run


VARIANTS: dict[str, Variant] = {
    "jax.jit (donated) [reference]": jax_reference(donate=True),
    "jax.jit (no donation)": jax_reference(donate=False),
    "ps.function": paramstore_function,
    "flax nnx.jit": flax_nnx,
    "flax nnx.jit_partial (tree, donated)": lambda cfg: flax_nnx(cfg, fast=True),
    "equinox filter_jit": equinox_filter_jit,
    "tf.function": tf_function,
    f"jax.jit, {FUSED} steps fused (lax.scan)": jax_fused,
    f"ps.function, {FUSED} steps fused (lax.scan)": paramstore_fused,
}
FUSED_ONLY_ON = ("dispatch",)  # per the issue: the dispatch-bound model


def _block(x: object) -> None:
    if hasattr(x, "block_until_ready"):
        x.block_until_ready()  # type: ignore[union-attr]
    elif hasattr(x, "numpy"):
        x.numpy()  # type: ignore[union-attr]


ASYNC_BLOCK = 100  # calls per async sample: dispatch overlaps within a block (20 left the
# drain at the end of each block, one blocking step, in every sample: run-to-run 1.12-1.34x)


def _iqr(xs: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(xs, n=4) if len(xs) > 1 else (xs[0],) * 3
    return q1, statistics.median(xs), q3


def time_steps(
    runs: dict[str, Callable[[], object]], steps: int, repeats: int
) -> dict[str, tuple[list[float], list[float]]]:
    """Seconds per step of each variant, every per-call sample, blocking and async.

    Robust to a noisy shared machine: the variants are interleaved call by call (blocking:
    each call waits for its loss; async: blocks of ``ASYNC_BLOCK`` calls), in alternating
    order, for a pinned number of steps, so a change in load hits every variant alike;
    medians and interquartile ranges of the per-call samples are reported, and ratios are
    medians of per-pair ratios (``paired_ratio``)."""
    blocking: dict[str, list[float]] = {name: [] for name in runs}
    asynchronous: dict[str, list[float]] = {name: [] for name in runs}
    per_call = {name: getattr(run, "steps_per_call", 1) for name, run in runs.items()}
    calls = {name: max(steps // n, 3) for name, n in per_call.items()}
    names = list(runs)
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        gc.collect()
        for i in range(max(calls.values())):
            for name in order:
                if i >= calls[name]:
                    continue
                run = runs[name]
                t0 = time.perf_counter()
                _block(run())
                blocking[name].append((time.perf_counter() - t0) / per_call[name])
        for i in range(max(max(c // ASYNC_BLOCK, 1) for c in calls.values())):
            for name in order:
                block = min(ASYNC_BLOCK, calls[name])
                if i >= max(calls[name] // ASYNC_BLOCK, 1):
                    continue
                run = runs[name]
                t0 = time.perf_counter()
                loss = None
                for _ in range(block):
                    loss = run()
                _block(loss)
                asynchronous[name].append((time.perf_counter() - t0) / (block * per_call[name]))
    return {name: (blocking[name], asynchronous[name]) for name in runs}


def paired_ratio(samples: list[float], ref: list[float]) -> float:
    """The median of the per-call ratios to the reference's call made just before or after
    (the same round and index): drift in the machine's load cancels in each pair, so two
    runs agree more closely than the ratio of two medians (issue 15: within 5%)."""
    if len(samples) != len(ref):  # fused variants make fewer calls: medians' ratio
        return statistics.median(samples) / statistics.median(ref)
    return statistics.median(a / b for a, b in zip(samples, ref))


def _spread(q: tuple[float, float, float]) -> str:
    return f"{q[0] * 1e6:.1f}-{q[2] * 1e6:.1f}"


def first_call(build: Variant, cfg: Config) -> float:
    jax.clear_caches()
    t0 = time.perf_counter()
    _block(build(cfg)())
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--variants", nargs="*", default=None, help="substrings to select")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="few steps, for a smoke test")
    parser.add_argument("--no-first-call", action="store_true", help="skip the first-call row")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 20, 3
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.repeats} repeats")
    for key in args.models:
        cfg = MODELS[key]
        steps = args.steps if key != "compute" else max(args.steps // 4, 10)
        print(f"\n## {cfg.name}: {steps} steps, Adam")
        print(
            f"{'variant':38} {'blocking us':>12} {'ratio':>7} {'IQR us':>13} "
            f"{'async us':>10} {'ratio':>7} {'IQR us':>13}"
        )
        runs: dict[str, Callable[[], object]] = {}
        for name, build in VARIANTS.items():
            if args.variants and runs and not any(sel in name for sel in args.variants):
                continue
            if "fused" in name and key not in FUSED_ONLY_ON:
                continue
            try:
                with ps.VariableStore():
                    run = build(cfg)
                    for _ in range(3):
                        _block(run())  # compile and warm up
                runs[name] = run
            except ImportError as e:
                print(f"{name:38} skipped ({e.name} not installed)")
        results = time_steps(runs, steps, args.repeats)
        ref_b, ref_a = next(iter(results.values()))
        for name, (bs, as_) in results.items():
            b, a = _iqr(bs), _iqr(as_)
            print(
                f"{name:38} {b[1] * 1e6:12.1f} {paired_ratio(bs, ref_b):7.2f} {_spread(b):>13} "
                f"{a[1] * 1e6:10.1f} {paired_ratio(as_, ref_a):7.2f} {_spread(a):>13}"
            )
        if args.no_first_call:
            continue
        ratios = []
        for _ in range(args.repeats if not args.quick else 1):
            with ps.VariableStore():
                ratios.append(
                    first_call(paramstore_function, cfg) / first_call(jax_reference(True), cfg)
                )
        print(
            f"first call (trace+compile+step), ps.function / jax.jit: {statistics.median(ratios):.2f}x"
        )


if __name__ == "__main__":
    main()
