"""``Conv2D``: a 2-D convolution over NHWC inputs (as ``keras.layers.Conv2D``)."""

from __future__ import annotations

from typing import Any

import jax

from paramstore import initializers as _init
from paramstore._layout import Partition
from paramstore.nn._base import Activation, Layer, as_float, initializer, resolve_activation
from paramstore.variable import Variable

__all__ = ["Conv2D"]


def _pair(value: Any, what: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in pair
    ):
        raise ValueError(f"Conv2D: {what} must be a positive int or a pair of them, got {value!r}.")
    return (int(pair[0]), int(pair[1]))


class Conv2D(Layer):
    """``activation(conv(x, kernel) + bias)`` for ``x`` of shape ``(batch, height, width,
    channels)``; ``kernel`` ``(kh, kw, channels, filters)``, ``bias`` ``(filters,)``
    (glorot_uniform and zeros). ``padding`` is ``"valid"`` or ``"same"``.
    ``kernel_partition``/``bias_partition``: the variables' ``partition=``."""

    def __init__(
        self,
        filters: int,
        kernel_size: int | tuple[int, int],
        strides: int | tuple[int, int] = 1,
        padding: str = "valid",
        activation: str | Activation | None = None,
        use_bias: bool = True,
        kernel_initializer: Any = None,
        bias_initializer: Any = None,
        name: str | None = None,
        *,
        kernel_partition: Partition | None = None,
        bias_partition: Partition | None = None,
    ) -> None:
        super().__init__(name=name or "conv2d")  # Keras' name (not "conv2_d")
        self._partitions = (kernel_partition, bias_partition)
        if isinstance(filters, bool) or not isinstance(filters, int) or filters < 1:
            raise ValueError(f"Conv2D: filters must be a positive int, got {filters!r}.")
        if not isinstance(padding, str) or padding.lower() not in ("valid", "same"):
            raise ValueError(f"Conv2D: padding must be 'valid' or 'same', got {padding!r}.")
        self.filters = filters
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.strides = _pair(strides, "strides")
        self.padding = padding.lower()
        self.activation = resolve_activation(activation, "Conv2D")
        self.use_bias = bool(use_bias)
        self._kernel_init = initializer(
            kernel_initializer, _init.glorot_uniform(), "Conv2D", "kernel_initializer"
        )
        self._bias_init = initializer(bias_initializer, _init.zeros(), "Conv2D", "bias_initializer")
        self.kernel: Variable | None = None
        self.bias: Variable | None = None

    def build(self, shape: tuple[int, ...]) -> None:
        k_init, b_init = self._kernel_init, self._bias_init
        kshape = (*self.kernel_size, shape[-1], self.filters)
        k_part, b_part = self._partitions
        self.kernel = Variable(lambda: k_init(kshape), name="kernel", partition=k_part)
        if self.use_bias:
            filters = self.filters
            self.bias = Variable(lambda: b_init((filters,)), name="bias", partition=b_part)

    def __call__(self, x: Any) -> jax.Array:
        x = as_float(x)
        if x.ndim != 4:
            raise ValueError(
                f"{self.describe()} expects a 4-D input (batch, height, width, channels), "
                f"got shape {tuple(x.shape)} ({x.ndim}-D). Add a batch axis with x[None] "
                "or a channel axis with x[..., None]."
            )
        self._ensure_built(tuple(x.shape))
        assert self.kernel is not None
        y = jax.lax.conv_general_dilated(
            x,
            self.kernel.value().astype(x.dtype),
            window_strides=self.strides,
            padding=self.padding.upper(),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        if self.bias is not None:
            y = y + self.bias.value()
        return y if self.activation is None else self.activation(y)
