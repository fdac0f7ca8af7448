"""``ps.Module``: a container that finds the Variables and Modules it holds.

Contract (docs/api.md, "Modules"):

* Variables and Modules assigned as attributes, or held in lists, tuples and dicts (any
  nesting) of attributes, are tracked. Traversal follows ``tf.Module._flatten`` exactly:
  attributes in sorted order, containers in ``tf.nest`` order (mapping keys sorted, an
  ``OrderedDict``'s too; other JAX pytrees in their own order), a module's own leaves
  before those of its submodules (which are then visited in the order found), each
  object once.
* ``name`` defaults to the class name in snake_case. Like Sonnet 2 (and unlike tf.Module),
  a subclass's ``__init__`` runs inside the module's name scope, so its variables are named
  ``"<scope>/w"``. The name is taken from the ``__init__``'s ``name`` argument (also through
  ``**kwargs``), or from ``super().__init__(name=...)``, which renames the scope for the
  variables created after it. The scope is made unique in the store (``dense``,
  ``dense_1``, ...), so two layers of one class never fight over names.
  ``with m.name_scope:`` re-enters it later.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from paramstore import scope as _scope
from paramstore._core import html as _html
from paramstore._core import training as _training
from paramstore._core.context import Scope, ctx, prefixed
from paramstore._core.store import default_store
from paramstore._traverse import Key, Node, walk
from paramstore.variable import Variable

__all__ = ["Module"]

# State a higher layer leaves on a module (ps.Checkpoint's deferred restoration: the saved
# values of variables not created yet), handed to the hooks registered with
# ``on_attribute_set`` after each attribute assignment. This module knows nothing more.
PENDING = "_ps_pending"

# A module's own bookkeeping, never part of its variables.
_UNTRACKED = frozenset(("_scope_name", "_module_name", PENDING, "_ps_trainable"))

AttributeHook = Callable[["Module", str, Any], None]
_attribute_hooks: list[AttributeHook] = []


def on_attribute_set(hook: AttributeHook) -> AttributeHook:
    """Register ``hook(module, name, value)``, called after ``module.<name> = value`` on a
    module that holds pending state (its ``PENDING`` attribute): the inversion through
    which ``paramstore.checkpoint.objects`` (a higher layer) hands a saved value to a
    variable created after the restore. Returns ``hook`` (usable as a decorator)."""
    _attribute_hooks.append(hook)
    return hook


def _camel_to_snake(name: str) -> str:
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def _check_name(name: Any) -> None:
    if name is not None and not isinstance(name, str):
        raise TypeError(
            f"A module name must be a str (a Python identifier like 'dense'), got "
            f"{type(name).__name__} {name!r}."
        )
    if name is not None and not name.isidentifier():
        raise ValueError(
            f"{name!r} is not a valid module name: use a Python identifier like 'dense'."
        )


class Module(Node):
    """Base class for models and layers; subclass it and assign Variables as attributes."""

    _scope_name: str
    _module_name: str

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__call__" in cls.__dict__:  # training= travels down (paramstore/_core/training.py)
            cls.__call__ = _training.propagate(cls.__dict__["__call__"])  # type: ignore[method-assign]
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        signature = inspect.signature(init)

        @functools.wraps(init)
        def wrapped(self: Module, *args: Any, **kw: Any) -> None:
            if "_scope_name" not in self.__dict__:
                try:
                    call = signature.bind_partial(self, *args, **kw)
                    call.apply_defaults()  # `def __init__(self, name="model")` names it
                    bound = call.arguments
                except TypeError:
                    bound = {}
                name = bound.get("name", kw.get("name"))  # kw: a name passed via **kwargs
                Module.__init__(self, name=name)  # a name that is not a str: TypeError
            with self.name_scope:
                init(self, *args, **kw)

        cls.__init__ = wrapped  # type: ignore[method-assign]

    def __init__(self, name: str | None = None) -> None:
        _check_name(name)
        if "_scope_name" in self.__dict__:
            # Already set up by a subclass's wrapped __init__, which could not see a name
            # given only here (``super().__init__(name="encoder")``): rename the scope.
            if name is not None and name != self._module_name:
                self._rename(name)
            return
        base = name or _camel_to_snake(type(self).__name__)
        self._module_name = base
        self._scope_name = default_store().unique_name(prefixed(base))

    def _rename(self, name: str) -> None:
        old = self._scope_name
        parent = old.rpartition("/")[0]
        new = default_store().unique_name(f"{parent}/{name}" if parent else name)
        self._module_name, self._scope_name = name, new
        stack = ctx.scopes
        if stack and stack[-1] == Scope(old, True, None):  # inside our own scope
            stack[-1] = Scope(new, True, None)

    @property
    def name(self) -> str:
        """The module's name (as given, or the class name in snake_case)."""
        return self._module_name

    @property
    def name_scope(self) -> AbstractContextManager[None]:
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
    def trainable(self) -> bool:
        """Whether this module trains (Keras 3's ``layer.trainable``). ``m.trainable = False``
        freezes every variable of the module and its submodules (and sets their
        ``trainable`` to False): ``m.trainable_variables`` is empty, ``ps.trainable``,
        ``ps.grad`` over Modules and every optimizer (even one built before) leave them
        alone, from the next step on (a ``ps.function`` retraces where a flag it saw
        changed). ``m.trainable = True`` lifts the freeze; variables created
        non-trainable (moving statistics, ``v.trainable = False``) stay so. A frozen
        variable keeps its value, name and checkpoint key. Not a bool: ``TypeError``."""
        return bool(self.__dict__.get("_ps_trainable", True))

    @trainable.setter
    def trainable(self, value: bool) -> None:
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(
                f"{type(self).__name__} '{self.scope_name}': trainable must be a bool (True or "
                f"False), got {type(value).__name__} {value!r:.40}."
            )
        value = bool(value)
        for _, x in walk(self):
            if isinstance(x, Module):
                object.__setattr__(x, "_ps_trainable", value)
            elif isinstance(x, Variable):
                x._freeze(not value)

    @property
    def trainable_variables(self) -> tuple[Variable, ...]:
        """The variables that train: none when the module is frozen (``trainable = False``)."""
        if not self.trainable:
            return ()
        return tuple(self._flatten(lambda x: isinstance(x, Variable) and x.trainable))

    @property
    def non_trainable_variables(self) -> tuple[Variable, ...]:
        return tuple(self._flatten(lambda x: isinstance(x, Variable) and not x.trainable))

    @property
    def submodules(self) -> tuple[Module, ...]:
        """Every Module held (recursively), in tf.Module order."""
        return tuple(self._flatten(lambda x: isinstance(x, Module)))

    def _flatten(self, predicate: Callable[[Any], bool]) -> Iterator[Any]:
        return (x for _, x in walk(self) if x is not self and predicate(x))

    def _ps_children(self) -> list[tuple[Key, Any]]:
        """The attributes the traversal visits, sorted by name (``paramstore._traverse``)."""
        attrs = vars(self)
        return [(k, attrs[k]) for k in sorted(attrs) if k not in _UNTRACKED]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} '{self._scope_name}' ({len(self.variables)} variables)>"

    def _repr_html_(self) -> str:  # Jupyter's rendering (paramstore/_core/html.py)
        return _html.module_html(self)

    # A module with pending state (``PENDING``: a restore left the values of variables not
    # created yet) passes each assignment to the registered hooks (``on_attribute_set``).
    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if self.__dict__.get(PENDING) is not None:
            for hook in _attribute_hooks:
                hook(self, name, value)
