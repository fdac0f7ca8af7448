"""The functional core: ``state``, ``pure``, ``update``, ``grad``, ``value_and_grad``.

Contract (API.md, "The functional core"):

* ``state(vars_or_module)`` -> an immutable ``State`` mapping ``{name: jax.Array}``, a
  pytree keyed by the variables' full names (or a dict's keys), in the variables' order.
  String variables are host-side data and are left out.
* ``pure(fn, variables)`` -> ``f(values, *args, **kw) -> (out, new_values)``: runs ``fn``
  with the variables bound to ``values`` (on this thread only) and returns all their
  values after the call. The real variables are never touched, so ``f`` composes with
  ``jax.jit``, ``jax.grad``, ``jax.vmap`` and ``lax.scan``. ``values`` may be a ``State`` or a
  plain dict with the same keys. Variables outside ``variables`` are read as they are
  (inside a transformation they are constants); assigning one is an error.
* ``update(vars_or_module, values)`` assigns a state back, all or nothing.
* ``grad(fn, variables)`` / ``value_and_grad(fn, variables, has_aux=False)``: gradients of
  ``fn(*args)`` with respect to the variables, in the structure of ``variables`` (a list
  for a list, a tuple for a tuple, a dict for a dict, one array for one Variable, and a
  tuple like ``m.trainable_variables`` for a Module). Assigns that ``fn`` makes to those
  variables take effect, as in eager TensorFlow code. Works eagerly and in ``ps.function``.

``pure`` and the gradients run on one primitive, ``_run_bound`` (a binding frame, see
``_trace``); ``ps.function``'s trace is the same frame with an open set of variables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from paramstore import _trace
from paramstore.module import Module
from paramstore.scope import VariableStore
from paramstore.variable import Variable, VariableSlice, _shape_error

__all__ = ["State", "state", "pure", "update", "grad", "value_and_grad"]


class State(Mapping[str, Any]):
    """An immutable ``{name: array}`` mapping, registered as a pytree keyed by name."""

    __slots__ = ("_dict",)
    _dict: dict[str, Any]

    def __init__(self, items: Mapping[str, Any] | Any = ()) -> None:
        object.__setattr__(self, "_dict", dict(items))

    def __getitem__(self, key: str) -> Any:
        return self._dict[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict)

    def __len__(self) -> int:
        return len(self._dict)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ps.State is immutable; build a new one, e.g. State({**s, k: v}).")

    def __repr__(self) -> str:
        body = ", ".join(
            f"'{k}': {getattr(v, 'dtype', type(v).__name__)}{list(np.shape(v))}"
            for k, v in self._dict.items()
        )
        return f"State({{{body}}})"


jax.tree_util.register_pytree_with_keys(
    State,
    lambda s: (tuple((jax.tree_util.DictKey(k), v) for k, v in s._dict.items()), tuple(s._dict)),
    lambda keys, values: State(zip(keys, values)),
    flatten_func=lambda s: (tuple(s._dict.values()), tuple(s._dict)),
)


def _named(variables: Any) -> tuple[list[str], list[Variable]]:
    """Names and variables of a Variable, Module, store, list/tuple or {name: Variable} dict."""
    if isinstance(variables, Mapping) and not isinstance(variables, State):
        names, found = [], []
        for key, var in variables.items():
            if not isinstance(var, Variable):
                raise TypeError(f"Entry '{key}' is a {type(var).__name__}, not a ps.Variable.")
            names.append(str(key))
            found.append(var)
        return names, found
    if isinstance(variables, VariableStore):
        found = variables.variables()
    else:
        found = []
        for leaf in jax.tree_util.tree_leaves(
            variables, is_leaf=lambda x: isinstance(x, (Variable, Module))
        ):
            if isinstance(leaf, Module):
                found.extend(leaf.variables)
            elif isinstance(leaf, Variable):
                found.append(leaf)
            else:
                raise TypeError(
                    f"Expected Variables or Modules, got a {type(leaf).__name__} ({leaf!r})."
                )
    unique = list({id(v): v for v in found if not v._is_string}.values())
    names = [v.name for v in unique]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(
            f"Several variables are named {dup} (they come from different stores); pass a "
            "dict {name: variable} to choose the keys."
        )
    return names, unique


def state(vars_or_module: Any) -> State:
    """The current values as an immutable ``{name: jax.Array}`` pytree."""
    names, found = _named(vars_or_module)
    return State(zip(names, (v.value() for v in found)))


def _values_for(names: list[str], variables: list[Variable], values: Any) -> list[Any]:
    if not isinstance(values, Mapping):
        raise TypeError(
            f"values must be a ps.State or a dict keyed by variable name, got "
            f"{type(values).__name__}."
        )
    missing = [n for n in names if n not in values]
    extra = [k for k in values if k not in set(names)]
    if missing or extra:
        raise KeyError(
            f"values do not match the variables: missing {missing}, unexpected {extra}. "
            "Build them with ps.state(variables)."
        )
    out = [values[n] for n in names]
    for name, var, val in zip(names, variables, out):
        if tuple(np.shape(val)) != var.shape:
            raise _shape_error(name, var.shape, tuple(np.shape(val)))
    return out


def _run_bound(
    fn: Callable[..., Any],
    variables: list[Variable],
    values: list[Any],
    args: tuple,
    kwargs: dict,
    owner: str,
    open: bool = False,
) -> tuple[Any, list[Any], _trace.Frame]:
    """Run ``fn`` with ``variables`` bound to ``values``: (out, their new values, the frame).

    With ``open``, assigns to other variables are recorded in the frame, not refused."""
    frame = _trace.Frame(owner, {id(v): x for v, x in zip(variables, values)}, open=open)
    with _trace.push(frame):
        out = fn(*args, **kwargs)
        out = jax.tree_util.tree_map(_as_value, out, is_leaf=_is_var)
        new = [frame.values[id(v)] for v in variables]
    return out, new, frame


def _is_var(x: Any) -> bool:
    return isinstance(x, (Variable, VariableSlice))


def _as_value(x: Any) -> Any:
    return x.value() if _is_var(x) else x


def _owner(kind: str, fn: Callable[..., Any]) -> str:
    return f"{kind}({getattr(fn, '__name__', type(fn).__name__)})"


def pure(fn: Callable[..., Any], variables: Any) -> Callable[..., tuple[Any, State]]:
    """``fn`` as a pure function ``f(values, *args, **kw) -> (out, new_values)``."""
    names, found = _named(variables)
    owner = _owner("ps.pure", fn)

    def pure_fn(values: Any, *args: Any, **kwargs: Any) -> tuple[Any, State]:
        vals = _values_for(names, found, values)
        out, new, _ = _run_bound(fn, found, vals, args, kwargs, owner)
        return out, State(zip(names, new))

    pure_fn.__name__ = f"pure_{getattr(fn, '__name__', 'fn')}"
    pure_fn.__doc__ = fn.__doc__
    return pure_fn


def update(vars_or_module: Any, values: Any) -> None:
    """Assign ``values`` (a state) back to the variables, all or nothing."""
    names, found = _named(vars_or_module)
    vals = _values_for(names, found, values)
    checked = [v._coerce(x, "assign") for v, x in zip(found, vals)]
    for v, x in zip(found, checked):
        v._swap(x)


def _structured(variables: Any) -> tuple[list[Variable], Callable[[list[Any]], Any]]:
    """The variables to differentiate, and how to put gradients in their structure."""
    if isinstance(variables, Variable):
        return [variables], lambda g: g[0]
    if isinstance(variables, Module):
        return list(variables.trainable_variables), tuple
    if isinstance(variables, Mapping):
        keys = list(variables)
        _named(variables)  # type check
        return [variables[k] for k in keys], lambda g: dict(zip(keys, g))
    if isinstance(variables, (list, tuple)):
        found = list(variables)
        for v in found:
            if not isinstance(v, Variable):
                raise TypeError(f"Expected a list of ps.Variable, got a {type(v).__name__}.")
        kind = type(variables) if type(variables) in (list, tuple) else list
        return found, kind
    raise TypeError(
        "variables must be a Variable, a list/tuple/dict of Variables, or a Module; got "
        f"{type(variables).__name__}."
    )


def value_and_grad(
    fn: Callable[..., Any], variables: Any, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """``f(*args) -> (fn(*args), grads)``; with ``has_aux``, ``fn`` returns ``(value, aux)``
    and ``f`` returns ``((value, aux), grads)``."""
    found, rebuild = _structured(variables)
    owner = _owner("ps.value_and_grad", fn)

    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        values = [v.value() for v in found]
        assigned: list[Variable] = []

        def loss(vals: list[Any]) -> tuple[Any, tuple[Any, list[Any]]]:
            out, _, frame = _run_bound(fn, found, vals, args, kwargs, owner, open=True)
            assigned[:] = frame.assigned.values()
            if has_aux and not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    f"{owner} with has_aux=True needs fn to return (value, aux), got "
                    f"{type(out).__name__}."
                )
            new = [frame.values[id(v)] for v in assigned]
            return (out[0] if has_aux else out), (out, new)

        (_, (out, new)), grads = jax.value_and_grad(loss, has_aux=True)(values)
        for var, x in zip(assigned, new):  # assigns made by fn take effect, as in eager code
            var._swap(x)
        return out, rebuild(grads)

    return wrapped


def grad(fn: Callable[..., Any], variables: Any, has_aux: bool = False) -> Callable[..., Any]:
    """``f(*args) -> grads`` of ``fn`` w.r.t. ``variables`` (with ``has_aux``: ``(grads, aux)``)."""
    vg = value_and_grad(fn, variables, has_aux=has_aux)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out, grads = vg(*args, **kwargs)
        return (grads, out[1]) if has_aux else grads

    return wrapped
