"""``ps.regularizers``: Keras 3's weight regularizers, and the check of any regularizer.

Contract (docs/api.md, "Weight averaging, constraints and regularizers"):

* ``L1(l1=0.01)``: ``l1 * sum(|x|)``; ``L2(l2=0.01)``: ``l2 * sum(x**2)``;
  ``L1L2(l1=0.0, l2=0.0)``: both. Keras 3's definitions and defaults (``None`` means the
  default; a factor that is not a finite non-negative number is a ``ValueError``), the
  penalty computed in the variable's dtype. ``get_config()`` / ``from_config``.
* Names, as ``keras.regularizers.get``: ``"l1"``, ``"l2"`` (and the class names ``"L1"``,
  ``"L2"``, ``"L1L2"``, ``"l1l2"``: their defaults). ``"l1_l2"`` is ``L1L2(l1=0.01,
  l2=0.01)``, the defaults Keras documents for that name (Keras 3's own ``get`` refuses
  the name; TF's ``tf.keras.regularizers.l1_l2`` had these defaults).
* ``get(identifier)``: None, a name, a ``serialize`` dict, or any callable ``(array) ->
  scalar`` (a class is instantiated with its defaults); anything else a ``ValueError``.
  ``serialize(r)`` gives Keras' dict (``{"module": "keras.regularizers", "class_name":
  "L2", "config": {"l2": 0.01}, "registered_name": None}``), which Keras' ``deserialize``
  also reads; ``deserialize`` is its inverse.
* ``check(regularizer, shape, dtype, name)``: what a penalty of a variable of that shape
  and dtype would be, computed abstractly: not a scalar is a ``ValueError`` naming the
  variable (raised before the variable exists, so nothing is created).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from paramstore._variable.keras_objects import Registry, abstract_call
from paramstore.typing import RegularizerLike

__all__ = [
    "L1",
    "L1L2",
    "L2",
    "Regularizer",
    "check",
    "deserialize",
    "get",
    "l1",
    "l1_l2",
    "l2",
    "serialize",
]


def _factor(value: Any, name: str) -> float:
    """Keras' ``validate_float_arg``: a finite, non-negative number."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (float, int))
        or math.isinf(value)
        or math.isnan(value)
        or value < 0
    ):
        raise ValueError(
            f"Invalid value for argument {name}: expected a non-negative float. "
            f"Received: {name}={value!r}"
        )
    return float(value)


class Regularizer:
    """Base class: a callable ``(array) -> scalar`` penalty with a config (Keras 3's)."""

    def __call__(self, x: ArrayLike) -> jax.Array:
        """The penalty for ``x`` (the base class: zero)."""
        return jnp.zeros((), jnp.result_type(x))

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, as Keras' ``get_config``."""
        return {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Regularizer:
        """The regularizer ``get_config`` describes."""
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"ps.regularizers.{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.get_config() == self.get_config()

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.get_config().items()))))


class L1L2(Regularizer):
    """``l1 * sum(|x|) + l2 * sum(x**2)`` (``keras.regularizers.L1L2``)."""

    def __init__(self, l1: float | None = 0.0, l2: float | None = 0.0) -> None:
        self.l1 = _factor(0.0 if l1 is None else l1, "l1")
        self.l2 = _factor(0.0 if l2 is None else l2, "l2")

    def __call__(self, x: ArrayLike) -> jax.Array:
        """The penalty ``l1 * sum(|x|) + l2 * sum(x**2)``, a scalar."""
        x = jnp.asarray(x)
        penalty = jnp.zeros((), x.dtype)
        if self.l1 != 0.0:
            penalty += jnp.asarray(self.l1, x.dtype) * jnp.sum(jnp.abs(x))
        if self.l2 != 0.0:
            penalty += jnp.asarray(self.l2, x.dtype) * jnp.sum(jnp.square(x))
        return penalty

    def get_config(self) -> dict[str, Any]:
        """``{"l1": ..., "l2": ...}``, as Keras' ``get_config``."""
        return {"l1": self.l1, "l2": self.l2}


