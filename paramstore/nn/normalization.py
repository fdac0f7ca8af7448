"""``LayerNormalization`` and ``BatchNormalization`` over the last axis (Keras defaults)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from paramstore import initializers as _init
from paramstore._core.layout import Partition
from paramstore.nn._base import Layer, Shape, as_float, features, traced_training
from paramstore.typing import ValueLike
from paramstore.variable import Variable

__all__ = ["LayerNormalization", "BatchNormalization"]


def _check_epsilon(epsilon: Any, layer: str) -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0:
        raise ValueError(f"{layer}: epsilon must be a positive number, got {epsilon!r}.")
    return float(epsilon)


class LayerNormalization(Layer):
    """``(x - mean) / sqrt(var + epsilon) * gamma + beta`` with the mean and (biased)
    variance of each example's last axis, as ``keras.layers.LayerNormalization``;
    ``gamma`` (ones) and ``beta`` (zeros) have shape ``(features,)``; ``gamma_partition`` and
    ``beta_partition`` are their ``partition=``."""

    variable_names = ("gamma", "beta")
    gamma: Variable
    beta: Variable

    def __init__(
        self,
        epsilon: float = 1e-3,
        name: str | None = None,
        *,
        gamma_partition: Partition | None = None,
        beta_partition: Partition | None = None,
    ) -> None:
        super().__init__(name=name)
        self._partitions = (gamma_partition, beta_partition)
        self.epsilon = _check_epsilon(epsilon, "LayerNormalization")

    def compute_output_shape(self, input_shape: Shape) -> Shape:
        """The input's shape (normalization keeps it)."""
        return input_shape

    def build(self, input_shape: Shape) -> None:
        """Create ``gamma`` and ``beta`` ``(features,)``."""
        n, (g_part, b_part) = features(self, input_shape), self._partitions
        self.gamma = Variable(lambda: _init.ones()((n,)), name="gamma", partition=g_part)
        self.beta = Variable(lambda: _init.zeros()((n,)), name="beta", partition=b_part)

    def __call__(self, x: ValueLike) -> jax.Array:
        """Normalize ``x`` over its last axis, then scale by ``gamma`` and shift by ``beta``."""
        x = as_float(x, self)
        self.ensure_built(tuple(x.shape))
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.epsilon)
        return y * self.gamma.value() + self.beta.value()


class BatchNormalization(Layer):
    """Batch normalization over the last (feature) axis, as ``keras.layers.BatchNormalization``.

    ``layer(x, training=True)`` normalizes with the batch's mean and (biased) variance over
    every axis but the last, and updates the non-trainable ``moving_mean`` (zeros) and
    ``moving_variance`` (ones): ``moving = moving * momentum + batch * (1 - momentum)``
    (eagerly and inside ``ps.function``; no gradient flows into them). ``training=False``
    (the default) normalizes with the moving statistics. ``gamma`` (ones) and ``beta``
    (zeros) are trainable.
    """

    variable_names = ("gamma", "beta", "moving_mean", "moving_variance")
    gamma: Variable
    beta: Variable
    moving_mean: Variable
    moving_variance: Variable

    def __init__(
        self, momentum: float = 0.99, epsilon: float = 1e-3, name: str | None = None
    ) -> None:
        super().__init__(name=name)
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
            raise ValueError(f"BatchNormalization: momentum must be a number, got {momentum!r}.")
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"BatchNormalization: momentum must be in [0, 1], got {momentum!r}.")
        self.momentum = float(momentum)
        self.epsilon = _check_epsilon(epsilon, "BatchNormalization")

    def compute_output_shape(self, input_shape: Shape) -> Shape:
        """The input's shape (normalization keeps it)."""
        return input_shape

    def build(self, input_shape: Shape) -> None:
        """Create ``gamma``, ``beta``, ``moving_mean`` and ``moving_variance``
        ``(features,)``."""
        n = features(self, input_shape)
        self.gamma = Variable(lambda: _init.ones()((n,)), name="gamma")
        self.beta = Variable(lambda: _init.zeros()((n,)), name="beta")
        self.moving_mean = Variable(
            lambda: _init.zeros()((n,)), trainable=False, name="moving_mean"
        )
        self.moving_variance = Variable(
            lambda: _init.ones()((n,)), trainable=False, name="moving_variance"
        )

    def __call__(self, x: ValueLike, training: bool | jax.Array = False) -> jax.Array:
        """Normalize ``x``; ``training`` is a Python bool, or a traced boolean scalar (then
        the batch and the moving statistics are both computed and ``jnp.where`` picks)."""
        x = as_float(x, self)
        flag = traced_training(training)
        if (flag is not None or training) and x.ndim < 2:
            raise ValueError(
                f"{self.describe()} in training mode needs a batch axis, got an input of "
                f"shape {tuple(x.shape)}."
            )
        self.ensure_built(tuple(x.shape))
        if flag is not None:
            return self._either(x, flag)
        if training:
            axes = tuple(range(x.ndim - 1))
            mean = jnp.mean(x, axis=axes)
            var = jnp.mean(jnp.square(x - mean), axis=axes)
            m = self.momentum
            stats = jax.lax.stop_gradient((mean, var))
            new_mean = self.moving_mean.value() * m + stats[0] * (1.0 - m)
            new_var = self.moving_variance.value() * m + stats[1] * (1.0 - m)
            self.moving_mean.assign(new_mean.astype(self.moving_mean.dtype), read_value=False)
            self.moving_variance.assign(
                new_var.astype(self.moving_variance.dtype), read_value=False
            )
        else:
            mean, var = self.moving_mean.value(), self.moving_variance.value()
        y = (x - mean) * jax.lax.rsqrt(var + self.epsilon)
        return y * self.gamma.value() + self.beta.value()

    def _either(self, x: jax.Array, flag: jax.Array) -> jax.Array:
        """Training mode where ``flag`` holds, inference mode elsewhere (one program)."""
        axes = tuple(range(x.ndim - 1))
        mean = jnp.mean(x, axis=axes)
        batch = (mean, jnp.mean(jnp.square(x - mean), axis=axes))
        old = (self.moving_mean.value(), self.moving_variance.value())
        m = self.momentum
        for moving, o, b in zip((self.moving_mean, self.moving_variance), old, batch):
            new = jnp.where(flag, o * m + jax.lax.stop_gradient(b) * (1.0 - m), o)
            moving.assign(new.astype(moving.dtype), read_value=False)
        mean, var = (jnp.where(flag, b, o) for b, o in zip(batch, old))
        y = (x - mean) * jax.lax.rsqrt(var + self.epsilon)
        return y * self.gamma.value() + self.beta.value()
