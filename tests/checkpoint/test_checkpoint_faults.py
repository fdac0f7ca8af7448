"""On-disk faults of issue 36 and issue 38 (item 4): what an interrupt (Ctrl-C, swept over
every point where CPython can run a signal's handler), a kill, a concurrent writer or a
hostile Hugging Face file does to checkpoints and exports. Whole or absent on disk, no
temporary left, no descriptor closed twice, no lock or thread left behind, and the
KeyboardInterrupt arrives as itself."""

from __future__ import annotations

import _thread
import gc
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _interrupting import _tracer, count_events

from paramstore.checkpoint import io as ckio

BOUND = 120.0  # seconds for one sweep


@pytest.fixture(autouse=True)
def default_sigint_handler():
    """Python's own SIGINT handler (what ``_thread.interrupt_main`` reaches) during each test."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def interrupted(op: Callable[[], Any], k: int) -> tuple[bool, BaseException | None]:
    """Run ``op`` with an interrupt at its k-th point: (it fired, what was raised)."""
    n, fired = [0], [False]

    def point() -> None:
        n[0] += 1
        if n[0] == k:
            fired[0] = True
            _thread.interrupt_main()

    error: BaseException | None = None
    sys.settrace(_tracer(point))
    try:
        try:
            op()
        finally:
            sys.settrace(None)
        (lambda: None)()  # a pending interrupt lands here at the latest
    except BaseException as e:  # noqa: BLE001 - what arrived, checked by the caller
        error = e
    return fired[0], error


def points(op: Callable[[], Any], most: int | None = None) -> list[int]:
    total = count_events(op)
    ks = list(range(1, total + 2))
    if most is not None and most < len(ks):
        ks = sorted({int(x) for x in np.linspace(1, total, most)})
    return ks


def open_fds() -> set[int]:
    return set(int(n) for n in os.listdir("/proc/self/fd"))


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")


# ------------------------------------------------------------ open_regular (item 4)


@needs_proc
def test_open_regular_interrupted_anywhere_closes_its_descriptor_exactly_once(tmp_path):
    """An interrupt right after the open closed the descriptor twice (through the dropped
    file object and in the except clause): another thread's file could be closed under it,
    or Ctrl-C surfaced as OSError EBADF."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 64)
    unraisable: list[Any] = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:

        def op() -> None:
            with ckio.open_regular(str(path)) as f:
                f.read(8)

        gc.collect()
        before = open_fds()
        start = time.monotonic()
        raised = 0
        for k in points(op):
            fired, error = interrupted(op, k)
            gc.collect()
            assert error is None or isinstance(error, KeyboardInterrupt), (k, repr(error))
            raised += error is not None
            assert open_fds() == before, f"interrupt at point {k}: a descriptor leaked"
            assert not unraisable, (k, [u.exc_value for u in unraisable])
            assert time.monotonic() - start < BOUND
        assert raised >= 5
    finally:
        sys.unraisablehook = old_hook
