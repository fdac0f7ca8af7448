"""The Keras 3 layers added to ps.nn (against Keras), the activation names, build(), unbuilt
layers, builds under threads, training= propagation, and the bad inputs of the layers."""

from __future__ import annotations

import importlib
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paramstore as ps

RNG = np.random.default_rng(7)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def snapshot(module):
    return {v.name: np.array(v.numpy()) for v in module.variables}


# ------------------------------------------------------------------ against Keras


@pytest.mark.tf
@pytest.mark.parametrize(
    "make",
    [
        lambda k: k.Flatten(),
        lambda k: k.Reshape((4, 6)),
        lambda k: k.Reshape((-1, 3)),
        lambda k: k.Activation("gelu"),
        lambda k: k.MaxPooling2D(),
        lambda k: k.MaxPooling2D((3, 3), strides=2, padding="same"),
        lambda k: k.AveragePooling2D((2, 2)),
        lambda k: k.AveragePooling2D((3, 2), strides=(2, 1), padding="same"),
        lambda k: k.AveragePooling2D(3, padding="valid"),
        lambda k: k.GlobalAveragePooling2D(),
        lambda k: k.GlobalMaxPooling2D(),
        lambda k: k.GlobalMaxPooling2D(keepdims=True),
    ],
)
def test_weightless_layers_match_keras(keras, make):
    x = rand(2, 4, 3, 2) if make(keras.layers).__class__.__name__ != "Activation" else rand(3, 5)
    theirs = make(keras.layers)
    ours = make(ps.nn)
    got = np.asarray(ours(x))
    want = np.asarray(theirs(x))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert ours.name == re.sub(r"_\d+$", "", theirs.name)  # Keras' default name


@pytest.mark.tf
@pytest.mark.parametrize("padding,strides", [("valid", 1), ("same", 2), ("valid", 3)])
def test_conv1d_matches_keras(keras, padding, strides):
    x = rand(2, 11, 3)
    layer = ps.nn.Conv1D(5, 3, strides=strides, padding=padding, activation="relu")
    layer(x)
    assert [v.name for v in layer.variables] == ["conv1d/bias", "conv1d/kernel"]
    assert layer.kernel.shape == (3, 3, 5)
    layer.bias.assign(rand(5))
    k = keras.layers.Conv1D(5, 3, strides=strides, padding=padding, activation="relu")
    k.build((None, 11, 3))
    k.set_weights([layer.kernel.numpy(), layer.bias.numpy()])
    np.testing.assert_allclose(layer(x), k(x), rtol=1e-5, atol=1e-5)


@pytest.mark.tf
def test_every_activation_name_matches_keras(keras):
    x = np.linspace(-4, 4, 18, dtype=np.float32).reshape(2, 9 * 1, 1).repeat(2, -1)
    for name, fn in ps.nn.ACTIVATIONS.items():
        want = np.asarray(keras.activations.get(name)(x))
        np.testing.assert_allclose(fn(jnp.asarray(x)), want, rtol=1e-5, atol=1e-6, err_msg=name)
    # The two the issue found: exact gelu and a leaky slope of 0.2.
    assert float(ps.nn.Activation("leaky_relu")(jnp.array(-1.0))) == pytest.approx(-0.2)
    exact = 0.5 * (1 + jax.scipy.special.erf(1.0 / np.sqrt(2.0)))
    assert float(ps.nn.Activation("gelu")(jnp.array(1.0))) == pytest.approx(float(exact))


def test_activation_names_cover_keras_where_they_need_no_arguments():
    pytest.importorskip("keras")
    names = importlib.import_module("keras.src.activations").ALL_OBJECTS_DICT  # Keras' table
    missing = set(names) - set(ps.nn.ACTIVATIONS) - {"threshold", "sparsemax"}
    assert not missing, missing


