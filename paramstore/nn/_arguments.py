"""A layer's constructor arguments resolved (Keras 3's forms): an activation by Keras name
(``ACTIVATIONS``) or a callable, an initializer (a callable, an uncalled factory or a
``ps.initializers`` name), and the per-weight ``<weight>_regularizer=`` /
``<weight>_constraint=`` arguments kept on the layer (``set_hooks``) and handed to each
variable it creates (``hooks``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp

from paramstore import constraints as _constraints
from paramstore import initializers as _init
from paramstore import regularizers as _regularizers
from paramstore.module import Module
from paramstore.typing import Initializer, LayerInitializer

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "hooks",
    "initializer",
    "resolve_activation",
    "set_hooks",
]

Activation = Callable[[jax.Array], jax.Array]


def _shrink(threshold: float, soft: bool) -> Activation:
    def fn(x: jax.Array) -> jax.Array:
        if soft:
            return jnp.where(
                x > threshold, x - threshold, jnp.where(x < -threshold, x + threshold, 0)
            )
        return jnp.where(jnp.abs(x) > threshold, x, 0).astype(x.dtype)

    return fn


# Keras 3's ``keras.activations`` by name, with Keras' defaults (checked against Keras in
# tests/nn/test_nn_layers.py): "gelu" is the exact erf form, "leaky_relu" has slope 0.2.
# Not here: "threshold" (needs arguments) and "sparsemax": pass a callable.
ACTIVATIONS: dict[str, Activation] = {
    "linear": lambda x: x,
    "relu": jax.nn.relu,
    "relu6": jax.nn.relu6,
    "leaky_relu": functools.partial(jax.nn.leaky_relu, negative_slope=0.2),
    "elu": jax.nn.elu,
    "celu": jax.nn.celu,
    "selu": jax.nn.selu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "glu": jax.nn.glu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "hard_silu": jax.nn.hard_silu,
    "hard_swish": jax.nn.hard_silu,
    "hard_sigmoid": jax.nn.hard_sigmoid,
    "hard_tanh": jax.nn.hard_tanh,
    "hard_shrink": _shrink(0.5, soft=False),
    "soft_shrink": _shrink(0.5, soft=True),
    "tanh_shrink": lambda x: x - jnp.tanh(x),
    "mish": jax.nn.mish,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "log_sigmoid": jax.nn.log_sigmoid,
    "sparse_sigmoid": jax.nn.sparse_sigmoid,
    "softmax": jax.nn.softmax,
    "log_softmax": jax.nn.log_softmax,
    "softplus": jax.nn.softplus,
    "sparse_plus": jax.nn.sparse_plus,
    "squareplus": functools.partial(jax.nn.squareplus, b=4),
    "softsign": jax.nn.soft_sign,
    "exponential": jnp.exp,
}
"""Keras 3's activation names (``keras.activations``) with Keras' defaults, as callables."""


def resolve_activation(fn: str | Activation | None, layer: str) -> Activation | None:
    """``fn`` as a callable: None, a callable, or a Keras name (``"relu"``)."""
    if fn is None or callable(fn):
        return fn
    if isinstance(fn, str) and fn in ACTIVATIONS:
        return ACTIVATIONS[fn]
    raise ValueError(
        f"{layer}: unknown activation {fn!r}; pass a callable or one of {sorted(ACTIVATIONS)}."
    )


def initializer(init: LayerInitializer, default: Initializer, layer: str, what: str) -> Initializer:
    """``init`` (a callable ``init(shape, dtype)`` or a ``ps.initializers`` name), or ``default``."""
    if init is None:
        return default
    if callable(init):  # an uncalled factory (ps.initializers.he_normal) is called
        init = cast(LayerInitializer, _init.resolve(init))
    if isinstance(init, str):
        factory = getattr(_init, init, None)
        if factory is None or not callable(factory):
            raise ValueError(f"{layer}: unknown {what} {init!r}; see ps.initializers.")
        made: Initializer = factory()
        return made
    if not callable(init):
        raise TypeError(
            f"{layer}: {what} must be a callable init(shape, dtype) such as "
            f"ps.initializers.glorot_uniform(), got {type(init).__name__}."
        )
    return cast(Initializer, init)


def set_hooks(layer: Module, arguments: dict[str, Any]) -> None:
    """Resolve a layer's ``<weight>_regularizer=`` / ``<weight>_constraint=`` arguments
    (those of ``arguments``, its ``__init__``'s ``locals()``: an object, a Keras name, a
    callable or None) and keep them as attributes of the same name (as Keras'
    ``layer.kernel_regularizer``); a bad one raises naming the layer and the argument."""
    kind = type(layer).__name__
    for arg, value in arguments.items():
        if arg.endswith("_regularizer"):
            setattr(layer, arg, _regularizers.get(value, f"{kind}: {arg}"))
        elif arg.endswith("_constraint"):
            setattr(layer, arg, _constraints.get(value, f"{kind}: {arg}"))


def hooks(layer: Module, weight: str) -> dict[str, Any]:
    """``regularizer=`` and ``constraint=`` for the layer's variable ``weight``."""
    return {
        "regularizer": getattr(layer, f"{weight}_regularizer", None),
        "constraint": getattr(layer, f"{weight}_constraint", None),
    }
