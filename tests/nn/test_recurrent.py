"""ps.nn.LSTM, GRU and Bidirectional against Keras 3 (same inputs and weights, eagerly and in
ps.function), their defaults, the one-scan program, and their bad inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paramstore as ps

RNG = np.random.default_rng(3)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _randomize(layer):
    """Give every variable random values (the zero bias would hide bias mistakes)."""
    for v in layer.variables:
        v.assign(rand(*v.shape) * 0.5)


def _close(got, want):
    if isinstance(want, (list, tuple)):
        assert isinstance(got, list) and len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


CASES = [
    ("LSTM", {}),
    ("LSTM", {"return_sequences": True}),
    ("LSTM", {"return_state": True, "go_backwards": True}),
    ("LSTM", {"return_sequences": True, "return_state": True, "activation": "relu"}),
    ("LSTM", {"use_bias": False, "unit_forget_bias": False}),
    ("GRU", {}),
    ("GRU", {"return_sequences": True, "go_backwards": True}),
    ("GRU", {"reset_after": False, "return_state": True}),
    ("GRU", {"reset_after": False, "return_sequences": True, "recurrent_activation": "tanh"}),
    ("GRU", {"use_bias": False}),
]


@pytest.mark.tf
@pytest.mark.parametrize("kind,kw", CASES)
def test_recurrent_layers_match_keras(keras, kind, kw):
    x = rand(2, 5, 3)
    ours = getattr(ps.nn, kind)(4, **kw)
    ours.build((None, 5, 3))
    theirs = getattr(keras.layers, kind)(4, **kw)
    theirs.build((None, 5, 3))
    # Keras' variables: same names (on the layer), shapes and order.
    assert [w.path.rsplit("/", 1)[1] for w in theirs.weights] == [
        v.name.rsplit("/", 1)[1] for v in ours.weights
    ]
    assert [tuple(w.shape) for w in theirs.weights] == [v.shape for v in ours.weights]
    _randomize(ours)
    theirs.set_weights(ours.get_weights())
    want = theirs(x)
    _close(ours(x), want)
    step = ps.function(lambda x: ours(x))
    _close(step(x), want)
    _close(step(x), want)
    assert step.trace_count == 1


@pytest.mark.tf
@pytest.mark.parametrize("merge_mode", ["concat", "sum", "mul", "ave", None])
@pytest.mark.parametrize("return_sequences", [False, True])
def test_bidirectional_matches_keras(keras, merge_mode, return_sequences):
    x = rand(2, 6, 3)
    ours = ps.nn.Bidirectional(
        ps.nn.GRU(4, return_sequences=return_sequences), merge_mode=merge_mode
    )
    theirs = keras.layers.Bidirectional(
        keras.layers.GRU(4, return_sequences=return_sequences), merge_mode=merge_mode
    )
    ours.build((None, 6, 3))
    theirs.build((None, 6, 3))
    assert [v.name for v in ours.weights][:3] == [
        "bidirectional/forward_gru/kernel",
        "bidirectional/forward_gru/recurrent_kernel",
        "bidirectional/forward_gru/bias",
    ]
    _randomize(ours)
    theirs.set_weights(ours.get_weights())
    want = theirs(x)
    _close(ours(x), want)
    _close(ps.function(lambda x: ours(x))(x), want)


@pytest.mark.tf
def test_bidirectional_lstm_return_state_matches_keras(keras):
    x = rand(3, 4, 2)
    ours = ps.nn.Bidirectional(ps.nn.LSTM(5, return_state=True, return_sequences=True))
    theirs = keras.layers.Bidirectional(
        keras.layers.LSTM(5, return_state=True, return_sequences=True)
    )
    ours.build((None, 4, 2))
    theirs.build((None, 4, 2))
    _randomize(ours)
    theirs.set_weights(ours.get_weights())
    out = ours(x)
    assert len(out) == 5  # output, forward h, c, backward h, c
    _close(out, theirs(x))


@pytest.mark.tf
def test_initial_state_matches_keras(keras):
    x, h, c = rand(2, 3, 4), rand(2, 5), rand(2, 5)
    ours, theirs = ps.nn.LSTM(5), keras.layers.LSTM(5)
    ours.build((None, 3, 4))
    theirs.build((None, 3, 4))
    _randomize(ours)
    theirs.set_weights(ours.get_weights())
    _close(ours(x, initial_state=[h, c]), theirs(x, initial_state=[h, c]))


def test_defaults_are_keras():
    lstm = ps.nn.LSTM(3)
    lstm(np.zeros((1, 2, 4), np.float32))
    assert lstm.kernel.shape == (4, 12) and lstm.recurrent_kernel.shape == (3, 12)
    # unit_forget_bias: the forget gate (second quarter) starts at one, the rest at zero.
    np.testing.assert_array_equal(lstm.bias.numpy(), [0, 0, 0, 1, 1, 1] + [0] * 6)
    # orthogonal recurrent kernel: its rows are orthonormal.
    rk = lstm.recurrent_kernel.numpy()
    np.testing.assert_allclose(rk @ rk.T, np.eye(3), atol=1e-5)
    gru = ps.nn.GRU(2)
    gru(np.zeros((1, 2, 4), np.float32))
    assert gru.bias.shape == (2, 6) and gru.reset_after
    assert ps.nn.GRU(2, reset_after=False).build((None, 3, 4)) is None


def test_one_scan_whatever_the_length():
    """One trace, one scan: the program does not grow with the number of steps."""
    layer = ps.nn.LSTM(4, return_sequences=True)

    def eqns(steps):
        fn = ps.pure(lambda x: layer(x), layer)
        x = jnp.zeros((2, steps, 3))
        jaxpr = jax.make_jaxpr(fn)(ps.state(layer), x)
        return [e.primitive.name for e in jaxpr.eqns]

    layer.build((None, 4, 3))
    short, long = eqns(4), eqns(400)
    assert short == long
    assert short.count("scan") == 1


def test_trains_in_a_function():
    model = ps.nn.Sequential([ps.nn.GRU(4), ps.nn.Dense(1)])
    model.build((None, 5, 2))
    opt = ps.Optimizer(__import__("optax").adam(0.05), model.trainable_variables)
    x, y = rand(8, 5, 2), rand(8, 1)

    @ps.function
    def step():
        loss, grads = ps.value_and_grad(lambda: jnp.mean((model(x) - y) ** 2), model)()
        opt.apply_gradients(grads)
        return loss

    first = float(step())
    for _ in range(20):
        last = float(step())
    assert last < first and step.trace_count == 1


def test_output_shapes_and_sequential_build():
    assert ps.nn.LSTM(3).compute_output_shape((None, 7, 2)) == (None, 3)
    assert ps.nn.GRU(3, return_sequences=True).compute_output_shape((None, 7, 2)) == (None, 7, 3)
    bi = ps.nn.Bidirectional(ps.nn.LSTM(3, return_sequences=True))
    assert bi.compute_output_shape((None, 7, 2)) == (None, 7, 6)
    model = ps.nn.Sequential([bi, ps.nn.LSTM(2)])
    model.build((None, 7, 2))
    assert model.layers[1].kernel.shape == (6, 8)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_rank_2_input_is_refused_and_builds_nothing(kind):
    layer = getattr(ps.nn, kind)(3)
    with pytest.raises(ValueError, match=rf"{kind} '\w+' expects a 3-D input .*x\[None\]"):
        layer(np.zeros((4, 5), np.float32))
    assert not layer.built and layer.variables == ()
    bi = ps.nn.Bidirectional(layer)
    with pytest.raises(ValueError, match="expects a 3-D input"):
        bi(np.zeros((4, 5), np.float32))
    assert bi.variables == ()


def test_bad_arguments():
    with pytest.raises(ValueError, match="LSTM: units must be a positive int"):
        ps.nn.LSTM(0)
    with pytest.raises(ValueError, match="merge_mode must be one of"):
        ps.nn.Bidirectional(ps.nn.LSTM(2), merge_mode="max")
    with pytest.raises(TypeError, match="must be a ps.nn.LSTM or ps.nn.GRU"):
        ps.nn.Bidirectional(ps.nn.Dense(2))
    layer = ps.nn.LSTM(2)
    with pytest.raises(ValueError, match=r"initial_state must be 2 array\(s\) of shape \(1, 2\)"):
        layer(np.zeros((1, 3, 2), np.float32), initial_state=[np.zeros((1, 2))])


# ------------------------------------------------------------------ dtype=, regularizers, constraints


@pytest.fixture
def keras_bf16(keras):
    """Keras with its default policy restored after the test (ps layers take dtype= here)."""
    yield keras
    keras.config.set_dtype_policy("float32")


def _f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


@pytest.mark.tf
@pytest.mark.parametrize(
    "kind,kw",
    [("LSTM", {"return_sequences": True}), ("GRU", {"return_state": True}), ("GRU", {})],
)
def test_mixed_bfloat16_matches_keras(keras_bf16, kind, kw):
    x = rand(2, 3, 3)
    ours = getattr(ps.nn, kind)(4, dtype="mixed_bfloat16", **kw)
    theirs = getattr(keras_bf16.layers, kind)(4, dtype="mixed_bfloat16", **kw)
    ours.build((None, 3, 3))
    theirs.build((None, 3, 3))
    assert all(v.dtype == jnp.float32 for v in ours.variables)
    _randomize(ours)
    theirs.set_weights(ours.get_weights())
    want = theirs(x)
    for got in (ours(x), ps.function(lambda x: ours(x))(x)):
        got_l, want_l = (got, want) if isinstance(got, list) else ([got], [want])
        assert len(got_l) == len(want_l)
        for g, w in zip(got_l, want_l):
            assert g.dtype == jnp.bfloat16
            assert keras_bf16.backend.standardize_dtype(w.dtype) == "bfloat16"
            np.testing.assert_allclose(_f32(g), _f32(w), rtol=4e-2, atol=4e-2)
    # Gradients of the float32 variables are float32.
    grads = ps.grad(lambda: jnp.sum(ours(x)[0]), ours)()
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))


@pytest.mark.tf
def test_bidirectional_dtype_is_its_input_cast_only_as_keras(keras_bf16):
    """The two directions keep the wrapped layer's policy; Bidirectional's casts its input and
    the outputs it merges (not the states)."""
    x = rand(2, 3, 3)
    k = keras_bf16
    bf16 = {"dtype": "mixed_bfloat16"}
    cases = [
        (ps.nn.LSTM(4, **bf16), {}, k.layers.LSTM(4, **bf16), {}),
        (ps.nn.GRU(4, return_state=True), bf16, k.layers.GRU(4, return_state=True), bf16),
    ]
    for layer, kw, their_layer, their_kw in cases:
        ours = ps.nn.Bidirectional(layer, **kw)
        theirs = k.layers.Bidirectional(their_layer, **their_kw)
        got, want = ours(x), theirs(x)
        got, want = (got, want) if isinstance(got, list) else ([got], [want])
        assert [str(a.dtype) for a in got] == [k.backend.standardize_dtype(w.dtype) for w in want]
        assert ours.forward_layer.dtype_policy.name == theirs.forward_layer.dtype_policy.name
        assert ours.backward_layer.compute_dtype == theirs.backward_layer.compute_dtype
        assert all(v.dtype == jnp.float32 for v in ours.variables)


@pytest.mark.tf
def test_regularized_lstm_loss_equals_keras(keras):
    hooks = {
        "kernel_regularizer": "l2",
        "recurrent_regularizer": ps.regularizers.L1(0.5),
        "bias_regularizer": ps.regularizers.L1L2(l1=0.1, l2=0.2),
    }
    ours = ps.nn.LSTM(4, **hooks)
    ours.build((None, 3, 3))
    _randomize(ours)
    theirs = keras.layers.LSTM(
        4,
        kernel_regularizer="l2",
        recurrent_regularizer=keras.regularizers.L1(0.5),
        bias_regularizer=keras.regularizers.L1L2(l1=0.1, l2=0.2),
    )
    theirs.build((None, 3, 3))
    theirs.set_weights(ours.get_weights())
    want = sum(float(x) for x in theirs.losses)
    assert len(theirs.losses) == 3
    np.testing.assert_allclose(float(ps.regularization_loss(ours)), want, rtol=1e-6)
    assert isinstance(ours.recurrent_kernel.regularizer, ps.regularizers.L1)
    assert isinstance(ours.recurrent_regularizer, ps.regularizers.L1)
    # Bidirectional's copies carry the same hooks: twice the penalty of equal weights.
    bi = ps.nn.Bidirectional(ps.nn.GRU(4, **hooks))
    bi.build((None, 3, 3))
    bi.backward_layer.set_weights(bi.forward_layer.get_weights())
    one = float(ps.regularization_loss(bi.forward_layer))
    assert one > 0
    np.testing.assert_allclose(float(ps.regularization_loss(bi)), 2 * one, rtol=1e-6)


@pytest.mark.tf
def test_constraints_are_applied_by_an_optimizer_step(keras):
    layer = ps.nn.LSTM(
        4,
        kernel_constraint=ps.constraints.MaxNorm(1.0),
        recurrent_constraint="non_neg",
        bias_constraint="unit_norm",
        dtype="mixed_bfloat16",
    )
    x = rand(2, 3, 3)
    layer(x)
    _randomize(layer)
    before = [v.numpy() for v in layer.weights]  # kernel, recurrent_kernel, bias
    opt = ps.Optimizer(__import__("optax").sgd(0.5), layer.weights)
    grads = ps.grad(lambda: jnp.sum(layer(x).astype(jnp.float32) ** 2), layer.weights)()
    ps.function(lambda: opt.apply_gradients(grads))()
    k, rk, b = (w - 0.5 * np.asarray(g) for w, g in zip(before, grads))
    expected = [
        keras.constraints.MaxNorm(1.0)(k),
        keras.constraints.NonNeg()(rk),
        keras.constraints.UnitNorm()(b),
    ]
    for v, want in zip(layer.weights, expected):
        assert v.dtype == jnp.float32
        np.testing.assert_allclose(v.numpy(), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert (layer.recurrent_kernel.numpy() >= 0).all()


def test_bad_hooks_and_dtype_name_the_layer_and_create_nothing(fresh_store):
    with pytest.raises(ValueError, match=r"LSTM: recurrent_regularizer: Unknown .*'l3'.*'l2'"):
        ps.nn.LSTM(4, recurrent_regularizer="l3")
    with pytest.raises(ValueError, match=r"GRU: recurrent_constraint: "):
        ps.nn.GRU(4, recurrent_constraint="positive")
    with pytest.raises(ValueError, match=r"GRU '\w+': dtype=int32 is not a floating.*Pass"):
        ps.nn.GRU(4, dtype="int32")
    with pytest.raises(ValueError, match=r"Bidirectional '\w+': dtype=int32"):
        ps.nn.Bidirectional(ps.nn.LSTM(2), dtype="int32")
    assert list(fresh_store.variables()) == []
