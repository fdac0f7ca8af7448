"""examples/gpt2.py against transformers: a tiny random GPT-2 made by transformers loads
through init_from_checkpoint alone with the same logits as GPT2LMHeadModel, fine-tunes, and
its export loads back into GPT2LMHeadModel.from_pretrained with paramstore's logits.

transformers computes in float32 on the CPU; paramstore's logits compared with its are
computed with float32 matrix products (``_backends.float32_matmuls``: a GPU's default is
TensorFloat-32, 1.3e-4 off on an H200), so the tolerances are the same on every backend."""

from __future__ import annotations

import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from _backends import float32_matmuls
from _examples import load_example

import paramstore as ps

pytestmark = pytest.mark.torch  # transformers and torch are the oracles (pyproject's markers)


def _example():
    return load_example("gpt2")


@pytest.fixture(scope="module")
def ex():
    return _example()


@pytest.fixture(scope="module")
def hf_dir(ex, tmp_path_factory):
    return ex.tiny_checkpoint(str(tmp_path_factory.mktemp("gpt2") / "tiny"))


IDS = np.random.default_rng(0).integers(0, 100, (2, 8))


@pytest.mark.slow
def test_loads_matches_transformers_fine_tunes_and_exports_back(ex, hf_dir, tmp_path, fresh_store):
    model, assigned = ex.load(hf_dir)
    # every tensor of the file went somewhere, and every variable was filled
    names = {n for n, _, _ in ps.checkpoint.list_variables(hf_dir, allow_unverified=True)}
    assert set(assigned.values()) == names
    assert not any(v.is_abstract for v in model.variables)
    with float32_matmuls():
        logits = np.asarray(model(jnp.asarray(IDS)))
    np.testing.assert_allclose(logits, ex.transformers_logits(hf_dir, IDS), atol=1e-4)

    batch = np.random.default_rng(1).integers(0, 100, (4, 9))
    losses = ex.fine_tune(model, [batch] * 4, learning_rate=1e-2)
    assert losses[-1] < losses[0] - 0.1
    with float32_matmuls():
        tuned = np.asarray(model(jnp.asarray(IDS)))
    assert np.abs(tuned - logits).max() > 1e-2

    for shard_size in (None, 20_000):  # one file, then shards + index.json
        out = tmp_path / f"out-{shard_size}"
        out.mkdir()
        shutil.copy(os.path.join(hf_dir, "config.json"), out)
        ex.export(model, str(out), max_shard_size=shard_size)
        files = sorted(os.listdir(out))
        assert ("model.safetensors.index.json" in files) == (shard_size is not None), files
        np.testing.assert_allclose(ex.transformers_logits(str(out), IDS), tuned, atol=1e-4)
    # and the export warm-starts a new paramstore model to the same logits
    with ps.VariableStore(), float32_matmuls():
        again, _ = ex.load(str(out))
        np.testing.assert_allclose(np.asarray(again(jnp.asarray(IDS))), tuned, atol=1e-5)


def test_the_map_names_every_variable_of_the_model_both_ways(ex, fresh_store):
    c = ex.Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = ex.build(c)
    names = ex.hf_names(model)
    for v in model.variables:
        stacked = v.shape[0] == c.n_layer and names.checkpoint_name(v.name) is None
        for label in [f"{v.name}[{i}]" for i in range(c.n_layer)] if stacked else [v.name]:
            back = names.checkpoint_name(label)
            assert back is not None, label
            there = names.variable_name(back)
            assert label in (there if isinstance(there, tuple) else (there,))
    q = model.h.stacked["attn/weights/query/kernel"].name
    assert names.checkpoint_name(f"{q}[1]") == "transformer.h.1.attn.c_attn.weight"


def _values(variables):
    return {v.name: np.asarray(v.value()) for v in variables}


