"""Quantized weights: layer.quantize("int8" | "int4") on Dense and Embedding against Keras 3's
(variables, integer values, scales, outputs), QLoRA against Keras' int8 + enable_lora,
ps.nn.quantize / dequantize over models and Repeat's stacked blocks, retracing, training, and
the bad inputs (nothing changed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _layers import f32, random_source, same, snapshot
from safetensors.numpy import save_file

import paramstore as ps
from paramstore.nn._quant import (
    abs_max_quantize,
    int8_matmul,
    pack_int4,
    quantize_host,
    unpack_int4,
)

rand = random_source(11)


def keras_quantize(layer, mode, keras):
    if mode == "int4":
        config = keras.quantizers.Int4QuantizationConfig(block_size=-1)
        layer.quantize("int4", config=config)
    else:
        layer.quantize(mode)


# ------------------------------------------------------------------ against Keras 3


@pytest.mark.tf
@pytest.mark.parametrize(
    "mode,policy", [("int8", "float32"), ("int8", "mixed_bfloat16"), ("int4", "float32")]
)
@pytest.mark.parametrize("units", [6, 7])  # 7: an odd axis, padded when packed
def test_dense_matches_keras(keras, mode, policy, units):
    w, b, x = rand(9, units), rand(units), rand(4, 9) * 3
    theirs = keras.layers.Dense(units, activation="relu", dtype=policy)
    theirs.build((None, 9))
    theirs.set_weights([w, b])
    keras_quantize(theirs, mode, keras)
    ours = ps.nn.Dense(units, activation="relu", dtype=policy)
    ours.build((None, 9))
    ours.kernel.assign(w)
    ours.bias.assign(b)
    ours.quantize(mode)
    assert ours.quantization_mode == mode
    assert ours.kernel.name.endswith("/kernel") and ours.kernel_scale.name.endswith("/kernel_scale")
    assert ours.kernel.dtype == jnp.int8 and ours.kernel_scale.dtype == jnp.float32
    assert ours.kernel.shape == tuple(theirs._kernel.shape)
    assert ours.kernel_scale.shape == (units,) == tuple(theirs.kernel_scale.shape)
    assert not ours.kernel.trainable and not ours.kernel_scale.trainable
    np.testing.assert_array_equal(ours.kernel.numpy(), np.asarray(theirs._kernel))  # exactly
    np.testing.assert_array_equal(ours.kernel_scale.numpy(), np.asarray(theirs.kernel_scale))
    tol = 1e-5 if policy == "float32" else 2e-2
    want = np.asarray(theirs(x)).astype(np.float32)
    np.testing.assert_allclose(f32(ours(x)), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(f32(ps.function(ours)(x)), want, rtol=tol, atol=tol)
    assert ours(x).dtype == jnp.dtype(ps.mixed_precision.Policy(policy).compute_dtype)
    assert [v.name.rsplit("/", 1)[1] for v in ours.trainable_variables] == ["bias"]


@pytest.mark.tf
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_embedding_matches_keras(keras, mode):
    e = rand(11, 5)
    ids = np.array([[0, 4, 10], [3, 3, 7]], np.int32)
    theirs = keras.layers.Embedding(11, 5)
    theirs.build()
    theirs.set_weights([e])
    keras_quantize(theirs, mode, keras)
    ours = ps.nn.Embedding(11, 5)
    ours.build(None)
    ours.embeddings.assign(e)
    ours.quantize(mode)
    assert ours.embeddings.shape == tuple(theirs._embeddings.shape)
    assert ours.embeddings_scale.shape == (11,)
    np.testing.assert_array_equal(ours.embeddings.numpy(), np.asarray(theirs._embeddings))
    np.testing.assert_array_equal(
        ours.embeddings_scale.numpy(), np.asarray(theirs.embeddings_scale)
    )
    want = np.asarray(theirs(ids))
    np.testing.assert_allclose(f32(ours(ids)), want, rtol=1e-5, atol=1e-6)


@pytest.mark.tf
def test_qlora_matches_keras(keras):
    w, b, x = rand(8, 6), rand(6), rand(3, 8)
    theirs = keras.layers.Dense(6)
    theirs.build((None, 8))
    theirs.set_weights([w, b])
    theirs.quantize("int8")
    theirs.enable_lora(2, lora_alpha=4.0)
    ours = ps.nn.Dense(6)
    ours.build((None, 8))
    ours.kernel.assign(w)
    ours.bias.assign(b)
    ours.quantize("int8")
    ours.enable_lora(2, lora_alpha=4.0)
    assert ours.lora_kernel_a.shape == (8, 2) and ours.lora_kernel_b.shape == (2, 6)
    for k, p in [(theirs.lora_kernel_a, ours.lora_kernel_a), (theirs.lora_kernel_b, ours.lora_kernel_b)]:  # fmt: skip
        value = rand(*p.shape)
        k.assign(value)
        p.assign(value)
    want = np.asarray(theirs(x))
    np.testing.assert_allclose(f32(ours(x)), want, rtol=1e-5, atol=1e-5)
    names = sorted(v.name.rsplit("/", 1)[1] for v in ours.trainable_variables)
    assert names == sorted(v.path.rsplit("/", 1)[1] for v in theirs.trainable_variables)

    e = rand(7, 4)
    ids = np.array([1, 6, 0], np.int32)
    theirs_e = keras.layers.Embedding(7, 4)
    theirs_e.build()
    theirs_e.set_weights([e])
    theirs_e.quantize("int8")
    theirs_e.enable_lora(3)
    ours_e = ps.nn.Embedding(7, 4)
    ours_e.build(None)
    ours_e.embeddings.assign(e)
    ours_e.quantize("int8")
    ours_e.enable_lora(3)
    for k, p in [(theirs_e.lora_embeddings_a, ours_e.lora_embeddings_a), (theirs_e.lora_embeddings_b, ours_e.lora_embeddings_b)]:  # fmt: skip
        value = rand(*p.shape)
        k.assign(value)
        p.assign(value)
    np.testing.assert_allclose(f32(ours_e(ids)), np.asarray(theirs_e(ids)), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the arithmetic


def test_int4_packing_is_keras_layout():
    q = np.array([[-3, 7, 2], [-8, 1, 0]], np.int8)  # Keras' pack_int4 docstring, axis=1
    packed = pack_int4(jnp.asarray(q))
    np.testing.assert_array_equal(np.asarray(packed), [[125, 2], [24, 0]])
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed, 3)), q)
    every = np.arange(-8, 8, dtype=np.int8).reshape(2, 8)
    np.testing.assert_array_equal(np.asarray(unpack_int4(pack_int4(jnp.asarray(every)), 8)), every)


def test_int8_values_and_scale_by_definition():
    w = rand(5, 3)
    q, s = abs_max_quantize(w, -2, "int8")
    scale = np.float32(127) / (np.abs(w).max(axis=0) + np.float32(1e-7))
    np.testing.assert_array_equal(np.asarray(s), scale)
    np.testing.assert_array_equal(np.asarray(q), np.clip(np.round(w * scale), -127, 127))


def test_int8_call_is_int8_matmul_with_int32_accumulation():
    dense = ps.nn.Dense(4)
    x = rand(2, 300) * 10
    dense(x)
    dense.quantize("int8")
    k, sc = dense.kernel.numpy(), dense.kernel_scale.numpy()
    text = jax.jit(int8_matmul).lower(x, k, sc).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 1 and "xi8>" in dots[0] and "xi32>" in dots[0]  # int8 in, int32 out
    xs = np.float32(127) / (np.abs(x).max(axis=-1, keepdims=True) + np.float32(1e-7))
    xq = np.clip(np.round(x * xs), -127, 127).astype(np.int32)
    acc = (xq @ dense.kernel.numpy().astype(np.int32)).astype(np.float32)
    want = acc / (dense.kernel_scale.numpy() * xs) + dense.bias.numpy()
    np.testing.assert_allclose(np.asarray(dense(x)), want, rtol=1e-6)


# ------------------------------------------------------------------ models, Repeat, retrace


class Block(ps.Module):
    def __init__(self):
        super().__init__()
        self.up = ps.nn.Dense(8, name="up")
        self.down = ps.nn.Dense(6, name="down")

    def __call__(self, x):
        return x + self.down(jax.nn.relu(self.up(x)))


class Model(ps.Module):
    def __init__(self, n=3):
        super().__init__()
        self.embed = ps.nn.Embedding(10, 6, name="embed")
        self.blocks = ps.nn.Repeat(Block, n, name="blocks")
        self.head = ps.nn.Dense(4, name="head")

    def __call__(self, ids):
        return self.head(self.blocks(self.embed(ids)))


def test_quantize_where_and_repeat_stacked_per_block():
    model = Model()
    ids = np.array([[1, 2, 3], [4, 5, 9]], np.int32)
    model(ids)
    floats = {k: v.numpy() for k, v in model.blocks.stacked.items()}
    changed = ps.nn.quantize(model, "int8", where=r"blocks|head")
    assert sorted(ly.scope_name for ly in changed) == [
        "model/blocks/block/down", "model/blocks/block/up", "model/head"
    ]  # fmt: skip
    assert model.embed.quantization_mode is None
    st = model.blocks.stacked
    assert st["up/kernel"].dtype == jnp.int8 and st["up/kernel"].shape == (3, 6, 8)
    assert st["up/kernel_scale"].shape == (3, 8) and st["up/kernel_scale"].name == (
        "model/blocks/block/up/kernel_scale"
    )
    for i in range(3):  # one scale row per block, from that block's kernel
        q, s = abs_max_quantize(floats["up/kernel"][i], -2, "int8")
        np.testing.assert_array_equal(st["up/kernel"].numpy()[i], np.asarray(q))
        np.testing.assert_array_equal(st["up/kernel_scale"].numpy()[i], np.asarray(s))
    # the output: each block with its own quantized kernels
    h = np.asarray(model.embed(ids))
    for i in range(3):

        def dense(h, name, i=i):
            k = st[f"{name}/kernel"].numpy()[i].astype(np.float32)
            sc = st[f"{name}/kernel_scale"].numpy()[i]
            hs = np.float32(127) / (np.abs(h).max(-1, keepdims=True) + np.float32(1e-7))
            hq = np.clip(np.round(h * hs), -127, 127)
            return (hq @ k) / (sc * hs) + st[f"{name}/bias"].numpy()[i]

        h = h + dense(np.maximum(dense(h, "up"), 0), "down")
    want = np.asarray(model.head(jnp.asarray(h)))
    np.testing.assert_allclose(np.asarray(model(ids)), want, rtol=2e-5, atol=2e-5)


def test_function_traced_before_quantize_retraces():
    model = Model(n=2)
    ids = np.array([[1, 2, 3]], np.int32)
    step = ps.function(lambda ids: model(ids))
    before = np.asarray(step(ids))
    ps.nn.quantize(model, "int8")
    eager = np.asarray(model(ids))
    assert not np.array_equal(eager, before)  # quantizing changed the outputs
    np.testing.assert_array_equal(np.asarray(step(ids)), eager)  # the step sees it
    ps.nn.dequantize(model)
    np.testing.assert_array_equal(np.asarray(step(ids)), np.asarray(model(ids)))


def test_dequantize_puts_back_floats_and_flags():
    model = Model(n=2)
    ids = np.array([[1, 2, 3]], np.int32)
    y0 = np.asarray(model(ids))
    model.head.kernel.trainable = False
    names = [v.name for v in model.variables]
    ps.nn.quantize(model, "int4", where="head|embed")
    ps.nn.quantize(model, "int8", where="blocks")
    q, s = model.head.kernel.numpy(), model.head.kernel_scale.numpy()
    ps.nn.dequantize(model)
    assert [v.name for v in model.variables] == names
    assert all(v.dtype == jnp.float32 for v in model.variables)
    assert not model.head.kernel.trainable and model.embed.embeddings.trainable
    assert model.blocks.stacked["up/kernel"].trainable
    np.testing.assert_array_equal(model.head.kernel.numpy(), unpack_int4(q, 4) / s)
    np.testing.assert_allclose(np.asarray(model(ids)), y0, atol=0.3)  # int4's error
    with pytest.raises(ValueError, match="no quantized layer"):
        ps.nn.dequantize(model)


def test_qlora_trains_adapters_and_bias_only():
    model = Model(n=2)
    ids = np.array([[1, 2, 3], [0, 4, 4]], np.int32)
    model(ids)
    ps.nn.quantize(model, "int8", where="blocks|head")
    ps.nn.enable_lora(model, 2, where="blocks|head")
    frozen = {v.name: v.numpy().copy() for v in model.variables if v.dtype == jnp.int8}
    opt = ps.Optimizer(optax.adam(1e-2), model.trainable_variables)

    @ps.function
    def step(ids):
        loss, grads = ps.value_and_grad(lambda: jnp.mean(model(ids) ** 2), model)()
        opt.apply_gradients(grads)
        return loss

    losses = [float(step(ids)) for _ in range(5)]
    assert losses[-1] < losses[0]
    for v in model.variables:
        if v.name in frozen:
            np.testing.assert_array_equal(v.numpy(), frozen[v.name])
    assert not any(v.name.endswith(("kernel", "kernel_scale")) for v in model.trainable_variables)


def test_merge_lora_refused_until_dequantized():
    model = Model(n=2)
    model(np.array([[1]], np.int32))
    ps.nn.quantize(model, "int8", where="blocks|head")
    ps.nn.enable_lora(model, 2, where="blocks|head")
    before = snapshot(model)
    for merge in (lambda: ps.nn.merge_lora(model), model.head.merge_lora):
        with pytest.raises(ValueError, match="is quantized.*dequantize"):
            merge()
        same(before, snapshot(model))
    ps.nn.dequantize(model)
    assert len(ps.nn.merge_lora(model)) == 3
    assert all(v.trainable for v in model.variables)


# ------------------------------------------------------------------ bad input


def test_bad_input_changes_nothing():
    model = Model(n=2)
    with pytest.raises(ValueError, match="Repeat 'model/blocks'.*not built"):
        ps.nn.quantize(model, "int8")
    dense = ps.nn.Dense(3)
    with pytest.raises(ValueError, match="Dense 'dense.*' is not built"):
        dense.quantize("int8")
    model(np.array([[1, 2]], np.int32))
    before = snapshot(model)
    with pytest.raises(ValueError, match="unknown quantization mode 'int3'.*'int8', 'int4'"):
        ps.nn.quantize(model, "int3")
    with pytest.raises(ValueError, match="unknown quantization mode 'float8'"):
        model.head.quantize("float8")
    with pytest.raises(ValueError, match=r"matches where='attn'.*model/head"):
        ps.nn.quantize(model, "int8", where="attn")
    with pytest.raises(TypeError, match="where must be a regular expression"):
        ps.nn.quantize(model, "int8", where=3)
    with pytest.raises(ValueError, match="no Dense, Embedding or attention projection"):
        ps.nn.quantize(ps.nn.Sequential([]), "int8")
    same(before, snapshot(model))
    ps.nn.quantize(model, "int8", where="head")
    before = snapshot(model)
    with pytest.raises(ValueError, match="Dense 'model/head' is quantized already"):
        ps.nn.quantize(model, "int4")  # the embedding and blocks are not changed either
    with pytest.raises(ValueError, match="quantized already"):
        model.head.quantize("int8")
    same(before, snapshot(model))
    model.embed.enable_lora(2)
    before = snapshot(model)
    with pytest.raises(ValueError, match="Embedding 'model/embed' has LoRA enabled"):
        ps.nn.quantize(model, "int8", where="embed")
    same(before, snapshot(model))


def test_a_layer_used_twice_is_quantized_once():
    shared = ps.nn.Dense(6, name="shared")
    model = ps.nn.Sequential([shared, shared])
    x = rand(2, 6)
    model(x)
    assert len(ps.nn.quantize(model, "int8")) == 1
    assert shared.kernel.dtype == jnp.int8
    assert len(ps.nn.dequantize(model)) == 1


@pytest.mark.parametrize(
    "shape,axis",
    [((37, 11), -2), ((37, 11), -1), ((5, 37, 11), -2), ((6, 2, 4), -3), ((2, 4, 6), (-3, -2))],
)
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_host_quantizer_is_bit_identical_also_over_a_memory_map(tmp_path, shape, axis, mode):
    w = rand(*shape)
    path = str(tmp_path / "w.safetensors")
    save_file({"w": w}, path)
    q, s = abs_max_quantize(w, axis, mode)
    q = pack_int4(q) if mode == "int4" else q
    reader = ps.checkpoint.open_reader(path, allow_unverified=True)
    try:
        for source in (w, reader.view("w")):  # an array, and a view of the mapped file
            hq, hs = quantize_host(source, axis, mode, rows=4)
            np.testing.assert_array_equal(hq, np.asarray(q))
            np.testing.assert_array_equal(hs, np.asarray(s))
    finally:
        reader.close()
