"""The base of every metric (``Metric``) and the means and sums the others are built on.

Contract (docs/api.md, "Metrics"):

* Each metric is a ``ps.Module`` with ``name=`` (default: Keras' name,
  ``"sparse_categorical_accuracy"``), its state in non-trainable float32 Variables.
* ``m.update_state(...)`` adds a batch; ``m.result()`` is a ``jax.Array``; ``m(...)`` does
  both (as Keras' ``metric(y_true, y_pred)``); ``m.reset_state()`` zeroes the state.
  They update eagerly, inside a ``ps.function`` and inside a ``lax.scan`` body run by one,
  and save in a ``ps.Checkpoint``.
* The arithmetic is Keras 3's (``reduce_to_samplewise_values``, ``MeanMetricWrapper``):
  per-element values are reduced to one per sample (mean over the axes the weight lacks),
  weighted, summed into ``total``; ``count`` adds the summed weights (or the sample count).
  ``result()`` of an empty metric is 0 (Keras' ``divide_no_nan``).
* Bad input (checked from the static shapes, so also inside a trace): ``y_true`` and
  ``y_pred`` whose shapes do not match (after Keras' squeeze or expand of a trailing 1), or a
  ``sample_weight`` that does not broadcast against the samples, raise ``ValueError`` naming
  the metric and the shapes; nothing is updated.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from paramstore._core.interrupts import deferred
from paramstore.module import Module
from paramstore.typing import ValueLike
from paramstore.variable import Variable

__all__ = ["Metric", "Mean", "Sum", "MeanOf", "same_rank", "zero"]

Array = jax.Array


def _divide_no_nan(total: Array, count: Array) -> Array:
    return jnp.where(
        count == 0, jnp.zeros((), total.dtype), total / jnp.where(count == 0, 1, count)
    )


# One compiled program rather than five eager operations: ``float(mean.result())`` after
# each step (a progress bar) of benchmarks/alternating.py's MLP went from 2.16x of the
# hand-written loop's ``float(total / count)`` to the figure in benchmarks/README.md.
_mean_of: Callable[[Array, Array], Array] = jax.jit(_divide_no_nan)


def zero(name: str) -> Variable:
    return Variable(jnp.zeros((), jnp.float32), trainable=False, name=name)


def same_rank(a: Array, b: Array) -> tuple[Array, Array]:
    """Keras' ``squeeze_or_expand_tosame_rank``: drop or add a trailing axis of 1."""
    if a.ndim == b.ndim + 1 and a.shape[-1] == 1:
        return (a, b[..., None]) if b.ndim == 1 else (a[..., 0], b)
    if b.ndim == a.ndim + 1 and b.shape[-1] == 1:
        return (a[..., None], b) if a.ndim == 1 else (a, b[..., 0])
    return a, b


class Metric(Module):
    """The base: ``update_state``, ``result``, ``reset_state``; state in ``variables``."""

    total: Variable

    def describe(self) -> str:
        """``"Mean 'loss'"``: how error messages name this metric."""
        return f"{type(self).__name__} '{self.scope_name}'"

    def reset_state(self) -> None:
        """Zero every state variable."""
        zeros = [jnp.zeros(v.shape, v.dtype) for v in self.variables]
        with deferred():  # all or none, Ctrl-C included (held back to the end)
            for v, zero in zip(self.variables, zeros):
                v.assign(zero, read_value=False)

    def result(self) -> Array:
        """The metric's value from the state so far (a ``jax.Array``)."""
        raise NotImplementedError

    def __call__(self, *args: ValueLike, **kwargs: ValueLike | None) -> Array:
        """``update_state(*args, **kwargs)`` (each metric's own arguments: ``y_true, y_pred,
        sample_weight=None``, or ``values`` for ``Mean``/``Sum``), then ``result()``, as Keras'
        ``metric(y_true, y_pred)``: eagerly and inside a ``ps.function``."""
        update: Callable[..., None] = getattr(self, "update_state")  # noqa: B009
        update(*args, **kwargs)
        return self.result()

    def __repr__(self) -> str:
        return f"<ps.metrics.{type(self).__name__} '{self.scope_name}'>"

    def _samplewise(
        self, values: ValueLike, sample_weight: ValueLike | None, mean: bool
    ) -> tuple[Array, Array | None]:
        """Keras' ``reduce_to_samplewise_values`` with shape checks (see the docstring)."""
        values = jnp.asarray(values, jnp.float32)
        reduce = jnp.mean if mean else jnp.sum
        weight = None
        if sample_weight is not None:
            weight = jnp.asarray(sample_weight, jnp.float32)
            values, weight = same_rank(values, weight)
            n = weight.ndim
            lead = values.shape[:n]
            if n > values.ndim or any(w not in (1, v) for w, v in zip(weight.shape, lead)):
                raise ValueError(
                    f"{self.describe()}: sample_weight of shape {tuple(weight.shape)} does not "
                    f"match values of shape {tuple(values.shape)}: it needs one weight per "
                    f"sample (shape {tuple(values.shape[:1])}) or the values' leading axes. "
                    "Nothing was updated."
                )
            if values.ndim > n:
                values = reduce(values, axis=tuple(range(n, values.ndim)))
            weight = jnp.broadcast_to(weight, values.shape)
            values = values * weight
            if n > 1:
                weight = reduce(weight, axis=tuple(range(1, n)))
        if values.ndim > 1:
            values = reduce(values, axis=tuple(range(1, values.ndim)))
        return values, weight


