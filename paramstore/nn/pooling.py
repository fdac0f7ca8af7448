"""``MaxPooling2D``, ``AveragePooling2D``, ``GlobalAveragePooling2D``, ``GlobalMaxPooling2D``
over NHWC inputs (NCHW with ``data_format="channels_first"``, keyword-only), with Keras 3's
arguments, defaults and output shapes. No variables."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paramstore.nn._base import Layer, PolicyLike, Shape, as_float, keras_name
from paramstore.nn.conv import check_windows, data_format_of, padding_of, window
from paramstore.typing import ValueLike

__all__ = [
    "MaxPooling2D",
    "AveragePooling2D",
    "GlobalAveragePooling2D",
    "GlobalMaxPooling2D",
]


class _Pooling2D(Layer):
    def __init__(
        self,
        pool_size: int | tuple[int, int] = (2, 2),
        strides: int | tuple[int, int] | None = None,
        padding: str = "valid",
        name: str | None = None,
        *,
        data_format: str = "channels_last",
        dtype: PolicyLike = None,
    ) -> None:
        kind = type(self).__name__
        super().__init__(name=name or keras_name(kind), dtype=dtype)
        self.pool_size = window(pool_size, 2, "pool_size", kind)
        self.strides = self.pool_size if strides is None else window(strides, 2, "strides", kind)
        self.padding = padding_of(padding, kind)
        self.data_format = data_format_of(data_format, kind)
        self.built = True  # nothing to create

    def check_shape(self, *shapes: Shape | None) -> None:
        shape = shapes[0]
        assert shape is not None
        fmt = self.data_format
        check_windows(self, shape, 2, self.pool_size, self.padding, "pool_size", fmt)

    def _window(self, size: tuple[int, ...]) -> tuple[int, ...]:
        """``size`` on the spatial axes, 1 on batch and channels."""
        return (1, 1, *size) if self.data_format == "channels_first" else (1, *size, 1)

    def check_built(self, *shapes: Shape | None) -> None:
        """No variables: any channel count."""

    def _reduce(self, x: jax.Array, init: Any, op: Any) -> jax.Array:
        out: jax.Array = jax.lax.reduce_window(
            x,
            init,
            op,
            self._window(self.pool_size),
            self._window(self.strides),
            self.padding.upper(),
        )
        return out


class MaxPooling2D(_Pooling2D):
    """The maximum of each ``pool_size`` window, moved by ``strides`` (default
    ``pool_size``), as ``keras.layers.MaxPooling2D``; ``"same"`` padding pads with -inf."""

    def __call__(self, x: ValueLike) -> jax.Array:
        """The maximum of each window of ``x``."""
        x = as_float(x, self)
        self.ensure_built(tuple(x.shape))
        return self._reduce(x, -jnp.inf, jax.lax.max)


class AveragePooling2D(_Pooling2D):
    """The mean of each ``pool_size`` window, as ``keras.layers.AveragePooling2D``; with
    ``"same"`` padding the padded positions are left out of the mean (as Keras does)."""

    def __call__(self, x: ValueLike) -> jax.Array:
        """The mean of each window of ``x``."""
        x = as_float(x, self)
        self.ensure_built(tuple(x.shape))
        zero = 0.0  # Python scalars select the differentiable reduce_window_{max,sum}
        total = self._reduce(x, zero, jax.lax.add)
        if self.padding == "valid":
            return total / np.prod(self.pool_size)
        spatial = x.shape[2:] if self.data_format == "channels_first" else x.shape[1:3]
        ones = jnp.ones(self._window(tuple(spatial)), x.dtype)
        count = self._reduce(ones, zero, jax.lax.add)
        return total / count


class _Global2D(Layer):
    def __init__(
        self,
        keepdims: bool = False,
        name: str | None = None,
        *,
        data_format: str = "channels_last",
        dtype: PolicyLike = None,
    ) -> None:
        super().__init__(name=name or keras_name(type(self).__name__), dtype=dtype)
        if not isinstance(keepdims, bool):
            raise TypeError(f"{type(self).__name__}: keepdims must be a bool, got {keepdims!r}.")
        self.keepdims = keepdims
        self.data_format = data_format_of(data_format, type(self).__name__)
        self.axes = (2, 3) if self.data_format == "channels_first" else (1, 2)
        self.built = True  # nothing to create

    def check_shape(self, *shapes: Shape | None) -> None:
        shape = shapes[0]
        assert shape is not None
        if len(shape) != 4:
            raise ValueError(
                f"{self.describe()} expects a 4-D input (batch, height, width, channels; "
                f"{self.data_format}), got "
                f"shape {shape} ({len(shape)}-D). Add a batch axis with x[None] or a channel "
                "axis with x[..., None]."
            )

    def check_built(self, *shapes: Shape | None) -> None:
        """No variables: any channel count."""


class GlobalAveragePooling2D(_Global2D):
    """The mean over height and width: ``(batch, h, w, c)`` to ``(batch, c)`` (``(batch, 1, 1,
    c)`` with ``keepdims=True``), as ``keras.layers.GlobalAveragePooling2D``."""

    def __call__(self, x: ValueLike) -> jax.Array:
        """The mean of ``x`` over its spatial axes."""
        x = as_float(x, self)
        self.ensure_built(tuple(x.shape))
        return jnp.mean(x, axis=self.axes, keepdims=self.keepdims)


class GlobalMaxPooling2D(_Global2D):
    """The maximum over height and width, as ``keras.layers.GlobalMaxPooling2D``."""

    def __call__(self, x: ValueLike) -> jax.Array:
        """The maximum of ``x`` over its spatial axes."""
        x = as_float(x, self)
        self.ensure_built(tuple(x.shape))
        return jnp.max(x, axis=self.axes, keepdims=self.keepdims)
