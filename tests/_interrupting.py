"""Interrupt an operation at many points: ``sweep`` runs it once per point k, with
``_thread.interrupt_main()`` (what Ctrl-C does) called at the k-th point of the operation
where CPython could run a signal's handler (in any module: paramstore's, JAX's, the
standard library's), and checks that afterwards every variable is readable and that all
of them hold their values from before the operation, or all of them their values from
after it.

The points are exactly where CPython (3.11 and 3.12) checks for a pending signal: the start of a
Python function, the instruction after every call (of anything: a Python function, a
builtin, a C extension's callable such as a ``jax.jit`` function) and every backward
jump. A ``sys.settrace`` function with opcode events stops there and raises the
handler's ``KeyboardInterrupt`` right there, in the traced code, so k swept over every
point lands it at every place a real Ctrl-C can land, and nowhere a real one cannot
(a ``line`` event would, e.g. between a ``with`` block's last line and its ``__exit__``).
Bounded in time: a hang dumps the stacks and ends the run (a failure).
"""

from __future__ import annotations

import _thread
import dis
import faulthandler
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from paramstore._core.context import STATE_LOCK

BOUND = 120.0  # seconds for one sweep: anything longer is a hang


def _noop() -> None:
    """A Python call: the main thread checks for a pending signal on entry."""


def _read(variables: Sequence[Any]) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in variables]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


_POINTS: dict[Any, frozenset[int]] = {}


def _checkpoints(code: Any) -> frozenset[int]:
    """The offsets of ``code`` where CPython 3.11 runs a pending signal's handler: right
    after each call returns (``CALL``) and at each backward jump's target."""
    points = _POINTS.get(code)
    if points is None:
        found: set[int] = set()
        after_call = False
        for ins in dis.get_instructions(code):
            if after_call:
                found.add(ins.offset)
            after_call = ins.opname == "CALL"
            if ins.opname.startswith("JUMP_BACKWARD"):
                found.add(ins.argval)
        points = _POINTS[code] = frozenset(found)
    return points


def _tracer(on_point: Callable[[], None]) -> Callable[..., Any]:
    """A trace function calling ``on_point()`` at each point a signal's handler can run:
    a Python function's start, and every offset ``_checkpoints`` lists."""

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
            on_point()
        elif event == "opcode" and frame.f_lasti in _checkpoints(frame.f_code):
            on_point()
        return tracer

    return tracer


def count_events(op: Callable[[], Any]) -> int:
    """The number of points where a signal's handler can run in one run of ``op``."""
    n = [0]

    def count() -> None:
        n[0] += 1

    sys.settrace(_tracer(count))
    try:
        op()
    finally:
        sys.settrace(None)
    return n[0]


def run_interrupted(op: Callable[[], Any], k: int) -> tuple[bool, bool]:
    """Run ``op`` with an interrupt at point ``k``: (it fired, it was raised)."""
    n = [0]
    fired = [False]

    def point() -> None:
        n[0] += 1
        if n[0] == k:
            fired[0] = True
            _thread.interrupt_main()  # raised right here, in the traced code

    raised = False
    sys.settrace(_tracer(point))
    try:
        try:
            op()
        finally:
            sys.settrace(None)
        _noop()  # a pending interrupt lands here at the latest
    except KeyboardInterrupt:
        raised = True
    except Exception:  # what a C caller made of it (numpy: SystemError), as with Ctrl-C
        if not fired[0]:
            raise
        raised = True
    return fired[0], raised


def sweep(
    prepare: Callable[[], Callable[[], Any]],
    variables: Callable[[], Sequence[Any]],
    points: int | None = None,
) -> dict[str, int]:
    """For k over the operation's trace events (all of them, or ``points`` spread evenly):
    ``op = prepare()`` (puts the state back and returns the operation), run ``op`` with an
    interrupt at event k, check the variables (``variables()``) are readable and all at
    their before- or all at their after-values. Returns how many runs ended each way."""
    faulthandler.dump_traceback_later(BOUND, exit=True)
    start = time.monotonic()
    try:
        # Python 3.12 instruments code for sys.settrace on its first traced run, which
        # then reports fewer events (5 of a warm step's 25): a first count warms that up.
        count_events(prepare())
        op = prepare()
        before = _read(variables())
        op = prepare()
        total = count_events(op)
        after = _read(variables())
        assert not _same(before, after), "the operation changes nothing: a useless sweep"
        ks = range(1, total + 2)
        if points is not None and points < total:
            ks = sorted({int(x) for x in np.linspace(1, total, points)})
        seen = {"before": 0, "after": 0, "raised": 0}
        for k in ks:
            op = prepare()  # (no read here: a read hands the arrays out, so none is donated)
            _, raised = run_interrupted(op, k)
            try:
                now = _read(variables())
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"interrupt at event {k}/{total}: unreadable: {e}") from e
            try:  # plain JAX works on (jax >= 0.11 could be left with no current trace)
                assert float(jnp.add(1.0, 1.0)) == 2.0
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"interrupt at event {k}/{total}: JAX broken: {e}") from e
            if _same(now, before):
                seen["before"] += 1
            elif _same(now, after):
                seen["after"] += 1
            else:
                raise AssertionError(
                    f"interrupt at event {k}/{total}: neither before nor after: {now}"
                )
            seen["raised"] += raised
            assert not STATE_LOCK._is_owned(), f"interrupt at point {k}: the state lock leaked"
            assert time.monotonic() - start < BOUND
        assert seen["raised"], "no interrupt was ever raised"
        assert seen["after"], "the uninterrupted run did not end at the after-values"
        return seen
    finally:
        faulthandler.cancel_dump_traceback_later()
