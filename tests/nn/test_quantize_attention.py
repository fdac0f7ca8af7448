"""Quantized attention projections: MultiHeadAttention / GroupQueryAttention.quantize("int8" |
"int4") against Keras 3's EinsumDense (variables, integer values, scales, outputs), QLoRA
against Keras' quantized EinsumDense with LoRA, ps.nn.quantize(where=) reaching the
projections (Repeat: one scale row per block), training, dequantize, checkpoints and
quantizing while loading, and the bad inputs (nothing changed)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _layers import f32, random_source, same, snapshot

import paramstore as ps
from paramstore.checkpoint import init_from_checkpoint
from paramstore.nn._quant import abs_max_quantize, int8_einsum, pack_int4, unpack_int4
from paramstore.nn.projection import Projection, einsum_axes

rand = random_source(23)
PROJ = ("query", "key", "value", "attention_output")
KERAS_PROJ = dict(zip(PROJ, ("_query_dense", "_key_dense", "_value_dense", "_output_dense")))


def keras_quantize(layer, mode, keras):
    """What ``keras.Model.quantize(mode)`` does to each EinsumDense of an attention layer
    (int4: per channel, as paramstore's)."""
    for attr in KERAS_PROJ.values():
        sub = getattr(layer, attr)
        if mode == "int4":
            sub.quantize("int4", config=keras.quantizers.Int4QuantizationConfig(block_size=-1))
        else:
            sub.quantize(mode)


def twins(keras, kind, policy="float32"):
    """A Keras attention layer and ours, built, with the same random float weights."""
    x = rand(2, 4, 8)
    if kind == "mha":  # key_dim 3: an odd last axis, padded when packed
        theirs = keras.layers.MultiHeadAttention(2, 3, dtype=policy)
        ours = ps.nn.MultiHeadAttention(2, 3, dtype=policy, name="attn")
    else:  # head_dim 4: Keras' flat int4 bytes are ours reshaped
        theirs = keras.layers.GroupQueryAttention(4, 4, 2, dtype=policy)
        ours = ps.nn.GroupQueryAttention(4, 4, 2, dtype=policy, name="attn")
    theirs(x, x)
    ours(x, x)
    for name, attr in KERAS_PROJ.items():
        k, p = getattr(theirs, attr), ours.projections[name]
        for kv, pv in ((k._kernel, p.kernel), (k.bias, p.bias)):
            value = rand(*pv.shape)
            kv.assign(value)
            pv.assign(value)
    return theirs, ours, x


# ------------------------------------------------------------------ against Keras 3


@pytest.mark.tf
@pytest.mark.parametrize(
    ("kind", "mode", "policy"),
    [
        ("mha", "int8", "float32"),
        ("gqa", "int8", "float32"),
        ("gqa", "int8", "mixed_bfloat16"),
        ("mha", "int4", "float32"),
        ("gqa", "int4", "float32"),
        ("gqa", "int4", "mixed_bfloat16"),
    ],
)
def test_projections_match_keras_einsum_dense(keras, kind, mode, policy):
    theirs, ours, x = twins(keras, kind, policy)
    keras_quantize(theirs, mode, keras)
    ours.quantize(mode)
    assert ours.quantization_mode == mode
    for name, attr in KERAS_PROJ.items():
        k, p = getattr(theirs, attr), ours.projections[name]
        assert p.quantization_mode == mode
        assert p.kernel.name == f"attn/{name}/kernel"
        assert p.kernel_scale.name == f"attn/{name}/kernel_scale"
        assert p.kernel.dtype == jnp.int8 and p.kernel_scale.dtype == jnp.float32
        assert not p.kernel.trainable and not p.kernel_scale.trainable
        scale = np.asarray(k.kernel_scale)
        # one scale per non-contracted kernel element: Keras' shape without its unit axes
        assert p.kernel_scale.shape == p.kernel_shape[-p.kernel_scale.ndim :]
        assert p.kernel_scale.size == scale.size
        np.testing.assert_array_equal(p.kernel_scale.numpy().ravel(), scale.ravel())
        if mode == "int8":
            assert p.kernel.shape == tuple(k._kernel.shape) == p.kernel_shape
            np.testing.assert_array_equal(p.kernel.numpy(), np.asarray(k._kernel))  # exactly
        else:  # the float kernel's axes, packed along the last one
            float_shape = p.kernel_shape
            assert p.kernel.shape == (*float_shape[:-1], (float_shape[-1] + 1) // 2)
            theirs_values = np.asarray(
                keras.quantizers.unpack_int4(k._kernel, k._int4_unpacked_column_size, axis=-1)
            )
            ours_values = np.asarray(unpack_int4(p.kernel.value(), float_shape[-1]))
            np.testing.assert_array_equal(ours_values.reshape(theirs_values.shape), theirs_values)
            if float_shape[-1] % 2 == 0:  # then the bytes are Keras' too
                np.testing.assert_array_equal(
                    p.kernel.numpy().reshape(k._kernel.shape), np.asarray(k._kernel)
                )
    want = np.asarray(theirs(x, x), np.float32)
    # bfloat16: a few of its ulps at the outputs' scale (TF and XLA round the sums apart)
    rtol, atol = (1e-5, 1e-5) if policy == "float32" else (2e-2, 2e-2 * np.abs(want).max())
    np.testing.assert_allclose(f32(ours(x, x)), want, rtol=rtol, atol=atol)
    got = f32(ps.function(lambda x: ours(x, x))(x))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    assert ours(x, x).dtype == jnp.dtype(ps.mixed_precision.Policy(policy).compute_dtype)
    assert all(v.name.endswith("/bias") for v in ours.trainable_variables)
    assert len(ours.trainable_variables) == 4


@pytest.mark.tf
@pytest.mark.parametrize(("kind", "mode"), [("mha", "int8"), ("gqa", "int8"), ("mha", "int4")])
def test_qlora_matches_keras(keras, kind, mode):
    theirs, ours, x = twins(keras, kind)
    keras_quantize(theirs, mode, keras)
    ours.quantize(mode)
    for attr in KERAS_PROJ.values():
        getattr(theirs, attr).enable_lora(2, lora_alpha=3.0)
    ours.enable_lora(2, lora_alpha=3.0)
    for name, attr in KERAS_PROJ.items():
        k, p = getattr(theirs, attr), ours.projections[name]
        assert p.lora_kernel_a.shape == (*p.kernel_shape[:-1], 2)  # the float kernel's
        for kv, pv in ((k.lora_kernel_a, p.lora_kernel_a), (k.lora_kernel_b, p.lora_kernel_b)):
            assert tuple(kv.shape) == pv.shape and pv.trainable
            value = rand(*pv.shape) * 0.3
            kv.assign(value)
            pv.assign(value)
    want = np.asarray(theirs(x, x))
    np.testing.assert_allclose(f32(ours(x, x)), want, rtol=1e-5, atol=1e-5)
    names = sorted(v.name.rsplit("/", 1)[1] for v in ours.trainable_variables)
    assert names == sorted(["bias", "lora_kernel_a", "lora_kernel_b"] * 4)


# ------------------------------------------------------------------ the arithmetic


def test_int8_call_contracts_int8_with_int32_accumulation_over_two_axes():
    attn = ps.nn.MultiHeadAttention(2, 3, name="attn")
    x = rand(2, 4, 6) * 5
    attn(x, x)
    attn.quantize("int8")
    out = attn.projections["attention_output"]
    assert out.kernel_scale.shape == (6,)
    h = rand(2, 4, 2, 3) * 4  # (batch, T, heads, value_dim): two contracted axes
    k, sc = out.kernel.numpy(), out.kernel_scale.numpy()
    text = jax.jit(int8_einsum, static_argnums=(0, 4)).lower(out.equation, h, k, sc, (-2, -1))
    dots = [line for line in text.as_text().splitlines() if "dot_general" in line]
    assert len(dots) == 1 and "xi8>" in dots[0] and "xi32>" in dots[0]  # int8 in, int32 out
    hs = np.float32(127) / (np.abs(h).max(axis=(-2, -1), keepdims=True) + np.float32(1e-7))
    hq = np.clip(np.round(h * hs), -127, 127).astype(np.int32)
    acc = np.einsum("bthk,hkd->btd", hq, k.astype(np.int32)).astype(np.float32)
    want = acc / (sc * hs[..., 0]) + out.bias.numpy()
    np.testing.assert_allclose(np.asarray(out(h)), want, rtol=1e-6)
    # the kernel's values and scale by definition: reduced over (heads, value_dim)
    w = rand(2, 3, 6)
    q, s = abs_max_quantize(w, (-3, -2), "int8")
    scale = np.float32(127) / (np.abs(w).max(axis=(0, 1)) + np.float32(1e-7))
    np.testing.assert_array_equal(np.asarray(s), scale)
    np.testing.assert_array_equal(np.asarray(q), np.clip(np.round(w * scale), -127, 127))


def test_int4_call_is_the_dequantized_kernel_and_the_gradient_reaches_the_inputs():
    layer = ps.nn.GroupQueryAttention(3, 2, 1, name="gqa")
    x = rand(1, 5, 4)
    layer(x, x)
    layer.quantize("int4")
    q = layer.projections["query"]
    assert q.kernel.shape == (4, 2, 2) and q.kernel_scale.shape == (2, 3)
    w = unpack_int4(q.kernel.value(), 3).astype(jnp.float32) / q.kernel_scale.value()
    want = np.einsum("bqm,muh->bquh", x, np.asarray(w)) + q.bias.numpy()
    np.testing.assert_allclose(np.asarray(q(x)), want, rtol=1e-6, atol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(q(x) ** 2))(jnp.asarray(x))
    want_grad = jax.grad(lambda x: jnp.sum((jnp.einsum("bqm,muh->bquh", x, w) + q.bias.value()) ** 2))  # fmt: skip
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad(x)), rtol=1e-5, atol=1e-5)


