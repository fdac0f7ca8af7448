"""What reading "a collection of variables" costs: the one traversal and the one parser.

Run: ``python benchmarks/traversal.py`` (``--quick`` for a short run, ``--blocks 48``).

A model of ``--blocks`` blocks, each two ``ps.nn.Dense(16)`` layers (4 variables a block),
built once. Each row is the median over ``--repeats`` runs of ``--calls`` calls, in us per
call (process time, so other processes on a shared machine weigh less); the ratio is to
``jax.tree_util.tree_leaves`` over a nested dict holding the same arrays, measured in the
same run. These run when a ``ps.function`` traces (``ps.value_and_grad(loss, model)`` in a
step), when a checkpoint is saved or restored, and at every eager ``ps.grad`` built anew,
never on a compiled step's steady path.
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

import paramstore as ps


class Block(ps.Module):
    def __init__(self) -> None:
        self.first = ps.nn.Dense(16, activation="relu")
        self.second = ps.nn.Dense(16)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.second(self.first(x))


class Net(ps.Module):
    def __init__(self, n: int) -> None:
        self.blocks = [Block() for _ in range(n)]

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return x


def per_call(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            fn()
        runs.append((time.process_time() - start) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="few calls, for a smoke test")
    args = parser.parse_args()
    calls, repeats = (5, 1) if args.quick else (args.calls, args.repeats)

    x = jnp.ones((4, 16))
    net = Net(args.blocks)
    net(x)
    opt = ps.Optimizer(optax.adam(1e-3), net)
    ckpt = ps.Checkpoint(model=net, optimizer=opt)
    tree = {
        f"b{i}": {"first": {"w": b.first.kernel.value(), "b": b.first.bias.value()},
                  "second": {"w": b.second.kernel.value(), "b": b.second.bias.value()}}
        for i, b in enumerate(net.blocks)
    }  # fmt: skip
    rows = [
        ("jax.tree_util.tree_leaves(same arrays) [reference]", lambda: jax.tree_util.tree_leaves(tree)),
        ("model.variables", lambda: net.variables),
        ("model.trainable_variables", lambda: net.trainable_variables),
        ("ps.state(model)", lambda: ps.state(net)),
        ("ps.state(model, where='kernel')", lambda: ps.state(net, where="kernel")),
        ("ps.value_and_grad(loss, model) (built)", lambda: ps.value_and_grad(len, net)),
        ("ps.value_and_grad(loss, model.blocks) (built)", lambda: ps.value_and_grad(len, net.blocks)),
        ("Checkpoint(model, optimizer).variables_by_path()", ckpt.variables_by_path),
    ]  # fmt: skip
    print(f"## {len(net.variables)} variables ({args.blocks} blocks), optimizer state "
          f"{len(opt.variables)} variables; us per call")  # fmt: skip
    print(f"{'':52s} {'us':>9s} {'ratio':>7s}")
    reference = None
    for label, fn in rows:
        t = per_call(fn, calls, repeats)
        reference = reference or t
        print(f"{label:52s} {t:9.1f} {t / reference:7.2f}")


if __name__ == "__main__":
    main()
