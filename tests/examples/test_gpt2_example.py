"""examples/gpt2.py against transformers: a tiny random GPT-2 made by transformers loads
through init_from_checkpoint alone with the same logits as GPT2LMHeadModel, fine-tunes, and
its export loads back into GPT2LMHeadModel.from_pretrained with paramstore's logits."""

from __future__ import annotations

import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from _examples import load_example

import paramstore as ps

pytest.importorskip("torch")
pytest.importorskip("transformers")


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
    logits = np.asarray(model(jnp.asarray(IDS)))
    np.testing.assert_allclose(logits, ex.transformers_logits(hf_dir, IDS), atol=1e-4)

    batch = np.random.default_rng(1).integers(0, 100, (4, 9))
    losses = ex.fine_tune(model, [batch] * 4, learning_rate=1e-2)
    assert losses[-1] < losses[0] - 0.1
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
    with ps.VariableStore():
        again, _ = ex.load(str(out))
        np.testing.assert_allclose(np.asarray(again(jnp.asarray(IDS))), tuned, atol=1e-5)


def test_the_map_names_every_variable_of_the_model(ex, fresh_store):
    c = ex.Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = ex.build(c)
    targets = set()
    for _, r in ex.hf_map(model):
        for name in r if isinstance(r, tuple) else (r,):
            targets.add(name.split("[")[0])
    assert targets == {v.name for v in model.variables}
