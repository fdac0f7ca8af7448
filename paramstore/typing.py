"""``ps.typing``: the named types of paramstore's public signatures.

Each alias says what a parameter accepts, matching what the code does with it at run time:

* Plain arrays and dtypes are ``jax.typing.ArrayLike`` and ``jax.typing.DTypeLike``
  (JAX's), results ``jax.Array``.
* ``ValueLike``: an array value paramstore converts: a ``jax.typing.ArrayLike``, nested
  lists/tuples of numbers (or strings, for a string variable), or a ``Variable`` (its value).
  What ``assign``, a layer's call and a metric's ``update_state`` take.
* ``InitialValue``: what ``ps.Variable(initial_value)`` takes: a ``ValueLike``, a
  zero-argument callable returning one (with ``shape=``: an ``Initializer``), or a
  ``jax.ShapeDtypeStruct`` (an abstract variable).
* ``Shape`` (a tuple of ints) and ``ShapeLike`` (an int or a sequence of ints).
* ``Initializer``: ``init(shape, dtype=float32) -> jax.Array``, what every factory of
  ``ps.initializers`` returns; ``InitializerLike``: what ``get_variable(initializer=)``
  accepts (an initializer, an uncalled factory such as ``ps.initializers.zeros``, a
  concrete value, or None for the default); ``LayerInitializer``: a ``ps.nn`` layer's
  ``*_initializer=`` (an initializer, a ``ps.initializers`` name, or None).
* ``ConstraintLike``: a constraint (``constraint=``, a layer's ``*_constraint=``): a
  callable ``(array) -> array`` of the same shape and dtype (``ps.constraints.MaxNorm()``),
  or a Keras name (``"non_neg"``); ``RegularizerLike``: a regularizer (``regularizer=``, a
  layer's ``*_regularizer=``): a callable ``(array) -> scalar`` (``ps.regularizers.L2()``),
  or a Keras name (``"l2"``).
* ``Index``: an index of ``v[index]`` (what NumPy/JAX indexing accepts).
* ``DeviceLike``: a device name (``"cpu:0"``, ``"gpu:1"``) or a ``jax.Device``;
  ``PlacementLike``: what ``ps.device`` accepts (also a ``Sharding``, a ``Mesh``, or a
  ``ps.sharding.LayoutMap``).
* ``VariablesLike``: "a collection of variables" as ``ps.state``, ``ps.grad``,
  ``ps.Optimizer``, ``ps.Saver`` and ``reshard`` parse it (``paramstore._collect``): a
  ``Variable``, a ``Module``, a ``VariableStore``, an object holding variables (``.state``
  a Variable, as ``ps.random.Generator``, or a ``.variables`` attribute), a dict
  ``{name: Variable}``, and lists or tuples of these. (Other JAX pytrees of variables are
  accepted at run time too; no static type can name them: ``typing.cast`` them.)
* ``ShardingTargets``: where ``reshard`` / ``Saver.restore(sharding=)`` put variables.
* ``SlotSharding``: where ``ps.Optimizer(slot_sharding=)`` puts each parameter's slots.
* ``Trackable``: what ``ps.Checkpoint(**objects)`` tracks (``VariablesLike``, Checkpoints,
  dicts and lists of these).
* ``PyTree``: any JAX pytree (``Any``, as in JAX: its leaves and nodes are the user's).

This module imports nothing from paramstore at run time (any module may use it); the
aliases naming paramstore's classes hold them as forward references (strings), resolved by
type checkers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, Union

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, Sharding
from jax.typing import ArrayLike, DTypeLike

if TYPE_CHECKING:
    from paramstore._core.layout import LayoutMap
    from paramstore._core.placement import Layouts
    from paramstore._core.store import VariableStore
    from paramstore.checkpoint.objects import Checkpoint
    from paramstore.module import Module
    from paramstore.variable import Variable

__all__ = [
    "ConstraintLike",
    "DeviceLike",
    "HasState",
    "HasVariables",
    "Index",
    "InitialValue",
    "Initializer",
    "InitializerLike",
    "LayerInitializer",
    "PlacementLike",
    "PyTree",
    "RegularizerLike",
    "Shape",
    "ShapeLike",
    "ShardingTargets",
    "SlotSharding",
    "Trackable",
    "ValueLike",
    "VariablesLike",
]

Shape: TypeAlias = tuple[int, ...]
"""A concrete shape: a tuple of non-negative ints."""

ShapeLike: TypeAlias = int | Sequence[int]
"""A shape as given: an int (one dimension) or a sequence of ints."""

PyTree: TypeAlias = Any
"""Any JAX pytree (``Any``, as in JAX: its structure and leaves are the caller's)."""

ValueLike: TypeAlias = Union[ArrayLike, "Variable", Sequence[Any]]
"""An array value paramstore converts: a ``jax.typing.ArrayLike``, nested lists or tuples
(of numbers, or strings for a string variable), or a ``Variable`` (its value)."""


class Initializer(Protocol):
    """``init(shape, dtype=jnp.float32) -> jax.Array``: what every factory of
    ``ps.initializers`` returns."""

    def __call__(self, shape: ShapeLike, dtype: DTypeLike = jnp.float32) -> jax.Array:
        """An array of ``shape`` and ``dtype``."""
        ...


InitialValue: TypeAlias = ValueLike | Callable[[], ValueLike] | Initializer | jax.ShapeDtypeStruct
"""``ps.Variable``'s ``initial_value``: a value, a zero-argument callable returning one (an
``Initializer`` when ``shape=`` is given), or a ``jax.ShapeDtypeStruct`` (an abstract
variable)."""


InitializerLike: TypeAlias = Initializer | Callable[..., Any] | ArrayLike | type | None
"""What ``get_variable(initializer=)`` accepts (``ps.initializers.resolve``): an
``Initializer``, an uncalled factory (``ps.initializers.zeros``), a concrete value, or None
(or a class) for the default initializer."""

Index: TypeAlias = Union[None, slice, EllipsisType, ArrayLike, "Variable", Sequence[Any]]
"""An index of ``v[index]``: what NumPy/JAX indexing accepts (ints, slices, ``...``,
``None``, integer or boolean arrays, a Variable's value, tuples of these)."""

LayerInitializer: TypeAlias = str | Initializer | Callable[..., ArrayLike] | None
"""A layer's ``*_initializer=`` (``ps.nn``): a ``ps.initializers`` name (``"he_normal"``), an
``init(shape, dtype)`` callable, or None for the layer's default."""

ConstraintLike: TypeAlias = str | Callable[[jax.Array], jax.Array]
"""A constraint: a callable ``(array) -> array`` keeping shape and dtype
(``ps.constraints.NonNeg()``), or a Keras name (``"non_neg"``, ``"max_norm"``...)."""

RegularizerLike: TypeAlias = str | Callable[[jax.Array], jax.Array]
"""A regularizer: a callable ``(array) -> scalar`` penalty (``ps.regularizers.L2(0.01)``), or
a Keras name (``"l1"``, ``"l2"``, ``"l1_l2"``)."""

DeviceLike: TypeAlias = str | jax.Device
"""A device: ``"cpu:0"``, ``"gpu:1"``, ``"/device:GPU:1"``, ``"cpu"``, or a ``jax.Device``."""

PlacementLike: TypeAlias = Union[str, jax.Device, Sharding, Mesh, "Layouts"]
"""What ``ps.device`` accepts: a ``DeviceLike``, a ``Sharding``, a ``Mesh`` (replicated over
it) or a ``ps.sharding.LayoutMap``."""

ShardingTargets: TypeAlias = (
    Sharding | Mesh | Mapping[str, Sharding | Mesh] | Callable[["Variable"], Sharding | Mesh | None]
)
"""Where ``ps.sharding.reshard`` (and ``Saver.restore(sharding=)``) puts variables: one
``Sharding`` for all (a ``Mesh``: replicated over it), a dict ``{variable full name:
Sharding}``, or a callable ``variable -> Sharding | None`` (None: the variable stays)."""

SlotSharding: TypeAlias = Union["LayoutMap", Sharding, Callable[["Variable"], Sharding | None]]
"""Where ``ps.Optimizer(slot_sharding=)`` puts the slots of each parameter: a
``ps.sharding.LayoutMap`` looked up with the parameter's name, one ``Sharding`` for all, or a
callable ``parameter -> Sharding | None`` (None: the parameter's own sharding)."""


class HasState(Protocol):
    """An object whose ``.state`` is a Variable (``ps.random.Generator``)."""

    @property
    def state(self) -> Variable:
        """The Variable holding the state."""
        ...


class HasVariables(Protocol):
    """An object with a (non-callable) ``.variables`` attribute holding variables."""

    @property
    def variables(self) -> Iterable[object]:
        """The variables held."""
        ...


VariablesLike: TypeAlias = Union[
    "Variable",
    "Module",
    "VariableStore",
    HasState,
    HasVariables,
    Mapping[Any, "Variable"],
    Sequence["VariablesLike"],
]
"""A collection of variables (see the module docstring), nested freely."""

Trackable: TypeAlias = Union[
    VariablesLike, "Checkpoint", Mapping[str, "Trackable"], Sequence["Trackable"]
]
"""What ``ps.Checkpoint(**objects)`` tracks: collections of variables (``VariablesLike``),
other Checkpoints, and dicts and lists of these (the attribute paths name the variables)."""
