"""``ps.function``: compile a stateful Python function with ``jax.jit``.

How it works. For each new signature (argument shapes/dtypes, static arguments, and the
identity of Variables/Modules passed as arguments) the function is traced **once** with
``jax.make_jaxpr`` inside a capture frame (see ``_core.frames``):

* the first read of each variable records a zero-copy alias of its array as a constant of
  the jaxpr and binds the variable to that constant's tracer; the constants are then
  *lifted* to inputs, so nothing is baked in: every call passes the variables' current
  arrays. A concrete read (``float(v)``) raises JAX's concretization error.
* every assign is recorded; the final values become extra outputs, swapped into the
  variables after the call. Reads and assigns inside ``lax`` control flow, ``jax.vmap``,
  ``jax.checkpoint`` and ``jax.grad`` bodies are ref effects (``_core.frames``), which the
  compiled program threads through those bodies.
* variables created during the first trace from a traced value (a layer that builds
  itself from its input's shape) get their value from a small program cut out of the
  trace (the computation of their initial values only), run once right after the trace;
  in the step itself they are inputs like any other variable. An initial value that
  depends on the *values* of the arguments is a ``ValueError``.
* the lifted jaxpr is run by ``jax.jit``, whose C++ dispatch does the per-call work; our
  own per-call cost is a dict lookup on the signature and a few C-level list operations.

Donation. A variable that the function both reads and assigns has its input buffer
donated, so XLA updates it in place, but only a buffer the variable owns (one that came
out of its own computation) and that was never handed out (``value()``, ``np.asarray``, a
step's output...: ``_core.ownership`` records each hand-out by identity, no reference counts):
any other is copied once first, so an array the user holds stays valid. A program with
host callbacks (``jax.debug.callback``, ``io_callback`` ...), which can raise while it
runs, donates nothing and is waited for before its results are swapped in, so a run-time
error leaves every variable as it was. ``donate=False`` turns donation off.

Errors and interrupts (issue 28). Each call is all-or-nothing: an exception in the
function, an error while the program runs, or a ``KeyboardInterrupt`` (Ctrl-C, any
signal handler's exception) at any point leaves every variable readable and at its value
from before the call or, all of them, from after it. A program's first call is waited for
before its results are swapped in (on CPU it donates private copies, as XLA:CPU allocates
a program's temporaries while it runs, after the donation), so an error that the program
raises when it first runs (out of memory: ``RESOURCE_EXHAUSTED``) changes nothing; later
calls run asynchronously like ``jax.jit``'s and need the memory the first call needed. A
signal arriving during a call is handled right after it (see ``_core.ownership``).

Threads. Each call gathers its inputs, dispatches and swaps its outputs under the state
lock (``_core.context.STATE_LOCK``), so it is atomic with respect to the variables it touches;
dispatch is asynchronous, so the lock is held for microseconds, not for the computation.
Tracing and compiling never hold it (a first call compiles outside it, then checks under
it that nothing the trace depends on changed meanwhile, else traces again). A program with
host callbacks holds it until it has finished and written (atomic too); its callbacks may
read variables (the values from before the call), and one that assigns raises.

Variables may be created during the first trace only; creating one on a later trace
raises ``ValueError``. A trace that fails creates nothing it cannot keep: variables it
created stay in their store (with their initial values); those it could not give a value
(an initial value that depends on the arguments' values, an interrupt) leave their store
and raise ``ValueError`` naming them on every use (``_function.failed``). A ``ps.function`` called inside
another, or inside ``ps.pure``/``ps.grad``, is inlined; one that assigns variables (or
reads them under ``jax.jit``) called inside a plain JAX transformation raises TypeError.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Generic, ParamSpec, TypeVar, overload

import jax

from paramstore._core import frames
from paramstore._core.context import TRACE_EPOCH
from paramstore._core.jax_api import ARRAY_TYPE
from paramstore._core.ownership import ownership
from paramstore._function.entry import Entry, StaleProgram
from paramstore._function.static import split, static_args, unhashable_message
from paramstore._function.trace import Shardings, is_ref, trace_signature
from paramstore._variable.initial import flag
from paramstore.functional import register_stager
from paramstore.module import Module
from paramstore.variable import Variable

__all__ = ["function", "Function", "Shardings"]

P = ParamSpec("P")
R = TypeVar("R")


def _leaf_key(x: Any) -> Any:
    """What a trace depends on: the abstract value (as jax.jit), or a reference's identity."""
    if type(x) is ARRAY_TYPE:
        return x.aval
    if isinstance(x, (Variable, Module)):
        return id(x)
    try:
        return jax.typeof(x)  # NumPy arrays, Python scalars, tracers: the same avals
    except TypeError:
        raise TypeError(
            f"ps.function got an argument of type {type(x).__name__} ({x!r:.60}), which is not an "
            "array, a Variable or a Module. Mark it static with static_argnums/static_argnames."
        ) from None


