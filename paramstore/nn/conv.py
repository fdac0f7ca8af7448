"""``Conv1D`` and ``Conv2D``: convolutions over NWC and NHWC inputs (as Keras')."""

from __future__ import annotations

from typing import Any

import jax

from paramstore import initializers as _init
from paramstore._core.layout import Partition
from paramstore.nn._arguments import Activation, initializer, resolve_activation, set_hooks
from paramstore.nn._base import Layer, PolicyLike, Shape, as_float, keras_name
from paramstore.typing import ConstraintLike, LayerInitializer, RegularizerLike, ValueLike
from paramstore.variable import Variable

__all__ = [
    "Conv1D",
    "Conv2D",
    "channels",
    "check_windows",
    "data_format_of",
    "spatial_axes",
    "window",
]


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


def data_format_of(value: Any, layer: str) -> str:
    """``"channels_last"`` or ``"channels_first"`` (Keras' two names), else ValueError."""
    if value not in ("channels_last", "channels_first"):
        raise ValueError(
            f"{layer}: data_format must be 'channels_last' (batch, ..., channels; the "
            f"default) or 'channels_first' (batch, channels, ...), got {value!r}."
        )
    return str(value)


def spatial_axes(shape: Shape, data_format: str) -> Shape:
    """The spatial axes of ``shape`` (between batch and channels, wherever they are)."""
    return shape[2:] if data_format == "channels_first" else shape[1:-1]


def channels(shape: Shape, data_format: str) -> int | None:
    """The channel axis of ``shape``."""
    return shape[1] if data_format == "channels_first" else shape[-1]


