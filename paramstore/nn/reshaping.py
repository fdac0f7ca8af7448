"""``Flatten``, ``Reshape`` and ``Activation``: Keras 3's layers without variables."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from paramstore.nn._arguments import Activation as _Fn
from paramstore.nn._arguments import resolve_activation
from paramstore.nn._base import Layer, PolicyLike, Shape, autocast
from paramstore.typing import ValueLike

__all__ = ["Flatten", "Reshape", "Activation"]


class _Stateless(Layer):
    def __init__(self, name: str | None = None, *, dtype: PolicyLike = None) -> None:
        super().__init__(name=name, dtype=dtype)
        self.built = True  # nothing to create

    def check_built(self, *shapes: Shape | None) -> None:
        """No variables: any input size."""


class Flatten(_Stateless):
    """``(batch, ...)`` to ``(batch, prod(...))``, as ``keras.layers.Flatten`` (a ``(batch,)``
    input becomes ``(batch, 1)``). A floating input is cast to the compute dtype (as Keras
    3 does); other dtypes are kept."""

    def __call__(self, x: ValueLike) -> jax.Array:
        """``x`` reshaped to ``(batch, -1)``."""
        x = autocast(jnp.asarray(x), self)
        self.ensure_built(tuple(x.shape))
        return x.reshape(x.shape[0], -1) if x.ndim != 1 else x[:, None]

    def check_shape(self, *shapes: Shape | None) -> None:
        """At least a batch axis."""
        shape = shapes[0]
        assert shape is not None
        if len(shape) == 0:
            raise ValueError(
                f"{self.describe()} needs an input with a batch axis, got a scalar. Pass "
                "x[None] for a batch of one."
            )


class Reshape(_Stateless):
    """``(batch, ...)`` to ``(batch, *target_shape)``, as ``keras.layers.Reshape``;
    ``target_shape`` excludes the batch axis and may hold one ``-1`` (inferred)."""

    def __init__(
        self, target_shape: tuple[int, ...], name: str | None = None, *, dtype: PolicyLike = None
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        dims: tuple[Any, ...]
        try:
            dims = tuple(target_shape)
        except TypeError:
            dims = (None,)
        ok = all(
            isinstance(d, int) and not isinstance(d, bool) and (d >= 1 or d == -1) for d in dims
        )
        if not ok or sum(d == -1 for d in dims) > 1:
            raise ValueError(
                f"Reshape: target_shape must be a tuple of positive ints (the shape without "
                f"the batch axis) with at most one -1, got {target_shape!r}."
            )
        self.target_shape = dims

    def check_shape(self, *shapes: Shape | None) -> None:
        """The input's size fits ``target_shape``."""
        shape = shapes[0]
        assert shape is not None
        if len(shape) == 0:
            raise ValueError(f"{self.describe()} needs an input with a batch axis, got a scalar.")
        if any(d is None for d in shape[1:]):
            return
        size = math.prod(shape[1:])  # type: ignore[arg-type]
        known = math.prod(d for d in self.target_shape if d != -1)
        fits = size % known == 0 if -1 in self.target_shape else size == known
        if not fits:
            raise ValueError(
                f"{self.describe()} cannot reshape an input of shape {shape} ({size} values "
                f"per example) to target_shape {self.target_shape}"
                + (f" ({known} values)." if -1 not in self.target_shape else ".")
                + " Pick a target_shape with the same number of values (one -1 may stand for "
                "the rest)."
            )

    def __call__(self, x: ValueLike) -> jax.Array:
        """``x`` reshaped to ``(batch, *target_shape)``."""
        x = autocast(jnp.asarray(x), self)
        self.ensure_built(tuple(x.shape))
        return x.reshape(x.shape[0], *self.target_shape)


class Activation(_Stateless):
    """``fn(x)``, as ``keras.layers.Activation``: ``fn`` is a callable or a Keras name
    (``"relu"``, ``"gelu"`` (exact), ``"leaky_relu"`` (slope 0.2), ...; see
    ``ps.nn.ACTIVATIONS``)."""

    def __init__(
        self, activation: str | _Fn, name: str | None = None, *, dtype: PolicyLike = None
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        if activation is None:
            raise ValueError("Activation: pass a callable or a Keras activation name, not None.")
        fn = resolve_activation(activation, "Activation")
        assert fn is not None
        self.activation = fn

    def check_shape(self, *shapes: Shape | None) -> None:
        """Any shape."""

    def __call__(self, x: ValueLike) -> jax.Array:
        """``fn(x)``."""
        x = autocast(jnp.asarray(x), self)
        return self.activation(x)