class Function(Generic[P, R]):
    """A compiled stateful function; see the module docstring. ``trace_count`` counts traces.

    It keeps at most ``max_traces`` traced signatures (each with its compiled program);
    beyond that the least recently called one is dropped (and traced again if called
    again). ``clear_cache()`` drops them all."""

    max_traces = 64

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        static_argnums: int | Iterable[int] = (),
        static_argnames: str | Iterable[str] = (),
        donate: bool = True,
        in_shardings: Shardings = None,
        out_shardings: Shardings = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"ps.function expects a callable, got {type(fn).__name__}.")
        flag(donate, "donate", "ps.function")
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._name: str = getattr(fn, "__name__", type(fn).__name__)
        self._donate = bool(donate)
        self._in_shardings = in_shardings
        self._out_shardings = out_shardings
        self._static_argnums, self._static_argnames = static_args(
            fn, static_argnums, static_argnames
        )
        self._cache: dict[Any, Entry] = {}
        self._fast: dict[tuple[Any, ...], Entry] = {}  # (n, *avals) of all-array calls
        self._simple = not (self._static_argnums or self._static_argnames)
        self._bound: weakref.ref[Any] | None = None
        self._instances: dict[int, Function[..., R]] = {}
        self._lock = threading.RLock()
        self.trace_count = 0

    # -- methods: one Function per instance, as tf.function does
    def __get__(self, instance: Any, owner: Any = None) -> Function[..., R]:
        if instance is None:
            return self
        key = id(instance)
        bound = self._instances.get(key)
        if bound is None or bound._bound is None or bound._bound() is not instance:
            bound = Function(
                self._fn,
                static_argnums=self._static_argnums,
                static_argnames=self._static_argnames,
                donate=self._donate,
                in_shardings=self._in_shardings,
                out_shardings=self._out_shardings,
            )
            bound._bound = weakref.ref(instance)
            bound._simple = False  # the instance is passed first: the general path
            self._instances[key] = bound
            weakref.finalize(instance, self._instances.pop, key, None)
        return bound

    def __deepcopy__(self, memo: dict[int, Any]) -> Function[P, R]:
        """A new compiled function of the same Python function (its traces are not shared)."""
        new = Function(
            self._fn,
            static_argnums=self._static_argnums,
            static_argnames=self._static_argnames,
            donate=self._donate,
            in_shardings=self._in_shardings,
            out_shardings=self._out_shardings,
        )
        memo[id(self)] = new
        return new

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run the compiled function (tracing it for a new signature first); assigned
        variables are updated after the call."""
        if self._simple and not kwargs and not frames.depth:
            # The common call: arrays only, no static arguments, no frame anywhere. Keyed
            # on the avals alone; the general path below costs ~5 us more per call.
            fast: list[Any] = [len(args)]
            for a in args:
                if type(a) is not ARRAY_TYPE:
                    break
                fast.append(a.aval)  # type: ignore[attr-defined]
            else:
                entry = self._fast.get(tuple(fast))
                if entry is not None and entry.epoch == TRACE_EPOCH.epoch:
                    try:
                        return entry(list(args))  # type: ignore[no-any-return]
                    except StaleProgram:  # a reshard in another thread since the check:
                        entry.epoch = -1  # checked again below, and traced anew

        if self._bound is not None:
            instance = self._bound()
            if instance is None:
                raise ReferenceError("The object this ps.function method is bound to is gone.")
            args = (instance, *args)  # type: ignore[assignment]
        if frames.active():
            return self._fn(*args, **kwargs)  # inside another ps.function or ps.pure: inline
        while True:
            entry, leaves, fast_key = self._entry(tuple(args), dict(kwargs))
            if fast_key is not None:
                self._fast[fast_key] = entry
            try:
                return entry(leaves)  # type: ignore[no-any-return]
            except StaleProgram:
                # ps.sharding.reshard moved a variable it assigns since _entry checked
                # (nothing ran): _entry checks the entry again, finds it stale, traces anew
                entry.epoch = -1

    def lower(self, *args: P.args, **kwargs: P.kwargs) -> jax.stages.Lowered:
        """JAX's ``Lowered`` for the program a call with these arguments runs (its
        ``as_text()``, ``compile()``, ``cost_analysis()``...), without running it or
        changing a variable (a first call's trace may still create variables)."""
        if self._bound is not None:
            instance = self._bound()
            if instance is None:
                raise ReferenceError("The object this ps.function method is bound to is gone.")
            args = (instance, *args)  # type: ignore[assignment]
        entry, leaves, _ = self._entry(tuple(args), dict(kwargs))
        if entry.ref_pos:
            leaves = [leaves[i] for i in entry.array_pos]

        spec = ownership.spec
        lowered: jax.stages.Lowered = entry.runner.lower(  # type: ignore[attr-defined]
            [spec(v) for v in entry.donated], [spec(v) for v in entry.readonly], leaves
        )
        return lowered

    def _entry(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Entry, list[Any], tuple[Any, ...] | None]:
        """The traced entry for these arguments (traced now if new), the flat leaves to
        call it with, and its fast-path key (None when the call does not qualify)."""
        if self._static_argnums or self._static_argnames:
            dyn, static = split(args, kwargs, self._static_argnums, self._static_argnames)
        else:
            dyn, static = (args, kwargs), ()
        leaves, treedef = jax.tree_util.tree_flatten(dyn, is_leaf=is_ref)
        key = (treedef, static, *map(_leaf_key, leaves))
        try:
            entry = self._cache.get(key)
        except TypeError:
            raise TypeError(unhashable_message(self._name, static)) from None
        if entry is not None and entry.epoch != TRACE_EPOCH.epoch and not entry.still_holds():
            with self._lock:  # a flag or sharding it saw has changed: trace anew
                self._evict(key)
                entry = None
        if entry is None or (entry.ref_pos and not entry.alive(leaves)):
            with self._lock:  # one trace per signature, also when threads race to it
                entry = self._cache.get(key)
                if entry is None or (entry.ref_pos and not entry.alive(leaves)):
                    entry = self._trace_signature(key, leaves, treedef, static)
        if (
            self._simple
            and not kwargs
            and not entry.ref_pos
            and all(type(a) is ARRAY_TYPE for a in args)
        ):
            return entry, leaves, (len(args), *(a.aval for a in args))
        return entry, leaves, None

    def clear_cache(self) -> None:
        """Drop every trace and compiled program of this function (and of its methods'
        per-instance copies). Variables are untouched; the next call traces again, and
        creating a variable then is the usual non-first-trace error."""
        with self._lock:
            for key in list(self._cache):
                self._evict(key)
            for bound in list(self._instances.values()):
                bound.clear_cache()

    def _evict(self, key: Any) -> None:
        entry = self._cache.pop(key, None)
        if entry is None:
            return
        for fast_key in [k for k, e in self._fast.items() if e is entry]:
            del self._fast[fast_key]
        entry.retire()

    def _trace_signature(
        self, key: Any, leaves: list[Any], treedef: Any, static: tuple[Any, ...]
    ) -> Entry:
        entry = trace_signature(
            self._name,
            self._fn,
            leaves,
            treedef,
            static,
            first=self.trace_count == 0,
            donate=self._donate,
            in_shardings=self._in_shardings,
            out_shardings=self._out_shardings,
        )
        self._cache[key] = entry
        self.trace_count += 1
        if len(self._cache) > self.max_traces:
            self._evict(min(self._cache, key=lambda k: self._cache[k].tick))
        return entry

    def __repr__(self) -> str:
        return f"<ps.function {getattr(self, '__qualname__', self._fn)!s}>"


@overload
def function(
    fn: Callable[P, R],
    *,
    static_argnums: int | Iterable[int] = (),
    static_argnames: str | Iterable[str] = (),
    donate: bool = True,
    in_shardings: Shardings = None,
    out_shardings: Shardings = None,
) -> Function[P, R]: ...


@overload
def function(
    fn: None = None,
    *,
    static_argnums: int | Iterable[int] = (),
    static_argnames: str | Iterable[str] = (),
    donate: bool = True,
    in_shardings: Shardings = None,
    out_shardings: Shardings = None,
) -> Callable[[Callable[P, R]], Function[P, R]]: ...


def function(
    fn: Callable[P, R] | None = None,
    *,
    static_argnums: int | Iterable[int] = (),
    static_argnames: str | Iterable[str] = (),
    donate: bool = True,
    in_shardings: Shardings = None,
    out_shardings: Shardings = None,
) -> Function[P, R] | Callable[[Callable[P, R]], Function[P, R]]:
    """Compile ``fn`` with ``jax.jit``, reading and updating Variables like eager code.

    Use as ``@ps.function``, ``@ps.function(static_argnums=...)`` or ``ps.function(fn, ...)``.
    The result keeps ``fn``'s signature for type checkers (``Function[P, R]``).
    ``in_shardings`` / ``out_shardings`` go to ``jax.jit`` for the arguments that are not
    Variables or Modules and for the results: one ``Sharding`` for all, or a pytree prefix
    of the positional arguments (of the result) with a ``Sharding`` or None (unspecified)
    at each leaf. Variables keep their own placement.
    """

    def make(f: Callable[P, R]) -> Function[P, R]:
        return Function(
            f,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate=donate,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
        )

    return make if fn is None else make(fn)


# An eager ps.pure or gradient that JAX cannot run correctly (a while_loop condition reading
# a variable the body assigns) runs as a ps.function instead (functional._eager_or_staged).
register_stager(function)
