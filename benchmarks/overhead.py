"""Per-call Python time of paramstore's own code on the steady path (not the computation).

Run: ``python benchmarks/overhead.py``. For ``ps.function`` the compiled program's runner
(the ``jax.jit`` that does the work) is wrapped with a timer; for eager ``assign_add`` the
jitted add it ends in is. "own code" is the time of the call minus the time inside that
runner, per call: what ``ps.function`` / ``Variable.assign_add`` add on top of ``jax.jit``'s
own dispatch. Times are CPU time of this thread (``thread_time_ns``), so that other processes on a shared machine disturb them less. The timer itself (two clock reads) counts as own code,
alike before and after a change. Median (and interquartile range) of ``--repeats`` blocks of
``--calls`` calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import paramstore as ps
from paramstore import variable as _variable


class Timed:
    """Wrap a callable, adding up the nanoseconds spent inside it."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.ns = 0

    def __call__(self, *args: Any) -> Any:
        t0 = time.thread_time_ns()
        out = self.fn(*args)
        self.ns += time.thread_time_ns() - t0
        return out


def own_time(call: Callable[[], Any], timers: list[Timed], calls: int, repeats: int) -> list[float]:
    """Microseconds per call outside ``timers``, one figure per block of ``calls``."""
    for _ in range(calls // 10):
        call()
    out = []
    for _ in range(repeats):
        for t in timers:
            t.ns = 0
        t0 = time.thread_time_ns()
        for _ in range(calls):
            call()
        total = time.thread_time_ns() - t0
        out.append((total - sum(t.ns for t in timers)) / calls / 1e3)
    jax.block_until_ready(call())
    return out


def function_case(n_vars: int) -> tuple[Callable[[], Any], list[Timed]]:
    vs = [ps.Variable(np.zeros(16, np.float32), name=f"v{i}") for i in range(n_vars)]
    d = jnp.ones(16, jnp.float32)

    @ps.function
    def step(d: jax.Array) -> jax.Array:
        for v in vs:
            v.assign_add(d)
        return d.sum()

    for _ in range(3):
        step(d)
    timers = []
    for entry in step._cache.values():
        timer = Timed(entry.runner)
        entry.runner = timer
        timers.append(timer)
    return (lambda: step(d)), timers


def eager_case() -> tuple[Callable[[], Any], list[Timed]]:
    v = ps.Variable(np.zeros(1000, np.float32), name="eager")
    d = jnp.ones(1000, jnp.float32)
    timers = []
    for how, pair in list(_variable._EAGER.items()):
        wrapped = tuple(Timed(f) for f in pair)
        _variable._EAGER[how] = wrapped  # type: ignore[assignment]
        timers += wrapped
    return (lambda: v.assign_add(d, read_value=False)), timers


def summary(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs):7.2f} us  (IQR {q[0]:.2f}-{q[2]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"jax {jax.__version__}; own code per call, median of {args.repeats} x {args.calls}")
    for n in (1, 602):
        calls = args.calls if n == 1 else max(args.calls // 20, 10)  # ~1 ms a call at 602
        call, timers = function_case(n)
        figures = summary(own_time(call, timers, calls, args.repeats))
        print(f"ps.function steady call, {n:3} variable(s): {figures}")
    call, timers = eager_case()
    print(
        f"eager v.assign_add(d), 1,000 float32:    {summary(own_time(call, timers, args.calls, args.repeats))}"
    )


if __name__ == "__main__":
    main()
