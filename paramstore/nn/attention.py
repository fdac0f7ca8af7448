"""``MultiHeadAttention``, as ``keras.layers.MultiHeadAttention`` (same variables).

Each projection (``query``, ``key``, ``value``, ``attention_output``) is a
``paramstore.nn.projection.Projection`` named ``<layer>/<projection>`` (so LoRA reaches it,
as Keras 3's ``EinsumDense``); the projections are held in the attribute ``weights`` (the
checkpoint keys ``attn/weights/query/kernel`` ... are those of earlier versions).
``layer.enable_lora(rank, lora_alpha=None)`` enables LoRA on all four;
``layer.quantize(mode)`` / ``layer.dequantize()`` quantize them (each as Keras 3's
``EinsumDense``, see ``paramstore.nn.projection``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from paramstore import initializers as _init
from paramstore._core.layout import Partition
from paramstore.nn._arguments import hooks, initializer, set_hooks
from paramstore.nn._base import Layer, PolicyLike, Shape, as_float
from paramstore.nn._lora import check_alpha, check_rank
from paramstore.nn._quant import check_mode
from paramstore.nn.projection import Projection
from paramstore.typing import ConstraintLike, LayerInitializer, RegularizerLike, ValueLike
from paramstore.variable import Variable

__all__ = ["MultiHeadAttention", "AttentionProjections", "attend"]

_ORDER = ("query", "key", "value", "attention_output")


class AttentionProjections(Layer):
    """What ``MultiHeadAttention`` and ``GroupQueryAttention`` share: their four
    ``Projection`` layers (held in the attribute ``weights``), Keras' ``weights`` order, and
    LoRA and quantized weights on all four."""

    _partitions: dict[str, tuple[Partition | None, Partition | None]]
    _kernel_init: Any
    _bias_init: Any
    use_bias: bool

    @property
    def projections(self) -> dict[str, Projection]:
        """The projections by name (``"query"``, ``"key"``, ``"value"``,
        ``"attention_output"``), once built."""
        found: dict[str, Projection] = self.__dict__["weights"]
        return found

    @property
    def _kernels(self) -> dict[str, Variable]:
        """The variables by Keras name (``"query/kernel"``)."""
        out: dict[str, Variable] = {}
        for name, p in self.projections.items():
            out[f"{name}/kernel"] = p.kernel
            if p.bias is not None:
                out[f"{name}/bias"] = p.bias
        return out

    @property
    def weights(self) -> list[Variable]:
        """Keras' order: query, key, value, attention_output, each kernel then bias (then
        the LoRA variables)."""
        names = [f"{h}/{w}" for h in _ORDER for w in ("kernel", "bias")]
        kernels = self._kernels
        first = [kernels[n] for n in names if n in kernels]
        return first + [v for v in super().weights if all(v is not f for f in first)]

    def feature_dims(
        self, query_shape: Shape, value_shape: Shape | None, key_shape: Shape | None
    ) -> tuple[int, int, int]:
        """The feature (last) axes of query, key and value (``value_shape`` defaults to
        ``query_shape``, ``key_shape`` to ``value_shape``), or ValueError naming the layer."""
        value_shape = query_shape if value_shape is None else value_shape
        key_shape = value_shape if key_shape is None else key_shape
        dq, dk, dv = (s[-1] if s else None for s in (query_shape, key_shape, value_shape))
        if dq is None or dk is None or dv is None:
            raise ValueError(
                f"{self.describe()} cannot be built without the feature (last) axes of query, "
                f"key and value; got shapes {query_shape}, {key_shape}, {value_shape}."
            )
        return dq, dk, dv

    def _project(
        self, name: str, equation: str, shape: tuple[int, ...], bias: tuple[int, ...]
    ) -> None:
        """Make and build the projection ``name`` (inside the layer's scope, in build)."""
        k_part, b_part = self._partitions.get(name, self._partitions[""])
        p = Projection(
            equation,
            shape,
            bias if self.use_bias else None,
            self._kernel_init,
            self._bias_init,
            name,
            kernel_partition=k_part,
            bias_partition=b_part,
            dtype=self.dtype_policy,
            **{f"kernel_{k}": v for k, v in hooks(self, "kernel").items()},
            **{f"bias_{k}": v for k, v in hooks(self, "bias").items()},
        )
        p.build((None, shape[0]))
        self.projections[name] = p

    def enable_lora(self, rank: int, lora_alpha: float | None = None) -> None:
        """LoRA on the four projections, as Keras 3's ``EinsumDense.enable_lora`` on each
        (``ValueError`` naming the layer, nothing changed: unbuilt, LoRA already on, or a
        bad ``rank``/``lora_alpha``)."""
        me = self.describe()
        rank = check_rank(rank, me)
        alpha = check_alpha(lora_alpha, rank, me)
        if not self.built:
            raise ValueError(
                f"{me} is not built yet, so it has no projections to adapt: call the layer "
                "(or layer.build(query_shape, value_shape)) before enable_lora."
            )
        for p in self.projections.values():
            p.check_lora_enable()
        for name in _ORDER:
            self.projections[name].enable_lora(rank, alpha)

    def merge_lora(self) -> None:
        """Merge the LoRA of every projection that has one (``ValueError``, nothing changed,
        if none has, or if one of them is quantized: dequantize first)."""
        chosen = [p for p in self.projections.values() if p.lora_enabled]
        if not chosen:
            raise ValueError(
                f"{self.describe()} has no LoRA to merge: enable_lora(rank) first (or leave "
                "this layer out of merge_lora)."
            )
        for p in chosen:
            p.check_lora_merge()
        for p in chosen:
            p.merge_lora()

    @property
    def quantization_mode(self) -> str | None:
        """The mode all four projections are quantized in (None when they are not all
        quantized alike, e.g. after ``ps.nn.quantize(..., where=)`` picked some of them)."""
        modes = {p.quantization_mode for p in self.projections.values()}
        return modes.pop() if len(modes) == 1 else None

    def quantize(self, mode: str) -> None:
        """Quantize the four projections in ``mode`` (``"int8"`` or ``"int4"``), each as Keras
        3's ``EinsumDense.quantize`` (``ValueError`` naming the layer or the projection,
        nothing changed: an unknown mode, an unbuilt layer, a projection quantized already
        or with LoRA enabled)."""
        me = self.describe()
        mode = check_mode(mode, me)
        if not self.built:
            raise ValueError(
                f"{me} is not built yet, so it has no projections to quantize: call the layer "
                "(or layer.build(query_shape, value_shape)) before quantize."
            )
        for p in self.projections.values():
            p.check_quantize(mode)
        for name in _ORDER:
            self.projections[name].quantize(mode)

    def dequantize(self) -> None:
        """Put back the float kernels of the quantized projections (``ValueError`` naming
        the layer if none is quantized)."""
        chosen = [p for p in self.projections.values() if p.quantization_mode is not None]
        if not chosen:
            raise ValueError(
                f"{self.describe()} is not quantized: nothing to dequantize (quantize it "
                "first, or leave it out of dequantize)."
            )
        for p in chosen:
            p.dequantize()


_NEG = -1e9  # Keras' large negative number for masked logits (float32)


class MultiHeadAttention(AttentionProjections):
    """Scaled dot-product attention with ``num_heads`` heads, as Keras'.

    ``layer(query, value, key=None, mask=None, use_causal_mask=False)``: ``query`` has shape
    ``(batch, T, dq)``, ``value`` ``(batch, S, dv)``, ``key`` (default ``value``)
    ``(batch, S, dk)``; the output has ``query``'s shape. Self-attention is
    ``layer(x, x)``. ``mask`` is a boolean array broadcastable to ``(batch, T, S)`` (rank
    2 or 3) or ``(batch, num_heads, T, S)`` (rank 4): ``True`` lets a query position
    attend to a key position. ``use_causal_mask=True`` also masks the future.

    Variables (Keras' names): ``query/kernel`` ``(dq, heads, key_dim)``, ``query/bias``
    ``(heads, key_dim)``, likewise ``key/*`` and ``value/*`` (``value_dim``, default
    ``key_dim``), ``attention_output/kernel`` ``(heads, value_dim, dq)`` and
    ``attention_output/bias`` ``(dq,)``; glorot_uniform kernels, zero biases.
    ``kernel_partition``/``bias_partition`` are the ``partition=`` of the query, key and
    value kernels (rank 3) and biases (rank 2); ``output_kernel_partition`` and
    ``output_bias_partition`` those of ``attention_output``.
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int,
        value_dim: int | None = None,
        use_bias: bool = True,
        kernel_initializer: LayerInitializer = None,
        name: str | None = None,
        *,
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

        self._partitions = {
            "": (kernel_partition, bias_partition),
            "attention_output": (output_kernel_partition, output_bias_partition),
        }
        for what, n in (("num_heads", num_heads), ("key_dim", key_dim), ("value_dim", value_dim)):
            if n is None and what == "value_dim":
                continue
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"MultiHeadAttention: {what} must be a positive int, got {n!r}.")
        self.num_heads, self.key_dim = num_heads, key_dim
        self.value_dim = key_dim if value_dim is None else value_dim
        self.use_bias = bool(use_bias)
        self._kernel_init = initializer(
            kernel_initializer, _init.glorot_uniform(), "MultiHeadAttention", "kernel_initializer"
        )
        self._bias_init = _init.zeros()
        self._dims: tuple[int, int, int] | None = None
        # The projections, stored as "weights" (the checkpoint key: attn/weights/query/kernel);
        # ``.weights`` itself is Keras' list of variables (ps.Module.weights).
        self.__dict__["weights"] = {}

    def build(
        self, query_shape: Shape, value_shape: Shape | None = None, key_shape: Shape | None = None
    ) -> None:
        """Create the variables for ``query``/``value``/``key`` shapes (as Keras' ``build``;
        ``value_shape`` defaults to ``query_shape``, ``key_shape`` to ``value_shape``)."""
        dq, dk, dv = self.feature_dims(query_shape, value_shape, key_shape)
        h, kd, vd = self.num_heads, self.key_dim, self.value_dim
        self._project("query", "bsd,dhk->bshk", (dq, h, kd), (h, kd))
        self._project("key", "bsd,dhk->bshk", (dk, h, kd), (h, kd))
        self._project("value", "bsd,dhk->bshk", (dv, h, vd), (h, vd))
        self._project("attention_output", "bthk,hkd->btd", (h, vd, dq), (dq,))
        self._dims = (dq, dk, dv)

    def check_shape(self, *shapes: Shape | None) -> None:
        """Shapes are checked with the arrays, in ``_check``."""

    def check_built(self, *shapes: Shape | None) -> None:
        q = shapes[0]
        v = shapes[1] if len(shapes) > 1 and shapes[1] is not None else q
        k = shapes[2] if len(shapes) > 2 and shapes[2] is not None else v
        got = tuple(s[-1] if s else None for s in (q, k, v))
        if self._dims is not None and got != self._dims:
            raise ValueError(
                f"{self.describe()} was built for query, key and value feature sizes "
                f"{self._dims}, got {got} (shapes query {q}, key {k}, value {v})."
            )

    def _check(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: Any) -> None:
        """Every shape check, before anything is built."""
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
        if self._dims is not None:
            got = (q.shape[-1], k.shape[-1], v.shape[-1])
            if got != self._dims:
                raise ValueError(
                    f"{me} was built for query, key and value feature sizes {self._dims}, "
                    f"got {got} (shapes query {tuple(q.shape)}, key {tuple(k.shape)}, "
                    f"value {tuple(v.shape)})."
                )
        if mask is not None:
            b, t, s = q.shape[0], q.shape[1], v.shape[1]
            shape = tuple(jnp.shape(mask))
            full = (b, self.num_heads, t, s) if len(shape) == 4 else (b, t, s)
            padded = (1,) * (len(full) - len(shape)) + shape
            if (
                len(shape) < 2
                or len(shape) > 4
                or any(m not in (1, f) for m, f in zip(padded, full))
            ):
                raise ValueError(
                    f"{me}: mask has shape {shape}, but query {tuple(q.shape)} and value "
                    f"{tuple(v.shape)} need a mask broadcastable to (batch, T, S) = {(b, t, s)} "
                    f"or (batch, heads, T, S) = {(b, self.num_heads, t, s)}."
                )

    def __call__(
        self,
        query: ValueLike,
        value: ValueLike,
        key: ValueLike | None = None,
        mask: ValueLike | None = None,
        use_causal_mask: bool = False,
    ) -> jax.Array:
        """Attend from ``query`` to ``value`` (keyed by ``key``, default ``value``) under
        ``mask``; returns an array of ``query``'s shape."""
        q_in = as_float(query, self)
        v_in = q_in if value is query else as_float(value, self)
        k_in = v_in if key is None else as_float(key, self)
        self._check(q_in, k_in, v_in, mask)
        self.ensure_built(tuple(q_in.shape), tuple(v_in.shape), tuple(k_in.shape))
        proj = self.projections
        q, k, v = proj["query"](q_in), proj["key"](k_in), proj["value"](v_in)
        allowed = None
        if mask is not None:
            m = jnp.asarray(mask).astype(bool)
            allowed = m[:, None] if m.ndim == 3 else m
        if use_causal_mask:
            t, s = q.shape[1], k.shape[1]
            causal = jnp.tril(jnp.ones((t, s), bool))
            allowed = causal if allowed is None else jnp.logical_and(allowed, causal)
        out, _ = attend(q, k, v, allowed, 1.0 / math.sqrt(self.key_dim))
        return proj["attention_output"](out)


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array | None, scale: float
) -> tuple[jax.Array, jax.Array]:
    """Keras 3's attention core on JAX (``_dot_product_attention_core``): the logits
    accumulated and scaled in at least float32, the softmax in float32, the weights cast
    back to the compute dtype for the sum over values. ``q`` ``(b, t, h, k)``, ``k`` and
    ``v`` ``(b, s, h, k)``, ``allowed`` broadcastable to ``(b, h, t, s)``; returns the output
    ``(b, t, h, k)`` and the weights ``(b, h, t, s)``."""
    wide = jnp.promote_types(q.dtype, jnp.float32)
    logits = jnp.einsum("bthk,bshk->bhts", q, k, preferred_element_type=wide)
    logits = logits * jnp.asarray(scale, wide)
    if allowed is not None:
        logits = jnp.where(allowed, logits, jnp.asarray(_NEG, wide))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(k.dtype)
    return jnp.einsum("bhts,bshk->bthk", probs, v), probs
