"""``Precision``, ``Recall`` and ``AUC``: Keras 3's confusion-matrix metrics.

Contract (docs/metrics.md):

* Every value of ``y_true`` is a label (nonzero: positive) and every value of ``y_pred`` a
  score, compared with each threshold as ``y_pred > threshold``; all axes are flattened
  (Keras' ``multi_label=False``). ``sample_weight`` (one per sample, or ``y_pred``'s shape)
  broadcasts against ``y_pred`` as in Keras and weighs each element's count.
* The state is float32 Variables of one entry per threshold, with Keras' names
  (``true_positives``, ``false_positives``, ``true_negatives``, ``false_negatives``).
* ``Precision(thresholds=None)`` / ``Recall(thresholds=None)``: ``thresholds`` is a float
  or a list of floats in [0, 1], Python or NumPy (``np.float32(0.5)``, as Keras; default
  0.5); ``result()`` is a scalar for one threshold (given as a number or None), else one value per threshold. 0 when nothing was counted.
* ``AUC(num_thresholds=200, curve="ROC", summation_method="interpolation",
  thresholds=None)``: the area under the ROC or PR curve from ``num_thresholds`` evenly
  spaced thresholds (``0 - 1e-7``, ``i / (num_thresholds - 1)``, ``1 + 1e-7``), or the
  given ``thresholds`` (with those two ends added); the Riemann sum Keras computes
  (``"interpolation"``, ``"minoring"``, ``"majoring"``; PR with interpolation is Davis &
  Goadrich's interpolation, as Keras).
* Not supported: ``top_k``, ``class_id``, ``multi_label``, ``label_weights`` (not
  arguments). Bad input (``num_thresholds`` below 2, a threshold outside [0, 1], an
  unknown curve or summation method, mismatched shapes) raises ``ValueError`` naming the
  metric; nothing is created or updated.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from paramstore.metrics.base import Metric, same_rank
from paramstore.typing import ValueLike
from paramstore.variable import Variable

__all__ = ["Precision", "Recall", "AUC"]

Array = jax.Array
_EPSILON = 1e-7  # Keras' backend.epsilon(): the ends of AUC's thresholds


def _no_nan(a: Array, b: Array) -> Array:
    return jnp.where(b == 0, jnp.zeros_like(a), a / jnp.where(b == 0, 1, b))


def _is_number(x: Any) -> bool:
    """A Python or NumPy real number (np.float32(0.5) as Keras takes it), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _thresholds(kind: str, thresholds: float | Sequence[float]) -> tuple[float, ...]:
    single = _is_number(thresholds) or isinstance(thresholds, (bool, np.bool_))
    values: tuple[Any, ...] = (thresholds,) if single else tuple(cast(Sequence[Any], thresholds))
    for t in values:
        if not _is_number(t) or not 0.0 <= float(t) <= 1.0:
            raise ValueError(
                f"{kind}: thresholds must be floats in [0, 1] (a score above a threshold "
                f"counts as a positive prediction), got {thresholds!r}."
            )
    if not values:
        raise ValueError(f"{kind}: thresholds must not be empty.")
    return tuple(float(t) for t in values)


class _Confusion(Metric):
    """Counts of (weighted) true/false positives/negatives per threshold."""

    counts: tuple[str, ...] = ()
    thresholds: tuple[float, ...]

    def _make(self) -> None:
        n = len(self.thresholds)
        for name in self.counts:
            setattr(
                self,
                name,
                Variable(jnp.zeros((n,), jnp.float32), trainable=False, name=name),
            )

    def update_state(
        self, y_true: ValueLike, y_pred: ValueLike, sample_weight: ValueLike | None = None
    ) -> None:
        """Count the batch's predictions at every threshold (see the module docstring)."""
        true, pred = jnp.asarray(y_true), jnp.asarray(y_pred)
        a, b = same_rank(true, pred)
        if a.shape != b.shape:
            raise ValueError(
                f"{self.describe()}: y_true of shape {tuple(true.shape)} and y_pred of shape "
                f"{tuple(pred.shape)} do not match (they need the same shape). Nothing was "
                "updated."
            )
        labels = (a != 0).reshape(-1)
        scores = b.astype(jnp.float32).reshape(-1)
        weight = jnp.ones_like(scores)
        if sample_weight is not None:
            w = jnp.asarray(sample_weight, jnp.float32)[..., None]  # Keras' expand, then
            if w.ndim == b.ndim + 1 and w.shape[-1] == 1:  # squeeze to y_pred's rank
                w = w[..., 0]
            try:
                w = jnp.broadcast_to(w, b.shape)
            except ValueError:
                raise ValueError(
                    f"{self.describe()}: sample_weight of shape {tuple(w.shape)} does not "
                    f"broadcast to y_pred's shape {tuple(b.shape)}. Nothing was updated."
                ) from None
            weight = w.reshape(-1)
        positive = scores[None, :] > jnp.asarray(self.thresholds, jnp.float32)[:, None]
        truth = labels[None, :]
        cells = {
            "true_positives": positive & truth,
            "false_positives": positive & ~truth,
            "true_negatives": ~positive & ~truth,
            "false_negatives": ~positive & truth,
        }
        for name in self.counts:
            var: Variable = getattr(self, name)
            var.assign_add(jnp.sum(cells[name] * weight[None, :], axis=1), read_value=False)


