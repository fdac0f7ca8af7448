"""The one parser for "a collection of variables", shared by ``ps.state``/``pure``/``update``,
the gradients, ``ps.Optimizer``, ``ps.Saver`` and ``reshard``.

Accepted forms (nested freely): a Variable; a Module (its ``variables``); a
``VariableStore`` (its live variables); any object with a ``variables`` attribute (an
Optimizer) or a Variable ``state`` attribute (a ``ps.random.Generator``); lists, tuples
and other pytrees of those; and a mapping ``{name: Variable}`` whose keys name them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from paramstore._store import State, VariableStore
from paramstore.module import Module
from paramstore.variable import Variable

__all__ = ["variables_of", "named", "structured"]


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (Variable, Module, VariableStore)) or _holder(x) is not None


def _holder(x: Any) -> Any:
    """The variables an object holds through ``.variables`` or a Variable ``.state``."""
    if isinstance(x, (Variable, Module, VariableStore, Mapping, list, tuple)) or x is None:
        return None
    state = getattr(x, "state", None)
    if isinstance(state, Variable):
        return [state]
    found = getattr(x, "variables", None)
    if found is None or callable(found):
        return None
    return list(found)


def variables_of(collection: Any) -> list[Variable]:
    """Every variable of ``collection``, each once, in order (see the module docstring)."""
    if isinstance(collection, Mapping) and not isinstance(collection, State):
        return _unique(_check_mapping(collection).values())
    found: list[Variable] = []
    for leaf in jax.tree_util.tree_leaves(collection, is_leaf=_is_leaf):
        if isinstance(leaf, Variable):
            found.append(leaf)
        elif isinstance(leaf, Module):
            found.extend(leaf.variables)
        elif isinstance(leaf, VariableStore):
            found.extend(leaf.variables())
        elif _holder(leaf) is not None:
            found.extend(variables_of(_holder(leaf)))
        else:
            raise TypeError(
                f"Expected Variables, Modules, Optimizers or dicts {{name: Variable}}, got a "
                f"{type(leaf).__name__} ({leaf!r:.60}). Pass the variables, e.g. "
                "[*model.variables, *optimizer.variables]."
            )
    return _unique(found)


def _unique(found: Any) -> list[Variable]:
    return list({id(v): v for v in found}.values())


def _check_mapping(mapping: Mapping[Any, Any]) -> Mapping[Any, Any]:
    for key, var in mapping.items():
        if not isinstance(var, Variable):
            raise TypeError(
                f"Entry '{key}' is a {type(var).__name__}, not a ps.Variable: a dict names "
                "single variables ({name: variable})."
            )
    return mapping


def named(collection: Any, *, strings: bool = False) -> tuple[list[str], list[Variable]]:
    """Names and variables: a mapping's keys, else each variable's full name. String
    variables (host data) are left out unless ``strings``. Two variables of one name
    (from different stores) are an error asking for a dict."""
    if isinstance(collection, Mapping) and not isinstance(collection, State):
        items = [(str(k), v) for k, v in _check_mapping(collection).items()]
    else:
        items = [(v.name, v) for v in variables_of(collection)]
    items = [(n, v) for n, v in items if strings or not v._is_string]
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(
            f"Several variables are named {dup} (they come from different stores); pass a "
            "dict {name: variable} to choose the keys."
        )
    return names, [v for _, v in items]


def structured(collection: Any) -> tuple[list[Variable], Callable[[list[Any]], Any]]:
    """The variables to differentiate (duplicates kept) and how to put one result per
    variable back into the structure of ``collection``: a list for a list, a tuple for a
    tuple, a dict for a dict, one value for one Variable, a tuple like
    ``m.trainable_variables`` for a Module."""
    if isinstance(collection, Variable):
        return [collection], lambda g: g[0]
    if isinstance(collection, Module):
        return list(collection.trainable_variables), tuple
    if isinstance(collection, Mapping):
        keys = list(_check_mapping(collection))
        return [collection[k] for k in keys], lambda g: dict(zip(keys, g))
    if isinstance(collection, (list, tuple)):
        found = list(collection)
        for v in found:
            if not isinstance(v, Variable):
                raise TypeError(f"Expected a list of ps.Variable, got a {type(v).__name__}.")
        kind = type(collection) if type(collection) in (list, tuple) else list
        return found, kind
    raise TypeError(
        "variables must be a Variable, a list/tuple/dict of Variables, or a Module; got "
        f"{type(collection).__name__}."
    )
