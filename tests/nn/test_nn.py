"""ps.nn: each layer against Keras 3 with the same weights, building, modes, bad input."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paramstore as ps

RNG = np.random.default_rng(0)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def snapshot(module):
    return {v.name: np.array(v.numpy()) for v in module.variables}


def assert_same(before, module):
    after = snapshot(module)
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])


# ------------------------------------------------------------------ against Keras


@pytest.mark.tf
@pytest.mark.parametrize("activation", [None, "relu"])
def test_dense_matches_keras(keras, activation):
    x = rand(5, 3, 4)
    layer = ps.nn.Dense(6, activation=activation)
    ours = np.asarray(layer(x))
    assert [v.name for v in layer.variables] == ["dense/bias", "dense/kernel"]
    assert layer.kernel.shape == (4, 6) and layer.bias.shape == (6,)
    np.testing.assert_array_equal(layer.bias.numpy(), 0.0)
    k = keras.layers.Dense(6, activation=activation)
    k.build((None, 3, 4))
    layer.bias.assign(rand(6))
    k.set_weights([layer.kernel.numpy(), layer.bias.numpy()])
    np.testing.assert_allclose(layer(x), k(x), rtol=1e-5, atol=1e-5)
    assert ours.shape == (5, 3, 6)


@pytest.mark.tf
@pytest.mark.parametrize("padding,strides", [("valid", 1), ("same", 2), ("same", (1, 2))])
def test_conv2d_matches_keras(keras, padding, strides):
    x = rand(2, 9, 8, 3)
    layer = ps.nn.Conv2D(5, (3, 2), strides=strides, padding=padding, activation="relu")
    layer(x)
    assert layer.kernel.shape == (3, 2, 3, 5) and layer.bias.shape == (5,)
    layer.bias.assign(rand(5))
    k = keras.layers.Conv2D(5, (3, 2), strides=strides, padding=padding, activation="relu")
    k.build(x.shape)
    k.set_weights([layer.kernel.numpy(), layer.bias.numpy()])
    np.testing.assert_allclose(layer(x), k(x), rtol=1e-5, atol=1e-5)


@pytest.mark.tf
def test_embedding_matches_keras(keras):
    ids = RNG.integers(0, 10, size=(3, 7)).astype(np.int32)
    layer = ps.nn.Embedding(10, 4)
    out = layer(ids)
    assert layer.embeddings.name == "embedding/embeddings" and layer.embeddings.shape == (10, 4)
    assert np.abs(layer.embeddings.numpy()).max() <= 0.05
    k = keras.layers.Embedding(10, 4)
    k.build((None, 7))
    k.set_weights([layer.embeddings.numpy()])
    np.testing.assert_allclose(out, k(ids), rtol=1e-6)


@pytest.mark.tf
def test_layer_normalization_matches_keras(keras):
    x = rand(4, 6, 5) * 3 + 1
    layer = ps.nn.LayerNormalization()
    layer(x)
    layer.gamma.assign(rand(5))
    layer.beta.assign(rand(5))
    k = keras.layers.LayerNormalization()
    assert k.epsilon == layer.epsilon == 1e-3
    k.build(x.shape)
    k.set_weights([layer.gamma.numpy(), layer.beta.numpy()])
    np.testing.assert_allclose(layer(x), k(x), rtol=1e-4, atol=1e-5)


@pytest.mark.tf
def test_batch_normalization_matches_keras_in_both_modes(keras):
    layer = ps.nn.BatchNormalization()
    k = keras.layers.BatchNormalization()
    assert (k.momentum, k.epsilon) == (layer.momentum, layer.epsilon) == (0.99, 1e-3)
    x0 = rand(8, 3, 4) * 2 + 0.5
    layer(x0)  # build (inference: nothing changes)
    k.build(x0.shape)
    gamma, beta = rand(4), rand(4)
    layer.gamma.assign(gamma)
    layer.beta.assign(beta)
    k.set_weights([gamma, beta, np.zeros(4, np.float32), np.ones(4, np.float32)])
    assert [v.name for v in layer.non_trainable_variables] == [
        "batch_normalization/moving_mean",
        "batch_normalization/moving_variance",
    ]
    for _ in range(3):
        x = rand(8, 3, 4) * 2 + 0.5
        np.testing.assert_allclose(
            layer(x, training=True), k(x, training=True), rtol=1e-4, atol=1e-4
        )
    np.testing.assert_allclose(
        layer.moving_mean.numpy(), k.moving_mean.numpy(), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        layer.moving_variance.numpy(), k.moving_variance.numpy(), rtol=1e-5, atol=1e-6
    )
    x = rand(8, 3, 4)
    np.testing.assert_allclose(layer(x, training=False), k(x, training=False), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.tf
@pytest.mark.parametrize("masked", [False, True])
def test_multi_head_attention_matches_keras(keras, masked):
    q, v = rand(2, 5, 8), rand(2, 7, 6)
    mask = RNG.random((2, 5, 7)) > 0.3 if masked else None
    layer = ps.nn.MultiHeadAttention(num_heads=3, key_dim=4)
    ours = layer(q, v, mask=mask)
    assert ours.shape == (2, 5, 8)
    k = keras.layers.MultiHeadAttention(num_heads=3, key_dim=4)
    k(q, v)  # build
    for name, sub in [
        ("query", k._query_dense),
        ("key", k._key_dense),
        ("value", k._value_dense),
        ("attention_output", k._output_dense),
    ]:
        by_name = {"/".join(v.name.split("/")[-2:]): v for v in layer.weights}
        kern, bias = by_name[f"{name}/kernel"], by_name[f"{name}/bias"]
        assert tuple(sub.kernel.shape) == kern.shape and tuple(sub.bias.shape) == bias.shape
        bias.assign(rand(*bias.shape) * 0.1)
        sub.kernel.assign(kern.numpy())
        sub.bias.assign(bias.numpy())
    np.testing.assert_allclose(
        layer(q, v, mask=mask), k(q, v, attention_mask=mask), rtol=1e-4, atol=1e-5
    )
    x = rand(2, 5, 8)
    self_layer = ps.nn.MultiHeadAttention(2, 4)
    got = self_layer(x, x, use_causal_mask=True)
    # causal: the first position only sees itself, so changing later positions leaves it
    x2 = x.copy()
    x2[:, 1:] += 1.0
    np.testing.assert_allclose(got[:, 0], self_layer(x2, x2, use_causal_mask=True)[:, 0], rtol=1e-5)


# -------------------------------------------------------------- building, modes


def test_layers_build_in_the_first_trace_of_a_function():
    model = ps.nn.Sequential(
        [ps.nn.Dense(8, activation="relu"), ps.nn.Dropout(0.5), ps.nn.Dense(2)]
    )
    assert model.variables == ()

    def fn(x, training):
        return model(x, training=training)

    f = ps.function(fn, static_argnames=("training",))
    x = jnp.ones((3, 5))
    y = f(x, training=False)
    assert y.shape == (3, 2)
    assert [v.name for v in model.variables] == [
        "dense/bias",  # layers are named where they are created, as in Keras
        "dense/kernel",
        "dense_1/bias",
        "dense_1/kernel",
    ]
    np.testing.assert_allclose(f(x, training=False), y)
    assert f.trace_count == 1
    assert f(x, training=True).shape == (3, 2)  # a second trace: no new variables
    assert f.trace_count == 2 and len(model.variables) == 4
    # eager and compiled agree
    np.testing.assert_allclose(model(x), y, rtol=1e-6)


def test_batch_norm_updates_moving_stats_inside_function_and_grad():
    bn = ps.nn.BatchNormalization(momentum=0.5)
    dense = ps.nn.Dense(4)
    x = jnp.asarray(rand(16, 4) * 3 + 2)
    dense(x)

    @ps.function
    def step(x):
        def loss():
            return jnp.sum(bn(dense(x), training=True) ** 2)

        return ps.value_and_grad(loss, dense)()

    step(x)
    h = np.asarray(dense(x))
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.5 * h.mean(0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        bn.moving_variance.numpy(), 0.5 + 0.5 * h.var(0), rtol=1e-4, atol=1e-5
    )
    step(x)
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.75 * h.mean(0), rtol=1e-4, atol=1e-5)
    before = snapshot(bn)
    bn(x, training=False)
    assert_same(before, bn)


def test_dropout_statistics_and_inference():
    layer = ps.nn.Dropout(0.25)
    x = jnp.ones((200, 100))
    np.testing.assert_array_equal(layer(x), x)  # training=False by default
    y = np.asarray(layer(x, training=True))
    kept = y != 0
    assert abs(kept.mean() - 0.75) < 0.01
    np.testing.assert_allclose(y[kept], 1 / 0.75, rtol=1e-6)
    assert abs(y.mean() - 1.0) < 0.02
    y2 = np.asarray(layer(x, training=True))
    assert (y2 != y).any()  # eager calls draw new masks


def test_dropout_draws_a_new_mask_on_every_compiled_call():
    layer = ps.nn.Dropout(0.5)
    f = ps.function(lambda x: layer(x, training=True))
    x = jnp.ones((64, 64))
    masks = [np.asarray(f(x)) != 0 for _ in range(3)]
    assert f.trace_count == 1
    assert (masks[0] != masks[1]).any() and (masks[1] != masks[2]).any()
    for m in masks:
        assert abs(m.mean() - 0.5) < 0.05


def test_dropout_with_a_generator_is_reproducible_and_fresh():
    def run():
        g = ps.random.Generator.from_seed(7)
        layer = ps.nn.Dropout(0.5, generator=g)
        f = ps.function(lambda x: layer(x, training=True))
        return [np.asarray(f(jnp.ones((32, 32)))) for _ in range(2)]

    a, b = run(), run()
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert (a[0] != a[1]).any()


def test_sequential_passes_training_only_to_layers_that_take_it():
    seen = []

    def plain(x):
        return x + 1

    class Probe(ps.Module):
        def __call__(self, x, training=False):
            seen.append(training)
            return x

    model = ps.nn.Sequential([plain, Probe(), ps.nn.Sequential([Probe()])])
    np.testing.assert_array_equal(model(jnp.zeros(2), training=True), 1.0)
    assert seen == [True, True]
    model(jnp.zeros(2))
    assert seen[2:] == [False, False]
    with pytest.raises(TypeError, match="layer 0 is a int"):
        ps.nn.Sequential([3])


def test_summary_and_html():
    model = ps.nn.Sequential([ps.nn.Dense(3), ps.nn.BatchNormalization()])
    assert "not built yet" in ps.summary(ps.nn.Dense(2))
    model(jnp.ones((2, 4)))
    text = ps.summary(model)
    assert "dense/kernel" in text and "(4, 3)" in text and "float32" in text
    assert "Total params: 27" in text  # 12 + 3 + 4 * 3
    assert "Trainable params: 21" in text and "Non-trainable params: 6" in text
    row = next(line for line in text.splitlines() if "moving_mean" in line)
    assert row.rstrip().endswith("no")
    html = model._repr_html_()
    assert "<table" in html and "dense/kernel" in html and "Sequential" in html
    assert "Total params: 2" in ps.summary([ps.Variable([1.0, 2.0])])
    assert "k" in ps.summary({"k": ps.Variable(1.0)})
    with pytest.raises(TypeError, match="ps.summary expects"):
        ps.summary(3)


# ------------------------------------------------------------------- bad input


def test_last_axis_mismatch_raises_and_changes_nothing():
    for layer in [ps.nn.Dense(3), ps.nn.LayerNormalization(), ps.nn.BatchNormalization()]:
        layer(jnp.ones((2, 4)))
        before = snapshot(layer)
        n = len(layer.variables)
        with pytest.raises(
            ValueError,
            match=rf"{type(layer).__name__} '.*' was built for inputs whose last axis is 4, but got an input of shape \(2, 5\)",
        ):
            layer(jnp.ones((2, 5)))
        assert len(layer.variables) == n
        assert_same(before, layer)


def test_conv2d_wrong_rank_builds_nothing():
    layer = ps.nn.Conv2D(4, 3)
    with pytest.raises(
        ValueError, match=r"Conv2D 'conv2d' expects a 4-D input .* got shape \(8, 8, 3\)"
    ):
        layer(jnp.ones((8, 8, 3)))
    assert layer.variables == () and not layer.built
    layer(jnp.ones((1, 8, 8, 3)))
    with pytest.raises(ValueError, match="last axis is 3"):
        layer(jnp.ones((1, 8, 8, 2)))


def test_embedding_float_input_builds_nothing():
    layer = ps.nn.Embedding(10, 3)
    with pytest.raises(
        TypeError,
        match=r"Embedding 'embedding' expects integer indices, got .*float32 and shape \(2, 3\)",
    ):
        layer(jnp.ones((2, 3)))
    assert layer.variables == ()


@pytest.mark.parametrize(
    "rate,exc", [(1.0, ValueError), (-0.1, ValueError), (1.5, ValueError), ("0.5", TypeError)]
)
def test_dropout_rate_outside_range(rate, exc):
    with pytest.raises(exc, match=r"Dropout: rate must be"):
        ps.nn.Dropout(rate)


def test_attention_mask_of_the_wrong_shape():
    layer = ps.nn.MultiHeadAttention(2, 4)
    q, v = jnp.ones((2, 5, 8)), jnp.ones((2, 7, 8))
    with pytest.raises(
        ValueError,
        match=r"MultiHeadAttention 'multi_head_attention': mask has shape \(2, 7, 5\).*\(2, 5, 7\)",
    ):
        layer(q, v, mask=jnp.ones((2, 7, 5), bool))
    assert layer.variables == ()
    layer(q, v, mask=jnp.ones((5, 7), bool))  # broadcast over the batch
    before = snapshot(layer)
    with pytest.raises(ValueError, match="mask has shape"):
        layer(q, v, mask=jnp.ones((2, 3, 5, 7), bool))  # 3 heads for 2
    with pytest.raises(
        ValueError, match=r"built for query, key and value feature sizes \(8, 8, 8\)"
    ):
        layer(jnp.ones((2, 5, 6)), v)
    assert_same(before, layer)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="Dense: units"):
        ps.nn.Dense(0)
    with pytest.raises(ValueError, match="unknown activation 'relux'"):
        ps.nn.Dense(2, activation="relux")
    with pytest.raises(ValueError, match="padding"):
        ps.nn.Conv2D(2, 3, padding="full")
    with pytest.raises(ValueError, match="num_heads"):
        ps.nn.MultiHeadAttention(0, 4)


def test_jit_grad_through_layers():
    model = ps.nn.Sequential(
        [ps.nn.Dense(4, activation="tanh"), ps.nn.LayerNormalization(), ps.nn.Dense(1)]
    )
    x = jnp.asarray(rand(8, 3))
    model(x)
    grads = ps.grad(lambda: jnp.sum(model(x) ** 2), model)()
    assert len(grads) == len(model.trainable_variables) == 6
    assert all(g.shape == v.shape for g, v in zip(grads, model.trainable_variables))
    assert jax.tree_util.tree_all(
        jax.tree_util.tree_map(lambda g: bool(jnp.isfinite(g).all()), grads)
    )


def test_a_layer_holds_its_build_lock_and_a_deep_copy_gets_its_own():
    layer = ps.nn.Dense(2)
    x = jnp.ones((1, 3))
    layer(x)
    twin = copy.deepcopy(layer)
    lock = layer.__dict__["_ps_build_lock"]
    assert twin.__dict__["_ps_build_lock"] is not lock
    np.testing.assert_allclose(twin(x), layer(x))
    assert [v.name for v in layer.variables] != [v.name for v in twin.variables]
    assert "_ps_build_lock" not in {
        p.split("/")[0] for p in ps.Checkpoint(m=layer).variables_by_path()
    }
