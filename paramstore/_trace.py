"""Binding frames: the one mechanism behind ``ps.pure``, the gradients and ``ps.function``.

A *frame* binds variables to values (often tracers) for the duration of a call, on the
current thread only. While a frame is active, ``Variable.value()`` returns the bound value
and ``Variable.assign`` rebinds it; the real variables are never touched. Frames nest:

* a *pure* frame (``ps.pure``) binds a fixed set of variables; reads of other variables
  pass through to the enclosing frame (or the real value); an assign to a variable
  outside its set is an error, because its new value could not be returned.
* an *open* frame (``ps.grad``) is a pure frame that also records assigns to variables
  outside its set, so they can be applied after the call.
* a *capture* frame (``ps.function``'s trace) is a pure frame with an open set: the first
  read of any variable records it and returns a fresh alias of its array (zero-copy), so
  the traced jaxpr holds that alias as a constant which ``ps.function`` then lifts to an
  input. Every assign is recorded and becomes an output.

``depth`` counts active frames over all threads, so ``Variable.value()`` costs one global
check when no frame is active anywhere.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
    from paramstore.variable import Variable

Tracer = jax.core.Tracer

depth = 0  # active frames, all threads together
_depth_lock = threading.Lock()
_local = threading.local()

NON_FIRST_TRACE = "ps.function-decorated function tried to create variables on non-first trace."


class Frame:
    """Variables bound to values for one call (see the module docstring)."""

    __slots__ = (
        "values",
        "assigned",
        "captured",
        "capture",
        "open",
        "allow_create",
        "owner",
    )

    def __init__(
        self,
        owner: str,
        bound: dict[int, Any] | None = None,
        *,
        capture: bool = False,
        open: bool = False,
        allow_create: bool = True,
    ) -> None:
        self.owner = owner
        # id(variable) -> its value here. The variables behind the ids stay alive: bound ones
        # are held by the caller, the others by `captured` (reads) or `assigned` (writes).
        self.values: dict[int, Any] = dict(bound or {})
        self.assigned: dict[int, Variable] = {}
        self.captured: dict[int, tuple[Variable, Any]] = {}
        self.capture = capture
        self.open = open or capture
        self.allow_create = allow_create


def _stack() -> list[Frame]:
    stack: list[Frame] | None = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def active() -> bool:
    """Whether a frame is active on this thread."""
    return bool(depth and getattr(_local, "stack", None))


@contextlib.contextmanager
def push(frame: Frame) -> Iterator[Frame]:
    global depth
    stack = _stack()
    stack.append(frame)
    with _depth_lock:
        depth += 1
    try:
        yield frame
    finally:
        stack.pop()
        with _depth_lock:
            depth -= 1


def _alias(value: Any) -> Any:
    """A new Python object for the same buffer(s), so that each variable's constant has its
    own identity in a jaxpr even when two variables share one array."""
    if isinstance(value, jax.Array) and not isinstance(value, Tracer):
        shards = [s.data for s in value.addressable_shards]
        return jax.make_array_from_single_device_arrays(value.shape, value.sharding, shards)
    return value


def _read(stack: list[Frame], i: int, var: Variable) -> Any:
    key = id(var)
    while i >= 0:
        frame = stack[i]
        if key in frame.values:
            return frame.values[key]
        if frame.capture:
            outer = _read(stack, i - 1, var)
            value = _alias(outer)
            frame.values[key] = value
            frame.captured[key] = (var, value)
            return value
        i -= 1
    return var._value


def read(var: Variable) -> Any:
    """The value ``var`` has on this thread: bound by a frame, or its real value."""
    stack = getattr(_local, "stack", None)
    if not stack:
        return var._value
    if var._is_string:
        raise TypeError(
            f"Variable '{var.name}' holds strings (host-side NumPy data) and cannot be used "
            f"inside {stack[-1].owner}. Read it outside the compiled or transformed function "
            "and pass what you need as a static argument."
        )
    return _read(stack, len(stack) - 1, var)


def bind(var: Variable, value: Any) -> bool:
    """Rebind ``var`` in the innermost frame that owns it. False when no frame is active."""
    stack = getattr(_local, "stack", None)
    if not stack:
        return False
    key = id(var)
    for frame in reversed(stack):
        if key in frame.values or frame.open:
            frame.values[key] = value
            frame.assigned[key] = var
            return True
        raise ValueError(
            f"{frame.owner} assigned variable '{var.name}', which is not among the variables "
            "it was given, so its new value could not be returned. Pass that variable too "
            "(e.g. model.variables rather than model.trainable_variables)."
        )
    return False


def check_create() -> None:
    """Raise when a variable may not be created here (a non-first ps.function trace)."""
    for frame in getattr(_local, "stack", ()):
        if not frame.allow_create:
            raise ValueError(
                NON_FIRST_TRACE + " Create variables outside the function, or only on its "
                "first call (e.g. `if self.w is None: self.w = ps.Variable(...)`)."
            )
