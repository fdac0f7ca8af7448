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
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import numpy as np

from paramstore import scope as _scope
from paramstore._core import html as _html
from paramstore._core import training as _training
from paramstore._core.context import STATE_LOCK, Scope, ctx, prefixed
from paramstore._core.interrupts import deferred
from paramstore._core.jax_api import refuse_as_array
from paramstore._core.store import default_store, give_back, journal
from paramstore._summary import summary as _summary
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


ChildHook = Callable[["Module", Key, Variable], bool]
_child_hooks: list[ChildHook] = []


def on_child_created(hook: ChildHook) -> ChildHook:
    """Register ``hook(module, key, variable) -> bool``, called by ``child_created`` for a
    variable a module holds other than as an attribute (an average's shadow, keyed by a
    ``Relative``); it returns True when it gave the variable a pending saved value."""
    _child_hooks.append(hook)
    return hook


def child_created(module: Module, key: Key, var: Variable) -> bool:
    """``module`` now holds the new variable ``var`` under ``key`` (as its ``_ps_children``
    lists it): deferred restoration for children that are not attributes. True when a
    pending saved value was given to ``var``; a saved value that does not fit raises (and
    stays pending)."""
    if module.__dict__.get(PENDING) is None:
        return False
    return any([hook(module, key, var) for hook in _child_hooks])


def _camel_to_snake(name: str) -> str:
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def _kind_fits(given: np.dtype[Any], want: np.dtype[Any]) -> bool:
    """May a value of dtype ``given`` go into a variable of ``want`` (``set_weights``)?"""
    if given == want:
        return True
    if np.issubdtype(want, np.floating) or want.kind == "V":  # bfloat16 & co. are "V"
        return given.kind in "biuf" or given.kind == "V"
    if np.issubdtype(want, np.integer):
        return given.kind in "biu"
    if np.issubdtype(want, np.complexfloating):
        return given.kind in "biufc"
    return False


def _describe(module: Module) -> str:
    describe = getattr(module, "describe", None)
    if callable(describe):
        return str(describe())
    return f"{type(module).__name__} '{module.scope_name}'"


def _check_training(module: Module, given: object) -> None:
    """``training=`` that is not a Python bool or None: a traced flag where ``module``'s
    class allows one (``traced_training``), else ``TypeError`` naming the module."""
    supports = type(module).traced_training
    if supports and _training.is_flag(given):
        return
    extra = " or a boolean scalar array (a traced flag)" if supports else ""
    raise TypeError(
        f"{_describe(module)}: training must be True, False or None{extra}, got "
        f"{type(given).__name__} {given!r:.40}. Pass a Python bool (training=True for "
        "training, False for evaluation)."
    )


def _ordered(module: Module) -> list[Variable]:
    """The variables in ``weights`` order, whatever an instance attribute named ``weights``
    holds (a class may override ``weights`` with a property: MultiHeadAttention does)."""
    for klass in type(module).__mro__:
        attr = klass.__dict__.get("weights")
        if isinstance(attr, property) and attr.fget is not None:
            return list(attr.fget(module))
        if attr is not None:
            break
    return _keras_weights(module)


class _KerasWeights:
    """``Module.weights``: a non-data descriptor, so an attribute a subclass sets under that
    name (``self.weights = {...}``, as code written before it existed may) shadows it."""

    def __get__(self, module: Module | None, owner: type | None = None) -> Any:
        if module is None:
            return self
        return _keras_weights(module)


def _keras_children(node: Node) -> Iterable[tuple[Key, Any]]:
    """A module's attributes in Keras' order (see ``Module.weights``): its class's
    ``_keras_order`` and ``variable_names`` first, then the others in assignment order."""
    if not isinstance(node, Module):
        return node._ps_children()
    first = (*type(node)._keras_order, *getattr(type(node), "variable_names", ()))
    attrs = list(vars(node))
    rank = {k: (first.index(k) if k in first else len(first) + attrs.index(k)) for k in attrs}
    own = [(k, v) for k, v in node._ps_children() if isinstance(k, str) and k in rank]
    return sorted(own, key=lambda kv: rank[kv[0]])


