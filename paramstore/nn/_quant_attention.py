"""Quantized attention projections: ``MultiHeadAttention.quantize("int8")``.

Contract (docs/api.md, "Quantized weights"; the arithmetic is ``paramstore.nn._quant_ops``):

* ``layer.quantize("int8")`` on a built attention layer quantizes its four projection kernels
  as Keras 3's ``EinsumDense.quantize("int8")`` (what ``keras.Model.quantize`` does to a
  ``MultiHeadAttention``'s sublayers): ``query/kernel`` ``(dq, heads, key_dim)`` (likewise
  ``key``, ``value``) reduced over its input axis, ``kernel_scale`` ``(heads, key_dim)``;
  ``attention_output/kernel`` ``(heads, value_dim, dq)`` reduced over ``(heads, value_dim)``,
  ``kernel_scale`` ``(dq,)`` (Keras keeps unit axes in its scale shapes; the values are the
  same). At call time each projection quantizes its input over the contracted axes.
* Only ``"int8"``: ``"int4"`` is refused (``ValueError`` naming the layer); so are an unbuilt
  layer and quantizing twice. ``dequantize()`` puts the float kernels back.
* A layer only calls ``project(equation, x, name, w)`` for each projection: the float einsum,
  or the int8 one once quantized.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from paramstore.nn._base import Layer
from paramstore.nn._quant import Slot, dequantize_slots, quantize_slots
from paramstore.nn._quant_ops import check_mode, int8_einsum

__all__ = ["QuantAttention"]

# projection -> (the kernel's reduced axes, counted from the end; the input's contracted axes)
_PROJECTIONS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "query": ((-3,), (-1,)),
    "key": ((-3,), (-1,)),
    "value": ((-3,), (-1,)),
    "attention_output": ((-3, -2), (-2, -1)),
}


class QuantAttention(Layer):
    """The quantization of an attention layer's projections (see the module docstring);
    the layer keeps its variables in ``self._kernels`` under Keras' names."""

    quantization_mode: str | None = None
    _quant_flags: list[bool]

    @property
    def _kernels(self) -> dict[str, Any]:  # the layer's own dict of variables
        raise NotImplementedError

    def quant_slots(self) -> list[Slot]:
        """The four projection kernels and their scales (int8: never packed)."""
        k = self._kernels
        return [
            Slot(k, f"{p}/kernel", f"{p}/kernel_scale", axes, k[f"{p}/kernel"].shape[-1])
            for p, (axes, _) in _PROJECTIONS.items()
        ]

    def check_quantize(self, mode: Any) -> str:
        """The mode, or ``ValueError`` naming the layer if it cannot be quantized now."""
        me = self.describe()
        mode = check_mode(mode, me)
        if mode != "int8":
            raise ValueError(
                f"{me}: the attention projections are quantized in 'int8' only (got {mode!r}); "
                "quantize the Dense layers in 'int4' with where=, and this layer in 'int8'."
            )
        if not self.built:
            raise ValueError(
                f"{me} is not built yet, so it has no kernels to quantize: call the layer on "
                "inputs (or layer.build(query_shape)) before quantize."
            )
        if self.quantization_mode is not None:
            raise ValueError(
                f"{me} is quantized already ({self.quantization_mode!r}); a layer is quantized "
                "once. ps.nn.dequantize it first."
            )
        return str(mode)

    def quantize(self, mode: str) -> None:
        """Quantize the four projection kernels (``"int8"``), as Keras 3's ``EinsumDense``."""
        mode = self.check_quantize(mode)
        self._quant_flags = quantize_slots(self.quant_slots(), mode)
        self.quantization_mode = mode

    def check_dequantize(self) -> None:
        """``ValueError`` naming the layer if it is not quantized."""
        if self.quantization_mode is None:
            raise ValueError(f"{self.describe()} is not quantized: nothing to dequantize.")

    def dequantize(self) -> None:
        """The float kernels back (in the variable dtype, their trainable flags as before)."""
        self.check_dequantize()
        assert self.quantization_mode is not None
        dequantize_slots(
            self.quant_slots(), self.quantization_mode, self.variable_dtype, self._quant_flags
        )
        self.quantization_mode = None

    def project(self, equation: str, x: jax.Array, name: str, w: dict[str, jax.Array]) -> jax.Array:
        """``einsum(equation, x, kernel)`` of projection ``name`` (``w``: the kernels as the
        layer reads them), int8 once quantized."""
        if self.quantization_mode is None:
            return jnp.einsum(equation, x, w[f"{name}/kernel"])
        scale = self.cast(self._kernels[f"{name}/kernel_scale"])
        return int8_einsum(equation, x, w[f"{name}/kernel"], scale, _PROJECTIONS[name][1])