def test_gradients_flow_through_the_new_layers():
    model = ps.nn.Sequential(
        [
            ps.nn.Conv2D(3, 2, padding="same"),
            ps.nn.MaxPooling2D(),
            ps.nn.AveragePooling2D((1, 1), padding="same"),
            ps.nn.Reshape((2, 2, 3)),
            ps.nn.GlobalMaxPooling2D(keepdims=True),
            ps.nn.GlobalAveragePooling2D(),
            ps.nn.Activation("gelu"),
            ps.nn.Flatten(),
            ps.nn.Dense(1),
        ]
    )
    x = jnp.asarray(rand(2, 4, 4, 1))
    model(x)
    grads = ps.function(lambda x: ps.grad(lambda: jnp.sum(model(x)), model)())(x)
    leaves = jax.tree_util.tree_leaves(grads)
    assert len(leaves) == 4  # two kernels, two biases
    assert all(np.isfinite(np.asarray(g)).all() and float(jnp.abs(g).sum()) > 0 for g in leaves)


# ------------------------------------------------------------------------ build


def test_build_creates_what_the_first_call_would():
    called = ps.nn.Conv2D(4, 3, name="c")
    called(jnp.ones((2, 8, 8, 3)))
    built = ps.nn.Conv2D(4, 3, name="c")
    assert not built.built
    built.build((None, 8, 8, 3))
    assert built.built
    assert [(v.name.replace("c_1", "c"), v.shape) for v in built.variables] == [
        (v.name, v.shape) for v in called.variables
    ]
    assert built.scope_name == "c_1" and built.kernel.name == "c_1/kernel"
    before = snapshot(built)
    built(jnp.ones((1, 5, 5, 3)))  # the first call keeps what build made
    assert snapshot(built).keys() == before.keys()
    np.testing.assert_array_equal(built.kernel.numpy(), before["c_1/kernel"])


def test_sequential_build_builds_every_layer_from_propagated_shapes():
    model = ps.nn.Sequential(
        [
            ps.nn.Conv2D(4, 3, activation="relu"),
            ps.nn.MaxPooling2D(),
            ps.nn.Flatten(),
            ps.nn.Dense(10),
            ps.nn.BatchNormalization(),
        ]
    )
    model.build((None, 8, 8, 1))
    assert model.built and all(layer.built for layer in model.layers)
    assert model.layers[0].kernel.shape == (3, 3, 1, 4)
    assert model.layers[3].kernel.shape == (4 * 3 * 3, 10)  # 6x6 pooled to 3x3
    assert model.layers[4].moving_mean.shape == (10,)
    assert model(jnp.ones((2, 8, 8, 1))).shape == (2, 10)


def test_reading_a_variable_before_build_says_to_build():
    layer = ps.nn.Dense(3)
    with pytest.raises(AttributeError, match=r"not built yet.*call the layer.*build"):
        _ = layer.kernel
    assert not hasattr(layer, "bias") and layer.variables == ()
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = layer.nope


def test_summary_of_an_unbuilt_layer_says_not_built():
    text = ps.summary(ps.nn.Sequential([ps.nn.Dense(3)]))
    assert "not built" in text and "dense" in text
    html = ps.nn.Dense(2)._repr_html_()
    assert "not built" in html


def test_build_contradicting_a_built_layer_raises_and_changes_nothing():
    layer = ps.nn.Dense(3)
    layer.build((None, 4))
    before = snapshot(layer)
    with pytest.raises(ValueError, match=r"built for inputs whose last axis is 4.*Pass inputs"):
        layer.build((None, 5))
    with pytest.raises(ValueError, match="built for inputs whose last axis is 4"):
        layer(jnp.ones((2, 5)))
    assert snapshot(layer).keys() == before.keys()
    conv = ps.nn.Conv2D(2, 3)
    with pytest.raises(ValueError, match="4-D input"):
        conv.build((None, 5, 3))
    assert not conv.built and conv.variables == ()
    with pytest.raises(TypeError, match="expects an input shape"):
        ps.nn.Dense(2).build("x")


