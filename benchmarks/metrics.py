"""Three metrics updated in a compiled training step: ``ps.metrics`` against hand-written sums.

Run: ``python benchmarks/metrics.py`` (``--quick`` for a short run).

One Adam step of a small MLP (64-128-10 on a batch of 128, dispatch-bound on a CPU) that also
keeps three running metrics (mean loss, sparse categorical accuracy, mean squared error of
the softmax against the one-hot labels). Variants:

* ``ps.function + ps.metrics`` [measured]: the metrics' ``update_state`` inside the step;
* ``ps.function + hand-written sums`` [reference]: the same ``ps.function`` step, the running
  totals and counts written by hand in pure JAX and carried in and out as arrays;
* ``ps.function + hand-written sums in 6 Variables``: the same sums kept in six scalar
  ``ps.Variable`` s, the state layout of the three metrics (a total and a count each);
* ``jax.jit (donated), hand-written`` (for scale): everything in pure JAX, params, optimizer
  state and sums donated; once with the sums in one array, once in six scalar arrays (the
  metrics' layout: each extra small buffer costs XLA's CPU runtime time per call, in
  paramstore and in pure JAX alike).

Why six scalar Variables cost more than one array of six (and why ``ps.metrics`` does not):
XLA:CPU's thunk executor runs a step in the calling thread while at most 8 thunks are ready at
once and hands half of them to its thread pool beyond that. Here the reference step starts with
8 ready thunks; a constant increment of a scalar (``count += batch``) is another thunk ready at
the start, so three of them take the step over the threshold (pure JAX with the same six
in-place scalar buffers pays the same). ``ps.metrics`` computes each metric's two increments
in one program behind ``lax.optimization_barrier``, so no metric adds a thunk that is ready
at the start, whatever the model.

Each figure is the median per-step time over ``--repeats`` rounds of ``--steps`` steps; the
variants run interleaved round by round (one round each, in turn), so load on the machine
hits them alike (the first of each round rotates). ``blocking`` waits for the loss after
each step, ``async`` once per round; ``cpu`` columns are the process's CPU time per step (all
its threads), which other processes on a shared machine disturb less than the wall clock.
The target (issue 19): ps.metrics / hand-written sums <= 1.05x.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import paramstore as ps

BATCH, D_IN, HIDDEN, CLASSES = 128, 64, 128, 10


def data() -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, D_IN)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, CLASSES, BATCH).astype(np.int32))
    return x, y


def loss_and_metrics(logits: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    correct = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
    sq = jnp.mean(jnp.square(jax.nn.one_hot(y, CLASSES) - jax.nn.softmax(logits)), -1)
    return loss, correct, sq


Step = Callable[[], jax.Array]


def model_and_optimizer() -> tuple[ps.nn.Sequential, ps.Optimizer]:
    """The MLP (built) and its Adam optimizer, in the current store."""
    model = ps.nn.Sequential([ps.nn.Dense(HIDDEN, activation="relu"), ps.nn.Dense(CLASSES)])
    model.build((None, D_IN))
    return model, ps.Optimizer(optax.adam(1e-3), model)


def train(
    model: ps.nn.Sequential, opt: ps.Optimizer, x: jax.Array, y: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One Adam step (called inside each variant's ps.function): (loss, logits)."""

    def loss_fn() -> tuple[jax.Array, jax.Array]:
        logits = model(x)
        return loss_and_metrics(logits, y)[0], logits

    (loss, logits), grads = ps.value_and_grad(loss_fn, model, has_aux=True)()
    opt.apply_gradients(grads)
    return loss, logits


def ps_metrics() -> Step:
    with ps.VariableStore():
        model, opt = model_and_optimizer()
        mean_loss = ps.metrics.Mean(name="loss")
        accuracy = ps.metrics.SparseCategoricalAccuracy()
        mse = ps.metrics.MeanSquaredError()
    x, y = data()

    @ps.function
    def step(x: jax.Array, y: jax.Array) -> jax.Array:
        loss, logits = train(model, opt, x, y)
        mean_loss.update_state(loss)
        accuracy.update_state(y, logits)
        mse.update_state(jax.nn.one_hot(y, CLASSES), jax.nn.softmax(logits))
        return loss

    return lambda: step(x, y)


def ps_hand_sums() -> Step:
    with ps.VariableStore():
        model, opt = model_and_optimizer()
    x, y = data()
    sums = [jnp.zeros(6, jnp.float32)]  # loss total/count, correct total/count, sq total/count

    @ps.function
    def step(x: jax.Array, y: jax.Array, sums: jax.Array) -> tuple[jax.Array, jax.Array]:
        loss, logits = train(model, opt, x, y)
        _, correct, sq = loss_and_metrics(logits, y)
        n = jnp.float32(BATCH)
        add = jnp.stack([loss, 1.0, correct.sum(), n, sq.sum(), n])
        return loss, sums + add

    def run() -> jax.Array:
        loss, sums[0] = step(x, y, sums[0])
        return loss

    return run


