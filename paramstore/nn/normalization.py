"""``LayerNormalization`` and ``BatchNormalization`` over the last axis, and
``RMSNormalization`` (Keras 3's defaults and results)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from paramstore import initializers as _init
from paramstore._core.layout import Partition
from paramstore.nn._base import Layer, PolicyLike, Shape, as_float, features
from paramstore.typing import ValueLike
from paramstore.variable import Variable

__all__ = ["LayerNormalization", "BatchNormalization", "RMSNormalization"]


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
        dtype: PolicyLike = None,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        self._partitions = (gamma_partition, beta_partition)
        self.epsilon = _check_epsilon(epsilon, "LayerNormalization")

    def compute_output_shape(self, input_shape: Shape) -> Shape:
        """The input's shape (normalization keeps it)."""
        return input_shape

    def build(self, input_shape: Shape) -> None:
        """Create ``gamma`` and ``beta`` ``(features,)``."""
        n, (g_part, b_part) = features(self, input_shape), self._partitions
        self.gamma = self.add_weight("gamma", (n,), _init.ones(), partition=g_part)
        self.beta = self.add_weight("beta", (n,), _init.zeros(), partition=b_part)

    def __call__(self, x: ValueLike) -> jax.Array:
        """Normalize ``x`` over its last axis, then scale by ``gamma`` and shift by ``beta``."""
        # As Keras 3: the input is not autocast, the statistics and the affine map are
        # computed in at least float32 with gamma and beta as stored, and the result is
        # cast to the input's dtype, then to the compute dtype.
        x = as_float(x, self, keep=True)
        self.ensure_built(tuple(x.shape))
        wide = jnp.promote_types(x.dtype, jnp.float32)
        xw = x.astype(wide)
        mean = jnp.mean(xw, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xw - mean), axis=-1, keepdims=True)
        y = (xw - mean) * jax.lax.rsqrt(var + self.epsilon)
        y = y * self.gamma.value().astype(wide) + self.beta.value().astype(wide)
        return y.astype(x.dtype).astype(self.compute_dtype)


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
        self,
        momentum: float = 0.99,
        epsilon: float = 1e-3,
        name: str | None = None,
        *,
        dtype: PolicyLike = None,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
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
        self.gamma = self.add_weight("gamma", (n,), _init.ones())
        self.beta = self.add_weight("beta", (n,), _init.zeros())
        self.moving_mean = self.add_weight("moving_mean", (n,), _init.zeros(), trainable=False)
        self.moving_variance = self.add_weight(
            "moving_variance", (n,), _init.ones(), trainable=False
        )

    traced_training = True

    def __call__(self, x: ValueLike, training: bool | jax.Array = False) -> jax.Array:
        """Batch statistics when ``training`` (and the layer is trainable: a frozen
        BatchNormalization runs in inference mode, as in Keras 3); ``training`` may be a
        boolean scalar array (traced): both are computed and ``jnp.where`` picks one."""
        x = as_float(x, self)
        traced = isinstance(training, jax.Array)
        if not traced:
            training = bool(training) and self.trainable
        if (traced or training) and x.ndim < 2:
            raise ValueError(
                f"{self.describe()} in training mode needs a batch axis, got an input of "
                f"shape {tuple(x.shape)}."
            )
        self.ensure_built(tuple(x.shape))
        # As Keras 3: computed in at least float32 (half-precision inputs overflow), with
        # the variables read as they are stored (Keras does not autocast them here).
        wide = jnp.promote_types(x.dtype, jnp.float32)
        x = x.astype(wide)
        mean, var = self.moving_mean.value(), self.moving_variance.value()
        if traced or training:
            axes = tuple(range(x.ndim - 1))
            batch_mean = jnp.mean(x, axis=axes)
            batch_var = jnp.mean(jnp.square(x - batch_mean), axis=axes)
            m = self.momentum
            stats = jax.lax.stop_gradient((batch_mean, batch_var))
            new_mean = (mean * m + stats[0] * (1.0 - m)).astype(self.moving_mean.dtype)
            new_var = (var * m + stats[1] * (1.0 - m)).astype(self.moving_variance.dtype)
            if traced:
                on = jnp.logical_and(training, self.trainable)
                new_mean, new_var = jnp.where(on, new_mean, mean), jnp.where(on, new_var, var)
                batch_mean = jnp.where(on, batch_mean, mean)
                batch_var = jnp.where(on, batch_var, var)
            self.moving_mean.assign(new_mean, read_value=False)
            self.moving_variance.assign(new_var, read_value=False)
            mean, var = batch_mean, batch_var
        mean, var = mean.astype(wide), var.astype(wide)
        y = (x - mean) * jax.lax.rsqrt(var + self.epsilon)
        y = y * self.gamma.value().astype(wide) + self.beta.value().astype(wide)
        return y.astype(self.compute_dtype)


