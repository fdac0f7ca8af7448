"""ps.mixed_precision: Keras 3's policy names, dtype= on every ps.nn layer (against Keras 3
under the same policy and weights, eagerly and in ps.function), optimizer slots and
gradient dtypes, and the bad inputs."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import paramstore as ps
from paramstore import mixed_precision as mp

RNG = np.random.default_rng(11)
NAMES = ["float32", "float16", "bfloat16", "mixed_float16", "mixed_bfloat16"]
TOL = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 4e-2}


def rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


@pytest.fixture(autouse=True)
def float32_policy():
    """Every test starts and ends with the default global policy (ps and Keras)."""
    mp.set_global_policy("float32")
    yield
    mp.set_global_policy("float32")


@pytest.fixture
def keras_policy(keras):
    yield keras
    keras.config.set_dtype_policy("float32")


def f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


# ------------------------------------------------------------------ policies


@pytest.mark.tf
@pytest.mark.parametrize("name", NAMES)
def test_policy_matches_keras(keras, name):
    theirs = keras.mixed_precision.Policy(name)
    ours = mp.Policy(name)
    assert (ours.name, ours.compute_dtype, ours.variable_dtype) == (
        theirs.name,
        theirs.compute_dtype,
        theirs.variable_dtype,
    )
    assert ours == mp.Policy(name) and hash(ours) == hash(mp.Policy(name))
    assert name in repr(ours)


def test_global_policy_is_taken_at_construction():
    assert mp.global_policy() == mp.Policy("float32")
    mp.set_global_policy("mixed_bfloat16")
    dense = ps.nn.Dense(3)
    mp.set_global_policy(mp.Policy("float16"))
    late = ps.nn.Dense(3)
    mp.set_global_policy("float32")
    assert dense.dtype_policy.name == "mixed_bfloat16"
    assert late.dtype_policy.name == "float16"
    assert ps.nn.Dense(3).compute_dtype == "float32"
    y = dense(np.ones((2, 4), np.float32))
    assert dense.kernel.dtype == jnp.float32 and y.dtype == jnp.bfloat16


def test_unknown_policy_name_lists_the_names():
    with pytest.raises(ValueError, match=r"unknown policy name 'mixed_float64'") as e:
        mp.Policy("mixed_float64")
    for name in NAMES:
        assert repr(name) in str(e.value)
    with pytest.raises(ValueError, match="mixed_bfloat16"):
        mp.set_global_policy("bf16")
    with pytest.raises(TypeError, match="not None"):
        mp.set_global_policy(None)  # type: ignore[arg-type]
    assert mp.global_policy().name == "float32"  # nothing changed


def test_dtype_accepts_policies_names_and_float_dtypes():
    assert ps.nn.Dense(2, dtype=jnp.bfloat16).dtype_policy.name == "bfloat16"
    assert ps.nn.Dense(2, dtype=np.float16).dtype_policy.name == "float16"
    assert ps.nn.Dense(2, dtype="mixed_float16").variable_dtype == "float32"
    assert ps.nn.Dense(2, dtype=mp.Policy("mixed_bfloat16")).compute_dtype == "bfloat16"


@pytest.mark.parametrize(
    "make",
    [
        lambda d: ps.nn.Dense(2, dtype=d),
        lambda d: ps.nn.Conv2D(2, 3, dtype=d),
        lambda d: ps.nn.Embedding(4, 2, dtype=d),
        lambda d: ps.nn.LayerNormalization(dtype=d),
        lambda d: ps.nn.MultiHeadAttention(2, 2, dtype=d),
        lambda d: ps.nn.Repeat(lambda: ps.nn.Dense(2), 2, dtype=d),
    ],
)
@pytest.mark.parametrize("bad", ["int32", jnp.int8, bool, "uint8"])
def test_non_floating_dtype_names_the_layer(make, bad, fresh_store):
    with pytest.raises(ValueError, match=r"is not a floating dtype") as e:
        make(bad)
    msg = str(e.value)
    assert re.search(
        r"(Dense|Conv2D|Embedding|LayerNormalization|MultiHeadAttention|Repeat) '", msg
    )
    assert "mixed_bfloat16" in msg  # how to fix it
    assert not fresh_store.variables()


def test_unsupported_float_and_garbage_dtype():
    with pytest.raises(ValueError, match=r"Dense 'dense.*float64.*supported policies"):
        ps.nn.Dense(2, dtype="float64")
    with pytest.raises(ValueError, match=r"neither a policy nor a dtype"):
        ps.nn.Dense(2, dtype=object())


# ------------------------------------------------------------------ against Keras 3

D = 6


def _layers(k, policy):
    """Makers of (ps layer, keras layer, input) for each layer kind under ``policy``."""
    x3 = rand(2, 5, D)
    img = rand(2, 6, 6, 3)
    return {
        "dense": lambda: (
            ps.nn.Dense(4, activation="gelu", dtype=policy),
            k.layers.Dense(4, activation="gelu", dtype=policy),
            rand(3, D),
        ),
        "conv1d": lambda: (
            ps.nn.Conv1D(4, 3, dtype=policy),
            k.layers.Conv1D(4, 3, dtype=policy),
            x3,
        ),
        "conv2d": lambda: (
            ps.nn.Conv2D(4, 3, padding="same", dtype=policy),
            k.layers.Conv2D(4, 3, padding="same", dtype=policy),
            img,
        ),
        "embedding": lambda: (
            ps.nn.Embedding(7, 4, dtype=policy),
            k.layers.Embedding(7, 4, dtype=policy),
            np.array([[1, 6, 0], [3, 3, 2]], np.int32),
        ),
        "layer_norm": lambda: (
            ps.nn.LayerNormalization(dtype=policy),
            k.layers.LayerNormalization(dtype=policy),
            rand(2, 5, D, scale=3.0) + 2.0,
        ),
        "batch_norm": lambda: (
            ps.nn.BatchNormalization(dtype=policy),
            k.layers.BatchNormalization(dtype=policy),
            rand(4, D, scale=3.0) + 1.0,
        ),
        "attention": lambda: (
            ps.nn.MultiHeadAttention(2, 3, dtype=policy),
            k.layers.MultiHeadAttention(2, 3, dtype=policy),
            x3,
        ),
        "max_pool": lambda: (
            ps.nn.MaxPooling2D(dtype=policy),
            k.layers.MaxPooling2D(dtype=policy),
            img,
        ),
        "avg_pool": lambda: (
            ps.nn.AveragePooling2D(dtype=policy),
            k.layers.AveragePooling2D(2, dtype=policy),
            img,
        ),
        "global_pool": lambda: (
            ps.nn.GlobalAveragePooling2D(dtype=policy),
            k.layers.GlobalAveragePooling2D(dtype=policy),
            img,
        ),
        "flatten": lambda: (ps.nn.Flatten(dtype=policy), k.layers.Flatten(dtype=policy), img),
        "dropout": lambda: (
            ps.nn.Dropout(0.5, dtype=policy),
            k.layers.Dropout(0.5, dtype=policy),
            x3,
        ),
    }


def _call(layer, x, **kw):
    if isinstance(layer, ps.nn.MultiHeadAttention) or "MultiHeadAttention" in type(layer).__name__:
        return layer(x, x, **kw)
    return layer(x, **kw)


def _copy_weights(ours, theirs):
    """Random Keras weights (in its variable dtype), copied into ours in the same order."""
    if not theirs.weights:
        return
    fresh = []
    for w in theirs.weights:
        v = RNG.uniform(0.5, 1.5, w.shape) if "variance" in w.path else rand(*w.shape) * 0.5
        fresh.append(np.asarray(v, np.float32))
    theirs.set_weights(fresh)
    if isinstance(ours, ps.nn.MultiHeadAttention):
        order = [
            ours._kernels[f"{s}/{p}"]
            for s in ("query", "key", "value", "attention_output")
            for p in ("kernel", "bias")
        ]
    else:
        names = {
            "Dense": ("kernel", "bias"),
            "Conv1D": ("kernel", "bias"),
            "Conv2D": ("kernel", "bias"),
            "Embedding": ("embeddings",),
            "LayerNormalization": ("gamma", "beta"),
            "BatchNormalization": ("gamma", "beta", "moving_mean", "moving_variance"),
        }
        order = [getattr(ours, n) for n in names[type(ours).__name__]]
    for var, w in zip(order, theirs.weights, strict=True):
        assert var.shape == tuple(w.shape)
        var.assign(np.asarray(w.numpy()).astype(var.dtype))


LAYER_KINDS = [
    "dense",
    "conv1d",
    "conv2d",
    "embedding",
    "layer_norm",
    "batch_norm",
    "attention",
    "max_pool",
    "avg_pool",
    "global_pool",
    "flatten",
    "dropout",
]


CASES = [(kind, "mixed_bfloat16") for kind in LAYER_KINDS] + [
    (kind, policy)
    for kind in ("dense", "conv2d", "embedding", "layer_norm", "batch_norm", "attention")
    for policy in ("mixed_float16", "bfloat16")
]


@pytest.mark.tf
@pytest.mark.parametrize(("kind", "policy"), CASES)
def test_layer_matches_keras_under_policy(keras_policy, kind, policy):
    k = keras_policy
    ours, theirs, x = _layers(k, policy)[kind]()
    _call(theirs, x)  # build
    _call(ours, x)
    _copy_weights(ours, theirs)
    pol = mp.Policy(policy)
    for v in ours.variables:
        assert v.dtype == jnp.dtype(pol.variable_dtype), v.name
    want = np.asarray(_call(theirs, x)).astype(np.float32)
    got = _call(ours, x)
    assert got.dtype == jnp.dtype(pol.compute_dtype)
    compiled = ps.function(lambda x: _call(ours, x))(x)
    assert compiled.dtype == got.dtype
    tol = TOL[pol.compute_dtype]
    np.testing.assert_allclose(f32(got), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(f32(compiled), want, rtol=tol, atol=tol)


@pytest.mark.tf
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_batch_normalization_training_matches_keras(keras_policy, policy):
    k = keras_policy
    ours, theirs, x = _layers(k, policy)["batch_norm"]()
    theirs(x)
    ours(x)
    _copy_weights(ours, theirs)
    want = np.asarray(theirs(x, training=True)).astype(np.float32)
    got = ours(x, training=True)
    tol = TOL[mp.Policy(policy).compute_dtype]
    np.testing.assert_allclose(f32(got), want, rtol=tol, atol=tol)
    assert ours.moving_mean.dtype == jnp.float32
    np.testing.assert_allclose(
        ours.moving_mean.numpy(), theirs.moving_mean.numpy(), rtol=1e-2, atol=1e-2
    )
    np.testing.assert_allclose(
        ours.moving_variance.numpy(), theirs.moving_variance.numpy(), rtol=1e-2, atol=1e-2
    )


def test_attention_softmax_and_norm_statistics_are_float32():
    """Half-precision overflow where Keras computes in float32: a LayerNormalization of
    values whose squares overflow float16, and attention logits beyond float16's range."""
    ln = ps.nn.LayerNormalization(dtype="mixed_float16")
    x = np.array([[300.0, -300.0, 250.0, -250.0]], np.float32)
    y = ln(x)
    assert y.dtype == jnp.float16 and np.isfinite(f32(y)).all()
    att = ps.nn.MultiHeadAttention(1, 4, dtype="mixed_float16")
    big = np.full((1, 3, 4), 30.0, np.float32)
    att(big, big)
    for v in att.weights:
        v.assign(jnp.full(v.shape, 3.0, v.dtype) if v.ndim == 3 else jnp.zeros(v.shape))
    out = att(big, big)
    assert out.dtype == jnp.float16 and np.isfinite(f32(out)).all()