def check_windows(
    layer: Layer,
    shape: Shape,
    spatial: int,
    size: tuple[int, ...],
    padding: str,
    what: str,
    data_format: str = "channels_last",
) -> None:
    """Rank ``spatial + 2`` (batch, spatial axes, channels), and with ``"valid"`` padding every
    spatial axis at least as long as the window (else the output would be empty)."""
    last = {1: "(batch, steps, channels)", 2: "(batch, height, width, channels)"}
    first = {1: "(batch, channels, steps)", 2: "(batch, channels, height, width)"}
    names = (first if data_format == "channels_first" else last)[spatial]
    if len(shape) != spatial + 2:
        raise ValueError(
            f"{layer.describe()} expects a {spatial + 2}-D input {names}, got shape {shape} "
            f"({len(shape)}-D). Add a batch axis with x[None] or a channel axis with "
            "x[..., None]."
        )
    axes = spatial_axes(shape, data_format)
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
        dtype: PolicyLike = None,
        dilation_rate: int | tuple[int, ...] = 1,
        groups: int = 1,
        data_format: str = "channels_last",
    ) -> None:
        kind = type(self).__name__
        super().__init__(name=name or keras_name(kind), dtype=dtype)
        set_hooks(self, locals())

        if isinstance(filters, bool) or not isinstance(filters, int) or filters < 1:
            raise ValueError(f"{kind}: filters must be a positive int, got {filters!r}.")
        n = self.spatial
        self.filters = filters
        self.kernel_size = window(kernel_size, n, "kernel_size", kind)
        self.strides = window(strides, n, "strides", kind)
        self.padding = padding_of(padding, kind)
        self.dilation_rate = window(dilation_rate, n, "dilation_rate", kind)
        if max(self.strides) > 1 and max(self.dilation_rate) > 1:
            raise ValueError(
                f"{kind}: strides {self.strides} > 1 together with dilation_rate "
                f"{self.dilation_rate} > 1 is not supported (Keras refuses it too). Use "
                "strides=1 with the dilation, or a dilation_rate of 1."
            )
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"{kind}: groups must be a positive int, got {groups!r}.")
        if filters % groups:
            raise ValueError(
                f"{kind}: filters ({filters}) must be divisible by groups ({groups}): each "
                "group makes filters // groups output channels."
            )
        self.groups = groups
        self.data_format = data_format_of(data_format, kind)
        self.activation = resolve_activation(activation, kind)
        self.use_bias = bool(use_bias)
        self._partitions = (kernel_partition, bias_partition)
        self._kernel_init = initializer(
            kernel_initializer, _init.glorot_uniform(), kind, "kernel_initializer"
        )
        self._bias_init = initializer(bias_initializer, _init.zeros(), kind, "bias_initializer")

    def _extent(self) -> tuple[int, ...]:
        """The dilated kernel's size on each spatial axis."""
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel_size, self.dilation_rate))

    def check_shape(self, *shapes: Shape | None) -> None:
        shape = shapes[0]
        assert shape is not None
        size, fmt = self._extent(), self.data_format
        what = "kernel_size" if size == self.kernel_size else "dilated kernel size"
        check_windows(self, shape, self.spatial, size, self.padding, what, fmt)
        n_in = channels(shape, fmt)
        if n_in is not None and n_in % self.groups:
            raise ValueError(
                f"{self.describe()}: the input's {n_in} channels (shape {shape}, "
                f"{fmt}) are not divisible by groups={self.groups}: each group convolves "
                "channels // groups input channels. Pick groups dividing the channels."
            )

    def check_built(self, *shapes: Shape | None) -> None:
        """The channel axis must be the one the kernel was built for."""
        if self.data_format == "channels_last":
            return super().check_built(*shapes)
        old, new = self._built_shapes[0] if self._built_shapes else None, shapes[0]
        if old is None or new is None:
            return
        a, b = channels(old, self.data_format), channels(new, self.data_format)
        if a is not None and b is not None and a != b:
            raise ValueError(
                f"{self.describe()} was built for inputs with {a} channels, got an input of "
                f"shape {new} ({b} channels, {self.data_format}). Pass inputs with {a} "
                "channels, or use a new layer."
            )

    def compute_output_shape(self, input_shape: Shape) -> Shape:
        dims: list[int | None] = []
        spatial = spatial_axes(input_shape, self.data_format)
        for n, k, st in zip(spatial, self._extent(), self.strides):
            if n is None:
                dims.append(None)
            elif self.padding == "same":
                dims.append(-(-n // st))
            else:
                dims.append((n - k) // st + 1)
        if self.data_format == "channels_first":
            return (input_shape[0], self.filters, *dims)
        return (input_shape[0], *dims, self.filters)

    def build(self, input_shape: Shape) -> None:
        k_init, b_init, filters = self._kernel_init, self._bias_init, self.filters
        n_in = channels(input_shape, self.data_format)
        if n_in is None:
            raise ValueError(
                f"{self.describe()} cannot be built for input shape {input_shape}: the "
                f"channel axis ({self.data_format}) must be known."
            )
        kshape = (*self.kernel_size, n_in // self.groups, filters)
        k_part, b_part = self._partitions
        self.kernel = self.add_weight("kernel", kshape, k_init, partition=k_part)
        self.bias = (
            self.add_weight("bias", (filters,), b_init, partition=b_part) if self.use_bias else None
        )

    def __call__(self, x: ValueLike) -> jax.Array:
        x = as_float(x, self)
        self.ensure_built(tuple(x.shape))
        n, first = self.spatial, self.data_format == "channels_first"
        layouts = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC")}
        if first:
            layouts = {1: ("NCW", "WIO", "NCW"), 2: ("NCHW", "HWIO", "NCHW")}
        y = jax.lax.conv_general_dilated(
            x,
            self.cast(self.kernel),
            window_strides=self.strides,
            padding=self.padding.upper(),
            rhs_dilation=self.dilation_rate,
            dimension_numbers=layouts[n],
            feature_group_count=self.groups,
        )
        if self.bias is not None:
            bias = self.cast(self.bias)
            y = y + (bias.reshape((-1,) + (1,) * n) if first else bias)
        return y if self.activation is None else self.activation(y)


class Conv2D(_Conv):
    """``activation(conv(x, kernel) + bias)`` for ``x`` of shape ``(batch, height, width,
    channels)``; ``kernel`` ``(kh, kw, channels, filters)``, ``bias`` ``(filters,)``
    (glorot_uniform and zeros). ``padding`` is ``"valid"`` or ``"same"``; with ``"valid"``
    a kernel larger than the input is an error (Keras would return an empty array).
    ``kernel_partition``/``bias_partition``: the variables' ``partition=``.

    Keyword-only, as Keras: ``dilation_rate`` (int or 2 ints; not with ``strides`` > 1,
    which Keras refuses too), ``groups`` (dividing ``filters`` and the input's channels;
    ``kernel`` is then ``(kh, kw, channels // groups, filters)``) and ``data_format``
    (``"channels_last"``, the default, or ``"channels_first"``: ``(batch, channels, height,
    width)`` in and out; the kernel's layout is the same)."""

    spatial = 2


class Conv1D(_Conv):
    """``activation(conv(x, kernel) + bias)`` for ``x`` of shape ``(batch, steps, channels)``
    (NWC), as ``keras.layers.Conv1D``; ``kernel`` ``(k, channels, filters)``, ``bias``
    ``(filters,)`` (glorot_uniform and zeros). ``padding`` is ``"valid"`` or ``"same"``.
    ``dilation_rate``, ``groups`` and ``data_format`` as ``Conv2D``'s (keyword-only)."""

    spatial = 1
