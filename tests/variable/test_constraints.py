"""ps.regularizers, ps.constraints, ``constraint=``/``regularizer=`` on variables and layers,
ps.regularization_loss, and optimizers applying constraints; Keras 3 is the oracle."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import paramstore as ps

RNG = np.random.default_rng(0)
W = RNG.standard_normal((5, 3)).astype(np.float32) * 2
X = jnp.asarray(RNG.standard_normal((4, 5)).astype(np.float32))

REGULARIZERS = [
    ("L1", {"l1": 0.3}),
    ("L2", {"l2": 0.2}),
    ("L1L2", {"l1": 0.1, "l2": 0.05}),
    ("L1", {}),
    ("L2", {}),
    ("L1L2", {}),
]
CONSTRAINTS = [
    ("NonNeg", {}),
    ("MaxNorm", {}),
    ("MaxNorm", {"max_value": 1.5, "axis": 1}),
    ("UnitNorm", {}),
    ("UnitNorm", {"axis": [0, 1]}),
    ("MinMaxNorm", {}),
    ("MinMaxNorm", {"min_value": 0.5, "max_value": 2.0, "rate": 0.5, "axis": 1}),
]


@pytest.mark.parametrize(("cls", "kwargs"), REGULARIZERS)
def test_regularizers_equal_keras(keras, cls, kwargs):
    ours = getattr(ps.regularizers, cls)(**kwargs)
    theirs = getattr(keras.regularizers, cls)(**kwargs)
    np.testing.assert_allclose(ours(W), np.asarray(theirs(W)), rtol=1e-6)
    assert ours.get_config() == pytest.approx(theirs.get_config())
    assert keras.regularizers.deserialize(ps.regularizers.serialize(ours)).get_config() == (
        pytest.approx(ours.get_config())
    )


@pytest.mark.parametrize("name", ["l1", "l2", "L1", "L2", "l1l2", "L1L2"])
def test_regularizer_names_equal_keras(keras, name):
    ours, theirs = ps.regularizers.get(name), keras.regularizers.get(name)
    np.testing.assert_allclose(ours(W), np.asarray(theirs(W)), rtol=1e-6)


def test_l1_l2_by_name_uses_the_documented_defaults():
    assert ps.regularizers.get("l1_l2").get_config() == {"l1": 0.01, "l2": 0.01}


@pytest.mark.parametrize(("cls", "kwargs"), CONSTRAINTS)
def test_constraints_equal_keras(keras, cls, kwargs):
    ours = getattr(ps.constraints, cls)(**kwargs)
    theirs = getattr(keras.constraints, cls)(**kwargs)
    np.testing.assert_allclose(ours(W), np.asarray(theirs(W)), rtol=1e-6, atol=1e-7)
    assert ours.get_config() == theirs.get_config()
    config = ps.constraints.serialize(ours)
    assert keras.constraints.deserialize(config).get_config() == theirs.get_config()
    assert ps.constraints.deserialize(config).get_config() == ours.get_config()


@pytest.mark.parametrize("name", ["non_neg", "max_norm", "unit_norm", "min_max_norm"])
def test_constraint_names_equal_keras(keras, name):
    ours, theirs = ps.constraints.get(name), keras.constraints.get(name)
    np.testing.assert_allclose(ours(W), np.asarray(theirs(W)), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("get", [ps.regularizers.get, ps.constraints.get])
@pytest.mark.parametrize("bad", ["l3", 3, {"class_name": "Nope", "config": {}}])
def test_unknown_identifiers_are_clear_errors(get, bad):
    with pytest.raises(ValueError, match=r"(Unknown|could not interpret)"):
        get(bad)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "x", True])
def test_bad_factors_are_keras_errors(bad):
    with pytest.raises(ValueError, match="Invalid value for argument l2"):
        ps.regularizers.L2(bad)


def test_layers_take_keras_names_and_objects_and_the_loss_equals_keras(keras):
    dense = ps.nn.Dense(
        3,
        kernel_regularizer="l2",
        bias_regularizer=ps.regularizers.L1(0.5),
        kernel_constraint="max_norm",
        bias_constraint=ps.constraints.NonNeg(),
    )
    dense(X)
    ref = keras.layers.Dense(
        3, kernel_regularizer="l2", bias_regularizer=keras.regularizers.L1(0.5)
    )
    ref.build((None, 5))
    ref.set_weights([dense.kernel.numpy(), dense.bias.numpy() + 1.0])
    dense.bias.assign(dense.bias + 1.0)
    keras_loss = sum(float(x) for x in ref.losses)
    np.testing.assert_allclose(ps.regularization_loss(dense), keras_loss, rtol=1e-6)
    assert isinstance(dense.kernel_constraint, ps.constraints.MaxNorm)
    assert isinstance(dense.kernel.constraint, ps.constraints.MaxNorm)
    assert isinstance(dense.bias.constraint, ps.constraints.NonNeg)


@pytest.mark.parametrize(
    ("make", "weight"),
    [
        (lambda **k: ps.nn.Conv1D(2, 2, **k), "kernel"),
        (lambda **k: ps.nn.Conv2D(2, 2, **k), "kernel"),
        (lambda **k: ps.nn.MultiHeadAttention(2, 4, **k), "kernel"),
    ],
)
def test_every_layer_with_a_kernel_takes_the_arguments(make, weight):
    layer = make(kernel_regularizer="l1", bias_constraint="non_neg")
    x = jnp.ones((2, 6, 6, 3)) if isinstance(layer, ps.nn.Conv2D) else jnp.ones((2, 6, 3))
    layer(x, x) if isinstance(layer, ps.nn.MultiHeadAttention) else layer(x)
    kernels = [v for v in layer.variables if v.name.endswith("kernel")]
    biases = [v for v in layer.variables if v.name.endswith("bias")]
    assert kernels and all(isinstance(v.regularizer, ps.regularizers.L1) for v in kernels)
    assert biases and all(isinstance(v.constraint, ps.constraints.NonNeg) for v in biases)
    expected = sum(0.01 * np.abs(v.numpy()).sum() for v in kernels)
    np.testing.assert_allclose(ps.regularization_loss(layer), expected, rtol=1e-5)


def test_embedding_takes_embeddings_arguments():
    emb = ps.nn.Embedding(10, 4, embeddings_regularizer="l2", embeddings_constraint="unit_norm")
    emb(jnp.array([1, 2]))
    np.testing.assert_allclose(
        ps.regularization_loss(emb), 0.01 * np.square(emb.embeddings.numpy()).sum(), rtol=1e-6
    )
    assert isinstance(emb.embeddings.constraint, ps.constraints.UnitNorm)


def test_regularization_loss_of_the_store_skips_frozen_and_is_differentiable_and_compiled():
    with ps.variable_scope("tf1"):
        w = ps.get_variable("w", initializer=W, regularizer=ps.regularizers.L2(0.1))
        b = ps.get_variable("b", initializer=np.ones(3, np.float32), regularizer="l1")
        ps.get_variable("plain", [3])
    expected = 0.1 * np.square(W).sum() + 0.01 * 3
    np.testing.assert_allclose(ps.regularization_loss(), expected, rtol=1e-6)
    grads = ps.grad(lambda: ps.regularization_loss([w, b]), [w, b])()
    np.testing.assert_allclose(grads[0], 0.2 * W, rtol=1e-6)
    np.testing.assert_allclose(grads[1], np.full(3, 0.01), rtol=1e-6)
    compiled = ps.function(lambda: ps.regularization_loss())
    np.testing.assert_allclose(compiled(), expected, rtol=1e-6)
    b.trainable = False
    np.testing.assert_allclose(ps.regularization_loss(), 0.1 * np.square(W).sum(), rtol=1e-6)
    assert float(ps.regularization_loss([b])) == 0.0


def test_a_reused_get_variable_keeps_its_regularizer():
    with ps.variable_scope("s"):
        v = ps.get_variable("v", [2], regularizer="l2", constraint="non_neg")
    with ps.variable_scope("s", reuse=True):
        assert ps.get_variable("v") is v
    assert isinstance(v.regularizer, ps.regularizers.L2)
    assert isinstance(v.constraint, ps.constraints.NonNeg)


@pytest.mark.parametrize("compiled", [False, True])
def test_optimizers_apply_constraints_after_each_update_as_keras(keras, compiled):
    v = ps.Variable(W, constraint=ps.constraints.MaxNorm(1.0))
    free = ps.Variable(W)
    opt = ps.Optimizer(optax.sgd(0.5), [v, free])
    g = jnp.asarray(RNG.standard_normal(W.shape).astype(np.float32))
    step = ps.function(lambda: opt.apply_gradients([g, g])) if compiled else None
    step() if compiled else opt.apply_gradients([g, g])
    expected = keras.constraints.MaxNorm(1.0)(W - 0.5 * np.asarray(g))
    np.testing.assert_allclose(v.numpy(), np.asarray(expected), rtol=1e-6)
    np.testing.assert_allclose(free.numpy(), W - 0.5 * np.asarray(g), rtol=1e-6)


def test_a_constraint_that_changes_shape_or_dtype_is_refused_when_the_variable_is_made():
    store = ps.VariableStore()
    with store:
        kept = ps.Variable(1.0, name="kept")
    with store:
        with pytest.raises(ValueError, match=r"constraint of variable 'c'.*keep.*shape and dtype"):
            ps.Variable(W, name="c", constraint=lambda w: w.sum(0))
        with pytest.raises(ValueError, match=r"variable 'd'.*float32.*returns.*int32"):
            ps.Variable(W, name="d", constraint=lambda w: w.astype(jnp.int32))
        with (
            pytest.raises(ValueError, match=r"constraint of variable 'tf1/e'"),
            ps.variable_scope("tf1"),
        ):
            ps.get_variable("e", [2], constraint=lambda w: w[:1])
        with pytest.raises(ValueError, match=r"Dense: kernel_constraint: Unknown constraint"):
            ps.nn.Dense(2, kernel_constraint="nope")
        dense = ps.nn.Dense(2, kernel_regularizer=lambda w: w * 2)
        with pytest.raises(
            ValueError, match=r"regularizer of variable 'dense(_1)?/kernel'.*scalar"
        ):
            dense(X)
        assert store.variables() == [kept]  # nothing was created
        assert dense.variables == ()


def test_a_constraint_that_misbehaves_at_step_time_changes_nothing():
    calls = []

    def sneaky(w):  # keeps the shape while traced at creation, then changes it
        calls.append(1)
        return w if len(calls) == 1 else w[:1]

    v = ps.Variable(W, constraint=sneaky, name="sneaky")
    opt = ps.Optimizer(optax.adam(0.1), [v])
    before = [x.numpy() for x in (v, *opt.variables)]
    with pytest.raises(ValueError, match=r"constraint of variable 'sneaky'.*keep both"):
        opt.apply_gradients([jnp.ones_like(W)])
    for b, x in zip(before, (v, *opt.variables)):
        np.testing.assert_array_equal(b, x.numpy())


def test_a_regularizer_that_turns_non_scalar_later_is_an_error_naming_the_variable():
    state = {"n": 0}

    def reg(w):
        state["n"] += 1
        return jnp.sum(w) if state["n"] == 1 else w

    v = ps.Variable(W, name="r", regularizer=reg)
    with pytest.raises(ValueError, match=r"regularizer of variable 'r'.*not a scalar"):
        ps.regularization_loss([v])


def test_constraints_are_vmapped_over_repeat_blocks():
    block = ps.nn.Repeat(lambda: ps.nn.Dense(5, kernel_constraint=ps.constraints.UnitNorm()), 3)
    block(X)
    kernel = block.variables[-1] if block.variables[-1].ndim == 3 else block.variables[0]
    assert kernel.ndim == 3
    opt = ps.Optimizer(optax.sgd(1.0), block)
    opt.apply_gradients(ps.grad(lambda: jnp.sum(block(X) ** 2), block)())
    np.testing.assert_allclose(np.linalg.norm(kernel.numpy(), axis=1), 1.0, rtol=1e-5)
