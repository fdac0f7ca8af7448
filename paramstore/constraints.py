"""``ps.constraints``: Keras 3's weight constraints, and the check of any constraint.

Contract (docs/api.md, "Weight averaging, constraints and regularizers"):

* ``NonNeg()``: ``max(w, 0)``; ``MaxNorm(max_value=2, axis=0)``, ``UnitNorm(axis=0)``,
  ``MinMaxNorm(min_value=0.0, max_value=1.0, rate=1.0, axis=0)``: the norms over ``axis``
  (keepdims) rescaled as Keras 3 does, with its ``epsilon`` (1e-7) in the denominator.
  ``get_config()`` / ``from_config``.
* Names, as ``keras.constraints.get``: ``"non_neg"``, ``"max_norm"``, ``"unit_norm"``,
  ``"min_max_norm"`` (and the class names), each with its defaults.
* ``get(identifier)``: None, a name, a ``serialize`` dict, or any callable ``(array) ->
  array`` (a class is instantiated); anything else a ``ValueError``. ``serialize`` gives
  Keras' dict (``{"module": "keras.constraints", "class_name": "MaxNorm", ...}``).
* ``check(constraint, shape, dtype, name)``: the constraint run abstractly on a value of
  that shape and dtype; a result of another shape or dtype is a ``ValueError`` naming the
  variable (raised when the variable is created, and by an optimizer before it assigns
  anything).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from paramstore._variable.keras_objects import Registry, abstract_call
from paramstore.typing import ConstraintLike

__all__ = [
    "Constraint",
    "MaxNorm",
    "MinMaxNorm",
    "NonNeg",
    "UnitNorm",
    "check",
    "deserialize",
    "get",
    "max_norm",
    "min_max_norm",
    "non_neg",
    "serialize",
    "unit_norm",
]

EPSILON = 1e-7  # keras.backend.epsilon()

Axis = int | tuple[int, ...] | list[int]


def _norms(w: jax.Array, axis: Axis) -> jax.Array:
    ax = tuple(axis) if isinstance(axis, list) else axis
    return jnp.sqrt(jnp.sum(jnp.square(w), axis=ax, keepdims=True))


class Constraint:
    """Base class: a callable ``(array) -> array`` projection with a config (Keras 3's)."""

    def __call__(self, w: ArrayLike) -> jax.Array:
        """The projected value (the base class: ``w`` unchanged)."""
        return jnp.asarray(w)

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, as Keras' ``get_config``."""
        return {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Constraint:
        """The constraint ``get_config`` describes."""
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"ps.constraints.{type(self).__name__}({args})"


class MaxNorm(Constraint):
    """Norms over ``axis`` clipped to at most ``max_value`` (``keras.constraints.MaxNorm``)."""

    def __init__(self, max_value: float = 2, axis: Axis = 0) -> None:
        self.max_value = max_value
        self.axis = axis

    def __call__(self, w: ArrayLike) -> jax.Array:
        """``w`` rescaled so that its norm along ``axis`` is at most ``max_value`` (Keras 3's formula)."""
        w = jnp.asarray(w)
        norms = _norms(w, self.axis)
        desired = jnp.clip(norms, 0, self.max_value)
        return w.astype(norms.dtype) * (desired / (EPSILON + norms))

    def get_config(self) -> dict[str, Any]:
        """``{"max_value": ..., "axis": ...}``, as Keras' ``get_config``."""
        return {"max_value": self.max_value, "axis": self.axis}


class NonNeg(Constraint):
    """Negative entries set to zero (``keras.constraints.NonNeg``)."""

    def __call__(self, w: ArrayLike) -> jax.Array:
        """``w`` with its negative entries set to zero."""
        w = jnp.asarray(w)
        return jnp.maximum(w, jnp.zeros((), w.dtype))


class UnitNorm(Constraint):
    """Norms over ``axis`` scaled to one (``keras.constraints.UnitNorm``)."""

    def __init__(self, axis: Axis = 0) -> None:
        self.axis = axis

    def __call__(self, w: ArrayLike) -> jax.Array:
        """``w`` divided by its norm along ``axis`` (Keras 3's epsilon)."""
        w = jnp.asarray(w)
        norms = _norms(w, self.axis)
        return w.astype(norms.dtype) / (EPSILON + norms)

    def get_config(self) -> dict[str, Any]:
        """``{"axis": ...}``, as Keras' ``get_config``."""
        return {"axis": self.axis}


class MinMaxNorm(Constraint):
    """Norms over ``axis`` moved into ``[min_value, max_value]`` at ``rate``
    (``keras.constraints.MinMaxNorm``)."""

    def __init__(
        self, min_value: float = 0.0, max_value: float = 1.0, rate: float = 1.0, axis: Axis = 0
    ) -> None:
        self.min_value = min_value
        self.max_value = max_value
        self.rate = rate
        self.axis = axis

    def __call__(self, w: ArrayLike) -> jax.Array:
        """``w`` rescaled so that its norm along ``axis`` moves (by ``rate``) into ``[min_value, max_value]``."""
        w = jnp.asarray(w)
        norms = _norms(w, self.axis)
        desired = (
            self.rate * jnp.clip(norms, self.min_value, self.max_value) + (1 - self.rate) * norms
        )
        return w.astype(norms.dtype) * (desired / (EPSILON + norms))

    def get_config(self) -> dict[str, Any]:
        """``{"min_value", "max_value", "rate", "axis"}``, as Keras' ``get_config``."""
        return {
            "min_value": self.min_value,
            "max_value": self.max_value,
            "rate": self.rate,
            "axis": self.axis,
        }


max_norm = MaxNorm
non_neg = NonNeg
unit_norm = UnitNorm
min_max_norm = MinMaxNorm

_KNOWN = "'non_neg', 'max_norm', 'unit_norm', 'min_max_norm'"

_CLASSES: dict[str, type[Constraint]] = {
    "Constraint": Constraint,
    "MaxNorm": MaxNorm,
    "NonNeg": NonNeg,
    "UnitNorm": UnitNorm,
    "MinMaxNorm": MinMaxNorm,
    "constraint": Constraint,
    "max_norm": MaxNorm,
    "non_neg": NonNeg,
    "unit_norm": UnitNorm,
    "min_max_norm": MinMaxNorm,
}


_REGISTRY = Registry(
    "constraint",
    Constraint,
    _CLASSES,
    {n: c for n, c in _CLASSES.items() if isinstance(c, type) and n[0].isupper()},
    _KNOWN,
    "(array) -> array",
)


def serialize(constraint: Constraint) -> dict[str, Any]:
    """Keras' serialized form of a ``ps.constraints`` object."""
    return _REGISTRY.serialize(constraint)


def deserialize(config: Mapping[str, Any] | str) -> Constraint:
    """The constraint of a ``serialize`` dict (or a name)."""
    made: Constraint = _REGISTRY.deserialize(config)
    return made


def get(
    identifier: ConstraintLike | Mapping[str, Any] | type | None, where: str = "constraint"
) -> Callable[[jax.Array], jax.Array] | None:
    """``identifier`` as a constraint (see the module docstring); ``where`` names the
    argument in errors."""
    made: Callable[[jax.Array], jax.Array] | None = _REGISTRY.get(identifier, where)
    return made


def check(
    constraint: Callable[..., Any], shape: tuple[int, ...], dtype: DTypeLike, name: str
) -> None:
    """Raise ``ValueError`` naming variable ``name`` if ``constraint`` changes the shape or
    dtype of a value of ``shape`` and ``dtype`` (computed abstractly)."""
    out = abstract_call(constraint, shape, dtype, name, "constraint")
    got = (tuple(getattr(out, "shape", ())), getattr(out, "dtype", None))
    if got != (tuple(shape), jnp.dtype(dtype)):
        raise ValueError(
            f"The constraint of variable '{name}' ({constraint!r:.60}) must keep its value's "
            f"shape and dtype {tuple(shape)} {jnp.dtype(dtype)}, but returns {got[0]} {got[1]}. "
            "A constraint projects the value (e.g. clips its norm); it cannot reshape or cast it."
        )
