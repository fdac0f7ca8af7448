"""Binding frames: the one mechanism behind ``ps.function``, ``ps.pure`` and the gradients.

A *frame* binds variables to values (usually tracers) for the duration of a call, on the
current thread only. While a frame is active, ``Variable.value()`` returns the bound value
and an assign rebinds it; the real variables are never touched. Frames nest:

* a *pure* frame (``ps.pure``) binds a fixed set of variables; reads of other variables
  pass through to the enclosing frame (or the real value); assigning a variable outside
  its set is an error, because its new value could not be returned.
* an *open* frame (``ps.grad``) is a pure frame that also records assigns to variables
  outside its set, so they can be applied after the call.
* a *capture* frame (``ps.function``'s trace) has an open set: the first read of a variable
  records a zero-copy alias of its array as a constant of the jaxpr (which ``ps.function``
  lifts to an input) and binds the variable to that constant's tracer, so a concrete read
  (``float(v)``) raises JAX's concretization error instead of baking a value in. Variables
  created with a traced initial value are bound here too (``create``).

State inside control flow. A binding is a plain Python value while it is used in the
frame's own trace (its *base*: the trace that was current when the frame was pushed). The
first time a variable is read or written from a nested trace (a ``lax.fori_loop``, ``scan``,
``while_loop``, ``cond``/``switch`` body, ``jax.checkpoint``, ``jax.vmap``, ``jax.grad``...),
its binding is promoted to a ``jax.new_ref`` created in the base trace; from then on reads
and writes are ref effects, which every JAX transformation threads through its bodies, and
the frame's result is the ref's final value. Straight-line code never creates a ref, so
its jaxpr is exactly what a hand-written pure function gives.

Abstract variables (``ps.abstract()``) have no value to capture or read through: they read
and assign only what a frame binds them to (``bound``): a higher layer may bind abstract
variables to slices of stacked arrays inside a ``lax.scan`` body, say. A ``shapes`` frame
(a trace that only learns shapes, such as one under ``jax.eval_shape``) binds any abstract
variable read inside it to zeros staged in its trace, so code is traced for its shapes
without a value existing.

``depth`` counts active frames over all threads, so ``Variable.value()`` costs one global
check when no frame is active anywhere.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from paramstore._core.context import ctx
from paramstore._core.jax_api import (
    EVAL,
    Tracer,
    current_trace,
    forget_traced_bodies,
    in_shard_map,
    in_trace,
    in_while_body,
    in_while_cond,
    ref_in,
    staging,
    trace_of,
    tracer_in,
    vmap_home,
)
from paramstore._core.ownership import ownership

if TYPE_CHECKING:  # the class sits above this module: a name for annotations only
    from jax.core import Trace
    from jax.ref import Ref

    from paramstore.variable import Variable

__all__ = [
    "Frame",
    "Restage",
    "CreationRefused",
    "PURE",
    "OPEN",
    "CAPTURE",
    "push",
    "active",
    "read",
    "bound",
    "bind",
    "create",
]


PURE, OPEN, CAPTURE = 0, 1, 2
depth = 0  # active frames, all threads together
_depth_lock = threading.Lock()

NON_FIRST_TRACE = "ps.function-decorated function tried to create variables on non-first trace."


class CreationRefused(ValueError):
    """A variable created where a frame refuses creation (``check_create``: a non-first
    ``ps.function`` trace, or a frame made with ``allow_create=False``). Its own class, so
    a caller that words the error for its users tells it apart by type, not by text."""


class Restage(BaseException):
    """Raised out of a frame that JAX will run eagerly (an eager ``ps.pure`` or gradient)
    when a ``while_loop`` condition reads a variable the loop body assigns: JAX would run
    that loop with a condition that never sees the body's assigns. Nothing has run yet (the
    loop is being traced); the outermost eager entry catches it and runs the whole call as a
    compiled program that paramstore discharges itself (``functional``'s stager, a
    ``ps.function``). A BaseException, so that user code's ``except Exception`` passes it."""