def test_the_scales_keep_the_kernel_partition_without_the_contracted_axes():
    layer = ps.nn.MultiHeadAttention(
        2, 4, name="attn",
        kernel_partition=("embed", "heads", None), output_kernel_partition=("heads", None, "embed"),
    )  # fmt: skip
    x = rand(1, 2, 6)
    layer(x, x)
    layer.quantize("int4")
    query, out = layer.projections["query"], layer.projections["attention_output"]
    assert query.kernel.partition == ("embed", "heads", None)
    assert query.kernel_scale.partition == ("heads", None)
    assert out.kernel.partition == ("heads", None, "embed")
    assert out.kernel_scale.partition == ("embed",)


def test_einsum_axes_of_the_projections():
    assert einsum_axes("bsd,dhk->bshk") == ((-3,), (-1,))
    assert einsum_axes("bthk,hkd->btd") == ((-3, -2), (-2, -1))
    assert einsum_axes("bquh,uhm->bqm") == ((-3, -2), (-2, -1))
    assert einsum_axes("bsd,hdk->bshk") is None  # the contracted axis not leading the kernel
    assert einsum_axes("bsd,dhk->bskh") is None  # the kernel's axes transposed in the output
    assert einsum_axes("bsd,dhk") is None


# ------------------------------------------------------------------ models, Repeat, where


