"""``python -m paramstore demo``: runs in-process, reports accuracy, writes a checkpoint."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import paramstore as ps
from paramstore import cli, demo


def _accuracy(out: str) -> float:
    found = re.search(r"test accuracy: ([0-9.]+)", out)
    assert found, out
    return float(found.group(1))


def test_short_run_reports_accuracy_and_saves(tmp_path, capsys):
    out_dir = tmp_path / "run"
    argv = ["--steps", "30", "--batch-size", "32", "--seed", "1", "--output-dir", str(out_dir)]
    assert demo.main(argv) == 0
    out = capsys.readouterr()
    # 30 Adam steps on digits reach 0.82-0.88 for seeds 1-3; chance is 0.1.
    assert 0.6 < _accuracy(out.out) <= 1.0
    assert "training" in out.err  # the tqdm progress bar
    files = sorted(p.name for p in out_dir.iterdir())
    assert files == ["ckpt-30.safetensors"]
    names = {name for name, _, _ in ps.checkpoint.list_variables(out_dir / files[0])}
    assert "optimizer/iterations" in names
    assert "model/layers/0/kernel" in names  # ps.Checkpoint paths
    assert int(ps.checkpoint.load_variable(out_dir / files[0], "optimizer/iterations")) == 30
    # The model's 6 variables and the optimizer's 14: both counts said, and they add up.
    assert "model: 6 variables, 17226 parameters" in out.out
    assert "the optimizer's 14 variables" in out.out
    assert f"saved 20 variables (model 6, optimizer 14) to {out_dir}" in out.out
    assert len(names) == 20


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"paramstore {ps.__version__}"


def test_same_seed_same_result_and_runs_twice_in_one_process(tmp_path, capsys):
    argv = ["--steps", "20", "--no-progress", "--output-dir", str(tmp_path)]
    assert demo.main(argv) == 0
    first = capsys.readouterr()
    assert first.err == ""  # --no-progress
    assert demo.main(argv) == 0  # a second run in the same process: no name collisions
    second = capsys.readouterr()
    loss = re.compile(r"final batch loss ([0-9.]+)")
    assert loss.search(first.out).group(1) == loss.search(second.out).group(1)  # type: ignore[union-attr]


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for option in ["--steps", "--batch-size", "--seed", "--learning-rate", "--output-dir"]:
        assert option in text
    assert "paramstore-demo" in text  # the default output directory is shown


def test_bad_options_are_rejected(capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(["--steps", "0"])
    assert e.value.code == 2
    assert "positive integer" in capsys.readouterr().err


def test_missing_demo_extra_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn -> ImportError
    assert demo.main(["--steps", "1"]) == 1
    assert "pip install 'paramstore[demo]'" in capsys.readouterr().err


@pytest.mark.slow
def test_full_default_run_reaches_95_percent(tmp_path):
    """The real command, defaults and all, in a subprocess (as a user runs it)."""
    done = subprocess.run(
        [sys.executable, "-m", "paramstore", "demo", "--output-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert _accuracy(done.stdout) >= 0.95, done.stdout
    assert (tmp_path / "out" / "ckpt-600.safetensors").exists()
