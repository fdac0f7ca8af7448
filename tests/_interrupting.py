"""Interrupt an operation at many points: ``sweep`` runs it once per point k, with
``_thread.interrupt_main()`` (what Ctrl-C does) called at the k-th profiling event of the
operation (in any module: paramstore's, JAX's, the standard library's), and checks that
afterwards every variable is readable and that all of them hold their values from before
the operation, or all of them their values from after it.

The events are those where CPython runs a pending signal's handler: the start of a Python
function, and the return of any call, Python or C (``call``, ``return``, ``c_return``,
``c_exception`` of ``sys.setprofile``). The handler's ``KeyboardInterrupt`` is raised right
there, in the profiled code, so k swept over every event lands it at every place a real
Ctrl-C can land (a ``line`` event of ``sys.settrace`` would also land it where no signal
can, e.g. between a ``with`` block's last line and its ``__exit__``). Bounded in time: a
hang dumps the stacks and ends the run (a failure).
"""

from __future__ import annotations

import _thread
import faulthandler
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

BOUND = 120.0  # seconds for one sweep: anything longer is a hang


def _noop() -> None:
    """A Python call: the main thread checks for a pending signal on entry."""


def _read(variables: Sequence[Any]) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in variables]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


_EVENTS = frozenset(("call", "return", "c_return", "c_exception"))


def count_events(op: Callable[[], Any]) -> int:
    """The number of events one run of ``op`` makes."""
    n = [0]

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event in _EVENTS:
            n[0] += 1

    sys.setprofile(profiler)
    try:
        op()
    finally:
        sys.setprofile(None)
    return n[0]


def run_interrupted(op: Callable[[], Any], k: int) -> tuple[bool, bool]:
    """Run ``op`` with an interrupt at trace event ``k``: (it fired, it was raised)."""
    n = [0]
    fired = [False]

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event in _EVENTS:
            n[0] += 1
            if n[0] == k:
                fired[0] = True
                _thread.interrupt_main()  # raised right here, in the profiled code

    raised = False
    sys.setprofile(profiler)
    try:
        try:
            op()
        finally:
            sys.setprofile(None)
        _noop()  # a pending interrupt lands here at the latest
    except KeyboardInterrupt:
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
            if _same(now, before):
                seen["before"] += 1
            elif _same(now, after):
                seen["after"] += 1
            else:
                raise AssertionError(
                    f"interrupt at event {k}/{total}: neither before nor after: {now}"
                )
            seen["raised"] += raised
            assert time.monotonic() - start < BOUND
        assert seen["raised"], "no interrupt was ever raised"
        assert seen["after"], "the uninterrupted run did not end at the after-values"
        return seen
    finally:
        faulthandler.cancel_dump_traceback_later()