class Frame:
    """Variables bound to values for one call (see the module docstring)."""

    __slots__ = (
        "owner",
        "kind",
        "base",
        "values",
        "refs",
        "vars",
        "assigned",
        "captured",
        "created",
        "allow_create",
        "shapes",
        "cond_reads",
    )

    def __init__(
        self,
        owner: str,
        kind: int = PURE,
        bound: list[tuple[Variable, jax.Array]] | None = None,
        *,
        allow_create: bool = True,
        shapes: bool = False,
    ) -> None:
        self.owner = owner
        self.kind = kind
        self.base: Trace = EVAL  # set by push
        # id(variable) -> its value (or ref) here; `vars` keeps the variables alive.
        self.values: dict[int, jax.Array] = {}
        self.refs: dict[int, Ref] = {}
        self.vars: dict[int, Variable] = {}
        self.assigned: dict[int, Variable] = {}
        self.captured: dict[int, tuple[Variable, jax.Array]] = {}
        self.created: list[tuple[Variable, jax.Array]] = []
        self.allow_create = allow_create
        self.shapes = shapes  # binds abstract variables to zeros on first read (see bound)
        # ids read in a while_loop condition of a program JAX discharges (see _check_nested)
        self.cond_reads: set[int] = set()
        for var, value in bound or ():
            self.values[id(var)] = value
            self.vars[id(var)] = var

    def get(self, key: int) -> jax.Array:
        if current_trace() is self.base:
            ref = self.refs.get(key)
            return self.values[key] if ref is None else ref[...]
        self._check_nested(key, "read")
        ref = self.refs.get(key)
        return (ref if ref is not None else self._promote(key))[...]

    def _check_nested(self, key: int, what: str) -> None:
        var = self.vars.get(key)
        name = var.name if var is not None else "?"
        if not self._own_program():
            self._check_while(key, what, name)
        if in_shard_map(self.base):
            raise TypeError(
                f"Variable '{name}' was {what} inside a jax.shard_map body, where each "
                "device sees its own shard and a variable's single value cannot be read or "
                "written. Pass its value in as an argument of the shard_map "
                "(v.value()) and assign the result outside the body."
            )

    def _own_program(self) -> bool:
        """Whether paramstore discharges this frame's refs itself (they are in a
        ``ps.function``'s jaxpr: its capture frame is at the bottom of the stack), with
        ``_core.loops``' while_loop rewrite. Otherwise (``ps.pure`` or a gradient under a plain
        ``jax.jit``) JAX discharges them, with its own rule."""
        stack = ctx.frames
        return bool(stack) and stack[0].kind == CAPTURE

    def _check_while(self, key: int, what: str, name: str) -> None:
        """A variable read in a ``while_loop`` condition and assigned in a loop body of a
        program that JAX discharges: JAX gives the condition a copy of it that the body's
        assigns never reach, so the loop would not end (``_core.loops``). Run eagerly, the
        call is staged instead (``Restage``); under a plain JAX transformation it is refused."""
        if what == "read":
            if in_while_cond(self.base):
                self.cond_reads.add(key)
        elif key in self.cond_reads and in_while_body(self.base):
            if not staging(self.base):
                raise Restage(name)
            raise TypeError(
                f"Variable '{name}' is read in a jax.lax.while_loop condition and assigned "
                f"in the loop body inside {self.owner} under a plain JAX transformation "
                "(jax.jit ...). JAX (every release through 0.12) would give the condition a copy of it that the "
                "body's assigns never reach, so the loop would not end. Run the loop in a "
                "ps.function (which handles this), or carry the value through the loop "
                "(jax.lax.while_loop(cond, body, v.value())) and assign the result after it."
            )

    def put(self, key: int, value: jax.Array, name: str = "", update: str = "") -> None:
        """Bind ``value`` (``update``: the name of the op it results from, e.g.
        ``assign_add``, which reads what it writes)."""
        ref = self.refs.get(key)
        if ref is None:
            if current_trace() is self.base:
                self.values[key] = value
                return
            ref = self._promote(key)
        self._check_nested(key, "assigned")
        if in_while_cond(self.base):
            raise TypeError(
                f"Variable '{name}' was assigned in a jax.lax.while_loop condition. JAX "
                "evaluates a condition a number of times of its own choosing while tracing "
                "and running the loop, so the assign could not happen as often as eager "
                "code would. Assign it in the loop body (or before the loop) and only read "
                "variables in the condition."
            )
        home, batched = vmap_home(value, self.base)
        if batched:
            raise TypeError(
                f"Variable '{name}' was assigned a value that varies over the batch of an "
                "enclosing jax.vmap, but a variable holds one value, not one per example. "
                "Return the per-example values from the vmapped function and assign a "
                "reduction of them outside it (e.g. v.assign(per_example.mean(axis=0))), or "
                "vmap over ps.pure(fn, variables) to get one copy of the state per example."
            )
        if home is not None and update:
            raise TypeError(
                f"Cannot {update} variable '{name}' inside a jax.vmap body: run row by row, "
                "as eager code would, it would apply once per example, which a vmapped "
                "body cannot express. Sum the per-example deltas and apply them outside "
                f"the vmap (v.{update}(deltas.sum(axis=0)))."
            )
        if home is None:
            ref[...] = value
        else:  # a batch-independent value: written once, in the trace around the vmaps
            with in_trace(home):
                ref[...] = value

    def _promote(self, key: int) -> Ref:
        ref = self.refs[key] = ref_in(self.base, self.values[key])
        return ref

    def final(self, var: Variable) -> jax.Array:
        """``var``'s value at the end of the frame (call it in the base trace)."""
        ref = self.refs.get(id(var))
        return ref[...] if ref is not None else self.values[id(var)]

    def capture(self, var: Variable, outer: jax.Array) -> None:
        """Bind ``var`` to a new constant of this (capture) frame's jaxpr holding ``outer``."""
        alias = _alias(outer)
        self.values[id(var)] = tracer_in(self.base, alias)
        self.vars[id(var)] = var
        self.captured[id(var)] = (var, alias)