def _keras_weights(module: Module) -> list[Variable]:
    """``module``'s variables in Keras' order: its own variables, then each sub-module's
    whole (the one traversal, ``_traverse.walk``, with the children in Keras' order)."""
    return [v for _, v in walk(module, children=_keras_children) if isinstance(v, Variable)]


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
    # Attributes whose variables come first in ``weights`` (Keras' order), in this order.
    _keras_order: ClassVar[tuple[str, ...]] = ()
    #: Whether ``training=`` may be a traced flag (a boolean scalar ``jax.Array``,
    #: paramstore/_core/training.py); a class without a traced mode sets False.
    traced_training: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__call__" in cls.__dict__:  # training= travels down (paramstore/_core/training.py)
            call = _training.propagate(cls.__dict__["__call__"], _check_training)
            cls.__call__ = call  # type: ignore[method-assign]
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        signature = inspect.signature(init)

        @functools.wraps(init)
        def wrapped(self: Module, *args: Any, **kw: Any) -> None:
            if "_scope_name" in self.__dict__:  # an outer __init__ (or __new__) named it
                with self.name_scope:
                    init(self, *args, **kw)
                return
            try:
                call = signature.bind_partial(self, *args, **kw)
                call.apply_defaults()  # `def __init__(self, name="model")` names it
                bound = call.arguments
            except TypeError:
                bound = {}
            name = bound.get("name", kw.get("name"))  # kw: a name passed via **kwargs
            with journal() as taken:
                Module.__init__(self, name=name)  # a name that is not a str: TypeError
                first = self._scope_name
                try:
                    with self.name_scope:
                        init(self, *args, **kw)
                except BaseException:
                    # A constructor that raises made no module: its names (its scope's and
                    # everything under it) are free again, so the next one is `dense`.
                    give_back(taken, {first, self._scope_name})
                    raise

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
        """The non-trainable Variables of this module and its submodules, in ``variables``
        order."""
        return tuple(self._flatten(lambda x: isinstance(x, Variable) and not x.trainable))

    @property
    def submodules(self) -> tuple[Module, ...]:
        """Every Module held (recursively), in tf.Module order."""
        return tuple(self._flatten(lambda x: isinstance(x, Module)))

    # ---------------------------------------------------------------- Keras' weights API

    weights = _KerasWeights()
    """Every Variable, in Keras' order (a layer's own variables as Keras creates them,
    ``kernel`` before ``bias``; then its sub-layers, each whole, in attribute order, a
    ``Sequential``'s in list order), so ``keras_layer.set_weights(layer.get_weights())``
    lines up. The same set as ``variables``, ordered differently. (A subclass's own
    attribute named ``weights`` takes precedence, as it did before Module had one.)"""

    @property
    def trainable_weights(self) -> list[Variable]:
        """``trainable_variables`` (Keras' name), in ``weights`` order."""
        keep = {id(v) for v in self.trainable_variables}
        return [v for v in _ordered(self) if id(v) in keep]

    @property
    def non_trainable_weights(self) -> list[Variable]:
        """``non_trainable_variables`` (Keras' name), in ``weights`` order."""
        keep = {id(v) for v in self.trainable_variables}
        return [v for v in _ordered(self) if id(v) not in keep]

    def get_weights(self) -> list[np.ndarray]:
        """The values of ``weights`` as NumPy copies, in that order (as Keras)."""
        return [v.numpy() for v in _ordered(self)]

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Assign ``weights`` (arrays in ``weights`` order, as ``get_weights`` returns them).

        Checked before anything is assigned (all or nothing): the count, each shape, and
        each dtype's kind: a floating value may go into a floating variable of another
        width (cast, as Keras does: ``np.random.rand`` gives float64), an integer or bool
        into an integer or floating one; anything else (a float into an int variable, a
        complex into a float) raises TypeError naming the layer and the index. Abstract
        variables (``ps.abstract()``, not restored yet) raise ValueError naming them. The
        writes are one step: a compiled step, a read of several variables or an interrupt
        (Ctrl-C, held back until all are written) sees all old or all new values."""
        own = _ordered(self)
        who = _describe(self)
        values = list(weights)
        abstract = [v.name for v in own if v.is_abstract]
        if abstract:
            raise ValueError(
                f"{who}.set_weights: {len(abstract)} of its variables are abstract (created "
                f"in ps.abstract(), with no value yet): {abstract[:5]}"
                f"{' ...' if len(abstract) > 5 else ''}. Restore a checkpoint into them or "
                "call ps.initialize(module) first. Nothing was assigned."
            )
        if len(values) != len(own):
            raise ValueError(
                f"{who}.set_weights expects {len(own)} arrays (one per variable in "
                f".weights order: {[v.name for v in own]}), got {len(values)}. Nothing was "
                "assigned."
            )
        cast = []
        for i, (v, w) in enumerate(zip(own, values)):
            arr = np.asarray(w)
            if tuple(arr.shape) != tuple(v.shape):
                raise ValueError(
                    f"{who}.set_weights: array {i} has shape {tuple(arr.shape)} but variable "
                    f"{i} ({v.name}) has shape {tuple(v.shape)}. Nothing was assigned."
                )
            if not _kind_fits(arr.dtype, np.dtype(v.dtype)):
                raise TypeError(
                    f"{who}.set_weights: array {i} has dtype {arr.dtype}, which does not fit "
                    f"variable {i} ({v.name}, {v.dtype}). Pass values of that kind "
                    f"(arr.astype({str(v.dtype)!r}) if the conversion is meant). Nothing was "
                    "assigned."
                )
            cast.append(v._coerce(arr.astype(v.dtype), "assign"))
        with deferred(), STATE_LOCK:  # all or nothing, Ctrl-C included (held back to the end)
            for v, x in zip(own, cast):
                v._swap(x, owned=False)

    def count_params(self) -> int:
        """The number of scalars in ``weights`` (Keras' ``count_params``)."""
        return sum(int(v.size) for v in _ordered(self))

    def summary(self) -> None:
        """Print ``ps.summary(self)``, the table of the variables (as Keras'
        ``model.summary()``, it returns None; ``ps.summary`` returns the text)."""
        print(_summary(self))

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


def _not_an_array(module: Module) -> str:
    return (
        f"{type(module).__name__} '{module.scope_name}' was passed as an argument to a JAX "
        "transformation (jax.jit, jax.grad, jax.vmap, ...), but a Module is not an array: its "
        "variables are state a plain JAX function cannot read or update. Compile with "
        "ps.function instead of jax.jit (it takes Modules as arguments and writes their "
        "variables back), or pass ps.state(model) (a pytree of arrays) and run the model "
        "with ps.pure(fn, model)."
    )


refuse_as_array(Module, _not_an_array)
