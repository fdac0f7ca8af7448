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
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from paramstore.nn._arguments import set_hooks
from paramstore.nn._base import PolicyLike, Shape, as_float
from paramstore.nn._lora import LoRALayer, lora_delta
from paramstore.typing import Initializer, ValueLike
from paramstore.variable import Variable

__all__ = ["Projection"]


class Projection(LoRALayer):
    """``einsum(equation, x, kernel) + bias`` with a kernel of fixed shape (see the module
    docstring); made by the attention layers, not by users."""

    variable_names = ("kernel", "bias")
    kernel: Variable
    bias: Variable | None
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

    def __call__(self, x: ValueLike) -> jax.Array:
        """``einsum(equation, x, kernel) + bias`` (with LoRA: the adapted kernel)."""
        x = as_float(x, self)
        self.ensure_built(tuple(x.shape))
        kernel = self.cast(self.kernel)
        if self.lora_enabled:  # as Keras 3's EinsumDense: in the compute dtype
            scale = self.lora_alpha / self.lora_rank  # type: ignore[operator]
            delta = lora_delta(self.cast(self.lora_kernel_a), self.cast(self.lora_kernel_b))
            kernel = (kernel + scale * delta).astype(self.compute_dtype)
        y = jnp.einsum(self.equation, x, kernel)
        return y if self.bias is None else y + self.cast(self.bias)
