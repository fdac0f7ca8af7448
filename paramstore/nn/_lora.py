"""LoRA on one layer (``Dense``, ``Embedding``), as Keras 3's ``enable_lora``.

Contract (docs/api.md, "LoRA"; docs/guides/recipes.md, "LoRA"):

* ``layer.enable_lora(rank, lora_alpha=None, a_initializer="he_uniform",
  b_initializer="zeros")`` on a built layer: the target variable (``kernel`` of shape
  ``(in, out)``, ``embeddings`` of shape ``(input_dim, output_dim)``) becomes
  non-trainable, and two trainable float32 variables are added in the layer's scope,
  ``lora_kernel_a`` ``(in, rank)`` and ``lora_kernel_b`` ``(rank, out)`` (Embedding:
  ``lora_embeddings_a`` / ``lora_embeddings_b``), float32 whatever the policy, as Keras
  keeps them. The layer then computes with ``target + (lora_alpha / rank) * a @ b``
  (``lora_alpha`` defaults to ``rank``): a Dense in its compute dtype (Keras autocasts a, b
  and the kernel), an Embedding in float32 then cast to the compute dtype (Keras does not
  autocast it). Errors, each naming the layer and changing nothing: ``rank`` not an int
  >= 1, ``lora_alpha`` not a positive number, an unbuilt layer, LoRA already enabled.
* ``Dense(..., lora_rank=r, lora_alpha=a)`` / ``Embedding(...)`` enable it when the layer
  builds, as Keras does.
* ``layer.merge_lora()`` folds ``(lora_alpha / rank) * a @ b`` into the target (computed in
  float32, stored in the target's dtype), removes the LoRA variables and gives the target
  back the trainable flag it had before ``enable_lora``; the outputs stay equal (to the
  target dtype's precision). Without LoRA: ``ValueError`` naming the layer.
* ``enable_lora`` and ``merge_lora`` change what the layer computes with the same
  variables: every ``ps.function`` traced before traces again on its next call
  (``TRACE_EPOCH.restructure()``), so it computes with (or without) the adapters.
* A target of any rank (an attention projection's ``(dim, heads, head_dim)`` kernel, as
  Keras 3's ``EinsumDense``): ``a`` has shape ``target.shape[:-1] + (rank,)``, ``b``
  ``(rank, target.shape[-1])``, and ``a @ b`` is ``lora_delta(a, b)``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from paramstore import initializers as _init
from paramstore._core.context import TRACE_EPOCH
from paramstore.nn._arguments import initializer
from paramstore.nn._base import Layer, all_or_nothing
from paramstore.typing import LayerInitializer
from paramstore.variable import Variable

__all__ = [
    "LoRALayer",
    "check_rank",
    "check_alpha",
    "lora_delta",
    "freeze_target",
    "restore_flags",
]


def freeze_target(v: Variable) -> bool:
    """Make ``v`` non-trainable for LoRA; returns whether it was trainable (a variable that
    was not is left exactly as it is, its own flag and a Module's freeze alike)."""
    was = v.trainable
    if was:
        v.trainable = False
    return was


def restore_flags(v: Variable, was_trainable: bool, frozen_by_module: bool) -> None:
    """Undo ``freeze_target``: a variable that was trainable is again, unless its Module was
    frozen since (``frozen_by_module``: then it is frozen as the Module's other variables)."""
    if was_trainable:
        v.trainable = True
        if frozen_by_module:
            v._freeze(True)


def lora_delta(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` for ``a`` of shape ``(*lead, *mid, rank)`` and ``b`` ``(*lead, rank, out)``
    (``lead``: a Repeat's stacked axis, or nothing): shape ``(*lead, *mid, out)``."""
    extra = a.ndim - b.ndim
    if extra > 0:
        b = b.reshape((*b.shape[:-2], *(1,) * extra, *b.shape[-2:]))
    return jnp.matmul(a, b)


def check_rank(rank: Any, who: str) -> int:
    """``rank`` as an int >= 1, else ``ValueError`` naming ``who``."""
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1:
        raise ValueError(
            f"{who}: the LoRA rank must be an int >= 1 (the inner dimension of a @ b, "
            f"e.g. 4 or 8), got {rank!r}."
        )
    return int(rank)


def check_alpha(alpha: Any, rank: int, who: str) -> float:
    """``lora_alpha`` (default ``rank``) as a positive float, else ``ValueError``."""
    if alpha is None:
        return float(rank)
    try:
        value = float(alpha) if isinstance(alpha, numbers.Real) else math.nan
    except OverflowError:  # an int beyond float64
        value = math.inf
    if isinstance(alpha, bool) or not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"{who}: lora_alpha must be a positive number, finite (the update is scaled by "
            f"lora_alpha / rank; default: rank), got {alpha!r}."
        )
    return value


class LoRALayer(Layer):
    """A layer whose ``lora_target`` variable (2-D) can get a LoRA update (see the module
    docstring)."""

    lora_target: ClassVar[str] = "kernel"
    lora_names: ClassVar[tuple[str, str]] = ("lora_kernel_a", "lora_kernel_b")
    lora_rank: int | None
    lora_alpha: float | None
    lora_enabled: bool

    def _init_lora(self, lora_rank: Any, lora_alpha: Any) -> None:
        """Constructor arguments: checked now, applied when the layer builds."""
        me = type(self).__name__
        rank = None if lora_rank is None else check_rank(lora_rank, me)
        if lora_alpha is not None and rank is None:
            raise ValueError(f"{me}: lora_alpha={lora_alpha!r} needs lora_rank as well.")
        self._lora_pending = (rank, None if rank is None else check_alpha(lora_alpha, rank, me))
        self.lora_rank, self.lora_alpha, self.lora_enabled = None, None, False
        self._lora_was_trainable = True

    def _build_lora(self) -> None:
        """At the end of ``build`` (inside the layer's scope): the constructor's LoRA."""
        rank, alpha = self._lora_pending
        if rank is not None:
            self._add_lora(rank, alpha, _init.he_uniform(), _init.zeros())

    def _add_lora(
        self, rank: int, alpha: float | None, a_init: Any, b_init: Any
    ) -> tuple[Variable, Variable]:
        target: Variable = getattr(self, self.lora_target)
        lead, n_out = self.lora_dims()
        a = self.add_weight(self.lora_names[0], (*lead, rank), a_init, dtype="float32")
        b = self.add_weight(self.lora_names[1], (rank, n_out), b_init, dtype="float32")
        setattr(self, self.lora_names[0], a)
        setattr(self, self.lora_names[1], b)
        self._lora_was_trainable = freeze_target(target)
        self.lora_rank, self.lora_alpha = rank, float(rank) if alpha is None else alpha
        self.lora_enabled = True
        TRACE_EPOCH.restructure()  # a ps.function traced before computes without a, b
        return a, b

    def lora_dims(self) -> tuple[tuple[int, ...], int]:
        """``(a's leading shape, out)``: the target's shape but its last axis, and that axis,
        as Keras' ``EinsumDense`` (a quantized layer: those of its float kernel)."""
        target: Variable = getattr(self, self.lora_target)
        return tuple(target.shape[:-1]), target.shape[-1]

    def enable_lora(
        self,
        rank: int,
        lora_alpha: float | None = None,
        a_initializer: LayerInitializer = "he_uniform",
        b_initializer: LayerInitializer = "zeros",
    ) -> None:
        """Add LoRA variables ``a`` ``(*kernel.shape[:-1], rank)`` and ``b`` ``(rank, out)``
        and freeze the
        target, as Keras 3's ``enable_lora`` (see the module docstring)."""
        me = self.describe()
        rank = check_rank(rank, me)
        alpha = check_alpha(lora_alpha, rank, me)
        a_init = initializer(a_initializer, _init.he_uniform(), me, "a_initializer")
        b_init = initializer(b_initializer, _init.zeros(), me, "b_initializer")
        self.check_lora_enable()
        with all_or_nothing(self), self.name_scope:  # a failure leaves no stray variable
            self._add_lora(rank, alpha, a_init, b_init)

    def check_lora_enable(self) -> None:
        """Raise (``ValueError`` naming the layer) if LoRA cannot be enabled now."""
        me = self.describe()
        if not self.built:
            raise ValueError(
                f"{me} is not built yet, so it has no {self.lora_target} to adapt: call the "
                "layer on an input (or layer.build(input_shape)) before enable_lora, or pass "
                "lora_rank= to its constructor."
            )
        if self.lora_enabled:
            raise ValueError(
                f"{me} has LoRA enabled already (rank {self.lora_rank}); it can be enabled "
                "once per layer. Call merge_lora() first to start a new adapter."
            )

    def check_lora_merge(self) -> None:
        """Raise (``ValueError`` naming the layer) if the layer has no LoRA to merge."""
        if not self.lora_enabled:
            raise ValueError(
                f"{self.describe()} has no LoRA to merge: enable_lora(rank) first (or "
                "leave this layer out of merge_lora)."
            )

    def lora_parts(self) -> tuple[Variable, Variable, Variable]:
        """``(target, a, b)`` of a layer with LoRA enabled."""
        return (
            getattr(self, self.lora_target),
            getattr(self, self.lora_names[0]),
            getattr(self, self.lora_names[1]),
        )

    def lora_merged(self, target: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
        """``target + (alpha / rank) * a @ b`` in float32, in ``target``'s dtype (a leading
        stacked axis, as in a ``Repeat``, is batched over)."""
        assert self.lora_alpha is not None and self.lora_rank is not None
        scale = self.lora_alpha / self.lora_rank
        wide = jnp.promote_types(target.dtype, jnp.float32)
        delta = lora_delta(a.astype(wide), b.astype(wide))
        return (target.astype(wide) + scale * delta).astype(target.dtype)

    def drop_lora(self) -> None:
        """Remove the LoRA variables (their values are not folded: see ``merge_lora``)."""
        target = getattr(self, self.lora_target)
        for name in self.lora_names:
            delattr(self, name)
        restore_flags(target, self._lora_was_trainable, not self.trainable)
        self.lora_rank, self.lora_alpha, self.lora_enabled = None, None, False
        TRACE_EPOCH.restructure()  # a ps.function traced before still reads a and b

    def merge_lora(self) -> None:
        """Fold ``(lora_alpha / rank) * a @ b`` into the target and remove the LoRA
        variables (the outputs stay equal); ``ValueError`` without LoRA."""
        self.check_lora_merge()
        target, a, b = self.lora_parts()
        target.assign(self.lora_merged(target.value(), a.value(), b.value()), read_value=False)
        self.drop_lora()

    def lora_compute(self, target: Variable) -> jax.Array:
        """The target as the layer computes with it (see the module docstring)."""
        raise NotImplementedError
