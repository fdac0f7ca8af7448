"""The usual training loop around one compiled call (issue 33), against hand-written ``jax.jit``.

Run: ``python benchmarks/alternating.py`` (``--quick`` for a short run).

The dispatch-bound MLP of ``step.py`` (4 x 32, batch 8, optax Adam). Each row is timed in
blocks of ``--block`` iterations (dispatched asynchronously, waited for at the end of the
block), paramstore's block and the reference's block next to each other, their order
alternating; a ratio is the median over the blocks of paramstore's time over the
reference's (so load that changes during the run cancels out). The reference is the same
loop hand-written: ``jax.jit`` over ``(params, opt_state)`` with donation, and a ``jax.jit``
eval step over the params.

Each loop first runs for ``--warmup`` seconds (compiles, including a program paramstore
compiles in the background for a read that recurs). Rows:
* step alone: one train step per iteration;
* train alternating with eval: a train step, then an eval step (loss on another batch);
* train then a read: a train step, then one parameter read (``w.value()``: the hand-written
  loop keeps its parameter array the same way);
* train then float(v): a train step, then ``float`` of a scalar variable (the step counter);
* train then a progress bar: a train step that also updates a ``ps.metrics.Mean`` of the
  loss, then ``float(mean.result())`` (the hand-written loop carries the total and count in
  its step and prints ``float(total / count)``).

Then: the latency of another thread's ``v.value()`` + ``v.assign(...)`` + a call of an already
compiled ``ps.function``, while one thread compiles a ~2 s program (median and max).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import paramstore as ps

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step as _step  # noqa: E402  (benchmarks/step.py: its dispatch-bound MLP)

MODEL = _step.MODELS["dispatch"]
LAYERS, WIDTH, BATCH, LR = MODEL.layers, MODEL.width, MODEL.batch, 1e-3
mlp = _step.mlp


def init_params() -> list[tuple[np.ndarray, np.ndarray]]:
    return _step.init_params(MODEL)


def batches() -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(1)
    return tuple(  # type: ignore[return-value]
        jnp.asarray(rng.standard_normal((BATCH, WIDTH)).astype(np.float32)) for _ in range(4)
    )


Loop = dict[str, Callable[[], object]]  # row name -> one iteration


def reference() -> Loop:
    tx = optax.adam(LR)
    params = [(jnp.asarray(w), jnp.asarray(b)) for w, b in init_params()]
    state = [params, tx.init(params)]
    x, y, xe, ye = batches()

    def train(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((mlp(p, x) - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train_jit = jax.jit(train, donate_argnums=(0, 1))

    def train_mean(params, opt_state, total, count, x, y):
        params, opt_state, loss = train(params, opt_state, x, y)
        return params, opt_state, total + loss, count + 1.0

    train_mean_jit = jax.jit(train_mean, donate_argnums=(0, 1, 2, 3))
    mean = [jnp.zeros(()), jnp.zeros(())]
    eval_jit = jax.jit(lambda p, x, y: jnp.mean((mlp(p, x) - y) ** 2))
    kept: list[object] = []

    def step() -> object:
        state[0], state[1], loss = train_jit(state[0], state[1], x, y)
        return loss

    def alternate() -> object:
        step()
        return eval_jit(state[0], xe, ye)

    def read() -> object:
        loss = step()
        kept[:] = [state[0][0][0]]  # the parameter, kept as a user keeps w.value()
        return loss

    def scalar() -> object:
        step()
        return float(state[1][0].count)

    def progress() -> object:
        state[0], state[1], mean[0], mean[1] = train_mean_jit(
            state[0], state[1], mean[0], mean[1], x, y
        )
        return float(mean[0] / mean[1])

    return {
        "step alone": step,
        "alternating": alternate,
        "read": read,
        "float": scalar,
        "progress": progress,
    }


class MLP(ps.Module):
    def __init__(self) -> None:
        self.layers = [
            (ps.Variable(w, name=f"w{i}"), ps.Variable(b, name=f"b{i}"))
            for i, (w, b) in enumerate(init_params())
        ]

    def __call__(self, x):
        return mlp(self.layers, x)


def paramstore_loop() -> Loop:
    model = MLP()
    opt = ps.Optimizer(optax.adam(LR), model)
    x, y, xe, ye = batches()

    @ps.function
    def train(x, y):
        loss, grads = ps.value_and_grad(lambda: jnp.mean((model(x) - y) ** 2), model)()
        opt.apply_gradients(grads)
        return loss

    @ps.function
    def evaluate(x, y):
        return jnp.mean((model(x) - y) ** 2)

    w = model.layers[0][0]
    counter = opt.iterations
    mean = ps.metrics.Mean()

    @ps.function
    def train_mean(x, y):
        mean.update_state(train(x, y))

    kept: list[object] = []

    def step() -> object:
        return train(x, y)

    def alternate() -> object:
        train(x, y)
        return evaluate(xe, ye)

    def read() -> object:
        loss = train(x, y)
        kept[:] = [w.value()]
        return loss

    def scalar() -> object:
        train(x, y)
        return float(counter)

    def progress() -> object:
        train_mean(x, y)
        return float(mean.result())

    return {
        "step alone": step,
        "alternating": alternate,
        "read": read,
        "float": scalar,
        "progress": progress,
    }


def ratios(
    ours: Loop, ref: Loop, block: int, rounds: int, warmup: float
) -> dict[str, tuple[float, float]]:
    """Per row: (median ratio ours / reference, reference us per iteration)."""
    out: dict[str, tuple[float, float]] = {}
    for row in ours:
        a, b = ours[row], ref[row]
        for f in (a, b):  # compile and warm, for `warmup` seconds at least (what a
            end = time.perf_counter() + warmup  # loop compiles once in the background too)
            while time.perf_counter() < end:
                for _ in range(20):
                    jax.block_until_ready(f())
        rs, ts = [], []
        for r in range(rounds):
            times = {}
            for name, f in (("ours", a), ("ref", b)) if r % 2 == 0 else (("ref", b), ("ours", a)):
                t0 = time.perf_counter()
                for _ in range(block):
                    last = f()
                jax.block_until_ready(last)
                times[name] = (time.perf_counter() - t0) / block
            rs.append(times["ours"] / times["ref"])
            ts.append(times["ref"])
        out[row] = (statistics.median(rs), statistics.median(ts) * 1e6)
    return out


def read_latency_during_compile(
    ops: int, probe: bool = False
) -> tuple[float, float, float, float, int]:
    """(compile seconds, median, 95th percentile and max latency in ms of another thread's
    read + assign + compiled call, samples) while one thread compiles a big ``ps.function``.
    ``probe``: the sample is three ``time.sleep(0)`` instead (no paramstore, no lock: each
    gives the GIL up and waits to get it back), the floor that JAX's lowering, which holds
    the GIL for tens of ms at a time, sets for any thread."""
    w = ps.Variable(0.0)
    other = ps.Variable(jnp.zeros(4))
    small = ps.function(lambda: other.assign_add(jnp.ones(4)))
    small()

    @ps.function
    def big(x):
        y = x
        for i in range(ops):
            y = jnp.sin(y) * 1.0001 + jnp.cos(y * (i + 1))
        w.assign(w + y.sum())
        return y

    done = threading.Event()
    took: list[float] = []

    def run() -> None:
        t0 = time.perf_counter()
        big(jnp.ones(8))
        took.append(time.perf_counter() - t0)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    lat: list[float] = []
    while big.trace_count == 0 and not done.is_set():
        time.sleep(0.001)
    while not done.wait(0.005):
        t0 = time.perf_counter()
        if probe:
            time.sleep(0), time.sleep(0), time.sleep(0)
        else:
            other.value()
            other.assign(other.value() + 1)
            small()
        lat.append(time.perf_counter() - t0)
    p95 = statistics.quantiles(lat, n=20)[-1] if len(lat) > 1 else lat[0]
    return took[0], statistics.median(lat) * 1e3, p95 * 1e3, max(lat) * 1e3, len(lat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--block", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--ops", type=int, default=1500, help="size of the ~2 s compile")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds per row and loop")
    args = parser.parse_args()
    block, rounds = (50, 3) if args.quick else (args.block, args.rounds)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; MLP {LAYERS} x {WIDTH}, "
          f"batch {BATCH}, Adam; {rounds} rounds of {block} iterations")  # fmt: skip
    with ps.VariableStore():
        warmup = 0.2 if args.quick else args.warmup
        table = ratios(paramstore_loop(), reference(), block, rounds, warmup)
    print(f"{'row':<40} {'reference us/iter':>18} {'ps.function / jax.jit':>22}")
    names = {
        "step alone": "step alone",
        "alternating": "train alternating with eval",
        "read": "train then w.value()",
        "float": "train then float(step counter)",
        "progress": "train + Mean, then float(result())",
    }
    for row, (ratio, ref_us) in table.items():
        print(f"{names[row]:<40} {ref_us:>18.1f} {ratio:>21.2f}x")
    with ps.VariableStore():
        took, med, p95, worst, n = read_latency_during_compile(300 if args.quick else args.ops)
    print(
        f"another thread's read + assign + compiled call during a {took:.1f} s compile: "
        f"median {med:.2f} ms, 95th percentile {p95:.2f} ms, max {worst:.2f} ms ({n} samples)"
    )
    with ps.VariableStore():
        took, med, p95, worst, n = read_latency_during_compile(
            300 if args.quick else args.ops, probe=True
        )
    print(
        f"the same thread's 3 x time.sleep(0) (no lock: the GIL's floor) during a {took:.1f} s "
        f"compile: median {med:.2f} ms, 95th percentile {p95:.2f} ms, max {worst:.2f} ms"
    )


if __name__ == "__main__":
    main()