def test_eight_threads_first_call_build_once():
    for round_ in range(5):
        layer = ps.nn.Dense(4, name=f"d{round_}")
        x = jnp.ones((2, 3))
        outs: list = [None] * 8
        barrier = threading.Barrier(8)

        def work(i, layer=layer, barrier=barrier, outs=outs, x=x):
            barrier.wait(timeout=30)
            outs[i] = np.asarray(layer(x))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a build deadlocked"
        assert [v.name for v in layer.variables] == [f"d{round_}/bias", f"d{round_}/kernel"]
        want = np.asarray(x @ layer.kernel.value() + layer.bias.value())
        for out in outs:
            np.testing.assert_array_equal(out, want)  # every thread used the final weights


# ------------------------------------------------------------- training= travels down


class Block(ps.Module):
    def __init__(self):
        self.drop = ps.nn.Dropout(0.5)
        self.norm = ps.nn.BatchNormalization()

    def __call__(self, x, training=None):
        self.seen = training
        return self.norm(self.drop(x))  # training is not passed on by hand


class Net(ps.Module):
    def __init__(self):
        self.block = Block()

    def __call__(self, x, training=None):
        return self.block(x)


def test_training_travels_down_to_inner_layers():
    net = Net()
    x = jnp.asarray(rand(16, 4)) + 3.0
    net(x)  # builds
    before = net.block.norm.moving_mean.numpy().copy()
    net(x, training=True)
    assert net.block.seen is True
    assert not np.array_equal(net.block.norm.moving_mean.numpy(), before)  # batch stats used
    moved = net.block.norm.moving_mean.numpy().copy()
    net(x, training=False)
    assert net.block.seen is False
    np.testing.assert_array_equal(net.block.norm.moving_mean.numpy(), moved)
    net(x)  # outside any training call: the layers' own defaults
    assert net.block.seen is None


def test_an_inner_explicit_training_wins():
    class Outer(ps.Module):
        def __init__(self):
            self.drop = ps.nn.Dropout(0.9)

        def __call__(self, x, training=None):
            return self.drop(x, training=False)

    x = jnp.ones((50,))
    np.testing.assert_array_equal(Outer()(x, training=True), x)


def test_training_travels_down_inside_a_function():
    net = Net()
    x = jnp.asarray(rand(8, 4)) + 3.0
    net(x)
    f = ps.function(lambda x: net(x, training=True))
    before = net.block.norm.moving_mean.numpy().copy()
    f(x)
    assert not np.array_equal(net.block.norm.moving_mean.numpy(), before)
    g = ps.function(lambda x: net(x, training=False))
    moved = net.block.norm.moving_mean.numpy().copy()
    np.testing.assert_array_equal(g(x), g(x))
    np.testing.assert_array_equal(net.block.norm.moving_mean.numpy(), moved)


# -------------------------------------------------------------------- bad input


def test_embedding_ids_out_of_range_raise_eagerly_and_change_nothing():
    emb = ps.nn.Embedding(10, 4)
    emb(jnp.array([0, 9]))
    before = snapshot(emb)
    for bad in (10, -1):
        with pytest.raises(ValueError, match=rf"10 rows.*got id {bad}.*do not wrap"):
            emb(jnp.array([1, bad]))
    np.testing.assert_array_equal(
        snapshot(emb)["embedding/embeddings"], before["embedding/embeddings"]
    )
    fresh = ps.nn.Embedding(10, 4)
    with pytest.raises(ValueError, match="got id 10"):
        fresh(jnp.array([10]))
    assert not fresh.built  # nothing built either


def test_embedding_ids_out_of_range_inside_a_trace_give_nan_rows():
    emb = ps.nn.Embedding(10, 4)
    out = ps.function(lambda ids: emb(ids))(jnp.array([3, 10, -1]))
    np.testing.assert_array_equal(out[0], emb.embeddings.numpy()[3])
    assert np.isnan(np.asarray(out[1:])).all()  # never a wrapped or clipped row