def active() -> bool:
    """Whether a frame is active on this thread."""
    return bool(depth and ctx.frames)


@contextlib.contextmanager
def push(frame: Frame) -> Iterator[Frame]:
    global depth
    frame.base = current_trace()
    stack = ctx.frames
    stack.append(frame)
    with _depth_lock:
        depth += 1
    try:
        yield frame
    finally:
        stack.pop()
        if frame.refs:  # bodies JAX cached during the frame close over its refs
            forget_traced_bodies()
        with _depth_lock:
            depth -= 1


def _alias(value: jax.Array) -> jax.Array:
    """A new Python object for the same buffer(s), so that each variable's constant has its
    own identity in a jaxpr even when two variables share one array."""
    if isinstance(value, jax.Array) and not isinstance(value, Tracer):
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):  # a typed key array
            with jax.ensure_compile_time_eval():  # concrete, not ops of the current trace
                data = jax.random.key_data(value)
                return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
        shards = [s.data for s in value.addressable_shards]
        return jax.make_array_from_single_device_arrays(value.shape, value.sharding, shards)
    return value


def _lookup(stack: list[Frame], i: int, var: Variable, captured: bool = False) -> jax.Array:
    """``var``'s value seen from frame ``i`` down (``captured``: for a capture frame above,
    which turns a real value into an input of its program, so nothing is baked in)."""
    key = id(var)
    while i >= 0:
        frame = stack[i]
        if key in frame.values:
            return frame.get(key)
        if frame.kind == CAPTURE:
            frame.capture(var, _lookup(stack, i - 1, var, captured=True))
            return frame.get(key)
        i -= 1
    # captured: the array becomes a constant of the trace, so it is handed out (a step in
    # another thread may not donate it while the trace, which holds no lock, uses it)
    return ownership.hand_out(var) if captured else outside(var)


def outside(var: Variable) -> jax.Array:
    """``var``'s real value, refused where a trace would bake it in as a constant."""
    trace = current_trace()
    if trace is not EVAL and staging(trace):
        raise TypeError(
            f"Variable '{var.name}' was read inside a JAX trace that compiles (jax.jit, "
            "jax.lax control flow, jax.make_jaxpr ...) outside any ps.function or ps.pure: "
            "its current value would be baked into the compiled program as a constant and "
            "go stale after the next assign. Decorate the outer function with @ps.function, "
            "or pass the variable's values in with ps.pure(fn, variables). To export a "
            "model with its current values as constants, close over ps.state(model) in a "
            "ps.pure function (see docs/state.md)."
        )
    return ownership.hand_out(var)