@pytest.mark.slow
def test_lora_in_bfloat16_with_ema_resumes_and_exports_to_transformers(ex, hf_dir, tmp_path):
    batches = [np.random.default_rng(1).integers(0, 100, (4, 9))] * 6
    ckpt = str(tmp_path / "ckpt")
    with ps.VariableStore():  # the uninterrupted run, saving at steps 3 and 6
        model, _ = ex.load(hf_dir, policy="mixed_bfloat16")
        assert model.h.dtype_policy.name == "mixed_bfloat16"
        assert {v.dtype for v in model.variables} == {np.dtype("float32")}
        pretrained = _values(model.variables)
        tuner = ex.lora_tuner(model, directory=ckpt)
        # LoRA went into both MLP Dense layers of the Repeat's blocks and the attention's
        # query and value projections, stacked per block
        assert sorted(ly.scope_name for ly in tuner.layers) == [
            "gpt2/repeat/block/c_fc",
            "gpt2/repeat/block/c_proj",
            "gpt2/repeat/block/multi_head_attention/query",
            "gpt2/repeat/block/multi_head_attention/value",
        ]
        assert sorted(v.name.rsplit("/", 1)[1] for v in tuner.lora) == sorted(
            ["lora_kernel_a", "lora_kernel_b"] * 4
        )
        assert all(v.shape[0] == 2 and v.dtype == np.float32 for v in tuner.lora)
        assert [v.name for v in model.trainable_variables] == [v.name for v in tuner.lora]
        losses = tuner.train(batches, save_every=3)
        # bfloat16 compute, float32 master values: Adam's slots and the averages too
        trained = [*tuner.opt.variables, *tuner.ema.variables]
        assert {v.dtype for v in trained if v.dtype.kind == "f"} == {np.dtype("float32")}
        assert losses[-1] < losses[0] - 0.05
        # only the LoRA factors changed; the pretrained values are bit-identical
        after = _values(model.variables)
        assert set(pretrained) < set(after)
        for name, value in pretrained.items():
            assert np.array_equal(after[name], value), name
        assert all(not np.array_equal(after[v.name], 0 * after[v.name]) for v in tuner.lora)
        # the averages differ from the trained values; swap shows them, then puts them back
        raw = _values(tuner.lora)
        shadows = {v.name: np.asarray(tuner.ema.average(v).value()) for v in tuner.lora}
        assert all(np.abs(shadows[n] - raw[n]).max() > 1e-4 for n in raw)
        with tuner.ema.swap(tuner.lora):
            for v in tuner.lora:
                np.testing.assert_array_equal(np.asarray(v.value()), shadows[v.name])
        for v in tuner.lora:
            np.testing.assert_array_equal(np.asarray(v.value()), raw[v.name])
        loss_raw, loss_ema = tuner.evaluate(jnp.asarray(batches[0]))
        assert loss_raw != loss_ema
        final = _values([*model.variables, *tuner.opt.variables, *tuner.ema.variables])

        # the export: averages merged into float32 kernels, loaded by transformers
        tuner.finalize()
        assert not any("lora" in v.name for v in model.variables)
        bf16 = np.asarray(model(jnp.asarray(IDS)))
        out = tmp_path / "tuned"
        out.mkdir()
        shutil.copy(os.path.join(hf_dir, "config.json"), out)
        ex.export(model, str(out))
    reference = ex.transformers_logits(str(out), IDS)
    with ps.VariableStore(), float32_matmuls():  # the exported float32 weights in float32
        exported, _ = ex.load(str(out))
        np.testing.assert_allclose(np.asarray(exported(jnp.asarray(IDS))), reference, atol=1e-4)
    # bfloat16 compute: 8 significant bits, |logits| < 1, so ~2**-8 relative per op
    np.testing.assert_allclose(bf16, reference, atol=2e-2)
    assert np.abs(reference - ex.transformers_logits(hf_dir, IDS)).max() > 1e-3  # it was tuned

    with ps.VariableStore():  # "killed" after step 3: a new process resumes from its checkpoint
        model, _ = ex.load(hf_dir, policy="mixed_bfloat16")
        tuner = ex.lora_tuner(model, directory=str(tmp_path / "other"))
        assert tuner.resume(os.path.join(ckpt, "ckpt-3.safetensors")) == 3
        assert tuner.train(batches) == losses[3:]
        resumed = _values([*model.variables, *tuner.opt.variables, *tuner.ema.variables])
    assert resumed.keys() == final.keys()
    for name, value in final.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)


@pytest.mark.slow
def test_qlora_quantizes_while_loading_plans_and_trains(ex, hf_dir, capsys):
    batches = [np.random.default_rng(2).integers(0, 100, (4, 9))] * 4
    with ps.VariableStore():
        floats, _ = ex.load(hf_dir, policy="mixed_bfloat16")
        ps.nn.quantize(floats, "int8", where=ex.QUANT_WHERE)  # the reference: load, quantize
        want = {k: v.numpy() for k, v in floats.h.stacked.items()}
    with ps.VariableStore():
        run = ex.qlora_fine_tune(hf_dir, batches, rank=2)
        model = run["model"]
        attn = "gpt2/repeat/block/multi_head_attention/"
        assert sorted(ly.scope_name for ly in run["quantized"]) == [
            "gpt2/repeat/block/c_fc",
            "gpt2/repeat/block/c_proj",
            *(attn + p for p in ("attention_output", "key", "query", "value")),
        ]
        stacked = model.h.stacked
        assert set(want) == {k for k in stacked if "lora" not in k}
        for key in want:  # int8 values and scales equal loading the floats, then quantizing
            np.testing.assert_array_equal(stacked[key].numpy(), want[key], err_msg=key)
        for key in ("c_fc/kernel", "attn/weights/query/kernel", "attn/weights/attention_output/kernel"):  # fmt: skip
            assert stacked[key].dtype == np.int8 and not stacked[key].trainable, key
        c = model.config  # one scale per block and non-contracted kernel element
        heads, e = c.n_head, c.n_embd
        assert stacked["attn/weights/query/kernel_scale"].shape == (c.n_layer, heads, e // heads)
        assert stacked["attn/weights/attention_output/kernel_scale"].shape == (c.n_layer, e)
        assert stacked["attn/weights/query/lora_kernel_a"].shape == (c.n_layer, e, heads, 2)
        assert run["losses"][-1] < run["losses"][0]
        plan = run["plan"]
        (row,) = plan.devices.values()
        adapters = sum(v.size * 4 for v in model.trainable_variables)
        assert plan.host.optimizer_state == 2 * adapters  # Adam's slots in host memory
        assert row.other_state >= adapters  # the EMA shadows
        int8 = sum(v.size for v in model.variables if v.dtype == np.int8)
        assert row.parameters >= int8 + adapters
    out = capsys.readouterr().out
    assert "optimizer_state" in out and "host" in out and "peak per device" in out
