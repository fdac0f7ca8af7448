"""``ps.function``: compile a stateful Python function with ``jax.jit``.

How it works. For each new signature (argument shapes/dtypes, static arguments, and the
identity of Variables/Modules passed as arguments) the function is traced **once** with
``jax.make_jaxpr`` inside a capture frame (see ``_trace``):

* the first read of each variable records a zero-copy alias of its array as a constant of
  the jaxpr and binds the variable to that constant's tracer; the constants are then
  *lifted* to inputs, so nothing is baked in: every call passes the variables' current
  arrays. A concrete read (``float(v)``) raises JAX's concretization error.
* every assign is recorded; the final values become extra outputs, swapped into the
  variables after the call. Reads and assigns inside ``lax`` control flow, ``jax.vmap``,
  ``jax.checkpoint`` and ``jax.grad`` bodies are ref effects (``_trace``), which the
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
out of its own computation, see ``variable``) and that nobody else holds (the reference
count): any other is copied first, so an array the user holds stays valid. A program with
host callbacks (``jax.debug.callback``, ``io_callback`` ...), which can raise while it
runs, donates nothing and is waited for before its results are swapped in, so a run-time
error leaves every variable as it was. ``donate=False`` turns donation off.

Threads. Each call gathers its inputs, dispatches and swaps its outputs under the state
lock (``_context.STATE_LOCK``), so it is atomic with respect to the variables it touches;
dispatch is asynchronous, so the lock is held for microseconds, not for the computation.

Variables may be created during the first trace only; creating one on a later trace
raises ``ValueError``. A trace that fails creates nothing it cannot keep: variables it
created stay in their store (with their initial values). A ``ps.function`` called inside
another, or inside ``ps.pure``/``ps.grad``, is inlined; one that assigns variables (or
reads them under ``jax.jit``) called inside a plain JAX transformation raises TypeError.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Generic, ParamSpec, TypeVar, overload

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax.sharding import Sharding

from paramstore import _trace
from paramstore import sharding as _sharding
from paramstore._initial import flag
from paramstore._jax import ARRAY_TYPE, EVAL, current_trace, init_program, pure_jaxpr, staging
from paramstore._ownership import ownership
from paramstore._store import default_store
from paramstore.module import Module
from paramstore.variable import Variable, VariableSlice

__all__ = ["function", "Function", "Shardings"]

P = ParamSpec("P")
R = TypeVar("R")
# in_shardings / out_shardings: one Sharding for every array, or a pytree prefix of the
# positional arguments (of the result) with a Sharding or None (unspecified) at its leaves.
Shardings = Sharding | None | tuple[Any, ...] | list[Any] | dict[str, Any]

_HOST_CALLBACKS = ("callback",)  # debug_callback, io_callback, pure_callback
_CLOCK = itertools.count()  # ticks for least-recently-used eviction of traces


def _is_ref(x: Any) -> bool:
    return isinstance(x, (Variable, Module))


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


def _is_var_or_slice(x: Any) -> bool:
    return isinstance(x, (Variable, VariableSlice))


def _has_host_callback(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if any(word in eqn.primitive.name for word in _HOST_CALLBACKS):
            return True
        for sub in jex.core.jaxprs_in_params(eqn.params):
            if _has_host_callback(sub):
                return True
    return False


class _Entry:
    """One traced signature: the lifted jaxpr's runner and the variables it moves."""

    def __init__(
        self,
        owner: str,
        runner: Callable[..., Any],
        donated: list[Variable],
        readonly: list[Variable],
        assigned: list[Variable],
        out_tree: Any,
        ref_pos: list[int],
        refs: list[Any],
        n_leaves: int,
        donate: bool,
        wait: bool,
        shared: list[Variable],
    ) -> None:
        self.owner = owner
        self.runner = runner
        self.donated = donated
        self.readonly = readonly
        self.assigned = assigned
        # Variables whose array an output is (or may be) after each call: handed out.
        self.shared = shared
        self.touches = bool(donated or readonly or assigned)
        self.out_tree = out_tree
        self.one_out = out_tree is not None and out_tree.num_nodes == out_tree.num_leaves == 1
        self.ref_pos = ref_pos
        self.refs = [weakref.ref(r) for r in refs]
        self.array_pos = [i for i in range(n_leaves) if i not in set(ref_pos)]
        self.donate = donate
        self.wait = wait
        self.n_donated = len(donated)
        # The steady-path cache (see _ownership): the state version after this entry's
        # last call, and that call's outputs for the donated variables and its read-only
        # inputs, which are exactly the next call's while the version is unchanged.
        self.steady = not shared
        self.version = -1
        self.last: tuple[Any, Any] = ((), ())
        self.tick = next(_CLOCK)  # when last called, for least-recently-used eviction

    def __call__(self, leaves: list[Any]) -> Any:
        self.tick = next(_CLOCK)  # ~40 ns
        trace = current_trace()
        if trace is not EVAL and self.touches and (self.assigned or staging(trace)):
            self._transformed()
        if self.ref_pos:  # Variables/Modules passed as arguments are read, not passed
            leaves = [leaves[i] for i in self.array_pos]
        if self.wait:
            out = ownership.call_and_wait(self, leaves)
        else:
            out = ownership.call(self, leaves)
        return out[0] if self.one_out else jax.tree_util.tree_unflatten(self.out_tree, out)

    def _transformed(self) -> None:
        names = ", ".join(v.name for v in (self.assigned or [*self.donated, *self.readonly]))
        what = "assigns" if self.assigned else "reads"
        raise TypeError(
            f"{self.owner}, which {what} variables ({names:.200}), was called inside a plain "
            "JAX transformation (jax.jit, jax.vmap, jax.grad, lax control flow ...), where "
            "new values would be leaked tracers and read values would be baked in. Call it "
            "outside, make the outer function a ps.function too, or use ps.pure."
        )

    def alive(self, leaves: list[Any]) -> bool:
        """Whether the Variables/Modules this entry was traced with are still these."""
        return all(r() is leaves[i] for r, i in zip(self.refs, self.ref_pos))


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
        self._static_argnums, self._static_argnames = _static_args(
            fn, static_argnums, static_argnames
        )
        self._cache: dict[Any, _Entry] = {}
        self._fast: dict[tuple[Any, ...], _Entry] = {}  # (n, *avals) of all-array calls
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
        if self._simple and not kwargs and not _trace.depth:
            # The common call: arrays only, no static arguments, no frame anywhere. Keyed
            # on the avals alone; the general path below costs ~5 us more per call.
            fast: list[Any] = [len(args)]
            for a in args:
                if type(a) is not ARRAY_TYPE:
                    break
                fast.append(a.aval)  # type: ignore[attr-defined]
            else:
                entry = self._fast.get(tuple(fast))
                if entry is not None:
                    return entry(list(args))  # type: ignore[no-any-return]
        if self._bound is not None:
            instance = self._bound()
            if instance is None:
                raise ReferenceError("The object this ps.function method is bound to is gone.")
            args = (instance, *args)  # type: ignore[assignment]
        if _trace.active():
            return self._fn(*args, **kwargs)  # inside another ps.function or ps.pure: inline
        entry, leaves, fast_key = self._entry(tuple(args), dict(kwargs))
        if fast_key is not None:
            self._fast[fast_key] = entry
        return entry(leaves)  # type: ignore[no-any-return]

    def lower(self, *args: P.args, **kwargs: P.kwargs) -> Any:
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

        def spec(v: Variable) -> jax.ShapeDtypeStruct:
            x = ownership.peek(v)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # type: ignore[no-untyped-call]

        return entry.runner.lower(  # type: ignore[attr-defined]
            [spec(v) for v in entry.donated], [spec(v) for v in entry.readonly], leaves
        )

    def _entry(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[_Entry, list[Any], tuple[Any, ...] | None]:
        """The traced entry for these arguments (traced now if new), the flat leaves to
        call it with, and its fast-path key (None when the call does not qualify)."""
        if self._static_argnums or self._static_argnames:
            dyn, static = self._split(args, kwargs)
        else:
            dyn, static = (args, kwargs), ()
        leaves, treedef = jax.tree_util.tree_flatten(dyn, is_leaf=_is_ref)
        key = (treedef, static, *map(_leaf_key, leaves))
        try:
            entry = self._cache.get(key)
        except TypeError:
            raise TypeError(self._unhashable_message(static)) from None
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
        ownership.drop(entry)

    def _split(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
        nums, names = self._static_argnums, self._static_argnames
        dyn_args = tuple(None if i in nums else a for i, a in enumerate(args))
        dyn_kw = {k: v for k, v in kwargs.items() if k not in names}
        static = (
            tuple((i, args[i]) for i in nums if i < len(args)),
            tuple(sorted((k, v) for k, v in kwargs.items() if k in names)),
        )
        return (dyn_args, dyn_kw), static

    def _unhashable_message(self, static: tuple[Any, ...]) -> str:
        for where, value in [*static[0], *static[1]]:
            try:
                hash(value)
            except TypeError:
                label = f"position {where}" if isinstance(where, int) else f"'{where}'"
                return (
                    f"Static argument at {label} of {self._name}() is unhashable (type "
                    f"{type(value).__name__}): ps.function keys its traces on static "
                    "arguments. Pass a hashable value (a tuple instead of a list), or pass "
                    "arrays as regular (traced) arguments."
                )
        return f"An argument of {self._name}() is unhashable."

    def _merge(self, dyn: Any, static: tuple[Any, ...]) -> tuple[list[Any], dict[str, Any]]:
        args, kwargs = list(dyn[0]), dict(dyn[1])
        if static:
            for i, v in static[0]:
                args[i] = v
            kwargs.update(static[1])
        return args, kwargs

    def _trace_signature(
        self, key: Any, leaves: list[Any], treedef: Any, static: tuple[Any, ...]
    ) -> _Entry:
        owner = f"ps.function '{self._name}'"
        frame = _trace.Frame(owner, _trace.CAPTURE, allow_create=self.trace_count == 0)
        ref_pos = [i for i, x in enumerate(leaves) if _is_ref(x)]
        refs = {i: leaves[i] for i in ref_pos}
        arrays = [x for i, x in enumerate(leaves) if i not in refs]
        result: dict[str, Any] = {"out_tree": None, "assigned": []}

        def flat(*arrays: Any) -> tuple[list[Any], list[Any], list[Any]]:
            it = iter(arrays)
            full = [refs[i] if i in refs else next(it) for i in range(len(leaves))]
            args, kwargs = self._merge(jax.tree_util.tree_unflatten(treedef, full), static)
            out_leaves: list[Any] = []
            new: list[Any] = []
            with _trace.push(frame):
                try:
                    out = self._fn(*args, **kwargs)
                    out_leaves, result["out_tree"] = jax.tree_util.tree_flatten(
                        out, is_leaf=_is_var_or_slice
                    )
                    out_leaves = [x.value() if _is_var_or_slice(x) else x for x in out_leaves]
                    result["assigned"] = list(frame.assigned.values())
                    new = list(map(frame.final, result["assigned"]))
                except Exception as e:
                    if not frame.created:
                        raise
                    result["error"] = e  # finish the trace to give the created variables
                    out_leaves, new, result["assigned"] = [], [], []  # their values
            return out_leaves, new, [x for _, x in frame.created]

        # No lock is held while the body is traced: a captured array is handed out
        # (_trace), so no step in another thread donates what this trace holds.
        closed = jax.make_jaxpr(flat)(*arrays)
        if frame.created:
            _initialize(closed, frame.created, result.get("error"))
        if "error" in result:
            raise result["error"]
        _sharding.settle_unplaced(
            result["assigned"],
            [*(ownership.peek(v) for v, _ in frame.captured.values()), *arrays],
        )
        entry = self._lift(
            closed, frame, result, ref_pos, list(refs.values()), len(leaves), treedef
        )
        self._cache[key] = entry
        self.trace_count += 1
        if len(self._cache) > self.max_traces:
            self._evict(min(self._cache, key=lambda k: self._cache[k].tick))
        return entry

    def _lift(
        self,
        closed: Any,
        frame: _trace.Frame,
        result: dict[str, Any],
        ref_pos: list[int],
        refs: list[Any],
        n_leaves: int,
        treedef: Any,
    ) -> _Entry:
        """Turn the variables' constants (and created variables' initial values) into
        inputs; build the runner."""
        jaxpr = closed.jaxpr
        n_created = len(frame.created)
        var_of = {id(alias): var for var, alias in frame.captured.values()}
        assigned: list[Variable] = result["assigned"]
        written = {id(v) for v in assigned}
        moved: list[tuple[Variable, Any]] = []
        keep_vars, keep_consts = [], []
        for cvar, const in zip(jaxpr.constvars, closed.consts):
            var = var_of.get(id(const))
            if var is None:
                keep_vars.append(cvar)
                keep_consts.append(const)
            else:
                moved.append((var, cvar))
        # A created variable's initial value is the output of one `copy` (see
        # _trace.create): in the step, that jaxpr variable becomes an input instead.
        outvars = list(jaxpr.outvars)
        init_vars = outvars[len(outvars) - n_created :]
        cut = {id(v) for v in init_vars}
        eqns = [e for e in jaxpr.eqns if not (len(e.outvars) == 1 and id(e.outvars[0]) in cut)]
        moved += [(var, jv) for (var, _), jv in zip(frame.created, init_vars)]
        outvars = outvars[: len(outvars) - n_created]
        donated = [(v, c) for v, c in moved if id(v) in written]
        readonly = [(v, c) for v, c in moved if id(v) not in written]
        # jit pairs each output with the first unused donated input of the same shape and
        # dtype, in order. Donated inputs in the order of their outputs, and those outputs
        # first, pair every variable's new value with its own old buffer: XLA updates it in
        # place, with no copies (a mismatched pairing, e.g. Adam's mu with its parameter,
        # makes XLA copy each buffer to resolve the aliasing).
        position = {id(v): i for i, v in enumerate(assigned)}
        donated.sort(key=lambda vc: position[id(vc[0])])
        donated_ids = {id(v) for v, _ in donated}
        order = [position[id(v)] for v, _ in donated]
        order += [i for i, v in enumerate(assigned) if id(v) not in donated_ids]
        assigned = [assigned[i] for i in order]
        moved = donated + readonly
        invars = [c for _, c in moved] + list(jaxpr.invars)
        info = jaxpr.debug_info
        if info is not None:
            arg_names = info.arg_names
            if arg_names is not None:
                arg_names = (*(v.name for v, _ in moved), *arg_names)
            paths = info.result_paths
            if paths is not None and not callable(paths):
                paths = tuple(paths)[: len(outvars)]
            info = info._replace(arg_names=arg_names, result_paths=paths)
        lifted = jaxpr.replace(
            constvars=keep_vars, invars=invars, eqns=eqns, outvars=outvars, debug_info=info
        )
        fun = jex.core.jaxpr_as_fun(jex.core.ClosedJaxpr(lifted, keep_consts))
        n_out = len(outvars) - len(assigned)

        # Assigned variables come back with the very sharding they went in with (jit's
        # out_shardings; a with_sharding_constraint would hand back an equivalent but
        # unequal spec, P() -> P(None, None), and fails on Explicit mesh axes), so the
        # next call sees the same input shardings (no recompilation) and placement is kept.
        keep = [
            sh if len(sh.device_set) > 1 else None
            for sh in (ownership.peek(v).sharding for v in assigned)
        ]

        # An output that is also a variable's new value or a donated input (`return
        # v.value()` after `v.assign_add(1)`) would be one buffer for both, which then
        # could never be donated again: the output gets a copy of its own instead (one
        # copy of the returned value, where sharing cost a copy of the variable per call).
        new_vars = [outvars[n_out + i] for i in order]
        own_ids = {id(v) for v in new_vars} | {id(c) for _, c in donated}
        to_copy = frozenset(i for i, v in enumerate(outvars[:n_out]) if id(v) in own_ids)

        def run(don: list[Any], ro: list[Any], arrays: list[Any]) -> tuple[Any, Any]:
            res = fun(*don, *ro, *arrays)
            new = res[n_out:]
            out = [jnp.copy(x) if i in to_copy else x for i, x in enumerate(res[:n_out])]
            return [new[i] for i in order], out

        wait = _has_host_callback(lifted)
        kept = [v for i, v in enumerate(outvars[:n_out]) if i not in to_copy]
        shared = _shared(moved, assigned, new_vars, kept)
        donate = self._donate and bool(donated) and not wait
        arg_sh = self._leaf_shardings(self._in_shardings, treedef, n_leaves, ref_pos, True)
        out_sh = self._leaf_shardings(self._out_shardings, result["out_tree"], n_out, [], False)
        has_keep = any(sh is not None for sh in keep)
        runner = jax.jit(
            run,
            donate_argnums=(0,) if donate else (),
            in_shardings=(None, None, arg_sh) if arg_sh is not None else None,
            out_shardings=(keep if has_keep else None, out_sh)
            if has_keep or out_sh is not None
            else None,
        )
        return _Entry(
            f"ps.function '{self._name}'",
            runner,
            [v for v, _ in donated],
            [v for v, _ in readonly],
            assigned,
            result["out_tree"],
            ref_pos,
            refs,
            n_leaves,
            donate,
            wait,
            shared,
        )

    def _leaf_shardings(
        self, spec: Shardings, tree: Any, n: int, skip: list[int], args: bool
    ) -> list[Any] | None:
        """``spec`` (``in_shardings``: over the positional arguments; ``out_shardings``:
        over the result) as one Sharding or None per flat leaf, leaves in ``skip``
        (Variables/Modules passed as arguments) left out; None for no spec."""
        if spec is None or tree is None:
            return None
        which = "in_shardings" if args else "out_shardings"
        if isinstance(spec, Sharding):
            per_leaf: list[Any] = [spec] * n
        else:
            example = jax.tree_util.tree_unflatten(tree, list(range(n)))
            target = example[0] if args else example  # (args, kwargs) for arguments
            per_leaf = [None] * n
            is_spec = lambda x: x is None or isinstance(x, Sharding)  # noqa: E731
            try:
                pairs = jax.tree_util.tree_map(
                    lambda sh, sub: [(i, sh) for i in jax.tree_util.tree_leaves(sub)],
                    spec,
                    target,
                    is_leaf=is_spec,
                )
            except (ValueError, TypeError) as e:
                raise ValueError(
                    f"{which} of ps.function '{self._name}' must be a Sharding, or a pytree "
                    "prefix of the "
                    + ("positional arguments" if args else "result")
                    + f" with a Sharding or None at each leaf: {e}"
                ) from None
            for i, sh in itertools.chain.from_iterable(
                jax.tree_util.tree_leaves(pairs, is_leaf=lambda x: isinstance(x, list))
            ):
                if sh is not None and not isinstance(sh, Sharding):
                    raise TypeError(
                        f"{which} of ps.function '{self._name}': expected a "
                        f"jax.sharding.Sharding or None, got {type(sh).__name__}."
                    )
                per_leaf[i] = sh
        skipped = set(skip)
        return [sh for i, sh in enumerate(per_leaf) if i not in skipped]

    def __repr__(self) -> str:
        return f"<ps.function {getattr(self, '__qualname__', self._fn)!s}>"


def _initialize(closed: Any, created: list[tuple[Variable, Any]], error: Any) -> None:
    """Compute the initial values of the variables created (with traced values) during the
    trace ``closed``: run the part of the jaxpr they depend on, once, and write them."""
    closed = pure_jaxpr(closed)
    jaxpr = closed.jaxpr
    n_out, n_created = len(jaxpr.outvars), len(created)
    names = ", ".join(f"'{v.name}'" for v, _ in created)
    used_out = [False] * (n_out - n_created) + [True] * n_created
    init, used_in = init_program(jaxpr, used_out)
    n_consts = len(jaxpr.constvars)
    if any(used_in[n_consts:]):
        for var, _ in created:
            default_store()._forget(var)
            ownership.take_initial(var, None)
        raise ValueError(
            f"The initial value of variable(s) {names}, created inside a ps.function, "
            "depends on the values of the function's arguments. An initial value may depend "
            "on their shapes and dtypes only (as Keras' build(input_shape)): compute it from "
            "x.shape, or create the variable outside and assign it."
        ) from error
    consts = [c for c, used in zip(closed.consts, used_in[:n_consts]) if used]
    init = init.replace(debug_info=init.debug_info.with_unknown_names())
    # A variable created with a sharding (sharding=, a LayoutMap, axis rules) gets its value
    # from a program compiled with that output sharding: no device holds more than its
    # shards. The others come from a program with no output shardings, as before.
    shardings = [ownership.peek(v).sharding for v, _ in created]
    run = jex.core.jaxpr_as_fun(jex.core.ClosedJaxpr(init, []))
    values: list[Any] = [None] * n_created
    placed = [i for i, sh in enumerate(shardings) if sh is not None]
    for group in (placed, [i for i, sh in enumerate(shardings) if sh is None]):
        if group:
            outs = [shardings[i] for i in group] if group is placed else None
            program = jax.jit(lambda *c, g=group: [run(*c)[i] for i in g], out_shardings=outs)
            for i, value in zip(group, program(*consts)):
                values[i] = value
    for (var, _), value in zip(created, values):
        override = ownership.take_initial(var, None)
        sharding = ownership.peek(var).sharding
        if override is not None and sharding is not None:
            override = jax.device_put(override, sharding)
        var._write(value if override is None else override, owned=True)


def _shared(
    moved: list[tuple[Variable, Any]], assigned: list[Variable], new: list[Any], outs: list[Any]
) -> list[Variable]:
    """The variables whose array an output of the lifted jaxpr is, or may be, after a call.

    jit forwards an input that is returned unchanged and may return one buffer for two
    equal outputs (or a cached constant for a literal): then the user, or a second
    variable, holds that variable's buffer, which must count as handed out. ``moved``:
    (variable, input var); ``new``: the assigned variables' output vars, in order;
    ``outs``: the function's own outputs."""
    counts: dict[int, int] = {}
    for v in [*new, *outs]:
        counts[id(v)] = counts.get(id(v), 0) + 1
    inputs = {id(c) for _, c in moved}
    shared = [
        var
        for var, v in zip(assigned, new)
        if not isinstance(v, jex.core.Var) or counts[id(v)] > 1 or id(v) in inputs
    ]
    returned = {id(v) for v in outs}
    written = {id(v) for v in assigned}
    shared += [var for var, c in moved if id(c) in returned and id(var) not in written]
    return shared


def _static_args(
    fn: Callable[..., Any], nums: int | Iterable[int], names: str | Iterable[str]
) -> tuple[frozenset[int], frozenset[str]]:
    """Static positions and names, each completed from the other through the signature.
    Like ``jax.jit``: a position past the parameters or an unknown name is a ValueError
    (unless ``fn`` takes ``*args`` / ``**kwargs``); a wrong type is a TypeError."""
    nums = (nums,) if isinstance(nums, int) else nums
    names = (names,) if isinstance(names, str) else names
    try:
        nums = tuple(nums)
        names = tuple(names)
    except TypeError:
        raise TypeError(
            "static_argnums must be an int or a sequence of ints and static_argnames a str or "
            f"a sequence of str; got static_argnums={nums!r}, static_argnames={names!r}."
        ) from None
    bad: list[Any] = [i for i in nums if isinstance(i, bool) or not isinstance(i, int)]
    bad += [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(
            f"static_argnums takes ints and static_argnames takes str; got {bad[0]!r} "
            f"({type(bad[0]).__name__})."
        )
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return frozenset(nums), frozenset(names)
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    var_args = any(p.kind == p.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    label = getattr(fn, "__name__", "the function")
    for i in nums:
        if not var_args and not -len(positional) <= i < len(positional):
            raise ValueError(
                f"static_argnums {i} is out of range: {label}() takes {len(positional)} "
                f"positional argument(s) ({', '.join(positional) or 'none'})."
            )
    for n in names:
        if not var_kw and n not in keywords:
            raise ValueError(
                f"static_argnames {n!r} is not a parameter of {label}() (its parameters: "
                f"{', '.join(keywords) or 'none'})."
            )
    num_set = {i % len(positional) if i < 0 and positional else i for i in nums}
    name_set = set(names)
    for i in num_set:
        if 0 <= i < len(positional):
            name_set.add(positional[i])
    for n in names:
        if n in positional:
            num_set.add(positional.index(n))
    return frozenset(num_set), frozenset(name_set)


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
