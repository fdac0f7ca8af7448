"""``Dense``, ``Embedding``, ``Dropout`` and ``Sequential`` (Keras names and defaults)."""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from paramstore import functional as _functional
from paramstore import initializers as _init
from paramstore import random as _random
from paramstore._core.jax_api import Tracer
from paramstore._core.layout import Partition
from paramstore.nn._arguments import Activation, initializer, resolve_activation, set_hooks
from paramstore.nn._base import Layer, PolicyLike, Shape, as_float, autocast, features
from paramstore.nn._quant import QuantLayer, int4_matmul, int8_matmul, unpack_int4
from paramstore.typing import ConstraintLike, LayerInitializer, RegularizerLike, ValueLike
from paramstore.variable import Variable

__all__ = ["Dense", "Embedding", "Dropout", "Sequential"]


class Dense(QuantLayer):
    """``activation(x @ kernel + bias)`` over the last axis, as ``keras.layers.Dense``.

    ``kernel`` has shape ``(in, units)`` (``in`` is the last axis of the first input),
    ``bias`` ``(units,)``; defaults glorot_uniform and zeros. ``activation`` is a callable
    or a Keras name (``"relu"``). Integer inputs are cast to float32; complex ones refused.
    ``kernel_partition`` and ``bias_partition`` are the variables' ``partition=`` (logical
    axis names, e.g. ``("embed", "mlp")``; see ``ps.sharding.axis_rules``).
    ``lora_rank``/``lora_alpha`` and ``enable_lora``/``merge_lora``: LoRA on the kernel, as
    Keras 3 (``lora_kernel_a`` ``(in, rank)``, ``lora_kernel_b`` ``(rank, units)``; see
    ``paramstore.nn._lora``). ``quantize("int8" | "int4")``: an int8 ``kernel`` and a float32
    ``kernel_scale`` ``(units,)``, as Keras 3 (see ``paramstore.nn._quant``).
    """

    variable_names = ("kernel", "bias")
    kernel: Variable
    bias: Variable | None
    lora_kernel_a: Variable
    lora_kernel_b: Variable

    def __init__(
        self,
        units: int,
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
        lora_rank: int | None = None,
        lora_alpha: float | None = None,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        self._partitions = (kernel_partition, bias_partition)
        set_hooks(self, locals())

        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise ValueError(f"Dense: units must be a positive int, got {units!r}.")
        self.units = units
        self.activation = resolve_activation(activation, "Dense")
        self.use_bias = bool(use_bias)
        self._kernel_init = initializer(
            kernel_initializer, _init.glorot_uniform(), "Dense", "kernel_initializer"
        )
        self._bias_init = initializer(bias_initializer, _init.zeros(), "Dense", "bias_initializer")
        self._init_lora(lora_rank, lora_alpha)

    def build(self, input_shape: Shape) -> None:
        """Create ``kernel`` ``(input_shape[-1], units)`` and ``bias`` ``(units,)``."""
        k_init, b_init, units = self._kernel_init, self._bias_init, self.units
        n_in, (k_part, b_part) = features(self, input_shape), self._partitions
        self.kernel = self.add_weight("kernel", (n_in, units), k_init, partition=k_part)
        self.bias = (
            self.add_weight("bias", (units,), b_init, partition=b_part) if self.use_bias else None
        )
        self._build_lora()

    def compute_output_shape(self, input_shape: Shape) -> Shape:
        """``input_shape`` with its last axis replaced by ``units``."""
        return (*input_shape[:-1], self.units)

    def __call__(self, x: ValueLike) -> jax.Array:
        """``activation(x @ kernel + bias)``, building the layer on the first call."""
        x = as_float(x, self)
        self.ensure_built(tuple(x.shape))
        if self.quantization_mode is not None:
            return self._quantized_call(x)
        kernel = self.cast(self.kernel)
        if self.lora_enabled:  # as Keras 3: in the compute dtype (a and b autocast)
            scale = self.lora_alpha / self.lora_rank  # type: ignore[operator]
            delta = jnp.matmul(self.cast(self.lora_kernel_a), self.cast(self.lora_kernel_b))
            kernel = (kernel + scale * delta).astype(self.compute_dtype)
        y = jnp.matmul(x, kernel)
        if self.bias is not None:
            y = y + self.cast(self.bias)
        return y if self.activation is None else self.activation(y)

    def _quantized_call(self, x: jax.Array) -> jax.Array:
        """Keras 3's ``_int8_call`` / per-channel ``_int4_call`` (``paramstore.nn._quant``)."""
        scale = self.cast(self.kernel_scale)
        if self.quantization_mode == "int8":
            y = int8_matmul(x, self.kernel.value(), scale)
        else:
            y = int4_matmul(x, self.kernel.value(), scale, self.units)
        if self.lora_enabled:  # QLoRA: the adapter on the float inputs
            factor = self.lora_alpha / self.lora_rank  # type: ignore[operator]
            lora = jnp.matmul(
                jnp.matmul(x, self.cast(self.lora_kernel_a)), self.cast(self.lora_kernel_b)
            )
            y = (y + factor * lora).astype(self.compute_dtype)
        if self.bias is not None:
            y = y + self.cast(self.bias)
        return y if self.activation is None else self.activation(y)

    def lora_dims(self) -> tuple[tuple[int, ...], int]:
        """``((in,), units)``, also when the kernel is packed int4."""
        return (self.kernel.shape[-2],), self.units


class Embedding(QuantLayer):
    """A lookup table ``embeddings`` ``(input_dim, output_dim)``, as ``keras.layers.Embedding``
    (initialized uniformly in [-0.05, 0.05]). Inputs must be integer indices; the output has
    shape ``x.shape + (output_dim,)``. An id outside ``[0, input_dim)`` raises eagerly; in a
    trace (where ids are not known) it gives a row of NaN. ``embeddings_partition`` is the
    table's ``partition=`` (e.g. ``("vocab", "embed")``). ``lora_rank``/``lora_alpha`` and
    ``enable_lora``/``merge_lora``: LoRA on the table, as Keras 3 (``lora_embeddings_a``
    ``(input_dim, rank)``, ``lora_embeddings_b`` ``(rank, output_dim)``)."""

    lora_target = "embeddings"
    lora_names = ("lora_embeddings_a", "lora_embeddings_b")
    quant_axis = -1  # one scale per row (Keras 3's embeddings_scale (input_dim,))
    variable_names = ("embeddings",)
    embeddings: Variable
    lora_embeddings_a: Variable
    lora_embeddings_b: Variable

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        embeddings_initializer: LayerInitializer = None,
        name: str | None = None,
        *,
        embeddings_partition: Partition | None = None,
        embeddings_regularizer: RegularizerLike | None = None,
        embeddings_constraint: ConstraintLike | None = None,
        dtype: PolicyLike = None,
        lora_rank: int | None = None,
        lora_alpha: float | None = None,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        self._partition = embeddings_partition
        set_hooks(self, locals())
        for what, n in (("input_dim", input_dim), ("output_dim", output_dim)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"Embedding: {what} must be a positive int, got {n!r}.")
        self.input_dim, self.output_dim = input_dim, output_dim
        self._init = initializer(
            embeddings_initializer,
            _init.random_uniform(-0.05, 0.05),
            "Embedding",
            "embeddings_initializer",
        )
        self._init_lora(lora_rank, lora_alpha)

    def build(self, input_shape: Shape) -> None:
        """Create ``embeddings`` ``(input_dim, output_dim)`` (the ids' shape does not
        matter)."""
        shape = (self.input_dim, self.output_dim)
        self.embeddings = self.add_weight(
            "embeddings", shape, self._init, partition=self._partition
        )
        self._build_lora()

    def check_shape(self, *shapes: Shape | None) -> None:
        """Any shape of ids is fine (a scalar id too)."""

    def check_built(self, *shapes: Shape | None) -> None:
        """The table does not depend on the ids' shape."""

    def __call__(self, ids: ValueLike) -> jax.Array:
        """The rows of ``embeddings`` for the integer ``ids`` (shape ``ids.shape +
        (output_dim,)``)."""
        ids = jnp.asarray(ids)
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(
                f"{self.describe()} expects integer indices, got an input of dtype "
                f"{ids.dtype} and shape {tuple(ids.shape)}. Cast token ids to int32 "
                "(x.astype(jnp.int32)) before the lookup."
            )
        if not isinstance(ids, Tracer) and ids.size:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.input_dim:
                bad = low if low < 0 else high
                raise ValueError(
                    f"{self.describe()} has {self.input_dim} rows (ids 0 to "
                    f"{self.input_dim - 1}), got id {bad}. Map ids into that range (a "
                    "vocabulary lookup, or a larger input_dim); negative ids do not wrap."
                )
        self.ensure_built(tuple(ids.shape))
        # Traced ids cannot be checked: an id outside [0, input_dim) gives a row of NaN
        # (never a wrapped or clipped row), as documented in docs/layers.md.
        safe = jnp.where((ids < 0) | (ids >= self.input_dim), self.input_dim, ids)
        if self.quantization_mode is not None:
            return self._quantized_lookup(safe)
        table = self.embeddings.value()  # Keras 3 does not autocast the table: the rows are
        # taken in the variable dtype (with LoRA: float32), then cast to the compute dtype
        if self.lora_enabled:
            scale = self.lora_alpha / self.lora_rank  # type: ignore[operator]
            delta = jnp.matmul(self.lora_embeddings_a.value(), self.lora_embeddings_b.value())
            table = (table + scale * delta).astype(self.compute_dtype)
        out = jnp.take(table, safe, axis=0, mode="fill", fill_value=jnp.nan)
        return out.astype(self.compute_dtype)

    def _quantized_lookup(self, safe: jax.Array) -> jax.Array:
        """Keras 3's ``Embedding._int8_call`` / per-channel ``_int4_call``: the rows in the
        compute dtype divided by their scales (an id out of range: a row of NaN)."""
        rows = jnp.take(self.embeddings.value(), safe, axis=0, mode="fill", fill_value=0)
        if self.quantization_mode == "int4":  # unpack the rows taken, not the table
            rows = unpack_int4(rows, self.output_dim)
        rows = rows.astype(self.compute_dtype)
        scale = jnp.take(self.embeddings_scale.value(), safe, axis=0, mode="fill",
                         fill_value=jnp.nan)  # fmt: skip
        out = rows / scale[..., None]
        if self.lora_enabled:
            factor = self.lora_alpha / self.lora_rank  # type: ignore[operator]
            a = jnp.take(self.lora_embeddings_a.value(), safe, axis=0, mode="fill",
                         fill_value=jnp.nan)  # fmt: skip
            out = out + factor * jnp.matmul(a, self.lora_embeddings_b.value())
        return out.astype(self.compute_dtype)

    def lora_dims(self) -> tuple[tuple[int, ...], int]:
        """``((input_dim,), output_dim)``, also when the table is packed int4."""
        return (self.input_dim,), self.output_dim


class Dropout(Layer):
    """Inverted dropout, as ``keras.layers.Dropout``: ``layer(x, training=True)`` zeroes each
    element with probability ``rate`` and scales the others by ``1 / (1 - rate)``;
    ``training=False`` (the default) returns ``x``. Every call draws a new mask (eagerly and
    inside ``ps.function``) from ``generator.key()`` when a ``ps.random.Generator`` is given,
    else from ``ps.random.next_key()``. ``rate`` must be in [0, 1)."""

    rate: float
    generator: _random.Generator | None

    def __init__(
        self,
        rate: float,
        generator: _random.Generator | None = None,
        name: str | None = None,
        *,
        dtype: PolicyLike = None,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
            raise TypeError(f"Dropout: rate must be a number in [0, 1), got {rate!r}.")
        if not 0.0 <= float(rate) < 1.0:
            raise ValueError(
                f"Dropout: rate must be in [0, 1) (the fraction of inputs to drop), got {rate!r}."
            )
        if generator is not None and not callable(getattr(generator, "key", None)):
            raise TypeError(
                "Dropout: generator must be a ps.random.Generator (something with .key()), "
                f"got {type(generator).__name__}."
            )
        self.rate = float(rate)
        self.generator = generator
        self.built = True

    traced_training = True

    def __call__(self, x: ValueLike, training: bool | jax.Array = False) -> jax.Array:
        """``training`` may also be a boolean scalar array (traced): then the mask is drawn
        (the generator advances) and ``jnp.where`` picks the dropped or the plain input."""
        x = autocast(jnp.asarray(x), self)
        traced = isinstance(training, jax.Array)
        if (not traced and not training) or self.rate == 0.0:
            return x
        key = self.generator.key() if self.generator is not None else _random.next_key()
        keep = jax.random.bernoulli(key, 1.0 - self.rate, x.shape)
        out = jnp.where(keep, x / (1.0 - self.rate), jnp.zeros((), x.dtype)).astype(x.dtype)
        return jnp.where(training, out, x) if traced else out


def _takes_training(layer: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(layer).parameters
    except (TypeError, ValueError):
        return False
    return "training" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class Sequential(Layer):
    """Calls ``layers`` in order; ``training=`` is passed to the layers whose call takes it
    (Dropout, BatchNormalization, nested Sequentials), and travels down to the layers inside
    them. Any callable can be a layer (``jax.nn.relu`` too).

    ``build(input_shape)`` builds every layer in turn from the shape the previous ones
    produce (found with ``jax.eval_shape``, after the layer is built); the first call does
    the same with real inputs."""

    def __init__(
        self,
        layers: Iterable[Callable[..., Any]] = (),
        name: str | None = None,
        *,
        dtype: PolicyLike = None,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        self.layers: list[Callable[..., Any]] = []
        for layer in layers:
            self.add(layer)

    def add(self, layer: Callable[..., Any]) -> None:
        """Append a layer (any callable)."""
        if not callable(layer):
            raise TypeError(
                f"Sequential '{self.scope_name}': layer {len(self.layers)} is a "
                f"{type(layer).__name__}, which is not callable."
            )
        self.layers.append(layer)
        self.built = False  # a new layer is built by the next call or build()

    def build(self, input_shape: Shape) -> None:
        """Build every layer in turn from the shape the previous ones produce."""
        shape: Shape = input_shape
        for i, layer in enumerate(self.layers):
            if isinstance(layer, Layer):
                layer.build(shape)
            shape = _output_shape(self, i, layer, shape)

    def check_built(self, *shapes: Shape | None) -> None:
        """Each layer checks its own input."""

    def compute_output_shape(self, input_shape: Shape) -> Shape:
        """The output shape for inputs of ``input_shape``, layer by layer (each layer's own
        ``compute_output_shape``, else ``jax.eval_shape``; a layer that needs its variables
        for that is built from its input shape first, as Keras does)."""
        shape: Shape = tuple(input_shape)
        for i, layer in enumerate(self.layers):
            unbuilt = layer if isinstance(layer, Layer) and not layer.built else None
            if unbuilt is not None and unbuilt.compute_output_shape(shape) is None:
                unbuilt.build(shape)  # its shape needs its variables
            shape = _output_shape(self, i, layer, shape)
        return shape

    traced_training = True

    def __call__(self, x: Any, training: bool | jax.Array | None = None) -> Any:
        """Call the layers in order, passing ``training`` to those that take it."""
        x = autocast(x, self)  # the layers inside cast to their own policies
        for layer in self.layers:
            if training is not None and _takes_training(layer):
                x = layer(x, training=training)
            else:
                x = layer(x)
        self.built = True
        return x


def _output_shape(seq: Sequential, i: int, layer: Any, shape: Shape) -> Shape:
    """The output shape of ``layer`` (built) for inputs of ``shape`` (None: any size)."""
    if isinstance(layer, Layer):
        known = layer.compute_output_shape(shape)
        if known is not None:
            return known
    if any(d is None for d in shape[1:]):
        raise ValueError(
            f"Sequential '{seq.scope_name}'.build needs every axis but the first known, got "
            f"{shape}. Pass a shape such as (None, 28, 28, 1)."
        )
    batch = shape[0] if shape and shape[0] is not None else 1
    spec = jax.ShapeDtypeStruct((batch, *shape[1:]), jnp.float32)
    variables = list(getattr(layer, "variables", ()))
    try:
        if variables:  # read the variables as inputs, not as baked constants
            fn = _functional.pure(layer, variables)
            # Shapes only, never values: abstract variables (ps.abstract) build too.
            values = {v.name: jax.ShapeDtypeStruct(v.shape, v.dtype) for v in variables}
            out, _ = jax.eval_shape(fn, values, spec)
        else:
            out = jax.eval_shape(layer, spec)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"Sequential '{seq.scope_name}'.build: layer {i} ({type(layer).__name__}) "
            f"cannot take inputs of shape {shape}: {e}"
        ) from e
    dims: tuple[int | None, ...] = tuple(out.shape)
    if shape and shape[0] is None and dims:
        dims = (None, *dims[1:])
    return dims
