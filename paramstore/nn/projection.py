"""``Projection``: one projection of an attention layer, as Keras 3's ``EinsumDense``.

Contract (docs/api.md, "Blocks of today's language models"):

* A ``Projection`` is a layer made by ``MultiHeadAttention`` and ``GroupQueryAttention`` for
  each of their ``query``, ``key``, ``value`` and ``attention_output`` projections, named
  ``<layer>/query`` ... (its variables ``<layer>/query/kernel`` and ``<layer>/query/bias``).
  It computes ``einsum(equation, x, kernel) + bias`` in the compute dtype.
* LoRA as Keras 3's ``EinsumDense.enable_lora``: ``lora_kernel_a`` of shape
  ``kernel.shape[:-1] + (rank,)``, ``lora_kernel_b`` ``(rank, kernel.shape[-1])``, the
  projection computing with ``kernel + (lora_alpha / rank) * a @ b`` (in the compute
  dtype, a and b autocast); everything else as ``paramstore.nn._lora``.
* Quantized weights (``quantize("int8" | "int4")``, ``paramstore.nn._quant``), as Keras 3's
  ``EinsumDense``: the kernel is reduced over its *contracted* axes (those of the equation's
  kernel operand missing from its output), one float32 ``kernel_scale`` per non-contracted
  kernel element (Keras' scale shapes without their unit axes): ``query``, ``key`` and
  ``value`` ``(dim, heads, head_dim)`` -> ``(heads, head_dim)``; ``attention_output``
  ``(heads, head_dim, dim)`` -> ``(dim,)``.

  - ``"int8"``: ``EinsumDense._int8_call``: the inputs quantized over *their* contracted axes
    (``127 / (max|x| + 1e-7)`` per remaining position), an int8 x int8 einsum with int32
    accumulation, cast to the compute dtype, divided by both scales; the inputs' gradient is
    that of the dequantized kernel (``_quant_ops.int8_einsum``).
  - ``"int4"``: per-channel (Keras 3's ``Int4QuantizationConfig(block_size=-1)``): values in
    ``[-8, 7]``, ``s = 7 / (max|w| + 1e-7)``, the inputs not quantized; the layer computes
    ``einsum(x, unpack(kernel) / kernel_scale)`` in the compute dtype. The packed kernel
    keeps the float kernel's axes, packed two per byte along its last (output) axis:
    ``(dim, heads, ceil(head_dim/2))``. Keras flattens the kernel to ``(contracted,
    non-contracted)`` before packing (``(dim, ceil(heads*head_dim/2))``, scale
    ``(heads*head_dim,)``): the same values and scales (reshaped), the same bytes when the
    last axis is even; paramstore keeps the axes so that shardings and partitions by head,
    a ``Repeat``'s stacking and quantizing while loading apply unchanged.
  - QLoRA: with LoRA enabled the output gains ``(lora_alpha / rank) * einsum(x, a) @ b`` on
    the float inputs, as Keras' quantized ``EinsumDense``; ``a`` has the float kernel's
    shape but its last axis.
  - Only an equation whose output is the input's kept axes then the kernel's kept axes
    (the contracted axes trailing in the input, leading in the kernel) can be quantized, as
    every attention projection's; another is refused (``ValueError`` naming the layer).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from paramstore.nn._arguments import set_hooks
from paramstore.nn._base import PolicyLike, Shape, as_float
from paramstore.nn._lora import lora_delta
from paramstore.nn._quant import QuantLayer, int4_einsum, int8_einsum
from paramstore.typing import Initializer, ValueLike
from paramstore.variable import Variable

__all__ = ["Projection", "einsum_axes"]


def einsum_axes(equation: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(kernel axes, input axes)`` that the einsum ``"x,kernel->out"`` contracts, counted
    from the end, when ``out`` is the input's kept axes then the kernel's (the contracted
    axes trailing in the input, leading in the kernel: every attention projection's
    equation); None for another equation."""
    lhs, arrow, out = equation.replace(" ", "").partition("->")
    x, comma, k = lhs.partition(",")
    if not arrow or not comma:
        return None
    x_kept, x_gone = [c for c in x if c in out], [c for c in x if c not in out]
    k_kept, k_gone = [c for c in k if c in out], [c for c in k if c not in out]
    layout = "".join(x_kept + x_gone), "".join(k_gone + k_kept), "".join(x_kept + k_kept)
    if layout != (x, k, out) or not k_gone or sorted(x_gone) != sorted(k_gone):
        return None
    return tuple(range(-len(k), -len(k_kept))), tuple(range(-len(x_gone), 0))


