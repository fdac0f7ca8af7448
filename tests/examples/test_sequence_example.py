"""examples/sequence.py: a bidirectional GRU + LSTM classifier trains, checkpoints every epoch,
restores into a fresh model with the same predictions, and saves its plot."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import paramstore as ps

PATH = Path(__file__).resolve().parents[2] / "examples" / "sequence.py"


def _example():
    spec = importlib.util.spec_from_file_location("sequence_example", PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~30 s on 2 busy cores: compiling the GRU/LSTM training step dominates
def test_trains_checkpoints_restores_and_plots(tmp_path, capsys):
    example = _example()
    argv = ["--epochs", "2", "--units", "8", "--batch-size", "128", "--output-dir", str(tmp_path)]
    assert example.main(argv) == 0
    out = capsys.readouterr().out
    assert "bidirectional/forward_gru/recurrent_kernel" in out  # model.summary() printed
    accuracies = [float(a) for a in re.findall(r"val_accuracy ([0-9.]+)", out)]
    assert len(accuracies) == 2 and accuracies[-1] > 0.2  # chance is 0.1
    assert "same predictions: True" in out
    assert (tmp_path / "history.png").read_bytes()[:4] == b"\x89PNG"
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["ckpt-1.safetensors", "ckpt-2.safetensors"]
    names = {n for n, _, _ in ps.checkpoint.list_variables(tmp_path / "checkpoints" / saved[-1])}
    assert "model/layers/1/recurrent_kernel" in names and "optimizer/iterations" in names
