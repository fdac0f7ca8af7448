"""The one parser for "a collection of variables", shared by ``ps.state``/``pure``/
``update``, ``ps.grad``/``value_and_grad``, ``ps.Optimizer``, ``ps.Saver`` and ``reshard``.

Accepted forms, the same everywhere (nested freely):

* a ``Variable``;
* a ``Module``: its ``variables`` (``trainable=True``, as for gradients and optimizers: its
  ``trainable_variables``), found by the one traversal (``paramstore._traverse``);
* a ``VariableStore`` (its live variables); an object holding variables without being a
  Module: a ``.state`` Variable (``ps.random.Generator``) or a ``.variables`` attribute;
* lists, tuples and other JAX pytrees of these;
* a dict ``{key: Variable}``: at the top level its keys name the variables (``ps.state``,
  ``ps.Saver``); its values must be Variables.

``parse(collection, trainable=..., where=...)`` returns a ``Parsed``: the variables in
order, duplicates kept (``[v, v]`` has two), and how to put one value per variable back
into the collection's structure: a list for a list, a tuple for a tuple, a dict for a
dict, one value for one Variable, a tuple like ``m.trainable_variables`` for a Module (so
``[block, block2]`` gives ``[tuple, tuple]``), a list for a store or holder.

Filters (``where``): a callable ``(variable) -> bool``, a string searched as a regular
expression in each full name (``re.search``), or a class, as Flax NNX's type filters: a
``Module`` subclass keeps the variables of the modules of that type found in the
collection (the collection itself included), a ``Variable`` subclass the variables of
that type; anything else is a ``TypeError``. ``trainable`` and ``non_trainable`` are
ready-made. A filter drops the variables it rejects from the structure (a Module's tuple
holds its kept variables; a list, its kept items; a dict, its kept keys); one that keeps
nothing is a ValueError.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from paramstore._core.store import State, VariableStore
from paramstore._traverse import walk
from paramstore.module import Module
from paramstore.typing import VariablesLike
from paramstore.variable import Variable

__all__ = [
    "Parsed",
    "Where",
    "named",
    "non_trainable",
    "parse",
    "structured",
    "trainable",
    "variables_of",
]

#: A filter: ``(variable) -> bool``, a regular expression searched in each full name, or a
#: Module or Variable subclass.
Where = Callable[[Variable], bool] | str | type | None


def trainable(variable: Variable) -> bool:
    """``where=ps.trainable``: the trainable variables."""
    return bool(variable.trainable)


def non_trainable(variable: Variable) -> bool:
    """``where=ps.non_trainable``: the variables that are not trainable."""
    return not variable.trainable


def _predicate(where: Where, collection: Any = None) -> Callable[[Variable], bool] | None:
    """``where`` as a predicate over the variables of ``collection`` (see the module
    docstring); a class of Module needs the collection to find its instances."""
    if where is None:
        return None
    if isinstance(where, type):
        if issubclass(where, Variable):
            kind = where
            return lambda v: isinstance(v, kind)
        if issubclass(where, Module):
            held = {id(v) for _, m in walk(collection) if isinstance(m, where) for v in m.variables}
            return lambda v: id(v) in held
    elif isinstance(where, str):
        try:
            pattern = re.compile(where)
        except re.error as e:
            raise ValueError(f"where={where!r} is not a valid regular expression: {e}.") from None
        return lambda v: pattern.search(v.name) is not None
    elif callable(where):
        return lambda v: bool(where(v))
    what = f"the class {where.__name__}" if isinstance(where, type) else type(where).__name__
    shown = "" if isinstance(where, type) else f" {where!r:.60}"
    raise TypeError(
        f"where must be a callable (variable) -> bool (e.g. ps.trainable), a regular "
        f"expression string searched in the names, a ps.Module subclass (keeps the variables "
        f"of the modules of that type, e.g. ps.nn.Dense) or a ps.Variable subclass; got "
        f"{what}{shown}."
    )


# ------------------------------------------------------------------- the structure


class _Spec:
    """One node of a parsed collection: its variables, and its values rebuilt/flattened."""

    variables: list[Variable]

    def build(self, values: Iterator[Any]) -> Any:
        raise NotImplementedError

    def flatten(self, tree: Any, at: str) -> list[Any]:
        """``tree`` (this node's structure) as one value per variable, or a ValueError."""
        raise NotImplementedError


class _Leaf(_Spec):
    def __init__(self, v: Variable) -> None:
        self.variables = [v]

    def build(self, values: Iterator[Any]) -> Any:
        return next(values)

    def flatten(self, tree: Any, at: str) -> list[Any]:
        return [tree]


class _Dropped(_Spec):
    """A Variable that ``where`` dropped from a pytree of fixed structure: None there."""

    variables: list[Variable] = []

    def build(self, values: Iterator[Any]) -> Any:
        return None

    def flatten(self, tree: Any, at: str) -> list[Any]:
        return []


_DROPPED = _Dropped()


def _mismatch(at: str, want: str, tree: Any) -> ValueError:
    size = f", {len(tree)} items" if isinstance(tree, (list, tuple, Mapping)) else ""
    return ValueError(f"at {at or 'the top'}: expected {want}, got a {type(tree).__name__}{size}.")


class _Flat(_Spec):
    """A Module (a tuple, as ``m.trainable_variables``), a store or holder (a list)."""

    def __init__(self, found: Sequence[Variable], kind: type) -> None:
        self.variables, self.kind = list(found), kind

    def build(self, values: Iterator[Any]) -> Any:
        return self.kind(next(values) for _ in self.variables)

    def flatten(self, tree: Any, at: str) -> list[Any]:
        n = len(self.variables)
        if not isinstance(tree, (list, tuple)) or len(tree) != n:
            raise _mismatch(at, f"a {self.kind.__name__} of {n}", tree)
        return list(tree)


class _Node(_Spec):
    """A list, tuple, dict (``keys``) or other pytree (``kind``: its treedef)."""

    def __init__(self, children: list[_Spec], kind: Any, keys: list[Any] | None = None) -> None:
        self.children, self.kind, self.keys = children, kind, keys
        self.variables = [v for c in children for v in c.variables]

    def build(self, values: Iterator[Any]) -> Any:
        built = [c.build(values) for c in self.children]
        if self.keys is not None:
            return dict(zip(self.keys, built))
        return self.kind(built) if self.kind in (list, tuple) else self.kind.unflatten(built)

    def flatten(self, tree: Any, at: str) -> list[Any]:
        if self.keys is not None:
            if not isinstance(tree, Mapping) or set(tree) != set(self.keys):
                raise _mismatch(at, f"a dict with keys {self.keys}", tree)
            items = [(f"{at}[{k!r}]", tree[k]) for k in self.keys]
        elif self.kind in (list, tuple):
            if not isinstance(tree, (list, tuple)) or len(tree) != len(self.children):
                raise _mismatch(at, f"a {self.kind.__name__} of {len(self.children)}", tree)
            items = [(f"{at}[{i}]", x) for i, x in enumerate(tree)]
        else:
            try:
                items = [(at, x) for x in self.kind.flatten_up_to(tree)]
            except (ValueError, TypeError):
                raise _mismatch(at, f"a pytree {self.kind}", tree) from None
        return [x for c, (sub_at, sub) in zip(self.children, items) for x in c.flatten(sub, sub_at)]


def _bad(x: Any, at: str) -> TypeError:
    return TypeError(
        f"Expected Variables, Modules, Optimizers or dicts {{name: Variable}}, got a "
        f"{type(x).__name__} ({x!r:.60}){f' at {at}' if at else ''}. Pass the variables, e.g. "
        "[*model.variables, *optimizer.variables]."
    )


def _check_mapping(mapping: Mapping[Any, Any]) -> Mapping[Any, Any]:
    for key, var in mapping.items():
        if not isinstance(var, Variable):
            raise TypeError(
                f"Entry '{key}' is a {type(var).__name__}, not a ps.Variable: a dict names "
                "single variables ({name: variable}); put Modules in a list ([encoder, "
                "decoder])."
            )
    return mapping


def _spec(
    x: Any, train: bool, keep: Callable[[Variable], bool] | None, at: str = ""
) -> _Spec | None:
    """The parsed form of ``x`` (found at ``at``, for errors); None for a Variable the
    filter drops."""
    if isinstance(x, Variable):
        return _Leaf(x) if keep is None or keep(x) else None
    if isinstance(x, Module):
        found = x.trainable_variables if train else x.variables
        return _Flat([v for v in found if keep is None or keep(v)], tuple)
    if isinstance(x, VariableStore):
        return _Flat([v for v in x.variables() if keep is None or keep(v)], list)
    if isinstance(x, Mapping) and not isinstance(x, State):
        kept = [(k, _spec(v, train, keep, f"{at}[{k!r}]")) for k, v in _check_mapping(x).items()]
        keys = [k for k, s in kept if s is not None]
        return _Node([s for _, s in kept if s is not None], dict, keys)
    if isinstance(x, (list, tuple)):
        kind = type(x) if type(x) in (list, tuple) else list
        specs = (_spec(item, train, keep, f"{at}[{i}]") for i, item in enumerate(x))
        return _Node([s for s in specs if s is not None], kind)
    children, treedef = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
    if len(children) != 1 or children[0] is not x:  # another pytree: its own structure,
        parts = [_spec(c, train, keep, f"{at}[{i}]") for i, c in enumerate(children)]
        return _Node([_DROPPED if s is None else s for s in parts], treedef)
    if isinstance(x, State) or not _holds(x):
        raise _bad(x, at)
    held = [v for _, v in walk(x, holders=True) if isinstance(v, Variable)]
    return _Flat([v for v in held if keep is None or keep(v)], list)


def _holds(x: Any) -> bool:
    """A holder of variables that is not a Module: a ``.state`` Variable or ``.variables``."""
    if isinstance(getattr(x, "state", None), Variable):
        return True
    found = getattr(x, "variables", None)
    return found is not None and not callable(found)


@dataclass(frozen=True)
class Parsed:
    """A parsed collection (see the module docstring)."""

    variables: tuple[Variable, ...]
    spec: _Spec

    def rebuild(self, values: Sequence[Any]) -> Any:
        """One value per variable (in ``variables`` order) in the collection's structure."""
        return self.spec.build(iter(values))

    def flatten(self, tree: Any) -> list[Any]:
        """The inverse of ``rebuild``: ``tree`` in the collection's structure as one value
        per variable; a ValueError saying where the structure differs."""
        return self.spec.flatten(tree, "")


def parse(collection: VariablesLike, *, trainable: bool = False, where: Where = None) -> Parsed:
    """Parse ``collection`` (see the module docstring); ``trainable``: a Module gives its
    trainable variables. A ``where`` that keeps nothing raises ValueError."""
    keep = _predicate(where, collection)
    spec = _spec(collection, trainable, keep)
    if spec is None or (keep is not None and not spec.variables):
        total = _spec(collection, trainable, None)
        raise ValueError(
            f"where={where!r} keeps none of the {len(total.variables) if total else 0} "
            "variables it was given; check the filter (a regular expression is searched in "
            "each full name, e.g. where='dense/kernel')."
        )
    return Parsed(tuple(spec.variables), spec)


def _unique(found: Any) -> list[Variable]:
    return list({id(v): v for v in found}.values())


def variables_of(collection: VariablesLike, where: Where = None) -> list[Variable]:
    """Every variable of ``collection``, each once, in order (see the module docstring)."""
    return _unique(parse(collection, where=where).variables)


def named(
    collection: VariablesLike, *, strings: bool = False, where: Where = None
) -> tuple[list[str], list[Variable]]:
    """Names and variables, each once: a top-level dict's keys, else each variable's full
    name. String variables (host data) are left out unless ``strings``. Two variables of
    one name (from different stores) are an error asking for a dict."""
    if isinstance(collection, Mapping) and not isinstance(collection, State):
        keep = _predicate(where, collection)
        items = [(str(k), v) for k, v in _check_mapping(collection).items()]
        items = [(k, v) for k, v in items if keep is None or keep(v)]
        if keep is not None and not items:
            parse(collection, where=where)  # raises: the filter keeps nothing
    else:
        items = [(v.name, v) for v in variables_of(collection, where)]
    items = [(n, v) for n, v in items if strings or not v._is_string]
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(
            f"Several variables are named {dup} (they come from different stores); pass a "
            "dict {name: variable} to choose the keys."
        )
    return names, [v for _, v in items]


def structured(collection: VariablesLike, where: Where = None) -> Parsed:
    """What ``ps.grad`` differentiates: a Module's trainable variables, duplicates kept."""
    return parse(collection, trainable=True, where=where)