class L1(Regularizer):
    """``l1 * sum(|x|)`` (``keras.regularizers.L1``)."""

    def __init__(self, l1: float | None = 0.01) -> None:
        self.l1 = _factor(0.01 if l1 is None else l1, "l1")

    def __call__(self, x: ArrayLike) -> jax.Array:
        """The penalty ``l1 * sum(|x|)``, a scalar."""
        x = jnp.asarray(x)
        return jnp.asarray(self.l1, x.dtype) * jnp.sum(jnp.abs(x))

    def get_config(self) -> dict[str, Any]:
        """``{"l1": ...}``, as Keras' ``get_config``."""
        return {"l1": self.l1}


class L2(Regularizer):
    """``l2 * sum(x**2)`` (``keras.regularizers.L2``)."""

    def __init__(self, l2: float | None = 0.01) -> None:
        self.l2 = _factor(0.01 if l2 is None else l2, "l2")

    def __call__(self, x: ArrayLike) -> jax.Array:
        """The penalty ``l2 * sum(x**2)``, a scalar."""
        x = jnp.asarray(x)
        return jnp.asarray(self.l2, x.dtype) * jnp.sum(jnp.square(x))

    def get_config(self) -> dict[str, Any]:
        """``{"l2": ...}``, as Keras' ``get_config``."""
        return {"l2": self.l2}


l1 = L1
l2 = L2


def l1_l2(l1: float = 0.01, l2: float = 0.01) -> L1L2:
    """``L1L2`` with the defaults of the name ``"l1_l2"`` (0.01 each)."""
    return L1L2(l1=l1, l2=l2)


_CLASSES: dict[str, Callable[[], Any]] = {
    "Regularizer": Regularizer,
    "L1": L1,
    "L2": L2,
    "L1L2": L1L2,
    "regularizer": Regularizer,
    "l1": L1,
    "l2": L2,
    "l1l2": L1L2,
    "l1_l2": l1_l2,
}


_REGISTRY = Registry(
    "regularizer",
    Regularizer,
    _CLASSES,
    {n: c for n, c in _CLASSES.items() if isinstance(c, type) and n[0].isupper()},
    "'l1', 'l2', 'l1_l2'",
    "(array) -> scalar",
)


def serialize(regularizer: Regularizer) -> dict[str, Any]:
    """Keras' serialized form of a ``ps.regularizers`` object."""
    return _REGISTRY.serialize(regularizer)


def deserialize(config: Mapping[str, Any] | str) -> Regularizer:
    """The regularizer of a ``serialize`` dict (or a name)."""
    made: Regularizer = _REGISTRY.deserialize(config)
    return made


def get(
    identifier: RegularizerLike | Mapping[str, Any] | type | None, where: str = "regularizer"
) -> Callable[[jax.Array], jax.Array] | None:
    """``identifier`` as a regularizer (see the module docstring); ``where`` names the
    argument in errors."""
    made: Callable[[jax.Array], jax.Array] | None = _REGISTRY.get(identifier, where)
    return made


def check(
    regularizer: Callable[..., Any], shape: tuple[int, ...], dtype: DTypeLike, name: str
) -> None:
    """Raise ``ValueError`` naming variable ``name`` if ``regularizer`` does not give a
    scalar for a value of ``shape`` and ``dtype`` (computed abstractly)."""
    out = abstract_call(regularizer, shape, dtype, name, "regularizer")
    leaves = jax.tree_util.tree_leaves(out)
    if len(leaves) != 1 or tuple(leaves[0].shape) != ():
        got = [tuple(x.shape) for x in leaves]
        raise ValueError(
            f"The regularizer of variable '{name}' ({regularizer!r:.60}) must return a scalar "
            f"penalty, but for a value of shape {shape} it returns shape(s) {got}. Reduce it "
            "(e.g. jnp.sum) to one number."
        )
