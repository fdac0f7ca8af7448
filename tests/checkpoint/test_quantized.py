"""Quantized variables in checkpoints: every format saves and restores them bit-exactly,
export_safetensors writes them, and init_from_checkpoint quantizes float tensors on the way
into a quantized (or abstract quantized) model, tensor by tensor, with the result equal to
loading the floats and then quantizing; bad tensors change nothing."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the multi-device subprocess: before jax is imported
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import contextlib
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _multidevice import multi_device_tests, run_checks
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

import paramstore as ps
from paramstore.checkpoint import init_from_checkpoint
from paramstore.nn._quant_ops import abs_max_quantize, pack_int4


class Block(ps.Module):
    def __init__(self):
        super().__init__()
        self.up = ps.nn.Dense(8, name="up")

    def __call__(self, x):
        return x + self.up(x)[..., :6]


def make(abstract=False):
    """A model with an Embedding, a Repeat of Dense blocks and a Dense head, built."""
    with ps.abstract() if abstract else contextlib.nullcontext():
        model = ps.nn.Sequential(
            [
                ps.nn.Embedding(10, 6, name="embed"),
                ps.nn.Repeat(Block, 3, name="blocks"),
                ps.nn.Dense(5, name="head"),
            ],
            name="model",
        )
        model.layers[0].build(None)
        model.layers[1].build((None, 2, 6))
        model.layers[2].build((None, 2, 6))
    return model


def quantize(model):
    ps.nn.quantize(model, "int8", where="blocks|embed")
    ps.nn.quantize(model, "int4", where="head")


def values(model):
    return {v.name: v.numpy() for v in model.variables}


def assert_same(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


IDS = np.array([[1, 2], [9, 0]], np.int32)


@pytest.mark.parametrize("how", ["saver", "checkpoint", "sharded", "manager"])
def test_every_format_restores_quantized_bit_exactly(tmp_path, how):
    with ps.VariableStore():
        ps.random.set_seed(0)
        model = make()
        quantize(model)
        want, out = values(model), np.asarray(model(IDS))
        path = str(tmp_path / "ckpt")
        if how == "saver":
            ps.Saver(model).save(path)
        elif how == "manager":
            manager = ps.CheckpointManager(str(tmp_path), ps.Checkpoint(model=model))
            manager.save(3)
        else:
            path = ps.Checkpoint(model=model, sharded=how == "sharded").save(path)
    for abstract in (False, True):
        with ps.VariableStore():
            ps.random.set_seed(1)
            other = make(abstract)
            quantize(other)
            if how == "saver":
                ps.Saver(other).restore(path)
            elif how == "manager":
                ps.CheckpointManager(str(tmp_path), ps.Checkpoint(model=other)).restore_latest()
            else:
                ps.Checkpoint(model=other).restore(path)
            assert_same(values(other), want)
            np.testing.assert_array_equal(np.asarray(other(IDS)), out)


def test_export_safetensors_writes_int8_values_and_float32_scales(tmp_path):
    model = make()
    quantize(model)
    path = str(tmp_path / "q.safetensors")
    ps.checkpoint.export_safetensors(path, model)
    loaded = load_file(path)
    want = values(model)
    assert loaded.keys() == want.keys()
    assert loaded["head/kernel"].dtype == np.int8 and loaded["head/kernel"].shape == (6, 3)
    assert loaded["blocks/block/up/kernel_scale"].dtype == np.float32
    assert loaded["blocks/block/up/kernel_scale"].shape == (3, 8)
    assert_same(loaded, want)


@pytest.mark.parametrize("source", ["safetensors", "saver"])
@pytest.mark.parametrize("abstract", [False, True])
def test_quantize_while_loading_equals_load_then_quantize(tmp_path, source, abstract):
    with ps.VariableStore():
        ps.random.set_seed(0)
        floats = make()
        if source == "safetensors":
            path = str(tmp_path / "m.safetensors")
            ps.checkpoint.export_safetensors(path, floats)
        else:
            path = ps.Saver(floats).save(str(tmp_path / "m"))
        quantize(floats)  # the reference: the float weights loaded, then quantized
        want = values(floats)
    with ps.VariableStore():
        ps.random.set_seed(1)
        model = make(abstract)
        quantize(model)
        got = init_from_checkpoint(path, {"/": "/"}, allow_unverified=True)
        assert "head/kernel" in got and "head/kernel_scale" not in got
        assert_same(values(model), want)
        assert not any(v.is_abstract for v in model.variables)
        np.testing.assert_array_equal(np.asarray(model(IDS)), np.asarray(floats(IDS)))


def test_quantize_while_loading_a_stacked_variable_layer_by_layer(tmp_path):
    rng = np.random.default_rng(3)
    layers = rng.standard_normal((3, 6, 8)).astype(np.float32)
    path = str(tmp_path / "layers.safetensors")
    ps.checkpoint.write_arrays(path, {f"h.{i}.w": layers[i] for i in range(3)})
    with ps.VariableStore():
        model = make()
        quantize(model)
        init_from_checkpoint(path, [(r"h\.(\d+)\.w", r"blocks/block/up/kernel[\1]")])
        stacked = model.layers[1].stacked
        for i in range(3):
            scale = np.float32(127) / (np.abs(layers[i]).max(axis=0) + np.float32(1e-7))
            q = np.clip(np.round(layers[i] * scale), -127, 127).astype(np.int8)
            np.testing.assert_array_equal(stacked["up/kernel"].numpy()[i], q)
            np.testing.assert_array_equal(stacked["up/kernel_scale"].numpy()[i], scale)


def test_bad_tensors_name_both_and_assign_nothing(tmp_path):
    path = str(tmp_path / "bad.safetensors")
    ps.checkpoint.write_arrays(
        path,
        {
            "w": np.ones((5, 6), np.float32),  # head/kernel is (6, 5) as floats
            "ids": np.ones((6, 5), np.int32),
            "ok": np.full((5,), 2.0, np.float32),
            "good": np.ones((6, 5), np.float32),
        },
    )
    with ps.VariableStore():
        model = make()
        quantize(model)
        before = values(model)
        with pytest.raises(ValueError, match=r"'w' with shape \(5, 6\).*cannot be quantized into variable 'head/kernel'.*\(6, 5\)"):  # fmt: skip
            init_from_checkpoint(path, {"ok": "head/bias", "w": "head/kernel"})
        with pytest.raises(ValueError, match=r"'ids'.*int32.*cannot be quantized into variable 'head/kernel'.*floating-point"):  # fmt: skip
            init_from_checkpoint(path, {"ids": "head/kernel"})
        with pytest.raises(ValueError, match="also gives its scale 'head/kernel_scale'"):
            init_from_checkpoint(path, {"good": "head/kernel", "ok": "head/kernel_scale"})
        assert_same(values(model), before)


def test_the_float_model_is_never_on_a_device(tmp_path, monkeypatch):
    """Each float tensor is quantized on the host: no float32 array of a quantized kernel's
    float shape is ever placed on a device while loading."""
    with ps.VariableStore():
        floats = make()
        path = str(tmp_path / "m.safetensors")
        ps.checkpoint.export_safetensors(path, floats)
    placed = []
    real = jax.make_array_from_callback

    def spy(shape, sharding, cb, *a, **k):
        out = real(shape, sharding, cb, *a, **k)
        placed.append((tuple(shape), out.dtype))
        return out

    monkeypatch.setattr(jax, "make_array_from_callback", spy)
    with ps.VariableStore():
        model = make(abstract=True)
        quantize(model)
        init_from_checkpoint(path, {"/": "/"}, allow_unverified=True)
    assert ((6, 5), jnp.float32) not in placed and ((3, 6, 8), jnp.float32) not in placed
    assert ((6, 3), jnp.int8) in placed and ((3, 6, 8), jnp.int8) in placed
    assert os.path.exists(path)


def test_abstract_quantized_layer_initializes_from_its_float_initializer():
    def build(abstract):
        with ps.VariableStore():
            ps.random.set_seed(4)
            with ps.abstract() if abstract else contextlib.nullcontext():
                dense = ps.nn.Dense(5, name="d")
                dense.build((None, 7))
                dense.quantize("int8")
            if abstract:
                assert dense.kernel.is_abstract and dense.kernel_scale.is_abstract
                ps.initialize(dense)
            return dense.kernel.numpy(), dense.kernel_scale.numpy()

    concrete, initialized = build(False), build(True)
    np.testing.assert_array_equal(initialized[0], concrete[0])
    np.testing.assert_array_equal(initialized[1], concrete[1])


# ------------------------------------------------------------------ 8 devices

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


@check
def check_fsdp_quantize_while_loading_keeps_the_shardings():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rng = np.random.default_rng(5)
    w1, w2 = rng.standard_normal((16, 64), np.float32), rng.standard_normal((64, 32), np.float32)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.safetensors")
        ps.checkpoint.write_arrays(path, {"up/kernel": w1, "down/kernel": w2})
        with ps.abstract(), ps.device(mesh), ps.sharding.axis_rules(mesh, [("mlp", "data")]):
            model = ps.nn.Sequential(
                [
                    ps.nn.Dense(64, use_bias=False, kernel_partition=(None, "mlp"), name="up"),
                    ps.nn.Dense(32, use_bias=False, kernel_partition=("mlp", None), name="down"),
                ]
            )
            model.build((None, 16))
        ps.nn.quantize(model, "int8", where="up")
        ps.nn.quantize(model, "int4", where="down")
        up, down = model.layers
        assert up.kernel.sharding.spec == P(None, "data") and up.kernel.is_abstract
        assert up.kernel_scale.sharding.spec == P("data")
        assert down.kernel.sharding.spec == P("data", None)  # packed: (64, 16)
        init_from_checkpoint(path, {"/": "/"})
        for layer, w, mode in ((up, w1, "int8"), (down, w2, "int4")):
            q, s = abs_max_quantize(w, -2, mode)
            q = pack_int4(q) if mode == "int4" else q
            np.testing.assert_array_equal(layer.kernel.numpy(), np.asarray(q))
            np.testing.assert_array_equal(layer.kernel_scale.numpy(), np.asarray(s))
        shard = up.kernel.value().addressable_shards[0].data
        assert shard.shape == (16, 8) and shard.dtype == jnp.int8  # each device: its shard
        x = jax.device_put(np.ones((4, 16), np.float32), NamedSharding(mesh, P()))
        assert np.all(np.isfinite(np.asarray(model(x))))


quantized_results, test_multi_device = multi_device_tests(CHECKS, __file__, "quantized_results")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        run_checks(CHECKS, sys.argv[1])
