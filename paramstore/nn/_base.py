"""The base of every ``ps.nn`` layer: build on the first call, check the input after.

Contract:

* A layer is a ``ps.Module``. Its variables do not exist until its first call: then
  ``build(shape)`` creates them from the input's shape (eagerly, or during the first trace
  of a ``ps.function``), inside the layer's name scope, so they are named
  ``"<layer>/<variable>"`` (``"dense/kernel"``).
* Every input is checked before anything is built or computed: a bad input raises a
  ``ValueError``/``TypeError`` naming the layer and the shapes, and builds or changes nothing.
* ``_repr_html_`` renders ``ps.summary``'s table in Jupyter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from paramstore import initializers as _init
from paramstore._summary import summary, summary_html
from paramstore.module import Module

__all__ = ["Layer", "resolve_activation", "initializer", "as_float"]

Activation = Callable[[jax.Array], jax.Array]

_ACTIVATIONS: dict[str, Activation] = {
    "linear": lambda x: x,
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "elu": jax.nn.elu,
    "selu": jax.nn.selu,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "softmax": jax.nn.softmax,
    "softplus": jax.nn.softplus,
    "leaky_relu": jax.nn.leaky_relu,
}


def resolve_activation(fn: str | Activation | None, layer: str) -> Activation | None:
    """``fn`` as a callable: None, a callable, or a Keras name (``"relu"``)."""
    if fn is None or callable(fn):
        return fn
    if isinstance(fn, str) and fn in _ACTIVATIONS:
        return _ACTIVATIONS[fn]
    raise ValueError(
        f"{layer}: unknown activation {fn!r}; pass a callable or one of {sorted(_ACTIVATIONS)}."
    )


def initializer(init: Any, default: _init.Initializer, layer: str, what: str) -> Any:
    """``init`` (a callable ``init(shape, dtype)`` or a ``ps.initializers`` name), or ``default``."""
    if init is None:
        return default
    if isinstance(init, str):
        factory = getattr(_init, init, None)
        if factory is None or not callable(factory):
            raise ValueError(f"{layer}: unknown {what} {init!r}; see ps.initializers.")
        return factory()
    if not callable(init):
        raise TypeError(
            f"{layer}: {what} must be a callable init(shape, dtype) such as "
            f"ps.initializers.glorot_uniform(), got {type(init).__name__}."
        )
    return init


def as_float(x: Any) -> jax.Array:
    """``x`` as an array; integers and bools become float32 (as Keras casts inputs)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    return x


class Layer(Module):
    """A module that builds its variables on its first call (see the module docstring).

    Subclasses implement ``check(shape)`` (raise on a bad input, before building),
    ``build(shape)`` (create the variables) and ``call(...)``; ``__call__`` runs them.
    """

    built: bool

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name=name)
        self.built = False
        self._in_features: int | None = None

    def _ensure_built(self, shape: tuple[int, ...]) -> None:
        """Check the input shape against the built one, or build from it."""
        if self.built:
            if self._in_features is not None and (not shape or shape[-1] != self._in_features):
                raise ValueError(
                    f"{self.describe()} was built for inputs whose last axis is "
                    f"{self._in_features}, but got an input of shape {shape} (last axis "
                    f"{shape[-1] if shape else 'none'}). Pass inputs with "
                    f"{self._in_features} features, or use a new layer."
                )
            return
        if not shape:
            raise ValueError(
                f"{self.describe()} needs an input with at least one axis, got a scalar."
            )
        with self.name_scope:
            self.build(shape)
        self._in_features = shape[-1]
        self.built = True

    def build(self, shape: tuple[int, ...]) -> None:
        """Create the variables for an input of ``shape`` (called once, in the name scope)."""

    def describe(self) -> str:
        """``"Dense 'dense_1'"``: how error messages name this layer."""
        return f"{type(self).__name__} '{self.scope_name}'"

    def _repr_html_(self) -> str:
        return summary_html(self)

    def summary(self) -> str:
        """``ps.summary(self)``."""
        return summary(self)
