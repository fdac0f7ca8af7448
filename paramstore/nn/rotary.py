"""``RotaryEmbedding``: rotary position embeddings (keras_hub's layer, ``transformers``' Llama
convention).

Contract (docs/api.md, "Blocks of today's language models"):

* ``RotaryEmbedding(max_wavelength=10000, scaling_factor=1.0, sequence_axis=1,
  feature_axis=-1)`` has no variables. ``rope(x, start_index=0, positions=None)`` rotates
  ``x``'s feature axis (even size ``d``) in two halves: ``x * cos + rotate_half(x) * sin``
  with ``rotate_half(x) = concat(-x[d/2:], x[:d/2])``, the angles ``position * inv_freq``
  repeated over both halves, ``inv_freq[i] = 1 / max_wavelength ** (2i / d)``; positions
  are ``start_index + arange(seq)`` along ``sequence_axis``, or ``positions`` (shape
  ``(seq,)``) as given, divided by ``scaling_factor``. The same as ``transformers``'
  ``apply_rotary_pos_emb`` with ``rope_theta = max_wavelength``.
* The angles, cosines and sines are computed in float32, then cast to the compute dtype
  (as ``transformers`` and keras_hub do); the output is in the compute dtype.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp

from paramstore.nn._base import Layer, PolicyLike, Shape, as_float
from paramstore.typing import ValueLike

__all__ = ["RotaryEmbedding"]


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
        raise ValueError(f"RotaryEmbedding: {what} must be a positive number, got {value!r}.")
    return float(value)


class RotaryEmbedding(Layer):
    """Rotary position embeddings, no variables (see the module docstring)."""

    def __init__(
        self,
        max_wavelength: float = 10000,
        scaling_factor: float = 1.0,
        sequence_axis: int = 1,
        feature_axis: int = -1,
        name: str | None = None,
        *,
        dtype: PolicyLike = None,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        self.max_wavelength = _positive(max_wavelength, "max_wavelength")
        self.scaling_factor = _positive(scaling_factor, "scaling_factor")
        for what, axis in (("sequence_axis", sequence_axis), ("feature_axis", feature_axis)):
            if isinstance(axis, bool) or not isinstance(axis, int):
                raise TypeError(f"RotaryEmbedding: {what} must be an int, got {axis!r}.")
        self.sequence_axis, self.feature_axis = sequence_axis, feature_axis
        self.built = True

    def compute_output_shape(self, input_shape: Shape) -> Shape:
        """The input's shape."""
        return input_shape

    def _axes(self, x: jax.Array) -> tuple[int, int]:
        me = self.describe()
        for what, axis in (("sequence_axis", self.sequence_axis), ("feature", self.feature_axis)):
            if not -x.ndim <= axis < x.ndim:
                raise ValueError(
                    f"{me}: {what} {axis} is out of range for an input of shape {tuple(x.shape)}."
                )
        seq, feat = self.sequence_axis % x.ndim, self.feature_axis % x.ndim
        if seq == feat:
            raise ValueError(f"{me}: sequence_axis and feature_axis are the same axis ({seq}).")
        if x.shape[feat] % 2:
            raise ValueError(
                f"{me} rotates the feature axis in two halves, so its size must be even; got "
                f"an input of shape {tuple(x.shape)} (feature axis {feat})."
            )
        return seq, feat

    def __call__(
        self,
        x: ValueLike,
        start_index: int | jax.Array = 0,
        positions: ValueLike | None = None,
    ) -> jax.Array:
        """``x`` rotated by the angle of each position (see the module docstring)."""
        x = as_float(x, self)
        seq, feat = self._axes(x)
        n, d = x.shape[seq], x.shape[feat]
        if positions is None:
            pos = jnp.arange(n, dtype=jnp.float32) + jnp.asarray(start_index, jnp.float32)
        else:
            pos = jnp.asarray(positions).astype(jnp.float32)
            if pos.shape != (n,):
                raise ValueError(
                    f"{self.describe()}: positions must have shape (seq,) = ({n},) for an "
                    f"input of shape {tuple(x.shape)}, got {tuple(pos.shape)}."
                )
        pos = pos / jnp.float32(self.scaling_factor)
        inv_freq = 1.0 / (
            jnp.float32(self.max_wavelength) ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
        )
        angles = jnp.outer(pos, inv_freq)
        angles = jnp.concatenate([angles, angles], axis=-1)  # (seq, d)
        shape = [1] * x.ndim
        shape[seq], shape[feat] = n, d
        if seq > feat:  # the table is (seq, d): put its axes in x's order
            angles = angles.T
        cos = jnp.cos(angles).reshape(shape).astype(x.dtype)
        sin = jnp.sin(angles).reshape(shape).astype(x.dtype)
        x1, x2 = jnp.split(x, 2, axis=feat)
        rotated = jnp.concatenate([-x2, x1], axis=feat)
        return x * cos + rotated * sin