def test_stateless_layers_keep_integer_inputs():
    assert ps.nn.Flatten(dtype="mixed_bfloat16")(np.ones((2, 2, 2), np.int32)).dtype == jnp.int32
    assert ps.nn.Dropout(0.5, dtype="bfloat16")(np.ones(3, np.int32)).dtype == jnp.int32
    assert ps.nn.Dense(2, dtype="mixed_bfloat16")(np.ones((1, 3), np.int32)).dtype == jnp.bfloat16


# ------------------------------------------------------------------ models, Repeat, training


class Block(ps.Module):
    def __init__(self):
        self.ln = ps.nn.LayerNormalization()
        self.attn = ps.nn.MultiHeadAttention(2, 4)
        self.fc = ps.nn.Dense(8)

    def __call__(self, x):
        h = self.ln(x)
        x = x + self.attn(h, h)
        return x + self.fc(x)


@pytest.mark.slow
def test_repeat_blocks_follow_the_global_policy():
    mp.set_global_policy("mixed_bfloat16")
    model = ps.nn.Sequential([ps.nn.Dense(8), ps.nn.Repeat(Block, 3), ps.nn.Dense(2)])
    mp.set_global_policy("float32")
    x = rand(2, 5, 8)
    y = model(x)
    assert y.dtype == jnp.bfloat16
    rep = model.layers[1]
    assert rep.compute_dtype == "bfloat16"
    for v in rep.variables:
        assert v.dtype == jnp.float32 and v.shape[0] == 3
    compiled = ps.function(lambda x: model(x))(x)
    np.testing.assert_allclose(f32(compiled), f32(y), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "bfloat16"])
