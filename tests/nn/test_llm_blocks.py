"""RMSNormalization, GroupQueryAttention (against Keras 3 given the same weights),
RotaryEmbedding (against transformers' Llama apply_rotary_pos_emb), and their bad inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _layers import f32, random_source

import paramstore as ps
from tests._lazy import lazy

torch = lazy("torch")
llama = lazy("transformers.models.llama.modeling_llama")

RNG = np.random.default_rng(11)
rand = random_source(RNG)


# ------------------------------------------------------------------ RMSNormalization


@pytest.mark.tf
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_rms_normalization_matches_keras(keras, policy):
    x = rand(2, 3, 8) * 3
    theirs = keras.layers.RMSNormalization(epsilon=1e-5, dtype=policy)
    theirs(x)
    ours = ps.nn.RMSNormalization(epsilon=1e-5, dtype=policy)
    ours(x)
    assert [v.name for v in ours.variables] == ["rms_normalization/scale"]
    assert ours.scale.shape == (8,) and np.all(ours.scale.numpy() == 1)
    scale = rand(8)
    theirs.scale.assign(scale)
    ours.scale.assign(scale)
    want = np.asarray(theirs(x)).astype(np.float32)
    got = ours(x)
    assert got.dtype == jnp.dtype(ours.compute_dtype)
    tol = 1e-6 if policy == "float32" else 1e-2
    np.testing.assert_allclose(f32(got), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(f32(ps.function(ours)(x)), want, rtol=tol, atol=tol)


@pytest.mark.torch  # transformers' Llama, in torch, is the oracle
def test_rms_normalization_matches_llama_rmsnorm():
    x = rand(2, 5, 6)
    theirs = llama.LlamaRMSNorm(6, eps=1e-5)
    w = rand(6)
    with torch.no_grad():
        theirs.weight.copy_(torch.from_numpy(w))
        want = theirs(torch.from_numpy(x)).numpy()
    ours = ps.nn.RMSNormalization(epsilon=1e-5)
    ours(x)
    ours.scale.assign(w)
    np.testing.assert_allclose(np.asarray(ours(x)), want, rtol=1e-6, atol=1e-6)


def test_rms_normalization_other_axis():
    x = rand(2, 4, 3)
    ours = ps.nn.RMSNormalization(axis=1)
    ours(x)
    assert ours.scale.shape == (4,)
    s = rand(4)
    ours.scale.assign(s)
    want = x / np.sqrt(np.mean(x**2, axis=1, keepdims=True) + 1e-6) * s[None, :, None]
    np.testing.assert_allclose(np.asarray(ours(x)), want, rtol=1e-5, atol=1e-6)


def test_rms_normalization_bad_inputs():
    with pytest.raises(ValueError, match="epsilon must be a positive number"):
        ps.nn.RMSNormalization(epsilon=0)
    with pytest.raises(TypeError, match="axis must be an int"):
        ps.nn.RMSNormalization(axis="last")
    layer = ps.nn.RMSNormalization(axis=3)
    with pytest.raises(ValueError, match=r"axis 3, but the input has shape \(2, 4\)"):
        layer(rand(2, 4))
    assert not layer.built and layer.variables == ()
    layer = ps.nn.RMSNormalization()
    layer(rand(2, 4))
    before = layer.scale.numpy().copy()
    with pytest.raises(ValueError, match=r"built for 4 features on axis -1"):
        layer(rand(2, 5))
    np.testing.assert_array_equal(layer.scale.numpy(), before)


# ------------------------------------------------------------------ RotaryEmbedding


def _hf_rope(x_bhsd, positions, theta, scaling=1.0):
    """transformers' Llama rotary embedding, applied to (batch, heads, seq, dim)."""
    d = x_bhsd.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    pos = torch.tensor(positions, dtype=torch.float32)[None] / scaling
    freqs = (inv[None, :, None] @ pos[:, None, :]).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    x = torch.from_numpy(x_bhsd)
    q, _ = llama.apply_rotary_pos_emb(x, x, emb.cos(), emb.sin())
    return q.numpy()


@pytest.mark.torch  # transformers' Llama, in torch, is the oracle
@pytest.mark.parametrize("start", [0, 7])
def test_rotary_matches_transformers(start):
    x = rand(2, 5, 3, 8)  # (batch, seq, heads, dim): sequence_axis=1, feature_axis=-1
    rope = ps.nn.RotaryEmbedding(max_wavelength=500.0)
    got = np.asarray(rope(x, start_index=start))
    want = _hf_rope(x.transpose(0, 2, 1, 3), np.arange(5) + start, 500.0).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert rope.variables == ()