class RMSNormalization(Layer):
    """``x * rsqrt(mean(x**2, axis) + epsilon) * scale``, as ``keras.layers.RMSNormalization``
    and ``transformers``' ``LlamaRMSNorm``.

    ``scale`` (ones) has the size of the normalized ``axis`` (default the last); another
    axis normalizes over that axis with ``scale`` broadcast along it. As Keras 3, the input
    is cast to the compute dtype, then the statistics, the normalization and the scale (read
    in the compute dtype) are computed in at least float32 and rounded once, to the compute
    dtype, at the end. ``scale_partition`` is the ``partition=`` of ``scale``.
    """

    variable_names = ("scale",)
    scale: Variable

    def __init__(
        self,
        axis: int = -1,
        epsilon: float = 1e-6,
        name: str | None = None,
        *,
        scale_partition: Partition | None = None,
        dtype: PolicyLike = None,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"RMSNormalization: axis must be an int, got {axis!r}.")
        self.axis = axis
        self.epsilon = _check_epsilon(epsilon, "RMSNormalization")
        self._partition = scale_partition

    def compute_output_shape(self, input_shape: Shape) -> Shape:
        """The input's shape (normalization keeps it)."""
        return input_shape

    def check_shape(self, *shapes: Shape | None) -> None:
        """The input must have the axis to normalize over."""
        shape = shapes[0] if shapes else None
        if shape is not None and not -len(shape) <= self.axis < len(shape):
            raise ValueError(
                f"{self.describe()} normalizes over axis {self.axis}, but the input has "
                f"shape {shape} ({len(shape)} axes)."
            )

    def check_built(self, *shapes: Shape | None) -> None:
        """The normalized axis must keep the size ``scale`` was built for."""
        shape = shapes[0] if shapes else None
        if shape is None or not self.built:
            return
        n = shape[self.axis]
        if n is not None and (n,) != self.scale.shape:
            raise ValueError(
                f"{self.describe()} was built for {self.scale.shape[0]} features on axis "
                f"{self.axis}, got an input of shape {shape}."
            )

    def build(self, input_shape: Shape) -> None:
        """Create ``scale`` ``(input_shape[axis],)``."""
        n = input_shape[self.axis]
        if n is None:
            raise ValueError(
                f"{self.describe()} cannot be built for input shape {input_shape}: the size "
                f"of axis {self.axis} must be known."
            )
        self.scale = self.add_weight("scale", (n,), _init.ones(), partition=self._partition)

    def __call__(self, x: ValueLike) -> jax.Array:
        """Normalize ``x`` by its root mean square over ``axis``, then multiply by ``scale``."""
        x = as_float(x, self)
        self.ensure_built(tuple(x.shape))
        wide = jnp.promote_types(x.dtype, jnp.float32)
        xw = x.astype(wide)
        axis = self.axis % x.ndim
        ms = jnp.mean(jnp.square(xw), axis=axis, keepdims=True)
        shape = [1] * x.ndim
        shape[axis] = -1
        scale = self.cast(self.scale).astype(wide).reshape(shape)
        return (xw * jax.lax.rsqrt(ms + self.epsilon) * scale).astype(self.compute_dtype)