class _PrecisionRecall(_Confusion):
    def __init__(
        self, thresholds: float | Sequence[float] | None = None, name: str | None = None
    ) -> None:
        self.thresholds = _thresholds(
            type(self).__name__, 0.5 if thresholds is None else thresholds
        )
        self._scalar = thresholds is None or _is_number(thresholds)
        self._make()

    def _ratio(self, hits: Variable, misses: Variable) -> Array:
        tp = hits.value()
        out = _no_nan(tp, tp + misses.value())
        return out[0] if self._scalar else out


class Precision(_PrecisionRecall):
    """``true_positives / (true_positives + false_positives)`` at each threshold, as
    ``keras.metrics.Precision`` (see the module docstring)."""

    counts = _keras_order = ("true_positives", "false_positives")
    true_positives: Variable
    false_positives: Variable

    def result(self) -> Array:
        """The precision: a scalar for one threshold, else one per threshold."""
        return self._ratio(self.true_positives, self.false_positives)


class Recall(_PrecisionRecall):
    """``true_positives / (true_positives + false_negatives)`` at each threshold, as
    ``keras.metrics.Recall`` (see the module docstring)."""

    counts = _keras_order = ("true_positives", "false_negatives")
    true_positives: Variable
    false_negatives: Variable

    def result(self) -> Array:
        """The recall: a scalar for one threshold, else one per threshold."""
        return self._ratio(self.true_positives, self.false_negatives)


class AUC(_Confusion):
    """The area under the ROC (default) or PR curve, as ``keras.metrics.AUC`` (see the
    module docstring); ``num_thresholds`` must be at least 2."""

    counts = _keras_order = (
        "true_positives",
        "false_positives",
        "true_negatives",
        "false_negatives",
    )
    true_positives: Variable
    false_positives: Variable
    true_negatives: Variable
    false_negatives: Variable

    def __init__(
        self,
        num_thresholds: int = 200,
        curve: str = "ROC",
        summation_method: str = "interpolation",
        name: str | None = None,
        thresholds: Sequence[float] | None = None,
    ) -> None:
        if thresholds is None:
            if (
                isinstance(num_thresholds, bool)
                or not isinstance(num_thresholds, int)
                or num_thresholds < 2
            ):
                raise ValueError(
                    f"AUC: num_thresholds must be an int > 1 (the curve needs at least its "
                    f"two ends), got {num_thresholds!r}."
                )
            inner = [(i + 1) / (num_thresholds - 1) for i in range(num_thresholds - 2)]
        else:
            inner = sorted(_thresholds("AUC", thresholds))
        if curve not in ("ROC", "PR"):
            raise ValueError(f"AUC: curve must be 'ROC' or 'PR', got {curve!r}.")
        if summation_method not in ("interpolation", "minoring", "majoring"):
            raise ValueError(
                "AUC: summation_method must be 'interpolation', 'minoring' or 'majoring', "
                f"got {summation_method!r}."
            )
        self.thresholds = (0.0 - _EPSILON, *inner, 1.0 + _EPSILON)
        self.num_thresholds = len(self.thresholds)
        self.curve, self.summation_method = curve, summation_method
        self._make()

    def result(self) -> Array:
        """The area (a scalar), Keras' Riemann sum over the thresholds."""
        tp, fp = self.true_positives.value(), self.false_positives.value()
        tn, fn = self.true_negatives.value(), self.false_negatives.value()
        if self.curve == "PR" and self.summation_method == "interpolation":
            return _interpolate_pr_auc(tp, fp, fn)
        recall = _no_nan(tp, tp + fn)
        if self.curve == "ROC":
            x, y = _no_nan(fp, fp + tn), recall
        else:
            x, y = recall, _no_nan(tp, tp + fp)
        if self.summation_method == "interpolation":
            heights = (y[:-1] + y[1:]) / 2
        elif self.summation_method == "minoring":
            heights = jnp.minimum(y[:-1], y[1:])
        else:
            heights = jnp.maximum(y[:-1], y[1:])
        return jnp.sum((x[:-1] - x[1:]) * heights)


def _interpolate_pr_auc(tp: Array, fp: Array, fn: Array) -> Array:
    """Keras' ``interpolate_pr_auc`` (Davis & Goadrich 2006)."""
    dtp = tp[:-1] - tp[1:]
    p = tp + fp
    dp = p[:-1] - p[1:]
    slope = _no_nan(dtp, jnp.maximum(dp, 0))
    intercept = tp[1:] - slope * p[1:]
    ratio = jnp.where(
        (p[:-1] > 0) & (p[1:] > 0), _no_nan(p[:-1], jnp.maximum(p[1:], 0)), jnp.ones_like(p[1:])
    )
    increments = _no_nan(
        slope * (dtp + intercept * jnp.log(ratio)), jnp.maximum(tp[1:] + fn[1:], 0)
    )
    return jnp.sum(increments)