@pytest.mark.torch  # transformers' Llama, in torch, is the oracle
def test_rotary_positions_scaling_and_axes():
    x = rand(1, 4, 6)
    positions = np.array([3, 1, 4, 1])
    rope = ps.nn.RotaryEmbedding(scaling_factor=2.0)
    got = np.asarray(rope(x, positions=positions))
    want = _hf_rope(x[:, None], positions, 10000.0, scaling=2.0)[:, 0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # (batch, heads, seq, dim), as transformers lays it out
    y = rand(2, 3, 5, 4)
    hf_layout = ps.nn.RotaryEmbedding(sequence_axis=2)
    np.testing.assert_allclose(
        np.asarray(hf_layout(y)), _hf_rope(y, np.arange(5), 10000.0), rtol=1e-5, atol=1e-5
    )
    # feature axis before the sequence axis: the same rotation, transposed
    z = rand(2, 4, 5)  # (batch, dim, seq)
    t = ps.nn.RotaryEmbedding(sequence_axis=2, feature_axis=1)
    want = np.asarray(ps.nn.RotaryEmbedding()(z.transpose(0, 2, 1))).transpose(0, 2, 1)
    np.testing.assert_allclose(np.asarray(t(z)), want, rtol=1e-6, atol=1e-6)


def test_rotary_bad_inputs():
    with pytest.raises(ValueError, match="max_wavelength must be a positive number"):
        ps.nn.RotaryEmbedding(max_wavelength=0)
    with pytest.raises(ValueError, match="scaling_factor must be a positive number"):
        ps.nn.RotaryEmbedding(scaling_factor=-1)
    with pytest.raises(TypeError, match="sequence_axis must be an int"):
        ps.nn.RotaryEmbedding(sequence_axis=1.0)
    rope = ps.nn.RotaryEmbedding()
    with pytest.raises(ValueError, match="must be even"):
        rope(rand(1, 3, 5))
    with pytest.raises(ValueError, match=r"positions must have shape \(seq,\) = \(3,\)"):
        rope(rand(1, 3, 4), positions=np.arange(4))
    with pytest.raises(ValueError, match="are the same axis"):
        ps.nn.RotaryEmbedding(sequence_axis=2)(rand(1, 3, 4))


# ------------------------------------------------------------------ GroupQueryAttention


def _copy_gqa(theirs, ours):
    pairs = [
        (theirs._query_dense.kernel, ours.projections["query"].kernel),
        (theirs._key_dense.kernel, ours.projections["key"].kernel),
        (theirs._value_dense.kernel, ours.projections["value"].kernel),
        (theirs._output_dense.kernel, ours.projections["attention_output"].kernel),
    ]
    if ours.use_bias:
        pairs += [
            (theirs._query_dense.bias, ours.projections["query"].bias),
            (theirs._key_dense.bias, ours.projections["key"].bias),
            (theirs._value_dense.bias, ours.projections["value"].bias),
            (theirs._output_dense.bias, ours.projections["attention_output"].bias),
        ]
    for k, p in pairs:
        assert tuple(k.shape) == p.shape, (k.path, p.name)
        value = rand(*p.shape) * 0.4
        k.assign(value)
        p.assign(value)


@pytest.mark.tf
@pytest.mark.parametrize(
    ("policy", "use_bias", "causal"),
    [("float32", True, False), ("float32", False, True), ("mixed_bfloat16", True, True)],
)
def test_group_query_attention_matches_keras(keras, policy, use_bias, causal):
    q, v = rand(2, 5, 12), rand(2, 5, 12)
    mask = RNG.random((2, 5, 5)) > 0.3
    mask[..., 0] = True
    theirs = keras.layers.GroupQueryAttention(4, 6, 2, use_bias=use_bias, dtype=policy)
    theirs(q, v)
    ours = ps.nn.GroupQueryAttention(4, 6, 2, use_bias=use_bias, dtype=policy, name="gqa")
    ours(q, v)
    names = [v.name for v in ours.weights]
    want_names = ["gqa/query/kernel", "gqa/query/bias", "gqa/key/kernel", "gqa/key/bias"]
    assert names[: 4 if use_bias else 2] == (want_names if use_bias else want_names[::2])
    assert ours.projections["query"].kernel.shape == (12, 6, 4)
    assert ours.projections["key"].kernel.shape == (12, 2, 4)
    assert ours.projections["attention_output"].kernel.shape == (6, 4, 12)
    assert len(ours.weights) == len(theirs.weights)
    _copy_gqa(theirs, ours)
    tol = 1e-5 if policy == "float32" else 5e-2
    want, want_scores = theirs(
        q, v, attention_mask=mask, use_causal_mask=causal, return_attention_scores=True
    )
    got, scores = ours(
        q, v, attention_mask=mask, use_causal_mask=causal, return_attention_scores=True
    )
    assert scores.shape == (2, 6, 5, 5)
    np.testing.assert_allclose(f32(got), np.asarray(want, np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(f32(scores), np.asarray(want_scores, np.float32), rtol=tol, atol=tol)
    plain = ps.function(lambda a, b: ours(a, b, use_causal_mask=causal))(q, v)
    np.testing.assert_allclose(
        f32(plain), np.asarray(theirs(q, v, use_causal_mask=causal), np.float32), rtol=tol, atol=tol
    )


@pytest.mark.tf
def test_group_query_attention_cross_attention_matches_keras(keras):
    q, v, k = rand(2, 3, 8), rand(2, 6, 10), rand(2, 6, 7)
    theirs = keras.layers.GroupQueryAttention(4, 4, 1)
    theirs(q, v, k)
    ours = ps.nn.GroupQueryAttention(4, 4, 1)
    ours(q, v, k)
    assert ours.projections["key"].kernel.shape == (7, 1, 4)
    assert ours.projections["value"].kernel.shape == (10, 1, 4)
    _copy_gqa(theirs, ours)
    np.testing.assert_allclose(
        np.asarray(ours(q, v, k)), np.asarray(theirs(q, v, k)), rtol=1e-5, atol=1e-5
    )


def test_group_query_attention_with_rotary_equals_rotating_by_hand():
    x = rand(1, 4, 8)
    rope = ps.nn.RotaryEmbedding()
    layer = ps.nn.GroupQueryAttention(4, 2, 1, rotary_embedding=rope, use_bias=False)
    out = layer(x, x, use_causal_mask=True)
    p = {n: pr.kernel.numpy() for n, pr in layer.projections.items()}
    q = np.asarray(rope(np.einsum("btd,dhk->bthk", x, p["query"])))
    k = np.asarray(rope(np.einsum("btd,dhk->bthk", x, p["key"])))
    v = np.einsum("btd,dhk->bthk", x, p["value"])
    k, v = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
    logits = np.einsum("bthk,bshk->bhts", q, k) / 2.0
    logits = np.where(np.tril(np.ones((4, 4), bool)), logits, -1e9)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    want = np.einsum("bhts,bshk,hkd->btd", w, v, p["attention_output"])
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    # positions given to queries and keys alike: only their differences count
    plain = np.asarray(layer(x, x))
    shifted = np.asarray(layer(x, x, positions=np.arange(3, 7)))
    np.testing.assert_allclose(shifted, plain, rtol=1e-4, atol=1e-5)
    spread = np.asarray(layer(x, x, positions=np.array([0, 2, 4, 6])))
    assert np.abs(spread - plain).max() > 1e-3


def test_group_query_attention_bad_inputs():
    with pytest.raises(ValueError, match=r"num_query_heads \(6\) must be a multiple of"):
        ps.nn.GroupQueryAttention(4, 6, 4)
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        ps.nn.GroupQueryAttention(0, 2, 1)
    with pytest.raises(TypeError, match="rotary_embedding must be a ps.nn.RotaryEmbedding"):
        ps.nn.GroupQueryAttention(4, 2, 1, rotary_embedding=lambda x: x)
    layer = ps.nn.GroupQueryAttention(4, 2, 1)
    with pytest.raises(ValueError, match="expects a 3-D query"):
        layer(rand(2, 8), rand(2, 8))
    assert not layer.built and layer.variables == ()
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 4, 3\)"):
        layer(rand(2, 4, 8), rand(2, 4, 8), attention_mask=np.ones((2, 4, 3), bool))
    assert not layer.built
    layer(rand(2, 4, 8), rand(2, 4, 8))
    with pytest.raises(ValueError, match="was built for query, key and value feature sizes"):
        layer(rand(2, 4, 6), rand(2, 4, 6))


# ------------------------------------------------------------------ custom layers


class _Scale(ps.nn.Layer):
    variable_names = ("w",)

    def build(self, input_shape):
        self.w = self.add_weight("w", (input_shape[-1],), ps.initializers.ones())

    def __call__(self, x):  # forgets self.ensure_built(x.shape)
        return x * self.w.value()


class _NoBuild(ps.nn.Layer):
    def __call__(self, x):
        return x * self.w


def test_a_custom_layer_that_forgets_to_build_says_what_to_add():
    # Regression: the error said "call the layer on an input", which the user had done.
    layer = _Scale()
    with pytest.raises(AttributeError, match=r"_Scale '__scale' reads 'w' in its __call__") as e:
        layer(rand(2, 3))
    assert "self.ensure_built(x.shape) at the top of _Scale.__call__" in str(e.value)
    assert "call the layer on an input" not in str(e.value)
    assert not layer.built and layer.variables == ()
    with pytest.raises(AttributeError, match=r"define _NoBuild.build\(input_shape\)"):
        _NoBuild()(rand(2, 3))
    # read from outside, before any call: the usual advice
    with pytest.raises(AttributeError, match="call the layer on an input"):
        _Scale().w  # noqa: B018
    # with the line added, it builds on the first call
    fixed = type(
        "Fixed",
        (_Scale,),
        {"__call__": lambda self, x: (self.ensure_built(x.shape), x * self.w.value())[1]},
    )()
    np.testing.assert_array_equal(np.asarray(fixed(np.ones((2, 3), np.float32))), 1.0)
    assert fixed.built
