"""python -m paramstore inspect: totals, escaped names, globs, closed pipes, foreign files."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import paramstore as ps
from paramstore import cli
from paramstore.checkpoint import write_arrays


def test_totals_and_glob(tmp_path, capsys):
    path = write_arrays(
        tmp_path / "c.safetensors",
        {"dense/w": np.ones((3, 4), np.float32), "dense/b": np.zeros(4), "head/w": np.ones(2)},
    )
    assert cli.main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "3 variables, 18 parameters, 96 B" in out
    assert cli.main(["inspect", path, "--name", "dense/*"]) == 0
    out = capsys.readouterr().out
    assert "2 variables, 16 parameters" in out and "head/w" not in out
    assert cli.main(["inspect", path, "--name", "nope*"]) == 1
    assert "no variable 'nope*'" in capsys.readouterr().err


def test_names_are_escaped(tmp_path, capsys):
    evil = "a\x1b[2J\nfake/row  [1]\udcff"
    path = write_arrays(tmp_path / "c.safetensors", {"ok": np.ones(1)})
    v = ps.Variable(np.ones(1), name="x")
    path = ps.Saver({evil: v, "ok": v}).save(tmp_path / "evil.safetensors")
    assert cli.main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b[2J\\nfake/row" in out and "\\udcff" in out
    assert len(out.strip().splitlines()) == 4  # title, head, two rows: no forged row


def test_a_readme_is_not_a_checkpoint(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# A project\n\nHello.\n")
    assert cli.main(["inspect", str(readme)]) == 1
    err = capsys.readouterr().err
    assert "is not a paramstore checkpoint" in err and "corrupt" not in err


def test_closed_pipe_is_quiet(tmp_path):
    arrays = {f"layer_{i:04d}/w": np.ones(2, np.float32) for i in range(3000)}
    path = write_arrays(tmp_path / "big.safetensors", arrays)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(cli.__file__))}
    proc = subprocess.run(
        f"{sys.executable} -m paramstore inspect {path} | head -n 2",
        shell=True,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert len(proc.stdout.splitlines()) == 2
    assert proc.stderr == "", proc.stderr
