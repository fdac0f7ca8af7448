"""ps.metrics: equal to keras.metrics for the same inputs and weights; inside ps.function and a
lax.scan body; saved by ps.Checkpoint; bad input raises and changes nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paramstore as ps

RNG = np.random.default_rng(3)


def _inputs(kind):
    """(y_true, y_pred) batches of the kind each metric takes."""
    if kind == "values":
        return None, RNG.standard_normal((6, 3)).astype(np.float32)
    if kind == "binary":
        return (
            RNG.integers(0, 2, (6, 1)).astype(np.float32),
            RNG.uniform(size=(6, 1)).astype(np.float32),
        )
    if kind == "labels":
        return RNG.integers(0, 3, (6,)).astype(np.float32), RNG.integers(0, 3, (6,)).astype(
            np.float32
        )
    if kind == "onehot":
        return np.eye(4, dtype=np.float32)[RNG.integers(0, 4, 6)], RNG.uniform(size=(6, 4)).astype(
            np.float32
        )
    if kind == "sparse":
        return RNG.integers(0, 4, (6,)).astype(np.int32), RNG.uniform(size=(6, 4)).astype(
            np.float32
        )
    if kind == "sparse_column":
        return RNG.integers(0, 4, (6, 1)).astype(np.int32), RNG.uniform(size=(6, 4)).astype(
            np.float32
        )
    assert kind == "regression"
    return RNG.standard_normal((6, 5)).astype(np.float32), RNG.standard_normal((6, 5)).astype(
        np.float32
    )


CASES = [
    ("Mean", "values", {}),
    ("Sum", "values", {}),
    ("Accuracy", "labels", {}),
    ("BinaryAccuracy", "binary", {}),
    ("BinaryAccuracy", "binary", {"threshold": 0.7}),
    ("CategoricalAccuracy", "onehot", {}),
    ("SparseCategoricalAccuracy", "sparse", {}),
    ("SparseCategoricalAccuracy", "sparse_column", {}),
    ("MeanSquaredError", "regression", {}),
    ("MeanAbsoluteError", "regression", {}),
]


@pytest.mark.tf
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("cls,kind,kwargs", CASES)
def test_equal_to_keras(keras, cls, kind, kwargs, weighted):
    ours = getattr(ps.metrics, cls)(**kwargs)
    theirs = getattr(keras.metrics, cls)(**kwargs)
    for _ in range(3):  # several batches accumulate
        y_true, y_pred = _inputs(kind)
        weight = RNG.uniform(size=(6,)).astype(np.float32) if weighted else None
        args = (y_pred,) if y_true is None else (y_true, y_pred)
        ours.update_state(*args, sample_weight=weight)
        theirs.update_state(*args, sample_weight=weight)
        np.testing.assert_allclose(ours.result(), theirs.result(), rtol=1e-5, atol=1e-6)
    assert isinstance(ours.result(), jax.Array)
    assert ours.name == theirs.name  # Keras' default names
    assert {v.name.rpartition("/")[2] for v in ours.variables} == {v.name for v in theirs.variables}
    assert all(not v.trainable for v in ours.variables)
    ours.reset_state()
    theirs.reset_state()
    np.testing.assert_allclose(ours.result(), theirs.result())


@pytest.mark.tf
def test_per_element_weights_equal_to_keras(keras):
    y_true, y_pred = _inputs("regression")
    weight = RNG.uniform(size=(6, 5)).astype(np.float32)
    for cls in ("Mean", "Sum"):
        ours, theirs = getattr(ps.metrics, cls)(), getattr(keras.metrics, cls)()
        ours.update_state(y_pred, sample_weight=weight)
        theirs.update_state(y_pred, sample_weight=weight)
        np.testing.assert_allclose(ours.result(), theirs.result(), rtol=1e-5)


def test_values_by_hand():
    m = ps.metrics.Mean(name="loss")
    assert m.name == "loss" and float(m.result()) == 0.0  # empty: 0, as Keras
    m.update_state([1.0, 3.0, 5.0, 7.0], sample_weight=[1, 1, 0, 0])
    assert float(m.result()) == 2.0
    acc = ps.metrics.SparseCategoricalAccuracy()
    acc.update_state([0, 1, 2], jnp.eye(3)[jnp.array([0, 2, 2])])
    assert float(acc.result()) == pytest.approx(2 / 3)


def test_update_inside_function_and_scan_body():
    acc = ps.metrics.SparseCategoricalAccuracy()
    loss = ps.metrics.Mean()
    y_true = jnp.array(RNG.integers(0, 4, (5, 8)))
    y_pred = jnp.array(RNG.standard_normal((5, 8, 4)), jnp.float32)

    @ps.function
    def epoch(yt, yp):
        def body(carry, batch):
            t, p = batch
            acc.update_state(t, p)
            loss.update_state(jnp.mean(p, axis=-1))
            return carry, None

        jax.lax.scan(body, 0, (yt, yp))
        return acc.result(), loss.result()

    got_acc, got_loss = epoch(y_true, y_pred)
    want_acc = float(jnp.mean(jnp.argmax(y_pred, -1) == y_true))
    assert float(got_acc) == pytest.approx(want_acc)
    assert float(acc.result()) == pytest.approx(want_acc)  # the variables were updated
    assert float(got_loss) == pytest.approx(float(jnp.mean(y_pred)), abs=1e-6)
    assert float(acc.count.numpy()) == 40.0
    epoch(y_true, y_pred)  # accumulates across calls
    assert float(acc.count.numpy()) == 80.0

    @ps.function
    def step(t, p):
        acc.update_state(t, p)

    acc.reset_state()
    step(y_true[0], y_pred[0])
    assert float(acc.count.numpy()) == 8.0


def test_saved_and_restored_by_checkpoint(tmp_path):
    m = ps.metrics.Mean()
    m.update_state([1.0, 2.0, 6.0])
    path = ps.Checkpoint(metric=m).save(str(tmp_path / "ckpt"))
    m.update_state([100.0])
    fresh = ps.metrics.Mean()
    ps.Checkpoint(metric=fresh).restore(path).assert_consumed()
    assert float(fresh.result()) == 3.0
    assert float(fresh.count.numpy()) == 3.0


@pytest.mark.parametrize(
    "metric,args,match",
    [
        (ps.metrics.Accuracy, ([1.0, 2.0, 3.0], [1.0, 2.0]), r"y_true of shape \(3,\)"),
        (ps.metrics.BinaryAccuracy, (np.ones((4, 2)), np.ones((4, 3))), "do not match"),
        (ps.metrics.CategoricalAccuracy, (np.eye(3), np.ones((3, 4))), "one-hot"),
        (ps.metrics.SparseCategoricalAccuracy, ([0, 1], np.ones((3, 4))), "class"),
        (ps.metrics.MeanSquaredError, (np.ones((4, 2)), np.ones((2, 4))), "same shape"),
        (ps.metrics.MeanAbsoluteError, (np.ones((4, 2)), np.ones((4, 3))), "same shape"),
    ],
)
def test_mismatched_shapes_raise_and_change_nothing(metric, args, match):
    m = metric()
    ok_true, ok_pred = (np.zeros((2, 3)), np.zeros((2, 3)))
    if metric is ps.metrics.SparseCategoricalAccuracy:
        ok_true = np.zeros((2,))
    m.update_state(ok_true, ok_pred)
    before = [np.array(v.numpy()) for v in m.variables]
    with pytest.raises(ValueError, match=match) as info:
        m.update_state(*args)
    assert type(m).__name__ in str(info.value) and "Nothing was updated" in str(info.value)
    assert [np.array(v.numpy()) for v in m.variables] == before


def test_sample_weight_of_the_wrong_length_raises_and_changes_nothing():
    for m, args in [
        (ps.metrics.Mean(), ([1.0, 2.0, 3.0],)),
        (ps.metrics.Sum(), ([1.0, 2.0, 3.0],)),
        (ps.metrics.SparseCategoricalAccuracy(), ([0, 1, 2], np.ones((3, 4)))),
    ]:
        m.update_state(*args)
        before = [float(v.numpy()) for v in m.variables]
        with pytest.raises(ValueError, match=r"sample_weight of shape \(2,\)"):
            m.update_state(*args, sample_weight=[1.0, 1.0])
        assert [float(v.numpy()) for v in m.variables] == before


def test_bad_input_is_caught_inside_a_function_too():
    m = ps.metrics.MeanSquaredError()

    @ps.function
    def step(t, p):
        m.update_state(t, p)

    with pytest.raises(ValueError, match="same shape"):
        step(jnp.ones((4, 2)), jnp.ones((4, 3)))
    assert float(m.count.numpy()) == 0.0


def test_bad_threshold():
    with pytest.raises(TypeError, match="threshold must be a number"):
        ps.metrics.BinaryAccuracy(threshold="high")
