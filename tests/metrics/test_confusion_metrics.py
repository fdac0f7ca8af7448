"""Precision, Recall, AUC and the top-k accuracies against Keras 3 (eagerly and in
ps.function), calling a metric, and their bad inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import paramstore as ps

RNG = np.random.default_rng(5)
Y_TRUE = (RNG.random((12, 3)) > 0.5).astype(np.float32)
Y_PRED = RNG.random((12, 3)).astype(np.float32)
WEIGHT = RNG.random((12,)).astype(np.float32)
SCORES = RNG.random((6, 7)).astype(np.float32)
LABELS = RNG.integers(0, 7, 6)


def _feed(metric, y_true, y_pred, weight):
    metric.update_state(y_true[:7], y_pred[:7])
    metric.update_state(y_true[7:], y_pred[7:], sample_weight=weight[7:])
    return np.asarray(metric.result())


@pytest.mark.tf
@pytest.mark.parametrize(
    "name,kw",
    [
        ("Precision", {}),
        ("Precision", {"thresholds": [0.2, 0.5, 0.8]}),
        ("Recall", {}),
        ("Recall", {"thresholds": 0.3}),
        ("AUC", {}),
        ("AUC", {"num_thresholds": 9, "curve": "PR"}),
        ("AUC", {"summation_method": "majoring", "curve": "PR", "num_thresholds": 17}),
        ("AUC", {"summation_method": "minoring"}),
        ("AUC", {"thresholds": [0.3, 0.5, 0.9]}),
    ],
)
def test_confusion_metrics_match_keras(keras, name, kw):
    ours, theirs = getattr(ps.metrics, name)(**kw), getattr(keras.metrics, name)(**kw)
    want = _feed(theirs, Y_TRUE, Y_PRED, WEIGHT)
    np.testing.assert_allclose(_feed(ours, Y_TRUE, Y_PRED, WEIGHT), want, rtol=1e-5, atol=1e-6)
    assert [v.name.split("/")[1] for v in ours.weights] == [v.name for v in theirs.variables]
    fresh = getattr(ps.metrics, name)(**kw)
    step = ps.function(lambda t, p, w: fresh(t, p, sample_weight=w))
    step(Y_TRUE[:7], Y_PRED[:7], np.ones(7, np.float32))
    got = step(Y_TRUE[7:], Y_PRED[7:], WEIGHT[7:])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.tf
@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_accuracies_match_keras(keras, k):
    onehot = np.eye(7, dtype=np.float32)[LABELS]
    for name, y_true in [
        ("TopKCategoricalAccuracy", onehot),
        ("SparseTopKCategoricalAccuracy", LABELS),
        ("SparseTopKCategoricalAccuracy", LABELS[:, None]),
    ]:
        ours, theirs = getattr(ps.metrics, name)(k=k), getattr(keras.metrics, name)(k=k)
        want = np.asarray(theirs(y_true, SCORES, sample_weight=WEIGHT[:6]))
        np.testing.assert_allclose(ours(y_true, SCORES, sample_weight=WEIGHT[:6]), want, 1e-6)
        assert ours.name == theirs.name


def test_top_k_ties_count_as_keras_in_top_k():
    m = ps.metrics.SparseTopKCategoricalAccuracy(k=1)
    assert float(m([1], [[0.5, 0.5, 0.1]])) == 1.0  # the tie with the top score counts


def test_every_metric_is_callable_eagerly_and_in_a_function():
    m = ps.metrics.BinaryAccuracy()
    assert float(m([1, 0], [0.9, 0.8])) == 0.5
    assert float(m([1, 1], [0.9, 0.8])) == 0.75  # accumulates, as Keras
    mean = ps.metrics.Mean()
    f = ps.function(lambda x: mean(x))
    assert float(f(jnp.asarray([1.0, 3.0]))) == 2.0
    assert float(f(jnp.asarray([5.0]))) == 3.0


def test_bad_thresholds_and_k():
    for bad in (1, 0, 2.5, True):
        with pytest.raises(ValueError, match=r"AUC: num_thresholds must be an int > 1"):
            ps.metrics.AUC(num_thresholds=bad)
    with pytest.raises(ValueError, match=r"Precision: thresholds must be floats in \[0, 1\]"):
        ps.metrics.Precision(thresholds=[0.5, 1.5])
    with pytest.raises(ValueError, match="AUC: curve must be 'ROC' or 'PR'"):
        ps.metrics.AUC(curve="roc")
    with pytest.raises(ValueError, match="k must be a positive int"):
        ps.metrics.TopKCategoricalAccuracy(k=0)


def test_k_larger_than_the_classes_changes_nothing():
    m = ps.metrics.TopKCategoricalAccuracy()  # k=5
    m.update_state(np.eye(6)[[0, 1]], RNG.random((2, 6)))
    before = [v.numpy() for v in m.variables]
    with pytest.raises(
        ValueError,
        match=r"TopKCategoricalAccuracy '\w+': k=5 is larger than the number of classes \(3",
    ):
        m.update_state(np.eye(3)[[0, 1]], RNG.random((2, 3)))
    for b, v in zip(before, m.variables):
        np.testing.assert_array_equal(b, v.numpy())
    sparse = ps.metrics.SparseTopKCategoricalAccuracy(k=4)
    with pytest.raises(ValueError, match="k=4 is larger than the number of classes"):
        ps.function(lambda: sparse([0, 1], jnp.ones((2, 2))))()
    assert float(sparse.count.value()) == 0.0


def test_confusion_shape_mismatch_changes_nothing():
    m = ps.metrics.Recall()
    with pytest.raises(
        ValueError, match=r"Recall '\w+': y_true of shape \(4,\) and y_pred of shape \(3,\)"
    ):
        m.update_state(np.ones(4), np.ones(3))
    with pytest.raises(ValueError, match=r"sample_weight of shape .* does not broadcast"):
        m.update_state(np.ones((4, 2)), np.ones((4, 2)), sample_weight=np.ones(3))
    assert float(jnp.sum(m.true_positives.value())) == 0.0
