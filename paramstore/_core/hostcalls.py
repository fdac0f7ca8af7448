"""Host callbacks of a running compiled call: what they may not do, and how to tell them.

A ``ps.function`` call of a program with host callbacks (``jax.debug.callback``,
``io_callback``, ``pure_callback``) holds the state lock until it has written its results,
so that it is atomic with other threads' writes (``_core.ownership``). Its callbacks run
meanwhile, on the calling thread (XLA:CPU runs them inline) or on an XLA runtime thread
(which Python knows only as a dummy thread): a read there sees the values from before the
call, and a write (an assign, a compiled call) raises ``CallbackWriteError``, since it could
only be overwritten by the call's results or wait for the call forever.
"""

from __future__ import annotations

import threading

__all__ = ["CallbackWriteError", "refused", "foreign_thread"]


class CallbackWriteError(RuntimeError):
    """Raised by a write (an assign, a compiled call) made by a host callback of a compiled
    program that is running: the call holds the state lock until it has written its own
    results, so the write could only be lost or deadlock. Nothing is changed."""


def refused() -> CallbackWriteError:
    """The error for a write from a host callback of a running call."""
    return CallbackWriteError(
        "Cannot assign variables (or call a ps.function) from a host callback "
        "(jax.debug.callback, io_callback, pure_callback) of a running ps.function: the call "
        "is atomic and writes its own results when its program ends, so this write would be "
        "lost or wait forever. Reading variables there is allowed (it sees their values from "
        "before the call); return the value from the callback, or assign after the call."
    )


def foreign_thread() -> bool:
    """Whether this thread was not started by Python (an XLA runtime thread running a host
    callback: ``threading`` knows it only as a dummy)."""
    return isinstance(threading.current_thread(), threading._DummyThread)
