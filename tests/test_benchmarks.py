"""The benchmark scripts still run (smoke only: figures are read by people, not asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_eager_benchmark_prints_its_table():
    out = run("eager.py", "--calls", "50", "--repeats", "1")
    assert "ps.Variable: v.assign_add(d) / v + 1" in out


@pytest.mark.slow
def test_step_benchmark_prints_ratios_to_the_reference():
    out = run("step.py", "--quick", "--models", "dispatch", "--variants", "ps.function")
    assert "jax.jit (donated) [reference]" in out and "ps.function" in out
    assert "first call (trace+compile+step), ps.function / jax.jit" in out


@pytest.mark.slow
def test_depth_benchmark_prints_the_targets():
    root = str(BENCH.parent)
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "depth.py"),
            "--quick",
            "--variants",
            "ps.nn.Repeat,ps.nn.Repeat(remat=True),jax scan [reference]",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step at 4 layers, ps.nn.Repeat / reference" in done.stdout
    assert "temp memory at 4 layers, remat=True / plain" in done.stdout


@pytest.mark.slow
def test_metrics_benchmark_prints_ratios_to_the_hand_written_sums():
    out = run("metrics.py", "--quick")
    assert "ps.function + hand-written sums [reference]" in out
    assert "ps.function + ps.metrics (3 metrics)" in out and "async cpu us" in out


@pytest.mark.slow
def test_repeat_abstract_benchmark_prints_its_rows_and_ratios():
    done = subprocess.run(
        [sys.executable, str(BENCH / "repeat_abstract.py"), "--quick", "--runs", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(BENCH.parent)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| abstract build n=48" in done.stdout and "initialize n=2 / concrete" in done.stdout