def ps_hand_variables() -> Step:
    """The hand-written sums kept in six scalar ps.Variables (the metrics' state layout)."""
    with ps.VariableStore():
        model, opt = model_and_optimizer()
        sums = [ps.Variable(0.0, trainable=False, name=f"sum{i}") for i in range(6)]
    x, y = data()

    @ps.function
    def step(x: jax.Array, y: jax.Array) -> jax.Array:
        loss, logits = train(model, opt, x, y)
        _, correct, sq = loss_and_metrics(logits, y)
        n = jnp.float32(BATCH)
        for v, add in zip(sums, (loss, 1.0, correct.sum(), n, sq.sum(), n)):
            v.assign_add(add, read_value=False)
        return loss

    return lambda: step(x, y)


def jit_hand_sums(scalars: bool = False) -> Step:
    """Pure JAX, everything donated; the sums in one array, or (``scalars``) in six scalar
    arrays: the metrics' state layout, to separate the cost of the layout from paramstore's."""
    rng = np.random.default_rng(1)
    params = {
        "w1": jnp.asarray(rng.standard_normal((D_IN, HIDDEN)).astype(np.float32) * 0.1),
        "b1": jnp.zeros(HIDDEN),
        "w2": jnp.asarray(rng.standard_normal((HIDDEN, CLASSES)).astype(np.float32) * 0.1),
        "b2": jnp.zeros(CLASSES),
    }
    tx = optax.adam(1e-3)
    zeros = [jnp.zeros((), jnp.float32) for _ in range(6)] if scalars else jnp.zeros(6)
    state = [params, tx.init(params), zeros]
    x, y = data()

    def forward(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    @jax.jit
    def _step(p, s, sums, x, y):  # type: ignore[no-untyped-def]
        def loss_fn(p):  # type: ignore[no-untyped-def]
            logits = forward(p, x)
            return loss_and_metrics(logits, y)[0], logits

        (loss, logits), g = jax.value_and_grad(loss_fn, has_aux=True)(p)
        updates, s = tx.update(g, s, p)
        p = optax.apply_updates(p, updates)
        _, correct, sq = loss_and_metrics(logits, y)
        n = jnp.float32(BATCH)
        add = (loss, 1.0, correct.sum(), n, sq.sum(), n)
        # The loss last: jit pairs each donated input with the first unused output of its
        # shape and dtype, so a scalar loss first would take the first scalar sum's buffer
        # and make XLA copy every sum (which, by chance, also serializes the program).
        if scalars:
            return p, s, [total + a for total, a in zip(sums, add)], loss
        return p, s, sums + jnp.stack(add), loss

    step = jax.jit(_step, donate_argnums=(0, 1, 2))

    def run() -> jax.Array:
        state[0], state[1], state[2], loss = step(*state, x, y)
        return loss

    return run


VARIANTS = {
    "ps.function + hand-written sums [reference]": ps_hand_sums,
    "ps.function + ps.metrics (3 metrics)": ps_metrics,
    "ps.function + hand-written sums in 6 Variables": ps_hand_variables,
    "jax.jit (donated), hand-written sums": jit_hand_sums,
    "jax.jit (donated), sums in 6 scalar arrays": lambda: jit_hand_sums(scalars=True),
}


def round_us(step: Step, steps: int, blocking: bool) -> tuple[float, float]:
    """(wall, CPU) microseconds per step; CPU is the process's (all its threads), which a
    loaded machine disturbs less than the wall clock."""
    start, cpu = time.perf_counter(), time.process_time()
    if blocking:
        for _ in range(steps):
            step().block_until_ready()
    else:
        loss = None
        for _ in range(steps):
            loss = step()
        assert loss is not None
        loss.block_until_ready()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return wall / steps * 1e6, cpu / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="--steps 20 --repeats 3")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 20, 3
    steps = {name: make() for name, make in VARIANTS.items()}
    for step in steps.values():  # compile and warm up
        for _ in range(10):
            step().block_until_ready()
    modes = ("blocking", "async", "blocking cpu", "async cpu")
    results: dict[str, dict[str, list[float]]] = {n: {m: [] for m in modes} for n in steps}
    names = list(steps)
    for r in range(args.repeats):
        for mode in ("blocking", "async"):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate who goes first
                wall, cpu = round_us(steps[name], args.steps, mode == "blocking")
                results[name][mode].append(wall)
                results[name][f"{mode} cpu"].append(cpu)
    ref = next(iter(steps))
    med = {n: {m: statistics.median(v) for m, v in r.items()} for n, r in results.items()}
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; {args.repeats} rounds x "
        f"{args.steps} steps, interleaved; medians per step"
    )
    head = "".join(f"{m + ' us':>17} {'ratio':>6}" for m in modes)
    print(f"{'variant':46}{head}")
    for name in steps:
        cells = "".join(f"{med[name][m]:17.1f} {med[name][m] / med[ref][m]:6.2f}" for m in modes)
        print(f"{name:46}{cells}")


if __name__ == "__main__":
    main()
