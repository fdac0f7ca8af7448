"""``GroupQueryAttention``, as ``keras.layers.GroupQueryAttention`` (same variables and
results), with rotary position embeddings.

Contract (docs/api.md, "Blocks of today's language models"):

* ``GroupQueryAttention(head_dim, num_query_heads, num_key_value_heads, dropout=0.0,
  use_bias=True, kernel_initializer="glorot_uniform", bias_initializer="zeros", *,
  rotary_embedding=None)``; ``num_query_heads`` a multiple of ``num_key_value_heads``.
* Variables (four ``Projection`` layers, as Keras' ``EinsumDense``): ``query/kernel``
  ``(dim, num_query_heads, head_dim)``, ``key/kernel`` ``(key_dim_in, num_key_value_heads,
  head_dim)``, ``value/kernel`` ``(value_dim_in, num_key_value_heads, head_dim)``,
  ``attention_output/kernel`` ``(num_query_heads, head_dim, dim)``; biases
  ``(heads, head_dim)`` and ``(dim,)`` when ``use_bias``.
* ``layer(query, value, key=None, attention_mask=None, use_causal_mask=False,
  return_attention_scores=False, training=None, positions=None)``: key/value head ``j``
  serves the consecutive query heads ``j * r ... j * r + r - 1`` (``r = num_query_heads //
  num_key_value_heads``); scores scaled by ``1 / sqrt(head_dim)``, masked (``attention_mask``
  boolean, broadcastable to ``(batch, T, S)``, and the causal mask), softmax in float32;
  ``return_attention_scores=True`` returns ``(output, scores)``, scores ``(batch,
  num_query_heads, T, S)``. ``dropout`` drops attention weights when ``training``.
* ``rotary_embedding`` (a ``RotaryEmbedding``) rotates the projected queries and keys, at
  positions ``0 ... T-1`` (``S-1`` for keys) or the call's ``positions`` (shape ``(T,)``,
  used for both when ``T == S``), before the scores.
* ``enable_lora(rank, lora_alpha=None)`` and ``ps.nn.enable_lora`` reach the four
  projections (``<layer>/query`` ...), as Keras 3's ``EinsumDense.enable_lora``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

from paramstore import initializers as _init
from paramstore._core.layout import Partition
from paramstore.nn._arguments import initializer, set_hooks
from paramstore.nn._base import PolicyLike, Shape, as_float
from paramstore.nn.attention import AttentionProjections, attend
from paramstore.nn.core import Dropout
from paramstore.nn.rotary import RotaryEmbedding
from paramstore.typing import ConstraintLike, LayerInitializer, RegularizerLike, ValueLike

__all__ = ["GroupQueryAttention"]


class GroupQueryAttention(AttentionProjections):
    """Grouped-query attention, as Keras 3's (see the module docstring)."""

    head_dim: int
    num_query_heads: int
    num_key_value_heads: int
    num_repeats: int
    dropout: float
    rotary_embedding: RotaryEmbedding | None
    _dropout: Dropout

    def __init__(
        self,
        head_dim: int,
        num_query_heads: int,
        num_key_value_heads: int,
        dropout: float = 0.0,
        use_bias: bool = True,
        kernel_initializer: LayerInitializer = "glorot_uniform",
        bias_initializer: LayerInitializer = "zeros",
        name: str | None = None,
        *,
        rotary_embedding: RotaryEmbedding | None = None,
        kernel_partition: Partition | None = None,
        bias_partition: Partition | None = None,
        output_kernel_partition: Partition | None = None,
        output_bias_partition: Partition | None = None,
        kernel_regularizer: RegularizerLike | None = None,
        bias_regularizer: RegularizerLike | None = None,
        kernel_constraint: ConstraintLike | None = None,
        bias_constraint: ConstraintLike | None = None,
        dtype: PolicyLike = None,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        set_hooks(self, locals())
        me = "GroupQueryAttention"
        for what, n in (
            ("head_dim", head_dim),
            ("num_query_heads", num_query_heads),
            ("num_key_value_heads", num_key_value_heads),
        ):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{me}: {what} must be a positive int, got {n!r}.")
        if num_query_heads % num_key_value_heads:
            raise ValueError(
                f"{me}: num_query_heads ({num_query_heads}) must be a multiple of "
                f"num_key_value_heads ({num_key_value_heads}): each key/value head serves "
                "the same number of query heads."
            )
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
            raise TypeError(f"{me}: dropout must be a number in [0, 1), got {dropout!r}.")
        if rotary_embedding is not None and not isinstance(rotary_embedding, RotaryEmbedding):
            raise TypeError(
                f"{me}: rotary_embedding must be a ps.nn.RotaryEmbedding (or None), got "
                f"{type(rotary_embedding).__name__}."
            )
        self.head_dim, self.num_query_heads = head_dim, num_query_heads
        self.num_key_value_heads = num_key_value_heads
        self.num_repeats = num_query_heads // num_key_value_heads
        self.use_bias = bool(use_bias)
        self.dropout = float(dropout)
        self.rotary_embedding = rotary_embedding
        self._dropout = Dropout(self.dropout, name="dropout", dtype=self.dtype_policy)
        self._kernel_init = initializer(
            kernel_initializer, _init.glorot_uniform(), me, "kernel_initializer"
        )
        self._bias_init = initializer(bias_initializer, _init.zeros(), me, "bias_initializer")
        self._partitions = {
            "": (kernel_partition, bias_partition),
            "attention_output": (output_kernel_partition, output_bias_partition),
        }
        self._dims: tuple[int, int, int] | None = None
        self.__dict__["weights"] = {}  # the projections (see AttentionProjections)

    def build(
        self, query_shape: Shape, value_shape: Shape | None = None, key_shape: Shape | None = None
    ) -> None:
        """Create the projections for ``query``/``value``/``key`` shapes (``value_shape``
        defaults to ``query_shape``, ``key_shape`` to ``value_shape``)."""
        dq, dk, dv = self.feature_dims(query_shape, value_shape, key_shape)
        hq, hkv, hd = self.num_query_heads, self.num_key_value_heads, self.head_dim
        self._project("query", "bqm,muh->bquh", (dq, hq, hd), (hq, hd))
        self._project("key", "bkm,mvh->bkvh", (dk, hkv, hd), (hkv, hd))
        self._project("value", "bkm,mvh->bkvh", (dv, hkv, hd), (hkv, hd))
        self._project("attention_output", "bquh,uhm->bqm", (hq, hd, dq), (dq,))
        self._dims = (dq, dk, dv)

    def check_shape(self, *shapes: Shape | None) -> None:
        """Shapes are checked with the arrays, in ``_check``."""

    def check_built(self, *shapes: Shape | None) -> None:
        """Checked with the arrays, in ``_check``."""

    def _check(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: Any) -> None:
        me = self.describe()
        for what, x in (("query", q), ("key", k), ("value", v)):
            if x.ndim != 3:
                raise ValueError(
                    f"{me} expects a 3-D {what} (batch, length, features), got shape "
                    f"{tuple(x.shape)}."
                )
        if k.shape[:2] != v.shape[:2] or q.shape[0] != v.shape[0]:
            raise ValueError(
                f"{me}: query {tuple(q.shape)}, key {tuple(k.shape)} and value "
                f"{tuple(v.shape)} must share the batch size, and key and value the length."
            )
        got = (q.shape[-1], k.shape[-1], v.shape[-1])
        if self._dims is not None and got != self._dims:
            raise ValueError(
                f"{me} was built for query, key and value feature sizes {self._dims}, got {got}."
            )
        if mask is not None:
            b, t, s = q.shape[0], q.shape[1], v.shape[1]
            shape = tuple(jnp.shape(mask))
            padded = (1,) * (3 - len(shape)) + shape
            if not 2 <= len(shape) <= 3 or any(m not in (1, f) for m, f in zip(padded, (b, t, s))):
                raise ValueError(
                    f"{me}: attention_mask has shape {shape}, but query {tuple(q.shape)} and "
                    f"value {tuple(v.shape)} need a mask broadcastable to (batch, T, S) = "
                    f"{(b, t, s)}."
                )

    def __call__(
        self,
        query: ValueLike,
        value: ValueLike,
        key: ValueLike | None = None,
        attention_mask: ValueLike | None = None,
        use_causal_mask: bool = False,
        return_attention_scores: bool = False,
        training: bool | jax.Array | None = None,
        positions: ValueLike | None = None,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Attend from ``query`` to ``value`` (keyed by ``key``, default ``value``); returns
        the output (``query``'s shape), with the scores when ``return_attention_scores``."""
        q_in = as_float(query, self)
        v_in = q_in if value is query else as_float(value, self)
        k_in = v_in if key is None else as_float(key, self)
        self._check(q_in, k_in, v_in, attention_mask)
        self.ensure_built(tuple(q_in.shape), tuple(v_in.shape), tuple(k_in.shape))
        proj = self.projections
        q, k, v = proj["query"](q_in), proj["key"](k_in), proj["value"](v_in)
        if self.rotary_embedding is not None:
            q = self.rotary_embedding(q, positions=positions)
            k_pos = positions if k.shape[1] == q.shape[1] else None
            k = self.rotary_embedding(k, positions=k_pos)
        k = jnp.repeat(k, self.num_repeats, axis=2)
        v = jnp.repeat(v, self.num_repeats, axis=2)
        allowed = None
        if attention_mask is not None:
            allowed = jnp.asarray(attention_mask).astype(bool)
            allowed = allowed.reshape((1,) * (3 - allowed.ndim) + allowed.shape)[:, None]
        if use_causal_mask:
            t, s = q.shape[1], k.shape[1]
            causal = jnp.tril(jnp.ones((t, s), bool))
            allowed = causal if allowed is None else jnp.logical_and(allowed, causal)
        scale = 1.0 / math.sqrt(float(self.head_dim))
        if self.dropout > 0.0 and training:
            out, scores = self._attend_dropout(q, k, v, allowed, scale, training)
        else:
            out, scores = attend(q, k, v, allowed, scale)
        y = proj["attention_output"](out)
        return (y, scores) if return_attention_scores else y

    def _attend_dropout(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        allowed: jax.Array | None,
        scale: float,
        training: bool | jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        """``attend`` with dropout on the weights (the scores returned before it, as
        Keras)."""
        _, scores = attend(q, k, v, allowed, scale)
        dropped = self._dropout(scores, training=training)
        return jnp.einsum("bhts,bshk->bthk", dropped, v), scores
