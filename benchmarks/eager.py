"""Eager per-call cost of ``v.assign_add(d)`` and ``v + 1`` on a 1,000-element float32.

Run: ``python benchmarks/eager.py``. Compares with the same operation on a bare jax.Array
(the anchor: ``x = x + d``) and on ``tf.Variable`` when TensorFlow is installed. The
variants take turns in blocks of ``--calls // 10`` calls (``10 * --repeats`` blocks each);
medians per call; ratios to the jax.Array anchor of the same run.
Targets: eager ``assign_add`` within 1.5x of ``x = x + d`` (issue 15: at most 0.9x).

The tf.Variable row runs in a child process, right after the JAX rows (its ratios are to
this process's anchor): importing TensorFlow starts its thread pools and oneDNN in the
process, which slowed the JAX rows themselves (``x = x + d`` 12.6 -> 17.8 us, 2026-11-23)
and so blurred their ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import paramstore as ps


def interleaved(fns: dict[str, Callable[[], object]], calls: int, repeats: int) -> dict[str, float]:
    """Median seconds per call of each of ``fns``, timed in blocks of ``calls // 10`` calls
    that take turns (order alternating), ``10 * repeats`` blocks each: a change of load on a
    shared machine hits them alike, so their ratios hold."""
    block = max(calls // 10, 1)
    for fn in fns.values():
        for _ in range(block):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(10 * repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            fn = fns[name]
            t0 = time.perf_counter()
            for _ in range(block):
                fn()
            times[name].append((time.perf_counter() - t0) / block)
    for fn in fns.values():
        jax.block_until_ready(fn())
    return {name: statistics.median(ts) for name, ts in times.items()}


def tf_row(calls: int, repeats: int) -> tuple[float, float]:
    """Seconds per call of ``tf.Variable``'s assign_add and ``+ 1``, measured in a child
    process (TensorFlow never enters this one); NaNs without TensorFlow."""
    child = subprocess.run(
        [sys.executable, __file__, "--tf-row", "--calls", str(calls), "--repeats", str(repeats)],
        capture_output=True,
        text=True,
        check=True,
    )
    add, plus = json.loads(child.stdout.strip().splitlines()[-1])
    return add, plus


def _tf_child(calls: int, repeats: int) -> None:
    try:
        import tensorflow as tf
    except ImportError:
        print(json.dumps([float("nan"), float("nan")]))
        return
    tv = tf.Variable(np.zeros(1000, np.float32))
    td = tf.ones(1000)
    add = interleaved({"tf": lambda: tv.assign_add(td, read_value=False)}, calls, repeats)
    plus = interleaved({"tf": lambda: tv + 1}, calls, repeats)
    print(json.dumps([add["tf"], plus["tf"]]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tf-row", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tf_row:
        _tf_child(args.calls, args.repeats)
        return

    d = jnp.ones(1000, jnp.float32)
    box = [jnp.zeros(1000, jnp.float32)]

    def jax_add() -> object:
        box[0] = box[0] + d
        return box[0]

    v = ps.Variable(np.zeros(1000, np.float32), name="bench")
    adds: dict[str, Callable[[], object]] = {
        "jax": jax_add,
        "ps": lambda: v.assign_add(d, read_value=False),
    }
    pluses: dict[str, Callable[[], object]] = {"jax": lambda: box[0] + 1, "ps": lambda: v + 1}
    add = interleaved(adds, args.calls, args.repeats)
    plus = interleaved(pluses, args.calls, args.repeats)
    anchor_add, anchor_plus = add["jax"], plus["jax"]
    tf_add, tf_plus = tf_row(args.calls, args.repeats)

    threaded = threaded_rows(args.calls, args.repeats)

    print(f"jax {jax.__version__}; median of {args.repeats} x {args.calls} calls")
    print(f"{'':42} {'assign_add us':>14} {'ratio':>6} {'v + 1 us':>10} {'ratio':>6}")
    for name, a, p in [
        ("jax.Array: x = x + d / x + 1 [anchor]", add["jax"], plus["jax"]),
        ("ps.Variable: v.assign_add(d) / v + 1", add["ps"], plus["ps"]),
    ]:
        print(
            f"{name:42} {a * 1e6:14.2f} {a / anchor_add:6.2f} "
            f"{p * 1e6:10.2f} {p / anchor_plus:6.2f}"
        )
    print(
        f"{'tf.Variable (in a child process)':42} {tf_add * 1e6:14.2f} {tf_add / anchor_add:6.2f} "
        f"{tf_plus * 1e6:10.2f} {tf_plus / anchor_plus:6.2f}"
    )
    one = threaded[0][1]
    for n, rate in threaded:
        print(f"ps.function step from {n} thread(s): {rate:,.0f} steps/s ({rate / one:.2f}x)")


def threaded_rows(calls: int, repeats: int) -> list[tuple[int, float]]:
    """Steps per second of one ``ps.function`` step (assign_add on 1,000 float32) driven by
    1 and by 4 threads, ``calls`` steps in all; each call holds the state lock while it
    dispatches, so threads share one dispatch stream."""
    v = ps.Variable(np.zeros(1000, np.float32), name="threaded")
    d = jnp.ones(1000, jnp.float32)

    @ps.function
    def step() -> None:
        v.assign_add(d)

    step()
    out = []
    for n in (1, 4):
        rates = []
        for _ in range(repeats):
            each = calls // n

            def work(each: int = each) -> None:
                for _ in range(each):
                    step()

            threads = [threading.Thread(target=work) for _ in range(n)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            v.value().block_until_ready()
            rates.append(each * n / (time.perf_counter() - t0))
        out.append((n, statistics.median(rates)))
    expected = 1 + repeats * sum((calls // n) * n for n in (1, 4))
    assert float(v.numpy()[0]) == expected, "a step was lost"
    return out


if __name__ == "__main__":
    main()