def read(var: Variable) -> jax.Array:
    """The value ``var`` has on this thread: bound by a frame, or its real value."""
    stack = ctx.frames
    if not stack:
        return outside(var)
    if var._is_string:
        raise TypeError(
            f"Variable '{var.name}' holds strings (host-side NumPy data) and cannot be used "
            f"inside {stack[-1].owner}. Read it outside the compiled or transformed function "
            "and pass what you need as a static argument."
        )
    return _lookup(stack, len(stack) - 1, var)


def bound(var: Variable) -> jax.Array | None:
    """The value when an active frame binds the ABSTRACT variable ``var`` (which has
    no value of its own, so nothing is captured or read through), as a scan body's frame
    binds abstract variables to the current slices of stacked arrays. A frame made with
    ``shapes=True`` (a trace that only learns shapes) binds an abstract variable it does
    not hold to zeros of its shape and dtype, staged in its own trace, on first read. None
    when no frame binds it."""
    key = id(var)
    for frame in reversed(ctx.frames):
        if key in frame.values:
            return frame.get(key)
        if frame.shapes:
            with in_trace(frame.base):
                frame.values[key] = jnp.zeros(var.shape, var.dtype)
            frame.vars[key] = var
            return frame.get(key)
    return None


def bind(var: Variable, value: jax.Array, update: str = "") -> bool:
    """Rebind ``var`` in the innermost frame that owns it. False when no frame is active."""
    stack = ctx.frames
    if not stack:
        return False
    key = id(var)
    for i in range(len(stack) - 1, -1, -1):
        frame = stack[i]
        if key not in frame.values:
            if frame.kind == PURE:
                raise ValueError(
                    f"{frame.owner} assigned variable '{var.name}', which is not among the "
                    "variables it was given, so its new value could not be returned. Pass "
                    "that variable too (e.g. model.variables rather than "
                    "model.trainable_variables)."
                )
            if current_trace() is not frame.base:  # a nested write updates a ref of the
                if frame.kind == CAPTURE:  # value before it: bind that value first
                    frame.capture(var, _lookup(stack, i - 1, var, captured=True))
                else:
                    frame.values[key] = _lookup(stack, i - 1, var)
                    frame.vars[key] = var
            else:
                frame.vars[key] = var
        frame.put(key, value, var.name, update)
        frame.assigned[key] = var
        return True
    return False


def check_create() -> None:
    """Raise when a variable may not be created here (a non-first ps.function trace)."""
    for frame in ctx.frames:
        if not frame.allow_create:
            raise CreationRefused(
                NON_FIRST_TRACE + " Create variables outside the function, or only on its "
                "first call (e.g. `if self.w is None: self.w = ps.Variable(...)`)."
            )


def creation_trace() -> Trace | None:
    """Where a new variable's initializer should run: the base trace of the enclosing
    capture frame (so a layer built inside ps.grad or a lax.scan body still gets an
    initial value the trace can compute), else None (the current trace)."""
    stack = ctx.frames
    return stack[0].base if stack and stack[0].kind == CAPTURE else None


def create(var: Variable, value: jax.Array) -> None:
    """Bind a variable created with a traced initial value in the enclosing capture frame.

    The value is copied to a jaxpr variable of its own, which ``ps.function`` turns into an
    input after the trace (and computes once, as the variable's initial value)."""
    stack = ctx.frames
    frame = stack[0] if stack and stack[0].kind == CAPTURE else None
    if frame is None or trace_of(value) is not frame.base:
        where = stack[-1].owner if stack else "a plain JAX transformation (jax.jit, ...)"
        raise ValueError(
            f"The initial value of variable '{var.name}' is a traced value computed inside "
            f"{where}, where it cannot become a variable's state. Create variables in the "
            "body of a ps.function itself (not inside ps.pure, ps.grad, a lax control-flow "
            "body or a plain jax.jit), or outside it, or pass a concrete value or a "
            "callable (e.g. ps.Variable(lambda: jnp.zeros(shape)))."
        )
    with in_trace(stack[0].base):  # (frame.base) a jaxpr variable of its own, not `value`
        copy = jnp.array(value, copy=True)
    frame.values[id(var)] = copy
    frame.vars[id(var)] = var
    frame.created.append((var, copy))


@contextlib.contextmanager
def no_frames() -> Iterator[None]:
    """Run a block as if no frame were active on this thread (for state that is created
    once and shared, such as the global generator)."""
    saved = ctx.frames
    ctx.frames = []
    try:
        yield
    finally:
        ctx.frames = saved