class Block(ps.Module):
    def __init__(self):
        super().__init__()
        self.attn = ps.nn.MultiHeadAttention(2, 3, name="attn")
        self.fc = ps.nn.Dense(6, name="fc")

    def __call__(self, x):
        x = x + self.attn(x, x, use_causal_mask=True)
        return x + self.fc(x)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_repeat_quantizes_per_block_retraces_trains_below_and_dequantizes(mode):
    rep = ps.nn.Repeat(Block, 2, name="blocks")
    x = rand(2, 4, 6)
    y0 = np.asarray(rep(x))
    floats = {k: v.numpy() for k, v in rep.stacked.items()}
    step = ps.function(lambda x: rep(x))
    step(x)
    changed = ps.nn.quantize(rep, mode, where="attn")
    names = [f"blocks/block/attn/{p}" for p in PROJ]
    assert sorted(ly.scope_name for ly in changed) == sorted(names)
    assert all(isinstance(ly, Projection) for ly in changed)
    st = rep.stacked
    assert st["fc/kernel"].dtype == jnp.float32  # where= left it out
    assert st["attn/weights/query/kernel_scale"].shape == (2, 2, 3)
    assert st["attn/weights/attention_output/kernel_scale"].shape == (2, 6)
    assert st["attn/weights/query/kernel_scale"].name == "blocks/block/attn/query/kernel_scale"
    for p, axes in (("query", -3), ("attention_output", (-3, -2))):
        key = f"attn/weights/{p}/kernel"
        assert st[key].dtype == jnp.int8 and not st[key].trainable
        for i in range(2):  # one scale row per block, from that block's kernel
            q, s = abs_max_quantize(floats[key][i], axes, mode)
            np.testing.assert_array_equal(
                st[key].numpy()[i], pack_int4(q) if mode == "int4" else np.asarray(q)
            )
            np.testing.assert_array_equal(st[f"{key}_scale"].numpy()[i], np.asarray(s))
    y1 = np.asarray(rep(x))
    np.testing.assert_allclose(y1, y0, atol=0.1 if mode == "int8" else 1.0)  # not another model
    assert not np.array_equal(y1, y0)
    np.testing.assert_array_equal(np.asarray(step(x)), y1)  # the step traced before retraces
    g = jax.grad(lambda x: jnp.sum(ps.pure(lambda x: rep(x), rep)(ps.state(rep), x)[0] ** 2))
    grad = np.asarray(g(jnp.asarray(x)))
    assert np.all(np.isfinite(grad)) and np.any(grad)
    assert len(ps.nn.dequantize(rep)) == 4
    assert all(v.dtype == jnp.float32 and v.trainable for v in rep.variables)
    assert sorted(rep.stacked) == sorted(floats)
    np.testing.assert_allclose(np.asarray(rep(x)), y0, atol=0.1 if mode == "int8" else 1.0)
    np.testing.assert_array_equal(np.asarray(step(x)), np.asarray(rep(x)))


