"""The one traversal of an object graph: ``walk(root)`` yields ``(path, object)``.

Contract (used by ``Module.variables`` and ``Module.weights``, ``ps.Checkpoint``'s paths,
``_collect``, the parser of "a collection of variables", and ``ps.nn.Repeat``'s block paths):

* ``walk(root, prefix=None, *, holders=False, children=None)`` yields every ``Variable``
  and every ``Node`` (``ps.Module``) reachable from ``root``, each object once (where first
  met), with its path: ``"model/layers/0/w"`` (segments joined by ``/`` below ``prefix``),
  or ``None`` for every path when ``prefix`` is None (no strings are built).
* Order (``tf.Module._flatten``'s): a node's children in its own order (a Module's
  attributes sorted by name), each flattened in ``tf.nest`` order (mapping keys sorted,
  insertion order if they do not sort; lists and tuples in order; other JAX pytrees in
  their own order), stopping at Variables and nodes; a node's direct finds come before
  those of its sub-nodes, which are then walked in the order found.
* ``holders=True`` also descends into objects that hold variables without being
  Modules, and yields them (as it yields nodes): an object with a ``_ps_children()``
  method (``ps.Checkpoint``), one whose ``.state`` is a Variable (``ps.random.Generator``:
  path ``<...>/state``), or one with a non-callable ``.variables`` (path
  ``<...>/variables/<i>``). ``Module.variables`` walks without them, as ``tf.Module`` does.
* ``children(node)``, where given, lists a node's children instead of its own
  ``_ps_children()``: the same walk in another order (``Module.weights``: Keras' order,
  attributes in assignment order).
* A child may be keyed by ``Relative(owner, rest, fallback)`` instead of a string: its path
  is then ``<node path>/<owner's path>/<rest>`` where ``owner`` has a path in this walk, else
  ``<node path>/<fallback>``. Such children are walked after everything else (so every
  owner's path is known). ``ps.Optimizer`` keys its slots so: by the parameter's path, never
  by position.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from paramstore.variable import Variable

__all__ = ["Node", "Relative", "walk", "container_items"]

# Attribute values that hold nothing: skipped without asking JAX to flatten them (most of a
# layer's attributes; flattening each cost about 5 us, half of Module.variables' time).
_ATOMIC = (
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
    type,
    range,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    jax.Array,
    np.ndarray,
)

_SKIP = frozenset(_ATOMIC)  # checked first, by exact type (faster than isinstance)


@dataclass(frozen=True)
class Relative:
    """A child key relative to another object's path (see the module docstring)."""

    owner: Any
    rest: str
    fallback: str


Key = str | Relative
Children = Callable[["Node"], Iterable[tuple[Key, Any]]]
"""``children(node)``: a node's ``(key, child)`` pairs in the order a walk takes them."""


class Node:
    """An object the traversal descends into; ``ps.Module`` is one."""

    __slots__ = ()

    def _ps_children(self) -> Iterable[tuple[Key, Any]]:
        """``(key, value)`` pairs in traversal order."""
        raise NotImplementedError


def _segment(key: Any) -> str:
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, GetAttrKey):
        name: str = key.name
        return name
    if isinstance(key, (DictKey, FlattenedIndexKey)):
        return str(key.key)
    return str(key)


def container_items(x: Any) -> list[tuple[str, Any]] | None:
    """The children of a container in ``tf.nest`` order, as ``(segment, child)``; None for a
    leaf (anything that is not a mapping, list, tuple or other JAX pytree node)."""
    if isinstance(x, Mapping):
        try:
            keys = sorted(x)
        except TypeError:  # unsortable keys: tf.nest refuses them; keep insertion order
            keys = list(x)
        return [(str(k), x[k]) for k in keys]
    if isinstance(x, (list, tuple)):
        return [(str(i), item) for i, item in enumerate(x)]
    if isinstance(x, _ATOMIC):
        return None
    found, _ = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    if len(found) == 1 and found[0][1] is x:
        return None
    return [("/".join(_segment(k) for k in path), child) for path, child in found]


def _holder_children(x: Any) -> list[tuple[Key, Any]] | None:
    """What a non-Module holder of variables holds (``holders=True``), or None."""
    children = getattr(type(x), "_ps_children", None)
    if children is not None:
        return list(children(x))
    state = getattr(x, "state", None)
    if isinstance(state, Variable):
        return [("state", state)]
    found = getattr(x, "variables", None)
    if found is None or callable(found):
        return None
    return [("variables", list(found))]


def _join(path: str | None, segment: str | None) -> str | None:
    if path is None or segment is None:
        return path
    return f"{path}/{segment}" if path else segment


def _own_children(node: Node) -> Iterable[tuple[Key, Any]]:
    return node._ps_children()


class _Walk:
    def __init__(self, paths: bool, holders: bool, children: Children) -> None:
        self.paths = paths
        self.holders = holders
        self.children = children
        self.seen: set[int] = set()
        self.path_of: dict[int, str] = {}
        self.deferred: list[tuple[str, Relative, Any]] = []

    def leaves(self, x: Any, path: str | None, out: list[Any], later: list[Any]) -> None:
        """Append to ``out`` the Variables and nodes in ``x`` met for the first time (tf.nest
        order), and to ``later`` the nodes and holders to expand after them."""
        if type(x) in _SKIP:
            return
        if isinstance(x, Variable):
            if id(x) not in self.seen:
                self.seen.add(id(x))
                if path is not None:
                    self.path_of[id(x)] = path
                out.append((path, x))
            return
        is_node = isinstance(x, Node)
        if not is_node and isinstance(x, _ATOMIC):  # an array, a str subclass...
            return
        if is_node or (self.holders and not isinstance(x, (Mapping, list, tuple))):
            if id(x) in self.seen:
                return
            below = list(self.children(x)) if is_node else _holder_children(x)
            if below is not None:
                self.seen.add(id(x))
                out.append((path, x))
                later.append((path, below))
                return
        for segment, child in container_items(x) or ():
            self.leaves(child, _join(path, segment), out, later)

    def expand(self, entries: Iterable[tuple[Key | None, Any]], path: str | None) -> list[Any]:
        """``(path, object)`` under a node's ``entries``: its own finds, then its sub-nodes'."""
        out: list[Any] = []
        later: list[tuple[str | None, list[tuple[Key, Any]]]] = []
        for key, value in entries:
            if isinstance(key, Relative):
                if path is not None:
                    self.deferred.append((path, key, value))
                    continue
                key = None
            self.leaves(value, _join(path, key), out, later)
        for sub_path, below in later:
            out.extend(self.expand(below, sub_path))
        return out

    def resolve(self) -> list[Any]:
        """The children keyed by ``Relative``, now that every owner's path is known."""
        out: list[Any] = []
        while self.deferred:
            batch, self.deferred = self.deferred, []
            entries = []
            for path, key, value in batch:
                owner = self.path_of.get(id(key.owner))
                rel = f"{owner}/{key.rest}".rstrip("/") if owner is not None else key.fallback
                entries.append((_join(path, rel), value))
            out.extend(self.expand(entries, ""))
        return out


def walk(
    root: Any,
    prefix: str | None = None,
    *,
    holders: bool = False,
    children: Children | None = None,
) -> Iterator[tuple[str | None, Any]]:
    """Every Variable and Node (and holder) under ``root`` with its path (see the module
    docstring)."""
    state = _Walk(prefix is not None, holders, children or _own_children)
    yield from state.expand([(None, root)], prefix)
    yield from state.resolve()
