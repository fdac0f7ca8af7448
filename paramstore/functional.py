"""The functional core: ``state``, ``pure``, ``update``, ``grad``, ``value_and_grad``.

Contract (docs/api.md, "The functional core"):

* ``state(vars_or_module, where=None)`` -> an immutable ``State`` mapping
  ``{name: jax.Array}``, a pytree keyed by the variables' full names (or a dict's keys),
  in the variables' order. String variables are host-side data and are left out. Any
  form that ``paramstore._collect`` parses is accepted (Modules, Optimizers, lists of
  them, dicts ...), the same forms everywhere below.
* Filters: ``where`` is a callable ``(variable) -> bool`` (``ps.trainable``,
  ``ps.non_trainable``) or a string searched as a regular expression in each full name;
  ``state``, ``pure``, ``grad`` and ``value_and_grad`` take it. One that keeps nothing
  raises ValueError; a bad type TypeError; a bad regular expression ValueError.
* ``pure(fn, variables, where=None)`` -> ``f(values, *args, **kw) -> (out, new_values)``:
  runs ``fn`` with the variables bound to ``values`` (on this thread only) and returns all
  their values after the call. The real variables are never touched, so ``f`` composes
  with ``jax.jit``, ``jax.grad``, ``jax.vmap`` and ``lax.scan``, and ``fn`` may read and
  assign its variables inside ``lax`` control flow, ``jax.checkpoint`` and ``jax.vmap``
  bodies. ``values`` may be a ``State`` or a plain dict with the same keys. Variables
  outside ``variables`` (or left out by ``where``) are read as they are in eager code;
  under a compiling transformation (``jax.jit`` ...) reading one is a ``TypeError`` (it
  would be baked in); assigning one is an error.
* ``update(vars_or_module, values, partial=False)`` assigns a state back, all or nothing,
  atomically. Every variable must be in ``values`` (a missing name raises KeyError);
  with ``partial=True`` only the names present are assigned, and a name that is no
  variable's raises KeyError naming it (nothing assigned).
* ``grad(fn, variables, where=None)`` / ``value_and_grad(fn, variables, has_aux=False,
  where=None)``: gradients of ``fn(*args)`` with respect to the variables, in the
  structure of ``variables`` (a list for a list, a tuple for a tuple, a dict for a dict,
  one array for one Variable, a tuple like ``m.trainable_variables`` for a Module, so a
  list of Modules gives a list of such tuples). A Module contributes its trainable
  variables. A variable listed twice (``[v, v]``, ``[block, block]``) gets the full
  gradient in every place, as with ``tf.GradientTape``. Assigns that ``fn`` makes take
  effect, as in eager TensorFlow code. Works eagerly and in ``ps.function``.

All of them run on one primitive, a binding frame (``_core.frames``); ``ps.function``'s trace
is the same frame with an open set of variables.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar, cast

import jax
import numpy as np

from paramstore._collect import Where, named, non_trainable, structured, trainable
from paramstore._core import frames
from paramstore._core.context import STATE_LOCK
from paramstore._core.dtypes import shape_error
from paramstore._core.interrupts import deferred
from paramstore._core.jax_api import EVAL, current_trace
from paramstore._core.store import State
from paramstore.module import Module
from paramstore.typing import PyTree, ValueLike, VariablesLike
from paramstore.variable import Variable, VariableSlice

P = ParamSpec("P")
R = TypeVar("R")  # fn's output (Variables in it come back as their values)

__all__ = [
    "State",
    "Where",
    "grad",
    "non_trainable",
    "pure",
    "state",
    "trainable",
    "update",
    "value_and_grad",
]


def state(vars_or_module: VariablesLike, where: Where = None) -> State:
    """The current values as an immutable ``{name: jax.Array}`` pytree; ``where`` keeps
    the variables it holds for (a callable, or a regular expression searched in the
    names; one that keeps nothing raises ValueError)."""
    names, found = named(vars_or_module, where=where)
    return State(zip(names, (v.value() for v in found)))


def _values_for(
    names: list[str], variables: list[Variable], values: Any, partial: bool = False
) -> tuple[list[str], list[Variable], list[Any]]:
    """The names, variables and values that ``values`` gives, checked: every name (or,
    ``partial``, only those present, none unknown) with the variable's shape."""
    if not isinstance(values, Mapping):
        raise TypeError(
            f"values must be a ps.State or a dict keyed by variable name, got "
            f"{type(values).__name__}."
        )
    known = set(names)
    extra = [k for k in values if k not in known]
    if partial:
        if extra:
            raise KeyError(
                f"values name {len(extra)} variable(s) that are not among the "
                f"{len(names)} given: {extra}. Nothing was assigned; use the names of "
                "ps.state(variables)."
            )
        chosen = [(n, v) for n, v in zip(names, variables) if n in values]
        names, variables = [n for n, _ in chosen], [v for _, v in chosen]
    else:
        missing = [n for n in names if n not in values]
        if missing or extra:
            raise KeyError(
                f"values do not match the variables: missing {missing}, unexpected {extra}. "
                "Build them with ps.state(variables), or pass partial=True to assign only "
                "the names present."
            )
    out = [values[n] for n in names]
    for name, var, val in zip(names, variables, out):
        if val is None:
            raise TypeError(
                f"ps.update: the value for variable '{var.name}' is None. Give an array of "
                f"shape {var.shape} and dtype {var.dtype.name}, or leave the name out (with "
                "partial=True)."
            )
        if isinstance(val, Mapping):
            raise TypeError(
                f"ps.update: the value for variable '{var.name}' is a {type(val).__name__} "
                f"(keys {list(val)[:5]}), not an array. values is a flat {{full name: array}} "
                "mapping, as ps.state returns it; give an array of shape "
                f"{var.shape} and dtype {var.dtype.name} for '{name}'. Nothing was assigned."
            )
        if tuple(np.shape(val)) != var.shape:
            raise shape_error(name, var.shape, tuple(np.shape(val)))
    return names, variables, out