def test_where_picks_projections_and_the_layer_dequantizes_what_is_quantized():
    layer = ps.nn.GroupQueryAttention(4, 2, 1, name="attn")
    x = rand(1, 3, 8)
    layer(x, x)
    layer.projections["key"].kernel.trainable = False
    changed = ps.nn.quantize(layer, "int8", where=r"attn/(query|key)$")
    assert sorted(c.scope_name for c in changed) == ["attn/key", "attn/query"]
    assert layer.projections["value"].quantization_mode is None
    assert layer.quantization_mode is None  # not all four alike
    names = [v.name for v in layer.variables]
    assert "attn/query/kernel_scale" in names and "attn/value/kernel_scale" not in names
    with pytest.raises(ValueError, match="Projection 'attn/query' is quantized already"):
        layer.quantize("int8")  # checked before the others change
    assert layer.projections["value"].quantization_mode is None
    layer.dequantize()
    assert not any(v.name.endswith("_scale") for v in layer.variables)
    assert all(v.dtype == jnp.float32 for v in layer.variables)
    assert not layer.projections["key"].kernel.trainable  # its flag from before
    assert layer.projections["query"].kernel.trainable


def test_qlora_in_a_repeat_trains_adapters_and_biases_and_merge_waits_for_dequantize():
    rep = ps.nn.Repeat(Block, 2, name="blocks")
    x = rand(2, 4, 6)
    rep(x)
    ps.nn.quantize(rep, "int8")
    changed = ps.nn.enable_lora(rep, 2, where=r"attn/(query|value)$|fc")
    assert len(changed) == 3
    frozen = {v.name: v.numpy().copy() for v in rep.variables if v.dtype == jnp.int8}
    assert len(frozen) == 5
    opt = ps.Optimizer(optax.adam(1e-2), rep.trainable_variables)

    @ps.function
    def step(x):
        loss, grads = ps.value_and_grad(lambda: jnp.mean(rep(x) ** 2), rep)()
        opt.apply_gradients(grads)
        return loss

    losses = [float(step(x)) for _ in range(5)]
    assert losses[-1] < losses[0]
    for v in rep.variables:
        if v.name in frozen:
            np.testing.assert_array_equal(v.numpy(), frozen[v.name])
    leaves = {v.name.rsplit("/", 1)[1] for v in rep.trainable_variables}
    assert leaves == {"bias", "lora_kernel_a", "lora_kernel_b"}
    before = snapshot(rep)
    with pytest.raises(ValueError, match=r"'blocks/block/.*' is quantized.*ps.nn.dequantize"):
        ps.nn.merge_lora(rep)
    same(before, snapshot(rep))
    ps.nn.dequantize(rep)
    y = np.asarray(rep(x))
    assert len(ps.nn.merge_lora(rep)) == 3
    np.testing.assert_allclose(np.asarray(rep(x)), y, rtol=1e-5, atol=1e-5)
    assert all(v.trainable for v in rep.variables)


def test_merge_lora_on_a_quantized_attention_layer_changes_nothing():
    layer = ps.nn.MultiHeadAttention(2, 3, name="attn")
    x = rand(1, 3, 4)
    layer(x, x)
    ps.nn.quantize(layer, "int8", where="value")
    layer.enable_lora(2)  # all four; the value projection's on an int8 kernel
    before = snapshot(layer)
    with pytest.raises(ValueError, match="Projection 'attn/value' is quantized.*dequantize"):
        layer.merge_lora()  # query and key (float) are not merged either
    with pytest.raises(ValueError, match="Projection 'attn/value' is quantized.*dequantize"):
        layer.projections["value"].merge_lora()
    same(before, snapshot(layer))


# ------------------------------------------------------------------ bad input


