"""examples/transformer.py: the small configuration trains, checkpoints, restores, samples."""

from __future__ import annotations

import io
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from _examples import load_example

import paramstore as ps


def _example():
    return load_example("transformer")


@pytest.mark.slow
def test_small_configuration_trains_and_restores(tmp_path):
    ex = _example()
    config = ex.Config(  # small enough to train in seconds; the loss still falls by > 1
        steps=120,
        fuse=20,
        batch_size=8,
        seq_len=32,
        d_model=32,
        corpus_mb=0.5,
        sample_chars=40,
        output_dir=str(tmp_path),
        progress=False,
    )
    out = io.StringIO()
    result = ex.train(config, out=out)
    losses = result["losses"]
    assert len(losses) == 120
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.5  # it learns
    assert result["restored_eval_loss"] == pytest.approx(result["eval_loss"], rel=1e-6)
    assert result["sample"].startswith("def ") and len(result["sample"]) == 44
    assert "sample:" in out.getvalue() and "checkpoint:" in out.getvalue()
    assert any(tmp_path.iterdir())


def test_fused_steps_run_in_one_call():
    ex = _example()
    with ps.VariableStore():
        config = ex.Config(seq_len=16, d_model=16, heads=2, layers=1, batch_size=4)
        model, opt = ex.build(config)
        step, fused = ex.train_steps(model, opt)
        tokens = ex.load_corpus(0.05)
        xs, ys = ex.batches(tokens, 4, 16, np.random.default_rng(0), 5)
        losses = fused(xs, ys)
        assert losses.shape == (5,)
        assert int(opt.iterations.numpy()) == 5
        assert fused.trace_count == 1


def test_stacked_and_unrolled_blocks_have_the_same_parameters_and_train():
    ex = _example()
    tokens = ex.load_corpus(0.05)
    xs, ys = ex.batches(tokens, 4, 16, np.random.default_rng(0), 3)
    counts = {}
    for unrolled in (False, True):
        with ps.VariableStore():
            config = ex.Config(seq_len=16, d_model=16, heads=2, layers=3, unrolled=unrolled)
            model, opt = ex.build(config)
            assert isinstance(model.blocks, ps.nn.Repeat) != unrolled
            counts[unrolled] = sum(v.size for v in model.trainable_variables)
            losses = ex.train_steps(model, opt)[1](xs, ys)
            assert np.isfinite(np.asarray(losses)).all()
    assert counts[False] == counts[True]
    assert ex._parser().parse_args(["--unrolled"]).unrolled
    assert not ex._parser().parse_args([]).unrolled


@pytest.mark.slow
def test_lora_fine_tuning_in_bfloat16_freezes_averages_and_resumes(tmp_path):
    ex = _example()
    config = ex.Config(
        seq_len=16,
        heads=2,
        d_model=16,
        layers=2,
        batch_size=4,
        corpus_mb=0.05,
        lora_steps=4,
        learning_rate=3e-2,
    )
    with ps.VariableStore():  # the "pretrained" model, in float32
        base, opt = ex.build(config)
        path = ps.Checkpoint(model=base, optimizer=opt).save(str(tmp_path / "base"))
        base_values = {v.name: np.asarray(v.value()) for v in base.variables}
    data, held_out = ex.lora_data(config)
    with ps.VariableStore():  # an uninterrupted run, checkpointed after each step
        model = ex.pretrained(config, path)
        assert model.blocks.compute_dtype == "bfloat16"
        assert model(np.zeros((1, 16), np.int32)).dtype == jnp.bfloat16
        tuner = ex.lora_tuner(model, config, str(tmp_path / "full"))
        assert [ly.scope_name.rsplit("/", 1)[1] for ly in tuner.layers] == ["mlp_in", "mlp_out"]
        assert {v.dtype for v in model.variables} == {np.dtype("float32")}
        before = tuner.evaluate(*held_out)[0]
        losses = tuner.train(data, save_every=1)
        raw, averaged = tuner.evaluate(*held_out)
        assert raw < before and averaged != raw
        for v in model.variables:  # restored, and left bit for bit; the LoRA factors trained
            if "lora" in v.name:
                assert v.trainable
            else:
                assert not v.trainable
                np.testing.assert_array_equal(np.asarray(v.value()), base_values[v.name])
    # killed after step 2: what a second run finds is the checkpoint of step 2
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copy(tmp_path / "full" / "ckpt-2.safetensors", cut)
    out = io.StringIO()
    rest = ex.fine_tune_lora(config, path, str(cut), out=out)
    assert rest["resumed_at"] == 2
    assert rest["losses"] == losses[2:]
    assert (rest["eval_loss"], rest["ema_eval_loss"]) == (raw, averaged)
    assert "LoRA rank 4 in mixed_bfloat16" in out.getvalue()
    assert ex._parser().parse_args(["--lora"]).lora
