"""examples/llama.py against transformers: a tiny random LlamaForCausalLM saved by
save_pretrained loads through init_from_checkpoint alone (one NameMap) with the logits of
LlamaForCausalLM, LoRA-tunes attention and MLP in mixed_bfloat16 on bucketed batches, and its
export (the same NameMap turned around) loads back into LlamaForCausalLM with equal logits."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from _examples import load_example

import paramstore as ps

pytestmark = pytest.mark.torch  # transformers and torch are the oracles (pyproject)


@pytest.fixture(scope="module")
def ex():
    return load_example("llama")


@pytest.fixture(scope="module")
def hf_dir(ex, tmp_path_factory):
    return ex.tiny_checkpoint(str(tmp_path_factory.mktemp("llama") / "tiny"))


IDS = np.random.default_rng(0).integers(3, 128, (2, 10))


def test_loads_with_transformers_logits_and_right_padding_changes_nothing(ex, hf_dir):
    model, assigned = ex.load(hf_dir)
    names = {n for n, _, _ in ps.checkpoint.list_variables(hf_dir, allow_unverified=True)}
    assert set(assigned.values()) == names  # every tensor of the file went somewhere
    assert len(assigned) == len(names) and not any(v.is_abstract for v in model.variables)
    stacked = model.layers.stacked
    assert stacked["attn/weights/query/kernel"].shape == (2, 64, 4, 16)  # 4 query heads
    assert stacked["attn/weights/key/kernel"].shape == (2, 64, 2, 16)  # 2 key/value heads
    logits = np.asarray(model(jnp.asarray(IDS)))
    np.testing.assert_allclose(logits, ex.transformers_logits(hf_dir, IDS), atol=1e-4)
    # padded to a bucket on the right: the real tokens' logits do not change
    ids, mask = ex.pad_batch([IDS[0].tolist(), IDS[1, :7].tolist()])
    assert ids.shape == (2, 16) and mask.sum() == 17
    padded = np.asarray(model(jnp.asarray(ids)))
    np.testing.assert_allclose(padded[0, :10], logits[0], atol=1e-5)
    np.testing.assert_allclose(padded[1, :7], logits[1, :7], atol=1e-5)
    assert ex.bucket(17) == 32
    with pytest.raises(ValueError, match="longer than the largest bucket"):
        ex.bucket(1000)


@pytest.mark.slow
def test_main_lora_in_bfloat16_and_export_back(ex, hf_dir, tmp_path, capsys):
    out = tmp_path / "tuned"
    run = ex.main([hf_dir, "--steps", "3", "--out", str(out)])
    printed = capsys.readouterr().out
    diffs = [float(x) for x in re.findall(r"logits max abs diff vs transformers: (\S+)", printed)]
    assert len(diffs) == 2 and max(diffs) <= 1e-4, printed
    assert "bucketed lengths: [16, 32]" in printed
    assert "the step compiled 2 times for 3 batches (3 lengths, 2 buckets)" in printed
    assert "on 7 layers (mixed_bfloat16)" in printed  # 4 attention projections + 3 MLP Dense
    # the export differs from the pretrained model: the LoRA update was merged and written
    assert np.abs(run["exported_reference"] - run["reference"]).max() > 1e-4
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


@pytest.mark.slow
def test_lora_trains_only_the_adapters_and_merge_keeps_them_frozen(ex, hf_dir):
    model, _ = ex.load(hf_dir, policy="mixed_bfloat16")
    pretrained = {v.name: np.asarray(v.value()) for v in model.variables}
    tuner = ex.lora_tuner(model, rank=2)
    assert sorted(ly.scope_name.rsplit("/", 1)[1] for ly in tuner.layers) == sorted(
        ["query", "key", "value", "attention_output", "gate", "up", "down"]
    )
    a = model.layers.stacked["attn/weights/key/lora_kernel_a"]
    assert a.shape == (2, 64, 2, 2)  # Keras 3's EinsumDense: kernel.shape[:-1] + (rank,)
    batch = ex.pad_batch([list(range(3, 15)), list(range(20, 29))])
    losses = tuner.train([batch] * 3)
    assert losses[-1] < losses[0]
    for v in model.variables:
        if v.name in pretrained:
            np.testing.assert_array_equal(np.asarray(v.value()), pretrained[v.name])
    tuner.finalize()
    assert not any(v.trainable for v in model.variables)  # merged: still all frozen
    assert not any("lora" in v.name for v in model.variables)
