"""``ps.metrics``: Keras 3's stateful metrics, their state in non-trainable Variables.

Every metric updates eagerly and inside a ``ps.function`` (also in a ``lax.scan`` body),
saves in a ``ps.Checkpoint``, and is callable: ``m(y_true, y_pred)`` updates it and returns
the result, as in Keras. Losses are optax's; docs/metrics.md has the Keras-to-optax names.
"""

from paramstore.metrics.accuracy import (
    Accuracy,
    BinaryAccuracy,
    CategoricalAccuracy,
    SparseCategoricalAccuracy,
    SparseTopKCategoricalAccuracy,
    TopKCategoricalAccuracy,
)
from paramstore.metrics.base import Mean, Metric, Sum
from paramstore.metrics.confusion import AUC, Precision, Recall
from paramstore.metrics.errors import MeanAbsoluteError, MeanSquaredError

__all__ = [
    "AUC",
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "Mean",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "Metric",
    "Precision",
    "Recall",
    "SparseCategoricalAccuracy",
    "SparseTopKCategoricalAccuracy",
    "Sum",
    "TopKCategoricalAccuracy",
]
