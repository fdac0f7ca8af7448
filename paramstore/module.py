"""``ps.Module``: a container that finds the Variables and Modules it holds.

Contract (API.md, "Modules"):

* Variables and Modules assigned as attributes, or held in lists, tuples and dicts (any
  nesting) of attributes, are tracked. Traversal follows ``tf.Module._flatten`` exactly:
  attributes in sorted order, containers in pytree order (dict keys sorted), a module's
  own leaves before those of its submodules (which are then visited in the order found),
  each object once.
* ``name`` defaults to the class name in snake_case. Like Sonnet 2 (and unlike tf.Module),
  a subclass's ``__init__`` runs inside the module's name scope, so its variables are named
  ``"<scope>/w"``. The scope is made unique in the store (``dense``, ``dense_1``, ...), so two
  layers of one class never fight over names. ``with m.name_scope:`` re-enters it later.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax

from paramstore import scope as _scope
from paramstore.variable import Variable

__all__ = ["Module"]


def _camel_to_snake(name: str) -> str:
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def _is_tracked(x: Any) -> bool:
    return isinstance(x, (Variable, Module))


class Module:
    """Base class for models and layers; subclass it and assign Variables as attributes."""

    _scope_name: str
    _module_name: str

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        signature = inspect.signature(init)

        @functools.wraps(init)
        def wrapped(self: Module, *args: Any, **kw: Any) -> None:
            if "_scope_name" not in self.__dict__:
                try:
                    name = signature.bind_partial(self, *args, **kw).arguments.get("name")
                except TypeError:
                    name = None
                Module.__init__(self, name=name if isinstance(name, str) else None)
            with self.name_scope:
                init(self, *args, **kw)

        cls.__init__ = wrapped  # type: ignore[method-assign]

    def __init__(self, name: str | None = None) -> None:
        if "_scope_name" in self.__dict__:
            return  # already set up by a subclass's wrapped __init__
        if name is not None and (not isinstance(name, str) or not name.isidentifier()):
            raise ValueError(
                f"{name!r} is not a valid module name: use a Python identifier like 'dense'."
            )
        base = name or _camel_to_snake(type(self).__name__)
        store = _scope.default_store()
        self._module_name = base
        self._scope_name = store.unique_name(_scope.prefixed(base))

    @property
    def name(self) -> str:
        """The module's name (as given, or the class name in snake_case)."""
        return self._module_name

    @property
    def name_scope(self) -> Any:
        """A context manager that re-enters this module's (unique) name scope."""
        return _scope._absolute_scope(self._scope_name)

    @property
    def scope_name(self) -> str:
        """The full, unique prefix of this module's variable names."""
        return self._scope_name

    @property
    def variables(self) -> tuple[Variable, ...]:
        """Every Variable of this module and its submodules, in tf.Module order."""
        return tuple(self._flatten(lambda x: isinstance(x, Variable)))

    @property
    def trainable_variables(self) -> tuple[Variable, ...]:
        return tuple(self._flatten(lambda x: isinstance(x, Variable) and x.trainable))

    @property
    def non_trainable_variables(self) -> tuple[Variable, ...]:
        return tuple(self._flatten(lambda x: isinstance(x, Variable) and not x.trainable))

    @property
    def submodules(self) -> tuple[Module, ...]:
        """Every Module held (recursively), in tf.Module order."""
        return tuple(self._flatten(lambda x: isinstance(x, Module)))

    def _flatten(self, predicate: Callable[[Any], bool]) -> Iterator[Any]:
        return _walk(self, predicate, seen={id(self)}, stack=[])

    def __repr__(self) -> str:
        return f"<{type(self).__name__} '{self._scope_name}' ({len(self.variables)} variables)>"


def _walk(
    module: Module, predicate: Callable[[Any], bool], seen: set[int], stack: list[int]
) -> Iterator[Any]:
    """tf.Module's ``_flatten_module``: direct leaves first, then recurse into submodules."""
    recursive = id(module) not in stack
    submodules = []
    for key in sorted(vars(module)):
        if key in ("_scope_name", "_module_name"):
            continue
        leaves = jax.tree_util.tree_leaves(vars(module)[key], is_leaf=_is_tracked)
        for leaf in leaves:
            if id(leaf) in seen:
                continue
            seen.add(id(leaf))
            if predicate(leaf):
                yield leaf
            if recursive and isinstance(leaf, Module):
                submodules.append(leaf)
    stack.append(id(module))
    for sub in submodules:
        yield from _walk(sub, predicate, seen, stack)
    stack.pop()
