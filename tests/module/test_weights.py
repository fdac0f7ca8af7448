"""Keras' weights API on every Module and layer: weights (Keras' order), trainable and
non-trainable weights, get/set_weights (checked, all or nothing), count_params, summary()."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paramstore as ps


def _snapshot(module):
    return [v.numpy().copy() for v in module.variables]


def test_weights_follow_keras_order():
    model = ps.nn.Sequential([ps.nn.Dense(3), ps.nn.BatchNormalization(), ps.nn.Dense(2)])
    model.build((None, 4))
    names = [v.name for v in model.weights]
    assert names == [
        "dense/kernel",
        "dense/bias",
        "batch_normalization/gamma",
        "batch_normalization/beta",
        "batch_normalization/moving_mean",
        "batch_normalization/moving_variance",
        "dense_1/kernel",
        "dense_1/bias",
    ]
    assert {v.name for v in model.weights} == {v.name for v in model.variables}
    assert [v.name.rsplit("/", 1)[1] for v in model.non_trainable_weights] == [
        "moving_mean",
        "moving_variance",
    ]
    assert len(model.trainable_weights) == 6
    assert model.count_params() == 4 * 3 + 3 + 4 * 3 + 3 * 2 + 2


def test_plain_module_own_variables_first():
    class Tower(ps.Module):
        def __init__(self):
            self.w = ps.Variable(jnp.ones((2, 3)), name="w")
            self.head = ps.nn.Dense(2)
            self.steps = ps.Variable(0, trainable=False, name="steps")

    t = Tower()
    t.head.build((None, 3))
    # Own variables first (in assignment order), then each sub-layer's.
    assert [v.name for v in t.weights] == [
        "tower/w",
        "tower/steps",
        "tower/dense/kernel",
        "tower/dense/bias",
    ]
    assert [v.name for v in t.trainable_weights] == [
        "tower/w",
        "tower/dense/kernel",
        "tower/dense/bias",
    ]
    assert [v.name for v in t.non_trainable_weights] == ["tower/steps"]
    assert t.count_params() == 6 + 1 + 6 + 2


@pytest.mark.tf
def test_get_set_weights_round_trip_with_keras(keras):
    ours = ps.nn.Sequential([ps.nn.Dense(3, activation="relu"), ps.nn.Dense(2)])
    ours.build((None, 4))
    theirs = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, "relu"), keras.layers.Dense(2)]
    )
    theirs.set_weights(ours.get_weights())
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-6)
    fresh = [np.random.default_rng(1).standard_normal(w.shape) for w in theirs.get_weights()]
    ours.set_weights(fresh)  # float64 arrays into float32 variables: cast, as Keras
    theirs.set_weights(fresh)
    np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-6)
    assert all(v.dtype == jnp.float32 for v in ours.weights)
    assert ours.count_params() == theirs.count_params()


@pytest.mark.tf
def test_multi_head_attention_weights_in_keras_order(keras):
    ours = ps.nn.MultiHeadAttention(2, 3)
    q = np.ones((1, 4, 5), np.float32)
    ours(q, q)
    theirs = keras.layers.MultiHeadAttention(2, 3)
    theirs(q, q)
    assert [tuple(w.shape) for w in theirs.weights] == [v.shape for v in ours.weights]
    theirs.set_weights(ours.get_weights())


def test_set_weights_wrong_count_changes_nothing():
    layer = ps.nn.Dense(2)
    layer.build((None, 3))
    before = _snapshot(layer)
    with pytest.raises(ValueError, match=r"Dense 'dense'.set_weights expects 2 arrays .* got 1"):
        layer.set_weights([np.zeros((3, 2))])
    for a, b in zip(before, _snapshot(layer)):
        np.testing.assert_array_equal(a, b)


def test_set_weights_wrong_shape_names_the_index_and_changes_nothing():
    layer = ps.nn.Dense(2)
    layer.build((None, 3))
    before = _snapshot(layer)
    with pytest.raises(ValueError, match=r"array 1 has shape \(3,\) but variable 1 \(dense/bias\)"):
        layer.set_weights([np.ones((3, 2)), np.ones(3)])
    for a, b in zip(before, _snapshot(layer)):
        np.testing.assert_array_equal(a, b)  # the kernel (index 0, valid) was not assigned


def test_set_weights_wrong_dtype_names_the_index_and_changes_nothing():
    layer = ps.nn.Embedding(4, 2)
    layer.build((None,))
    before = _snapshot(layer)
    with pytest.raises(TypeError, match=r"array 0 has dtype complex64, which does not fit"):
        layer.set_weights([np.ones((4, 2), np.complex64)])
    counter = ps.Variable(0, name="n")

    class Holder(ps.Module):
        def __init__(self):
            self.n = counter

    with pytest.raises(
        TypeError, match=r"array 0 has dtype float64, which does not fit variable 0 \(n, int32\)"
    ):
        Holder().set_weights([np.float64(1.5)])
    assert int(counter) == 0
    for a, b in zip(before, _snapshot(layer)):
        np.testing.assert_array_equal(a, b)


def test_count_params_of_an_unbuilt_layer_says_to_build():
    with pytest.raises(ValueError, match=r"Dense 'dense' is not built yet.*build"):
        ps.nn.Dense(2).count_params()


def test_summary_prints_and_returns_none(capsys):
    layer = ps.nn.Dense(2)
    layer.build((None, 3))
    assert layer.summary() is None
    printed = capsys.readouterr().out
    assert printed.strip() == ps.summary(layer).strip()
    assert "dense/kernel" in printed and "Total params: 8" in printed


def test_uncalled_initializer_factory_in_a_layer():
    layer = ps.nn.Dense(3, kernel_initializer=ps.initializers.he_normal)
    layer(np.ones((2, 4), np.float32))
    assert layer.kernel.shape == (4, 3) and float(jnp.std(layer.kernel.value())) > 0
    zeros = ps.nn.Dense(3, bias_initializer=ps.initializers.ones)
    zeros.build((None, 2))
    np.testing.assert_array_equal(zeros.bias.numpy(), np.ones(3))
    with pytest.raises(TypeError, match="constant needs its value"):
        ps.nn.Dense(3, kernel_initializer=ps.initializers.constant)


def test_sequential_compute_output_shape():
    model = ps.nn.Sequential(
        [ps.nn.Conv2D(4, 3), ps.nn.MaxPooling2D(), ps.nn.Flatten(), ps.nn.Dense(5), jax.nn.relu]
    )
    assert model.compute_output_shape((None, 10, 10, 3)) == (None, 5)
    assert model.compute_output_shape((2, 10, 10, 3)) == (2, 5)
    seq = ps.nn.Sequential([ps.nn.LSTM(3, return_sequences=True), ps.nn.GRU(2)])
    assert seq.compute_output_shape((None, 7, 4)) == (None, 2)


def test_a_subclass_attribute_named_weights_still_works():
    """Code written before Module had .weights may hold its own attribute of that name."""

    class Old(ps.Module):
        def __init__(self):
            self.weights = {"w": ps.Variable(jnp.ones(2), name="w")}

    old = Old()
    assert isinstance(old.weights, dict) and old.weights["w"].shape == (2,)
    assert [v.name for v in old.trainable_weights] == ["old/w"]
    old.set_weights([np.zeros(2)])
    np.testing.assert_array_equal(old.get_weights()[0], np.zeros(2))
    assert old.count_params() == 2