class Sum(Metric):
    """The (weighted) sum of the values, as ``keras.metrics.Sum``: variable ``total``."""

    def __init__(self, name: str | None = None) -> None:
        self.total = zero("total")

    def update_state(self, values: ValueLike, sample_weight: ValueLike | None = None) -> None:
        """Add the (weighted) sum of ``values`` to ``total``."""
        values, _ = self._samplewise(values, sample_weight, mean=False)
        self.total.assign_add(jnp.sum(values), read_value=False)

    def result(self) -> Array:
        """The sum so far."""
        return self.total.value()


class Mean(Metric):
    """The (weighted) mean of the values, as ``keras.metrics.Mean``: ``total`` / ``count``."""

    count: Variable

    def __init__(self, name: str | None = None) -> None:
        self.total = zero("total")
        self.count = zero("count")

    def update_state(self, values: ValueLike, sample_weight: ValueLike | None = None) -> None:
        """Add a batch of ``values`` (weighted by ``sample_weight``) to the mean."""
        self._add(values, sample_weight)

    def _add(self, values: ValueLike, sample_weight: ValueLike | None) -> None:
        values, weight = self._samplewise(values, sample_weight, mean=True)
        if weight is not None:
            n = jnp.sum(weight)
        else:
            n = jnp.asarray(values.shape[0] if values.ndim >= 1 else 1, jnp.float32)
        # Both increments come out of one tiny program that XLA may not look through, so
        # the count's update waits for the batch's values instead of being a constant add
        # that is ready the moment a compiled step starts. XLA:CPU's executor hands work to
        # its thread pool once more than 8 thunks are ready at once: the 3 metrics' constant
        # count updates took the benchmark's step from 8 ready thunks to 11, which cost
        # 1.41x blocking / 1.79x async per step; with the barrier it is 1.02x / 0.94x of the
        # hand-written sums (benchmarks/metrics.py, 2-core CPU, 2026-11-23).
        both = jax.lax.optimization_barrier(jnp.stack([jnp.sum(values), n.astype(jnp.float32)]))
        with deferred():  # both or neither, Ctrl-C included (held back to the end)
            self.total.assign_add(both[0], read_value=False)
            self.count.assign_add(both[1], read_value=False)

    def result(self) -> Array:
        """``total / count`` (0 before any update)."""
        return _mean_of(self.total.value(), self.count.value())


class MeanOf(Mean):
    """Keras' ``MeanMetricWrapper``: the mean of ``fn(y_true, y_pred)`` per sample."""

    def update_state(  # type: ignore[override]
        self, y_true: ValueLike, y_pred: ValueLike, sample_weight: ValueLike | None = None
    ) -> None:
        self._add(self._values(jnp.asarray(y_true), jnp.asarray(y_pred)), sample_weight)

    def _values(self, y_true: Array, y_pred: Array) -> Array:
        raise NotImplementedError

    def _mismatch(self, y_true: Array, y_pred: Array, need: str) -> ValueError:
        return ValueError(
            f"{self.describe()}: y_true of shape {tuple(y_true.shape)} and y_pred of shape "
            f"{tuple(y_pred.shape)} do not match ({need}). Nothing was updated."
        )

    def _paired(self, y_true: Array, y_pred: Array) -> tuple[Array, Array]:
        a, b = same_rank(y_true, y_pred)
        if a.shape != b.shape:
            raise self._mismatch(y_true, y_pred, "they need the same shape")
        return a, b