def test_bad_input_changes_nothing():
    attn = ps.nn.MultiHeadAttention(2, 3, name="attn")
    with pytest.raises(ValueError, match="MultiHeadAttention 'attn' is not built"):
        attn.quantize("int8")
    rep = ps.nn.Repeat(Block, 2, name="blocks")
    with pytest.raises(ValueError, match=r"matches where='attn'.*\['blocks/block/fc'\].*attention layers \['blocks/block/attn'\] are not built"):  # fmt: skip
        ps.nn.quantize(rep, "int8", where="attn")
    with pytest.raises(ValueError, match="Repeat 'blocks'.*not built"):
        ps.nn.quantize(rep, "int8")
    with pytest.raises(ValueError, match=r"has no Dense.*attention layers \['attn'\] are not built"):  # fmt: skip
        ps.nn.quantize(attn, "int8")
    x = rand(1, 2, 4)
    attn(x, x)
    before = snapshot(attn)
    with pytest.raises(ValueError, match="MultiHeadAttention 'attn'.*unknown quantization mode 'int2'.*'int8', 'int4'"):  # fmt: skip
        attn.quantize("int2")
    with pytest.raises(ValueError, match=r"no Dense, Embedding or attention projection .* matches where='mlp'.*'attn/query'"):  # fmt: skip
        ps.nn.quantize(attn, "int8", where="mlp")
    with pytest.raises(ValueError, match="MultiHeadAttention 'attn' is not quantized"):
        attn.dequantize()
    with pytest.raises(ValueError, match="no quantized layer"):
        ps.nn.dequantize(attn)
    same(before, snapshot(attn))
    attn.projections["key"].enable_lora(2)
    before = snapshot(attn)
    with pytest.raises(ValueError, match="Projection 'attn/key' has LoRA enabled"):
        attn.quantize("int8")
    with pytest.raises(ValueError, match="Projection 'attn/key' has LoRA enabled"):
        ps.nn.quantize(attn, "int8")
    same(before, snapshot(attn))
    attn.projections["key"].merge_lora()
    attn.quantize("int4")
    before = snapshot(attn)
    with pytest.raises(ValueError, match="Projection 'attn/query' is quantized already \\('int4'\\)"):  # fmt: skip
        attn.quantize("int8")
    with pytest.raises(ValueError, match="quantized already"):
        ps.nn.quantize(attn, "int4", where="output")
    same(before, snapshot(attn))


def test_an_equation_it_cannot_quantize_is_refused():
    zeros = ps.initializers.zeros()
    p = Projection("bsd,hdk->bshk", (2, 4, 3), None, zeros, zeros, "odd")
    p.build((None, 4))
    before = snapshot(p)
    with pytest.raises(ValueError, match=r"Projection 'odd'.*equation 'bsd,hdk->bshk' cannot be quantized"):  # fmt: skip
        p.quantize("int8")
    same(before, snapshot(p))
    assert p.quantization_mode is None


# ------------------------------------------------------------------ checkpoints


def make(abstract=False):
    with ps.abstract() if abstract else contextlib.nullcontext():
        rep = ps.nn.Repeat(Block, 2, name="blocks")
        rep.build((None, 4, 6))
    return rep


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_checkpoint_restores_and_loading_quantizes_like_quantizing_after(tmp_path, mode):
    x = rand(1, 4, 6)
    with ps.VariableStore():
        ps.random.set_seed(0)
        floats = make()
        path = str(tmp_path / "floats.safetensors")
        ps.checkpoint.export_safetensors(path, floats)
        ps.nn.quantize(floats, mode, where="attn")  # the reference: load, then quantize
        want = {v.name: v.numpy() for v in floats.variables}
        out = np.asarray(floats(x))
        saved = ps.Checkpoint(model=floats).save(str(tmp_path / "q"))
    for abstract in (False, True):
        with ps.VariableStore():
            ps.random.set_seed(1)
            model = make(abstract)
            ps.nn.quantize(model, mode, where="attn")
            got = init_from_checkpoint(path, {"/": "/"}, allow_unverified=True)
            assert "blocks/block/attn/query/kernel_scale" not in got
            values = {v.name: v.numpy() for v in model.variables}
            assert values.keys() == want.keys()
            for k in want:
                assert values[k].dtype == want[k].dtype, k
                np.testing.assert_array_equal(values[k], want[k], err_msg=k)
        with ps.VariableStore():
            other = make(abstract)
            ps.nn.quantize(other, mode, where="attn")
            ps.Checkpoint(model=other).restore(saved)
            for v in other.variables:
                np.testing.assert_array_equal(v.numpy(), want[v.name], err_msg=v.name)
            np.testing.assert_array_equal(np.asarray(other(x)), out)
