"""Interrupt safety: ``deferred()`` holds back signal handlers' exceptions over a region.

Python runs a signal's handler (``KeyboardInterrupt`` from Ctrl-C, ``_thread.interrupt_main``,
any exception a user's handler raises) in the main thread only, between two bytecodes. So
an exception can land at any line of Python code that changes variables, and one that lands
after a buffer was donated but before the new arrays were stored would leave variables on
deleted buffers. Two tools keep every change of variables all-or-nothing:

* **No handler runs inside one C call**: the hot paths (a compiled step's dispatch, an
  eager ``assign_add``) dispatch a donating program and keep its results in one C call
  (see ``_core.ownership``), and an exception after it first stores those results; this
  costs a few hundred nanoseconds.
* **Anything else is deferred**: inside ``with deferred():`` (main thread), every signal
  whose handler is Python code gets a stand-in that records it; when the outermost region
  ends, the real handlers are put back and called, in order, for what was recorded, so the
  exception is raised right after the region (Ctrl-C still stops a training loop). It costs
  about 50-100 us (one look at every signal's handler), so it guards the cold paths only: a
  compiled program's first call, restores, ``ps.update``, ``jit_compile=False`` steps.

In a thread other than the main one ``deferred()`` does nothing: no signal handler runs
there.

From jax 0.11, an interrupt that lands inside JAX's ``Primitive.bind`` can leave the thread
with no current JAX trace, after which every JAX operation in that thread fails. A region
puts the trace back on its way in and out (``jax_api.repair_trace``), and so do the slow
paths of variable reads and assigns (``jax_api.staging``): the next operation works.
"""

from __future__ import annotations

import signal
import threading
from collections import deque
from collections.abc import Callable, Iterable
from itertools import repeat
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, cast

from paramstore._core.jax_api import current_trace, repair_trace

if TYPE_CHECKING:  # annotations only
    from jax.core import Trace

__all__ = ["deferred"]

_MAIN = threading.main_thread().ident
_EXHAUST: Callable[[Iterable[Any]], None] = deque(
    maxlen=0
).extend  # runs an iterator to its end, in C
_SIGNALS = tuple(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))


class _State:
    depth = 0
    trace: Trace | None = None  # the current JAX trace when the outermost region began
    saved: dict[int, Any] = {}  # signal -> the handler the stand-in replaced
    pending: list[tuple[int, FrameType | None]] = []


def _record(signum: int, frame: FrameType | None) -> None:
    """The stand-in handler: the signal is delivered when the region ends."""
    _State.pending.append((signum, frame))


class deferred:
    """``with deferred():`` runs its body with signal handlers' exceptions held back until
    the outermost such region ends (see the module docstring). Re-entrant."""

    __slots__ = ()

    def __enter__(self) -> None:
        if threading.get_ident() != _MAIN:
            return
        if _State.depth == 0:
            repair_trace()  # an earlier interrupt inside JAX's bind may have left none
            _State.trace = current_trace()
            wanted = [s for s in _SIGNALS if _python_handler(signal.getsignal(s))]
            # One C call installs them all (no bytecode between two installs); a signal
            # that arrives meanwhile raises from signal.signal: undo what was installed.
            old: list[Any] = []
            try:
                _EXHAUST(map(old.append, map(signal.signal, wanted, repeat(_record))))
            except BaseException:
                _restore(dict(zip(wanted, old)))
                raise
            _State.saved = dict(zip(wanted, old))
        _State.depth += 1

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if threading.get_ident() != _MAIN or _State.depth == 0:
            return
        _State.depth -= 1
        if _State.depth:
            return
        saved, _State.saved = _State.saved, {}
        repair_trace(_State.trace)  # jax >= 0.11: see jax_api.repair_trace
        _restore(saved)
        pending, _State.pending = _State.pending, []
        for signum, frame in pending:
            handler = saved.get(signum, signal.getsignal(signum))
            if _python_handler(handler):
                cast(Callable[[int, Any], None], handler)(
                    signum, frame
                )  # may raise: right after the region


def _python_handler(handler: object) -> bool:
    return callable(handler) and handler is not _record


def _restore(saved: dict[int, Any]) -> None:
    """Put the real handlers back, every one even if a signal arrives meanwhile (then its
    exception is raised once all are back)."""
    error: BaseException | None = None
    for s, handler in saved.items():
        for _ in range(3):  # signal.signal first runs a pending signal's handler
            try:
                signal.signal(s, handler)
                break
            except (ValueError, OSError):
                break
            except BaseException as e:
                error = e
    if error is not None:
        raise error
