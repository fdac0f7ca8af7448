"""Accuracy metrics: ``Accuracy``, ``BinaryAccuracy``, ``CategoricalAccuracy``,
``SparseCategoricalAccuracy``, ``TopKCategoricalAccuracy``, ``SparseTopKCategoricalAccuracy``
(Keras 3's, each the mean of a per-sample 0/1 match)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paramstore.metrics.base import MeanOf

Array = jax.Array

__all__ = [
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "SparseCategoricalAccuracy",
    "TopKCategoricalAccuracy",
    "SparseTopKCategoricalAccuracy",
]


class Accuracy(MeanOf):
    """How often ``y_pred`` equals ``y_true`` exactly, as ``keras.metrics.Accuracy``."""

    def _values(self, y_true: Array, y_pred: Array) -> Array:
        y_true, y_pred = self._paired(y_true.astype(y_pred.dtype), y_pred)
        return (y_true == y_pred).astype(jnp.float32)


class BinaryAccuracy(MeanOf):
    """How often ``y_pred > threshold`` equals the 0/1 ``y_true``, as
    ``keras.metrics.BinaryAccuracy``."""

    def __init__(self, name: str | None = None, threshold: float = 0.5) -> None:
        super().__init__(name=name)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise TypeError(f"BinaryAccuracy: threshold must be a number, got {threshold!r}.")
        self.threshold = float(threshold)

    def _values(self, y_true: Array, y_pred: Array) -> Array:
        y_true, y_pred = self._paired(y_true, y_pred)
        predicted = (y_pred > self.threshold).astype(y_true.dtype)
        return (y_true == predicted).astype(jnp.float32)


class CategoricalAccuracy(MeanOf):
    """How often ``argmax(y_pred)`` equals ``argmax(y_true)`` (one-hot labels), as
    ``keras.metrics.CategoricalAccuracy``."""

    def _values(self, y_true: Array, y_pred: Array) -> Array:
        if y_true.shape != y_pred.shape or y_pred.ndim < 1:
            raise self._mismatch(y_true, y_pred, "one-hot y_true needs y_pred's shape")
        return (jnp.argmax(y_true, -1) == jnp.argmax(y_pred, -1)).astype(jnp.float32)


class SparseCategoricalAccuracy(MeanOf):
    """How often ``argmax(y_pred)`` equals the integer ``y_true``, as
    ``keras.metrics.SparseCategoricalAccuracy`` (``y_true`` of shape ``y_pred.shape[:-1]``,
    or with a trailing axis of 1)."""

    def _values(self, y_true: Array, y_pred: Array) -> Array:
        labels = y_true
        if y_true.ndim == y_pred.ndim and y_true.ndim >= 1 and y_true.shape[-1] == 1:
            labels = y_true[..., 0]
        if y_pred.ndim < 1 or labels.shape != y_pred.shape[:-1]:
            raise self._mismatch(
                y_true, y_pred, "y_true needs y_pred's shape without its last (class) axis"
            )
        predicted = jnp.argmax(y_pred, -1).astype(jnp.float32)
        matches = (labels.astype(jnp.float32) == predicted).astype(jnp.float32)
        return matches.reshape(y_true.shape)


class _TopK(MeanOf):
    """How often the true class is among the ``k`` highest scores (ties count, as Keras'
    ``in_top_k``: the true class's score is at least the k-th largest)."""

    def __init__(self, k: int = 5, name: str | None = None) -> None:
        super().__init__(name=name)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{type(self).__name__}: k must be a positive int, got {k!r}.")
        self.k = k

    def _labels(self, y_true: Array, y_pred: Array) -> Array:
        raise NotImplementedError

    def _values(self, y_true: Array, y_pred: Array) -> Array:
        if y_pred.ndim < 1:
            raise self._mismatch(y_true, y_pred, "y_pred needs a class axis")
        classes = y_pred.shape[-1]
        if self.k > classes:
            raise ValueError(
                f"{self.describe()}: k={self.k} is larger than the number of classes "
                f"({classes}, the last axis of y_pred of shape {tuple(y_pred.shape)}), so every "
                f"prediction would count as correct. Use k <= {classes}. Nothing was updated."
            )
        labels = self._labels(y_true, y_pred)
        scores = y_pred.astype(jnp.result_type(y_pred.dtype, jnp.float32))
        kth = jax.lax.top_k(scores, self.k)[0][..., -1]
        true = jnp.take_along_axis(scores, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
        return (true >= kth).astype(jnp.float32)


class TopKCategoricalAccuracy(_TopK):
    """How often ``argmax(y_true)`` (one-hot labels) is among the ``k`` (default 5) highest
    scores of ``y_pred``, as ``keras.metrics.TopKCategoricalAccuracy``. ``k`` larger than
    the number of classes raises ValueError."""

    def _labels(self, y_true: Array, y_pred: Array) -> Array:
        if y_true.shape != y_pred.shape:
            raise self._mismatch(y_true, y_pred, "one-hot y_true needs y_pred's shape")
        return jnp.argmax(y_true, -1)


class SparseTopKCategoricalAccuracy(_TopK):
    """How often the integer ``y_true`` is among the ``k`` (default 5) highest scores of
    ``y_pred``, as ``keras.metrics.SparseTopKCategoricalAccuracy`` (``y_true`` of shape
    ``y_pred.shape[:-1]``, or with a trailing axis of 1)."""

    def _labels(self, y_true: Array, y_pred: Array) -> Array:
        labels = y_true
        if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1:
            labels = y_true[..., 0]
        if labels.shape != y_pred.shape[:-1]:
            raise self._mismatch(
                y_true, y_pred, "y_true needs y_pred's shape without its last (class) axis"
            )
        return labels
