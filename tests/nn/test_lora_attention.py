"""LoRA on the projections of MultiHeadAttention and GroupQueryAttention (against Keras 3's
EinsumDense.enable_lora), merge_lora keeping trainable flags (plain and inside a Repeat), and
a ps.function traced before enable_lora / merge_lora tracing again."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _layers import f32, random_source

import paramstore as ps

RNG = np.random.default_rng(17)
rand = random_source(RNG)


KERAS_PROJ = {
    "query": "_query_dense",
    "key": "_key_dense",
    "value": "_value_dense",
    "attention_output": "_output_dense",
}


@pytest.mark.tf
@pytest.mark.parametrize(
    ("kind", "policy"),
    [("mha", "float32"), ("gqa", "float32"), ("gqa", "mixed_bfloat16")],
)
def test_attention_lora_matches_keras_einsum_dense(keras, kind, policy):
    x = rand(2, 4, 8)
    if kind == "mha":
        theirs = keras.layers.MultiHeadAttention(2, 3, dtype=policy)
        ours = ps.nn.MultiHeadAttention(2, 3, dtype=policy, name="attn")
    else:
        theirs = keras.layers.GroupQueryAttention(3, 4, 2, dtype=policy)
        ours = ps.nn.GroupQueryAttention(3, 4, 2, dtype=policy, name="attn")
    theirs(x, x)
    ours(x, x)
    for attr in KERAS_PROJ.values():
        getattr(theirs, attr).enable_lora(2, lora_alpha=3.0)
    ours.enable_lora(2, lora_alpha=3.0)
    for name, attr in KERAS_PROJ.items():
        k, p = getattr(theirs, attr), ours.projections[name]
        assert p.scope_name == f"attn/{name}"
        assert p.lora_kernel_a.name == f"attn/{name}/lora_kernel_a"
        for kv, pv in [
            (k._kernel, p.kernel),
            (k.bias, p.bias),
            (k.lora_kernel_a, p.lora_kernel_a),
            (k.lora_kernel_b, p.lora_kernel_b),
        ]:
            assert tuple(kv.shape) == pv.shape and kv.trainable == pv.trainable, pv.name
            value = rand(*pv.shape) * 0.3
            kv.assign(value)
            pv.assign(value)
        assert p.lora_kernel_a.shape == p.kernel.shape[:-1] + (2,)
        assert p.lora_kernel_a.dtype == jnp.float32
    tol = 1e-5 if policy == "float32" else 5e-2
    want = np.asarray(theirs(x, x), np.float32)
    np.testing.assert_allclose(f32(ours(x, x)), want, rtol=tol, atol=tol)
    trainable = sorted(v.name.split("/", 1)[1] for v in ours.trainable_variables)
    assert all(("lora" in n) or n.endswith("bias") for n in trainable)
    assert len(trainable) == 12


def test_enable_lora_where_reaches_projections_and_merge_keeps_outputs():
    x = rand(1, 3, 8)
    layer = ps.nn.GroupQueryAttention(4, 2, 1, name="attn")
    layer(x, x)
    changed = ps.nn.enable_lora(layer, 2, where=r"attn/(query|value)$")
    assert [c.scope_name for c in changed] == ["attn/query", "attn/value"]
    assert not layer.projections["key"].lora_enabled
    for c in changed:
        c.lora_kernel_b.assign(rand(*c.lora_kernel_b.shape))
    before = np.asarray(layer(x, x))
    merged = ps.nn.merge_lora(layer)
    assert [m.scope_name for m in merged] == ["attn/query", "attn/value"]
    assert not any("lora" in v.name for v in layer.variables)
    assert all(v.trainable for v in layer.variables)
    np.testing.assert_allclose(np.asarray(layer(x, x)), before, rtol=1e-5, atol=1e-5)


class Block(ps.Module):
    def __init__(self):
        self.attn = ps.nn.GroupQueryAttention(4, 2, 1, name="attn")
        self.mlp = ps.nn.Dense(8, name="mlp")

    def __call__(self, x):
        return x + self.mlp(self.attn(x, x, use_causal_mask=True))


class Model(ps.Module):
    def __init__(self):
        self.blocks = ps.nn.Repeat(Block, 2)
        self.head = ps.nn.Dense(3, name="head")

    def __call__(self, x):
        return self.head(self.blocks(x))


X = RNG.standard_normal((2, 4, 8)).astype(np.float32)


def test_merge_lora_keeps_a_frozen_model_frozen_in_a_repeat():
    # Regression: merge_lora made the stacked kernels of a frozen model trainable again
    # (the template's flag was given to the stacked variable).
    model = Model()
    model(X)
    model.trainable = False
    flags = {v.name: v.trainable for v in model.variables}
    assert not any(flags.values())
    changed = ps.nn.enable_lora(model, 2, where=r"attn/(query|value)$|mlp|head")
    assert len(changed) == 4
    stacked = model.blocks.stacked
    assert stacked["attn/weights/query/lora_kernel_a"].shape == (2, 8, 2, 2)
    assert stacked["attn/weights/query/lora_kernel_b"].shape == (2, 2, 4)
    ps.nn.merge_lora(model)
    assert {v.name: v.trainable for v in model.variables} == flags
    assert model.trainable_variables == ()
    model.trainable = True  # the Module's freeze lifts as before: nothing stuck frozen
    assert all(v.trainable for v in model.variables)


def test_merge_lora_keeps_frozen_variables_frozen_in_a_repeat():
    # The researcher's recipe: every pretrained variable frozen one by one, LoRA trained.
    model = Model()
    model(X)
    for v in model.variables:
        v.trainable = False
    ps.nn.enable_lora(model, 2, where=r"attn/(query|value)$|mlp")
    lora = [v.name for v in model.trainable_variables]
    assert len(lora) == 6 and all("lora" in n for n in lora)
    ps.nn.merge_lora(model)
    assert not any(v.trainable for v in model.variables)


def test_merge_lora_keeps_a_frozen_kernel_frozen_and_a_trainable_one_trainable():
    model = Model()
    model(X)
    model.blocks.stacked["mlp/kernel"].trainable = False
    model.head.kernel.trainable = False
    ps.nn.enable_lora(model, 2)
    ps.nn.merge_lora(model)
    assert not model.blocks.stacked["mlp/kernel"].trainable
    assert not model.head.kernel.trainable
    assert model.blocks.stacked["attn/weights/query/kernel"].trainable


def test_lora_on_attention_in_a_repeat_trains_only_adapters():
    model = Model()
    model(X)
    for v in model.variables:
        v.trainable = False
    ps.nn.enable_lora(model, 2, where=r"attn")
    frozen = {v.name: v.numpy().copy() for v in model.variables if "lora" not in v.name}
    opt = ps.Optimizer(optax.adam(1e-2), model)

    @ps.function
    def step():
        loss, grads = ps.value_and_grad(lambda: jnp.mean((model(X) - 1.0) ** 2), model)()
        opt.apply_gradients(grads)
        return loss

    losses = [float(step()) for _ in range(4)]
    assert losses[-1] < losses[0]
    for v in model.variables:
        if v.name in frozen:
            np.testing.assert_array_equal(v.numpy(), frozen[v.name])
    trained = np.asarray(model(X))
    ps.nn.merge_lora(model)
    np.testing.assert_allclose(np.asarray(model(X)), trained, rtol=1e-5, atol=1e-5)


def test_a_function_traced_before_enable_lora_traces_again():
    # Regression: a ps.function traced before enable_lora on a frozen model kept its
    # program and computed without the adapters.
    model = Model()
    model(X)
    model.trainable = False
    loss = ps.function(lambda: jnp.mean(model(X) ** 2))
    before = float(loss())
    assert len(ps.nn.enable_lora(model, 2, where=r"mlp|head")) == 2
    for v in model.variables:
        if "lora_kernel_b" in v.name:
            v.assign(np.full(v.shape, 0.5, np.float32))
    with_lora = float(jnp.mean(model(X) ** 2))  # eagerly, a new program
    assert abs(with_lora - before) > 1e-3
    assert float(loss()) == pytest.approx(with_lora, rel=1e-5)
    ps.nn.merge_lora(model)
    assert float(loss()) == pytest.approx(with_lora, rel=1e-5)  # merged: the same outputs
    for v in model.variables:
        if v.name.endswith("head/kernel"):
            v.assign(np.zeros(v.shape, np.float32))
    assert float(loss()) == 0.0  # and it reads the merged kernel, not a or b


def test_attention_enable_lora_errors_change_nothing():
    x = rand(1, 3, 8)
    layer = ps.nn.MultiHeadAttention(2, 4, name="attn")
    with pytest.raises(ValueError, match=r"MultiHeadAttention 'attn' is not built yet"):
        layer.enable_lora(2)
    layer(x, x)
    with pytest.raises(ValueError, match="the LoRA rank must be an int >= 1"):
        layer.enable_lora(0)
    layer.projections["key"].enable_lora(2)
    names = [v.name for v in layer.variables]
    with pytest.raises(ValueError, match=r"Projection 'attn/key' has LoRA enabled already"):
        layer.enable_lora(2)
    assert [v.name for v in layer.variables] == names
    assert not layer.projections["query"].lora_enabled
    layer.merge_lora()
    with pytest.raises(ValueError, match=r"MultiHeadAttention 'attn' has no LoRA to merge"):
        layer.merge_lora()
