"""LoRA on Dense and Embedding (against Keras 3's enable_lora given the same weights),
ps.nn.enable_lora / merge_lora over models and Repeat's stacked blocks, training,
checkpoints, and the bad inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _layers import f32, random_source

import paramstore as ps

rand = random_source(5)


def snapshot(module):
    return {v.name: (v.numpy().copy(), v.trainable) for v in module.variables}


# ------------------------------------------------------------------ against Keras 3


@pytest.mark.tf
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_dense_lora_matches_keras(keras, policy):
    x = rand(3, 6)
    theirs = keras.layers.Dense(5, activation="relu", dtype=policy)
    theirs(x)
    theirs.enable_lora(3, lora_alpha=6.0)
    ours = ps.nn.Dense(5, activation="relu", dtype=policy)
    ours(x)
    ours.enable_lora(3, lora_alpha=6.0)
    pairs = [
        (theirs._kernel, ours.kernel),
        (theirs.bias, ours.bias),
        (theirs.lora_kernel_a, ours.lora_kernel_a),
        (theirs.lora_kernel_b, ours.lora_kernel_b),
    ]
    for k, p in pairs:
        assert tuple(k.shape) == p.shape and k.trainable == p.trainable
        value = rand(*p.shape) * 0.5
        k.assign(value)
        p.assign(value)
    assert ours.lora_kernel_a.dtype == jnp.float32  # float32 whatever the policy, as Keras
    tol = 1e-5 if policy == "float32" else 4e-2
    want = np.asarray(theirs(x)).astype(np.float32)
    np.testing.assert_allclose(f32(ours(x)), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(f32(ps.function(ours)(x)), want, rtol=tol, atol=tol)
    names = {v.name.rsplit("/", 1)[1] for v in ours.trainable_variables}
    assert names == {"bias", "lora_kernel_a", "lora_kernel_b"}


@pytest.mark.tf
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_embedding_lora_matches_keras(keras, policy):
    ids = np.array([[0, 4, 2], [3, 3, 1]], np.int32)
    theirs = keras.layers.Embedding(5, 4, dtype=policy, lora_rank=2)
    theirs(ids)
    ours = ps.nn.Embedding(5, 4, dtype=policy, lora_rank=2)
    ours(ids)
    assert ours.lora_enabled and not ours.embeddings.trainable
    for k, p in [
        (theirs._embeddings, ours.embeddings),
        (theirs.lora_embeddings_a, ours.lora_embeddings_a),
        (theirs.lora_embeddings_b, ours.lora_embeddings_b),
    ]:
        assert tuple(k.shape) == p.shape
        value = rand(*p.shape)
        k.assign(value)
        p.assign(value)
    tol = 1e-6 if policy == "float32" else 2e-3
    want = np.asarray(theirs(ids)).astype(np.float32)
    got = ours(ids)
    assert got.dtype == jnp.dtype(ps.mixed_precision.Policy(policy).compute_dtype)
    np.testing.assert_allclose(f32(got), want, rtol=tol, atol=tol)


def test_defaults_as_keras():
    dense = ps.nn.Dense(3)
    dense(np.ones((1, 4), np.float32))
    y = dense(np.ones((1, 4), np.float32))
    dense.enable_lora(2)
    assert dense.lora_alpha == 2.0 and dense.lora_rank == 2
    assert dense.lora_kernel_a.shape == (4, 2) and dense.lora_kernel_b.shape == (2, 3)
    assert not np.any(dense.lora_kernel_b.numpy())  # b zeros: the output is unchanged
    assert np.any(dense.lora_kernel_a.numpy())
    np.testing.assert_array_equal(dense(np.ones((1, 4), np.float32)), y)
    assert dense.lora_kernel_a.name == "dense/lora_kernel_a"


# ------------------------------------------------------------------ models and Repeat


class Block(ps.Module):
    def __init__(self):
        self.attn_in = ps.nn.Dense(8, name="attn_in")
        self.mlp = ps.nn.Dense(8, name="mlp")

    def __call__(self, x):
        return x + self.mlp(jnp.tanh(self.attn_in(x)))


class Model(ps.Module):
    def __init__(self):
        self.embed = ps.nn.Embedding(10, 8)
        self.blocks = ps.nn.Repeat(Block, 3)
        self.conv = ps.nn.Conv1D(8, 1)
        self.head = ps.nn.Dense(2, name="head")

    def __call__(self, ids):
        return self.head(self.conv(self.blocks(self.embed(ids))))


IDS = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32)


def test_enable_lora_over_a_model_with_repeat_then_train_and_merge():
    model = Model()
    before = model(IDS)
    changed = ps.nn.enable_lora(model, 4, where=r"attn_in|head")
    assert sorted(c.scope_name for c in changed) == ["model/head", "model/repeat/block/attn_in"]
    stacked = model.blocks.stacked
    assert stacked["attn_in/lora_kernel_a"].shape == (3, 8, 4)
    assert stacked["attn_in/lora_kernel_b"].shape == (3, 4, 8)
    assert not stacked["attn_in/kernel"].trainable and stacked["mlp/kernel"].trainable
    a = stacked["attn_in/lora_kernel_a"].numpy()
    assert not np.allclose(a[0], a[1])  # each block draws its own a
    np.testing.assert_allclose(model(IDS), before, rtol=1e-6, atol=1e-6)  # b is zeros
    assert not model.head.kernel.trainable and not model.embed.lora_enabled

    frozen = {v.name: v.numpy().copy() for v in model.variables if not v.trainable}
    opt = ps.Optimizer(optax.adam(1e-2), model)

    @ps.function
    def step():
        loss, grads = ps.value_and_grad(lambda: jnp.mean(model(IDS) ** 2), model)()
        opt.apply_gradients(grads)
        return loss

    losses = [float(step()) for _ in range(3)]
    assert losses[-1] < losses[0]
    for v in model.variables:
        if v.name in frozen:
            np.testing.assert_array_equal(v.numpy(), frozen[v.name])
    assert np.any(stacked["attn_in/lora_kernel_b"].numpy())

    trained = model(IDS)
    merged = ps.nn.merge_lora(model)
    assert len(merged) == 2
    assert not any("lora" in v.name for v in model.variables)
    assert model.head.kernel.trainable and model.blocks.stacked["attn_in/kernel"].trainable
    np.testing.assert_allclose(model(IDS), trained, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ps.function(model)(IDS), trained, rtol=1e-5, atol=1e-5)


def test_checkpoint_after_enable_lora(tmp_path):
    model = Model()
    model(IDS)
    ps.nn.enable_lora(model, 2)
    for v in model.variables:
        if "lora_kernel_b" in v.name or "lora_embeddings_b" in v.name:
            v.assign(np.full(v.shape, 0.01, np.float32))
    want = model(IDS)
    ckpt = ps.Checkpoint(model=model)
    path = ckpt.save(str(tmp_path / "ckpt"))
    keys = {name for name, _, _ in ps.checkpoint.list_variables(path)}
    assert "model/head/lora_kernel_a" in keys
    assert "model/blocks/stacked/attn_in/lora_kernel_b" in keys
    assert "model/embed/lora_embeddings_a" in keys
    saver_path = ps.Saver(model).save(str(tmp_path / "saver"))
    for v in model.variables:
        v.assign(jnp.zeros(v.shape, v.dtype))
    ckpt.restore(path).assert_consumed()
    np.testing.assert_allclose(model(IDS), want, rtol=1e-6)
    for v in model.variables:
        v.assign(jnp.zeros(v.shape, v.dtype))
    ps.Saver(model).restore(saver_path)
    np.testing.assert_allclose(model(IDS), want, rtol=1e-6)


def test_lora_rank_constructor_argument_in_a_repeat_block():
    rep = ps.nn.Repeat(lambda: ps.nn.Dense(4, lora_rank=2, lora_alpha=4.0), 2)
    rep(np.ones((1, 4), np.float32))
    assert rep.stacked["lora_kernel_a"].shape == (2, 4, 2)
    assert not rep.stacked["kernel"].trainable


# ------------------------------------------------------------------ bad input


def test_enable_twice_unbuilt_bad_rank_change_nothing(fresh_store):
    dense = ps.nn.Dense(3, name="proj")
    with pytest.raises(ValueError, match=r"Dense 'proj' is not built yet.*call the layer"):
        dense.enable_lora(2)
    assert not fresh_store.variables() and not dense.lora_enabled
    dense(np.ones((1, 2), np.float32))
    for rank in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"Dense 'proj'.*rank must be an int >= 1"):
            dense.enable_lora(rank)
    with pytest.raises(ValueError, match=r"lora_alpha must be a positive number"):
        dense.enable_lora(2, lora_alpha=0)
    before = snapshot(dense)
    assert set(before) == {"proj/kernel", "proj/bias"}
    dense.enable_lora(2)
    after = snapshot(dense)
    with pytest.raises(ValueError, match=r"Dense 'proj' has LoRA enabled already.*merge_lora"):
        dense.enable_lora(4)
    assert snapshot(dense).keys() == after.keys()
    with pytest.raises(ValueError, match=r"Dense: the LoRA rank must be"):
        ps.nn.Dense(3, lora_rank=0)
    with pytest.raises(ValueError, match=r"needs lora_rank"):
        ps.nn.Dense(3, lora_alpha=2.0)


def test_merge_without_lora_names_the_layer():
    emb = ps.nn.Embedding(4, 2, name="tokens")
    emb(np.array([1], np.int32))
    with pytest.raises(ValueError, match=r"Embedding 'tokens' has no LoRA to merge"):
        emb.merge_lora()
    with pytest.raises(ValueError, match=r"no layer of Embedding 'tokens' has LoRA"):
        ps.nn.merge_lora(emb)


def test_enable_lora_over_modules_bad_input_changes_nothing():
    conv = ps.nn.Conv1D(2, 1, name="c")
    with pytest.raises(TypeError, match=r"Conv1D 'c' has no layer with LoRA.*Dense"):
        ps.nn.enable_lora(conv, 2)
    model = Model()
    with pytest.raises(ValueError, match=r"Repeat 'model/repeat'.*not built"):
        ps.nn.enable_lora(model, 2, where="attn_in")
    model(IDS)
    before = snapshot(model)
    with pytest.raises(
        ValueError, match=r"no Dense, Embedding or attention projection .* where='nothing'.*head"
    ):
        ps.nn.enable_lora(model, 2, where="nothing")
    with pytest.raises(TypeError, match=r"where must be a regular expression"):
        ps.nn.enable_lora(model, 2, where=ps.nn.Dense)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank must be an int >= 1"):
        ps.nn.enable_lora(model, 0)
    model.head.enable_lora(2)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"Dense 'model/head' has LoRA enabled already"):
        ps.nn.enable_lora(model, 2)  # checked before the others change
    assert snapshot(model).keys() == before.keys()
    assert not model.embed.lora_enabled


def test_merge_lora_in_a_repeat_keeps_frozen_kernels_frozen():
    # Regression (issue 35): merge_lora gave the stacked kernel the template's flag, so a
    # frozen kernel inside a Repeat became trainable again (a plain Dense stayed frozen).
    model = Model()
    model(IDS)
    for v in model.variables:
        v.trainable = False
    ps.nn.enable_lora(model, 2, where=r"attn_in|mlp|head")
    assert all("lora" in v.name for v in model.trainable_variables)
    ps.nn.merge_lora(model)
    assert [v.name for v in model.variables if v.trainable] == []


def test_a_function_traced_before_enable_lora_computes_with_the_adapters():
    # Regression (issue 35): it kept its program, computing without the adapters.
    model = Model()
    model(IDS)
    model.trainable = False  # frozen before: enable_lora changes no trainable flag
    loss = ps.function(lambda: jnp.mean(model(IDS) ** 2))
    before = float(loss())
    ps.nn.enable_lora(model, 2, where=r"head")
    model.head.lora_kernel_b.assign(np.full(model.head.lora_kernel_b.shape, 0.5, np.float32))
    eager = float(jnp.mean(model(IDS) ** 2))
    assert abs(eager - before) > 1e-3
    assert float(loss()) == pytest.approx(eager, rel=1e-5)
