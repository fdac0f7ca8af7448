"""``Conv1D`` and ``Conv2D``: convolutions over NWC and NHWC inputs (as Keras')."""

from __future__ import annotations

from typing import Any

import jax

from paramstore import initializers as _init
from paramstore._core.layout import Partition
from paramstore.nn._base import (
    Activation,
    Layer,
    Shape,
    as_float,
    hooks,
    initializer,
    keras_name,
    resolve_activation,
    set_hooks,
)
from paramstore.typing import ConstraintLike, LayerInitializer, RegularizerLike, ValueLike
from paramstore.variable import Variable

__all__ = ["Conv1D", "Conv2D", "window", "check_windows"]


def window(value: Any, n: int, what: str, layer: str) -> tuple[int, ...]:
    """``value`` (an int or ``n`` ints, each >= 1) as an ``n``-tuple."""
    dims = (value,) * n if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        dims = tuple(dims)
    except TypeError:
        dims = ()
    if len(dims) != n or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims
    ):
        what_n = "a positive int" if n == 1 else f"a positive int or {n} of them"
        raise ValueError(f"{layer}: {what} must be {what_n}, got {value!r}.")
    return tuple(int(d) for d in dims)


def padding_of(value: Any, layer: str) -> str:
    if not isinstance(value, str) or value.lower() not in ("valid", "same"):
        raise ValueError(f"{layer}: padding must be 'valid' or 'same', got {value!r}.")
    return value.lower()


def check_windows(
    layer: Layer, shape: Shape, spatial: int, size: tuple[int, ...], padding: str, what: str
) -> None:
    """Rank ``spatial + 2`` (batch, spatial axes, channels), and with ``"valid"`` padding every
    spatial axis at least as long as the window (else the output would be empty)."""
    names = {1: "(batch, steps, channels)", 2: "(batch, height, width, channels)"}[spatial]
    if len(shape) != spatial + 2:
        raise ValueError(
            f"{layer.describe()} expects a {spatial + 2}-D input {names}, got shape {shape} "
            f"({len(shape)}-D). Add a batch axis with x[None] or a channel axis with "
            "x[..., None]."
        )
    axes = shape[1:-1]
    if padding == "valid" and any(a is not None and a < k for a, k in zip(axes, size)):
        raise ValueError(
            f"{layer.describe()}: its {what} {size} is larger than the input's spatial size "
            f"{tuple(axes)} (input shape {shape}), so 'valid' padding leaves no output. "
            f"Use padding='same', a smaller {what}, or a larger input."
        )


class _Conv(Layer):
    """The N-D convolution both layers are (``spatial`` axes between batch and channels)."""

    spatial = 2
    variable_names = ("kernel", "bias")
    kernel: Variable
    bias: Variable | None

    def __init__(
        self,
        filters: int,
        kernel_size: int | tuple[int, ...],
        strides: int | tuple[int, ...] = 1,
        padding: str = "valid",
        activation: str | Activation | None = None,
        use_bias: bool = True,
        kernel_initializer: LayerInitializer = None,
        bias_initializer: LayerInitializer = None,
        name: str | None = None,
        *,
        kernel_partition: Partition | None = None,
        bias_partition: Partition | None = None,
        kernel_regularizer: RegularizerLike | None = None,
        bias_regularizer: RegularizerLike | None = None,
        kernel_constraint: ConstraintLike | None = None,
        bias_constraint: ConstraintLike | None = None,
    ) -> None:
        kind = type(self).__name__
        super().__init__(name=name or keras_name(kind))
        set_hooks(self, locals())

        if isinstance(filters, bool) or not isinstance(filters, int) or filters < 1:
            raise ValueError(f"{kind}: filters must be a positive int, got {filters!r}.")
        n = self.spatial
        self.filters = filters
        self.kernel_size = window(kernel_size, n, "kernel_size", kind)
        self.strides = window(strides, n, "strides", kind)
        self.padding = padding_of(padding, kind)
        self.activation = resolve_activation(activation, kind)
        self.use_bias = bool(use_bias)
        self._partitions = (kernel_partition, bias_partition)
        self._kernel_init = initializer(
            kernel_initializer, _init.glorot_uniform(), kind, "kernel_initializer"
        )
        self._bias_init = initializer(bias_initializer, _init.zeros(), kind, "bias_initializer")

    def check_shape(self, *shapes: Shape | None) -> None:
        shape = shapes[0]
        assert shape is not None
        check_windows(self, shape, self.spatial, self.kernel_size, self.padding, "kernel_size")

    def compute_output_shape(self, input_shape: Shape) -> Shape:
        out: list[int | None] = [input_shape[0]]
        for n, k, st in zip(input_shape[1:-1], self.kernel_size, self.strides):
            if n is None:
                out.append(None)
            elif self.padding == "same":
                out.append(-(-n // st))
            else:
                out.append((n - k) // st + 1)
        return (*out, self.filters)

    def build(self, input_shape: Shape) -> None:
        k_init, b_init, filters = self._kernel_init, self._bias_init, self.filters
        if input_shape[-1] is None:
            raise ValueError(
                f"{self.describe()} cannot be built for input shape {input_shape}: the "
                "channel (last) axis must be known."
            )
        kshape = (*self.kernel_size, input_shape[-1], filters)
        k_part, b_part = self._partitions
        self.kernel = Variable(
            lambda: k_init(kshape), name="kernel", partition=k_part, **hooks(self, "kernel")
        )
        self.bias = (
            Variable(
                lambda: b_init((filters,)), name="bias", partition=b_part, **hooks(self, "bias")
            )
            if self.use_bias
            else None
        )

    def __call__(self, x: ValueLike) -> jax.Array:
        x = as_float(x, self)
        self.ensure_built(tuple(x.shape))
        n = self.spatial
        layout = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC")}[n]
        y = jax.lax.conv_general_dilated(
            x,
            self.kernel.value().astype(x.dtype),
            window_strides=self.strides,
            padding=self.padding.upper(),
            dimension_numbers=layout,
        )
        if self.bias is not None:
            y = y + self.bias.value()
        return y if self.activation is None else self.activation(y)


class Conv2D(_Conv):
    """``activation(conv(x, kernel) + bias)`` for ``x`` of shape ``(batch, height, width,
    channels)``; ``kernel`` ``(kh, kw, channels, filters)``, ``bias`` ``(filters,)``
    (glorot_uniform and zeros). ``padding`` is ``"valid"`` or ``"same"``; with ``"valid"``
    a kernel larger than the input is an error (Keras would return an empty array).
    ``kernel_partition``/``bias_partition``: the variables' ``partition=``."""

    spatial = 2


class Conv1D(_Conv):
    """``activation(conv(x, kernel) + bias)`` for ``x`` of shape ``(batch, steps, channels)``
    (NWC), as ``keras.layers.Conv1D``; ``kernel`` ``(k, channels, filters)``, ``bias``
    ``(filters,)`` (glorot_uniform and zeros). ``padding`` is ``"valid"`` or ``"same"``."""

    spatial = 1