def test_gradients_and_optimizer_slots_follow_the_variable_dtype(policy):
    model = ps.nn.Sequential(
        [
            ps.nn.Dense(8, activation="relu", dtype=policy),
            ps.nn.LayerNormalization(dtype=policy),
            ps.nn.Dense(1, dtype=policy),
        ]
    )
    x = rand(4, 3)
    model(x)
    var_dtype = jnp.dtype(mp.Policy(policy).variable_dtype)
    opt = ps.Optimizer(optax.adam(1e-2), model)
    slots = [v for v in opt.variables if v.shape and v is not opt.iterations]
    assert slots and all(v.dtype == var_dtype for v in slots)

    def loss():
        return jnp.mean(model(x).astype(jnp.float32) ** 2)

    grads = ps.grad(loss, model)()
    assert all(g.dtype == var_dtype for g in grads)

    @ps.function
    def step():
        value, g = ps.value_and_grad(loss, model)()
        opt.apply_gradients(g)
        return value

    first = float(step())
    for _ in range(5):
        last = float(step())
    assert last < first
    assert all(v.dtype == var_dtype for v in model.variables)
    assert all(v.dtype == var_dtype for v in slots)


def test_sequential_casts_its_input():
    seq = ps.nn.Sequential([lambda x: x], dtype="mixed_float16")
    assert seq(np.ones(2, np.float32)).dtype == jnp.float16
    assert seq(np.ones(2, np.int32)).dtype == jnp.int32
    assert jax.tree.leaves(seq((1, 2))) == [1, 2]