def test_dense_refuses_complex_input():
    layer = ps.nn.Dense(2)
    with pytest.raises(TypeError, match=r"Dense 'dense.*' takes real inputs.*complex64.*jnp.real"):
        layer(jnp.ones((3, 4), jnp.complex64))
    assert not layer.built


@pytest.mark.parametrize(
    "make,shape,match",
    [
        (lambda: ps.nn.Conv2D(2, 5), (1, 3, 3, 1), r"kernel_size \(5, 5\) is larger.*'valid'"),
        (lambda: ps.nn.Conv1D(2, 5), (1, 3, 1), r"kernel_size \(5,\) is larger"),
        (lambda: ps.nn.Conv1D(2, 3), (4, 3), r"3-D input \(batch, steps, channels\)"),
        (lambda: ps.nn.MaxPooling2D((4, 4)), (1, 3, 3, 1), r"pool_size \(4, 4\) is larger"),
        (lambda: ps.nn.AveragePooling2D(), (1, 1, 6, 1), "padding='same'"),
        (lambda: ps.nn.MaxPooling2D(), (3, 4, 4), "4-D input"),
        (lambda: ps.nn.AveragePooling2D(), (4, 4), "4-D input"),
        (lambda: ps.nn.GlobalAveragePooling2D(), (2, 4, 3), "4-D input"),
        (lambda: ps.nn.GlobalMaxPooling2D(), (2, 4, 3, 1, 1), "4-D input"),
        (lambda: ps.nn.Flatten(), (), "scalar"),
        (lambda: ps.nn.Reshape((5,)), (2, 3, 4), r"12 values per example.*\(5,\)"),
        (lambda: ps.nn.Reshape((5, -1)), (2, 3, 4), "one -1 may stand"),
    ],
)
def test_wrong_inputs_to_the_new_layers(make, shape, match):
    layer = make()
    with pytest.raises(ValueError, match=match) as info:
        layer(jnp.ones(shape))
    assert type(layer).__name__ in str(info.value)
    assert layer.variables == ()
    # The same check holds inside a trace (shapes are static there).
    with pytest.raises(ValueError, match=match):
        ps.function(lambda x: layer(x))(jnp.ones(shape))


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: ps.nn.Reshape((2, -1, -1)), "at most one -1"),
        (lambda: ps.nn.Reshape((0, 3)), "positive ints"),
        (lambda: ps.nn.Reshape(3), "tuple of positive ints"),
        (lambda: ps.nn.MaxPooling2D(0), "pool_size must be"),
        (lambda: ps.nn.AveragePooling2D(padding="full"), "padding must be"),
        (lambda: ps.nn.Conv1D(0, 3), "filters must be"),
        (lambda: ps.nn.Conv1D(2, (3, 3)), "kernel_size must be a positive int"),
        (lambda: ps.nn.Activation("nope"), "unknown activation 'nope'"),
        (lambda: ps.nn.GlobalMaxPooling2D(keepdims=1), "keepdims must be a bool"),
    ],
)
def test_bad_constructor_arguments_of_the_new_layers(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_sequential_build_under_abstract_creates_abstract_variables():
    model = ps.nn.Sequential([ps.nn.Dense(16), ps.nn.LayerNormalization(), ps.nn.Dense(8)])
    with ps.abstract():
        model.build((None, 8))
    assert model.built and all(v.is_abstract for v in model.variables)
    assert model.layers[2].kernel.shape == (16, 8)


@pytest.mark.parametrize("padding,strides", [("same", 2), ("valid", 2), ("valid", 1)])
def test_conv_output_shape_without_running_matches_the_call(padding, strides):
    for layer, shape in (
        (ps.nn.Conv2D(4, 3, strides=strides, padding=padding), (1, 7, 8, 2)),
        (ps.nn.Conv1D(4, 3, strides=strides, padding=padding), (1, 9, 2)),
    ):
        got = layer(jnp.ones(shape)).shape
        assert layer.compute_output_shape((None, *shape[1:])) == (None, *got[1:])