def _is_var(x: Any) -> bool:
    return isinstance(x, (Variable, VariableSlice))


def _as_value(x: Any) -> Any:
    return x.value() if _is_var(x) else x


def _run_bound(
    fn: Callable[..., Any],
    variables: list[Variable],
    values: list[Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    owner: str,
    kind: int,
) -> tuple[Any, frames.Frame]:
    """Run ``fn`` with ``variables`` bound to ``values``: its output and the frame (whose
    ``final`` gives each variable's value after the call)."""
    frame = frames.Frame(owner, kind, list(zip(variables, values)))
    with frames.push(frame):
        out = fn(*args, **kwargs)
        out = jax.tree_util.tree_map(_as_value, out, is_leaf=_is_var)
    return out, frame


# The compiled-function layer registers ``ps.function`` here (``register_stager``): an eager
# ps.pure or gradient whose while_loop condition reads a variable the body assigns runs as
# one (frames.Restage). A hook, because that layer sits above this one.
_STAGER: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = []


def register_stager(stage: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Set how an eager call that JAX cannot run correctly is compiled (``ps.function``)."""
    _STAGER[:] = [stage]


def _eager_or_staged(
    call: Callable[..., Any], staged: list[Callable[..., Any]]
) -> Callable[..., Any]:
    """``call`` run eagerly; once it raised ``frames.Restage`` at the outermost eager level,
    it and every later call run as the compiled ``staged[0]`` (see ``_STAGER``)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if staged and not frames.active():
            return staged[0](*args, **kwargs)
        outermost = not frames.active() and current_trace() is EVAL
        try:
            return call(*args, **kwargs)
        except frames.Restage:
            if not (outermost and _STAGER):
                raise
        staged[:] = [_STAGER[0](call)]
        return staged[0](*args, **kwargs)

    return run


def _owner(kind: str, fn: Callable[..., Any]) -> str:
    return f"{kind}({getattr(fn, '__name__', type(fn).__name__)})"


def pure(
    fn: Callable[..., R], variables: VariablesLike, where: Where = None
) -> Callable[..., tuple[R, State]]:
    """``fn`` as a pure function ``f(values, *args, **kw) -> (out, new_values)`` over the
    variables (those ``where`` keeps, as ``ps.state(variables, where)``)."""
    names, found = named(variables, where=where)
    owner = _owner("ps.pure", fn)

    def pure_fn(values: Mapping[str, ValueLike], *args: Any, **kwargs: Any) -> tuple[R, State]:
        _, _, vals = _values_for(names, found, values)
        out, frame = _run_bound(fn, found, vals, args, kwargs, owner, frames.PURE)
        return out, State(zip(names, map(frame.final, found)))

    pure_fn.__name__ = f"pure_{getattr(fn, '__name__', 'fn')}"
    pure_fn.__doc__ = fn.__doc__
    run = _eager_or_staged(pure_fn, [])
    functools.update_wrapper(run, pure_fn)
    return run


def update(
    vars_or_module: VariablesLike, values: Mapping[str, ValueLike], partial: bool = False
) -> None:
    """Assign ``values`` (a state) back to the variables, all or nothing. Every variable
    must be named in ``values`` (KeyError otherwise); with ``partial=True`` only the names
    present are assigned, and a name that is not a variable's raises KeyError."""
    if not isinstance(partial, bool):
        raise TypeError(f"ps.update: partial must be True or False, got {partial!r}.")
    names, found = named(vars_or_module)
    _, found, vals = _values_for(names, found, values, partial)
    checked = [v._coerce(x, "assign") for v, x in zip(found, vals)]
    with deferred(), STATE_LOCK:  # all or nothing, Ctrl-C included (held back to the end)
        for v, x in zip(found, checked):
            v._swap(x, owned=False)


def value_and_grad(
    fn: Callable[P, R], variables: VariablesLike, has_aux: bool = False, where: Where = None
) -> Callable[P, tuple[R, PyTree]]:
    """``f(*args) -> (fn(*args), grads)``; with ``has_aux``, ``fn`` returns ``(value, aux)``
    and ``f`` returns ``((value, aux), grads)``. ``where`` keeps some of the variables (the
    others leave the structure; see ``paramstore._collect``)."""
    owner = _owner("ps.value_and_grad", fn)
    try:
        _check_built(variables, owner)
    except ValueError:
        pass  # said when it is called, if the model is still unbuilt then
    else:
        structured(variables, where)  # a bad collection or filter: an error now

    def wrapped(*args: P.args, **kwargs: P.kwargs) -> tuple[R, PyTree]:
        _check_built(variables, owner)
        # read now, not when ps.grad was called: a freeze (trainable = False) takes effect
        parsed = structured(variables, where)
        unique = list({id(v): v for v in parsed.variables}.values())
        position = {id(v): i for i, v in enumerate(unique)}
        at = [position[id(v)] for v in parsed.variables]  # listed twice: its gradient twice
        values = [v.value() for v in unique]
        assigned: list[Variable] = []

        def loss(vals: list[Any]) -> tuple[Any, tuple[Any, list[Any]]]:
            out, frame = _run_bound(fn, unique, vals, args, kwargs, owner, frames.OPEN)
            assigned[:] = frame.assigned.values()
            if has_aux and not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    f"{owner} with has_aux=True needs fn to return (value, aux), got "
                    f"{type(out).__name__}."
                )
            return (out[0] if has_aux else out), (out, list(map(frame.final, assigned)))

        (_, (out, new)), grads = jax.value_and_grad(loss, has_aux=True)(values)
        for var, x in zip(assigned, new):  # assigns made by fn take effect, as in eager code
            var._swap(x)
        return out, parsed.rebuild([grads[i] for i in at])

    made = _GradFunction(_eager_or_staged(wrapped, []), "ps.value_and_grad", "loss, grads")
    return cast(Callable[P, tuple[R, PyTree]], made)


class _GradFunction:
    """The function ``ps.grad``/``ps.value_and_grad`` return; unpacking it (the call's
    ``()`` forgotten) raises a TypeError saying to call it."""

    def __init__(self, fn: Callable[..., Any], what: str, result: str) -> None:
        self._fn, self._what, self._result = fn, what, result
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __iter__(self) -> Any:
        raise TypeError(
            f"{self._what}(fn, variables) returns a function, which cannot be unpacked: call "
            f"it with fn's arguments, {self._result} = {self._what}(fn, model)(*args) (the "
            "trailing () when fn takes none)."
        )


def _check_built(variables: VariablesLike, owner: str) -> None:
    """A Module given (alone or in a list) that has no variables yet is an error: its
    variables are created by its first call, too late for the gradient to see them."""
    given = variables if isinstance(variables, (list, tuple)) else [variables]
    for m in given:
        if isinstance(m, Module) and not m.variables:
            raise ValueError(
                f"{owner}: Module '{m.scope_name}' has no variables yet, so there is nothing "
                "to differentiate (a model creates its variables on its first call, which "
                "here would happen inside the differentiated function, too late). Call or "
                "build the model first: model(x) once, or model.build(input_shape)."
            )


def grad(
    fn: Callable[P, Any], variables: VariablesLike, has_aux: bool = False, where: Where = None
) -> Callable[P, PyTree]:
    """``f(*args) -> grads`` of ``fn`` w.r.t. ``variables`` (with ``has_aux``: ``(grads, aux)``)."""
    vg = value_and_grad(fn, variables, has_aux=has_aux, where=where)

    def wrapped(*args: P.args, **kwargs: P.kwargs) -> PyTree:
        out, grads = vg(*args, **kwargs)
        return (grads, out[1]) if has_aux else grads

    return cast(Callable[P, PyTree], _GradFunction(wrapped, "ps.grad", "grads"))