class Projection(QuantLayer):
    """``einsum(equation, x, kernel) + bias`` with a kernel of fixed shape (see the module
    docstring); made by the attention layers, not by users."""

    variable_names = ("kernel", "bias")
    kernel: Variable
    bias: Variable | None
    kernel_scale: Variable
    lora_kernel_a: Variable
    lora_kernel_b: Variable

    def __init__(
        self,
        equation: str,
        kernel_shape: tuple[int, ...],
        bias_shape: tuple[int, ...] | None,
        kernel_initializer: Initializer,
        bias_initializer: Initializer,
        name: str,
        *,
        kernel_partition: Any = None,
        bias_partition: Any = None,
        kernel_regularizer: Any = None,
        bias_regularizer: Any = None,
        kernel_constraint: Any = None,
        bias_constraint: Any = None,
        dtype: PolicyLike = None,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        set_hooks(self, locals())
        self.equation = equation
        self.kernel_shape, self.bias_shape = tuple(kernel_shape), bias_shape
        self._inits = (kernel_initializer, bias_initializer)
        self._partitions = (kernel_partition, bias_partition)
        self._axes = einsum_axes(equation)
        if self._axes is not None:
            self.quant_axis = self._axes[0]  # the kernel's contracted axes
        self._init_lora(None, None)

    def check_shape(self, *shapes: Shape | None) -> None:
        """The attention layer checks its inputs' shapes."""

    def check_built(self, *shapes: Shape | None) -> None:
        """The kernel's shape does not depend on the input's."""

    def build(self, input_shape: Shape) -> None:
        """Create ``kernel`` (``kernel_shape``) and ``bias`` (``bias_shape``, when given)."""
        (k_init, b_init), (k_part, b_part) = self._inits, self._partitions
        self.kernel = self.add_weight("kernel", self.kernel_shape, k_init, partition=k_part)
        self.bias = (
            None
            if self.bias_shape is None
            else self.add_weight("bias", tuple(self.bias_shape), b_init, partition=b_part)
        )

    def check_quantize(self, mode: object) -> str:
        """As ``QuantLayer``'s, and refused for an equation ``einsum_axes`` does not know."""
        mode = super().check_quantize(mode)
        if self._axes is None:
            raise ValueError(
                f"{self.describe()}: its equation {self.equation!r} cannot be quantized: "
                "the output must be the input's kept axes then the kernel's, with the "
                "contracted axes last in the input and first in the kernel."
            )
        return mode

    def lora_dims(self) -> tuple[tuple[int, ...], int]:
        """The float kernel's shape but its last axis, and that axis (also when packed)."""
        return self.kernel_shape[:-1], self.kernel_shape[-1]

    def __call__(self, x: ValueLike) -> jax.Array:
        """``einsum(equation, x, kernel) + bias`` (with LoRA: the adapted kernel; quantized:
        Keras 3's quantized ``EinsumDense`` call, see the module docstring)."""
        x = as_float(x, self)
        self.ensure_built(tuple(x.shape))
        if self.quantization_mode is not None:
            return self._quantized_call(x)
        kernel = self.cast(self.kernel)
        if self.lora_enabled:  # as Keras 3's EinsumDense: in the compute dtype
            scale = self.lora_alpha / self.lora_rank  # type: ignore[operator]
            delta = lora_delta(self.cast(self.lora_kernel_a), self.cast(self.lora_kernel_b))
            kernel = (kernel + scale * delta).astype(self.compute_dtype)
        y = jnp.einsum(self.equation, x, kernel)
        return y if self.bias is None else y + self.cast(self.bias)

    def _quantized_call(self, x: jax.Array) -> jax.Array:
        """Keras 3's ``EinsumDense._int8_call`` / per-channel ``_int4_call``."""
        assert self._axes is not None
        scale = self.cast(self.kernel_scale)
        if self.quantization_mode == "int8":
            y = int8_einsum(self.equation, x, self.kernel.value(), scale, self._axes[1])
        else:
            units = self.kernel_shape[-1]
            y = int4_einsum(self.equation, x, self.kernel.value(), scale, units)
        if self.lora_enabled:  # QLoRA: the adapter on the float inputs
            factor = self.lora_alpha / self.lora_rank  # type: ignore[operator]
            lora = jnp.einsum(self.equation, x, self.cast(self.lora_kernel_a))
            lora = jnp.matmul(lora, self.cast(self.lora_kernel_b))
            y = (y + factor * lora).astype(self.compute_dtype)
        return y if self.bias is None else y + self.cast(self.bias)
