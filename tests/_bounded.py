"""Bounded waits for tests of hostile input: a hang fails the test instead of blocking CI."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

BOUND = 10.0  # seconds: anything longer is a hang


def in_thread(fn: Callable[[], Any], timeout: float = BOUND) -> BaseException | None:
    """Run ``fn`` in a daemon thread; fail (not hang) if it does not return in time.

    Returns the exception ``fn`` raised, or None."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert out, f"still blocked after {timeout} s"
    return out[0]
