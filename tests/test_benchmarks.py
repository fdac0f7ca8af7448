"""The benchmark scripts still run (smoke only: figures are read by people, not asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def run(script: str, *args: str, timeout: int = 300) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(BENCH.parent)},  # this checkout's paramstore
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
def test_transformer_benchmark_runs_the_repeat_and_the_unrolled_model():
    """Both block layouts of examples/transformer.py: its default ``ps.nn.Repeat`` (the
    reference's params_of once iterated it as a list: TypeError, every --config) and
    ``--unrolled``."""
    for extra in ((), ("--unrolled",)):
        out = run("transformer.py", "--config", "tiny", "--quick", *extra)
        assert "| jax.jit, donated (reference)" in out and "| ps.function + ps.nn" in out, out
        assert ("in a Python list" if extra else "in a ps.nn.Repeat (lax.scan)") in out, out


@pytest.mark.slow
def test_alternating_benchmark_prints_its_rows():
    out = run("alternating.py", "--quick")
    assert "train alternating with eval" in out and "train then w.value()" in out
    assert "another thread's read + assign + compiled call during a" in out


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
    assert "step at 2 layers, ps.nn.Repeat / reference" in done.stdout
    assert "temp memory at 2 layers, remat=True / plain" in done.stdout


@pytest.mark.slow
def test_metrics_benchmark_prints_ratios_to_the_hand_written_sums():
    out = run("metrics.py", "--quick")
    assert "ps.function + hand-written sums [reference]" in out
    assert "ps.function + ps.metrics (3 metrics)" in out and "async cpu us" in out


@pytest.mark.slow
def test_abstract_benchmark_prints_every_row_against_its_anchor():
    pytest.importorskip("flax")
    pytest.importorskip("orbax.checkpoint")
    root = str(BENCH.parent)
    done = subprocess.run(
        [sys.executable, str(BENCH / "abstract.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for row in (
        "jax.ShapeDtypeStruct(sharding=) by hand [anchor]",
        "ps.abstract() + ps.device(LayoutMap) + build",
        "plain Orbax restore(ShapeDtypeStructs) [anchor]",
        "ps.Checkpoint(model=abstract).restore",
        "Flax NNX: StandardCheckpointer.restore + merge",
        "ps.initialize(abstract model)",
        "jax.jit(init, out_shardings=...) [anchor]",
    ):
        assert row in out, (row, out)
    lines = {line[:54].strip(): line.split() for line in out.splitlines()}
    shard = float(re.search(r"a kernel's shard: ([\d.]+) MiB", out)[1])
    # restore and init never hold more than one shard of an array on a device
    for row in ("ps.Checkpoint(model=abstract).restore", "ps.initialize(abstract model)"):
        assert 0 < float(lines[row][-1]) <= shard, lines[row]
    # an abstract model allocates nothing
    assert float(lines["ps.abstract() + ps.device(LayoutMap) + build"][-1]) == 0.0


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


@pytest.mark.slow
def test_sharded_benchmark_prints_the_optimizer_placement_rows():
    """The optimizer-state rows only (the other row groups take minutes); the memory
    figures are exact, so the smallest size checks them too."""
    out = run("sharded.py", "--quick", "--rows", "optimizer")
    rows = {
        line[:30].strip(): line[30:].split()
        for line in out.splitlines()
        if line.startswith(("replicated", "ZeRO-1", "slots in"))
    }
    assert len(rows) == 4, out
    slots = {name: float(cells[6]) for name, cells in rows.items()}  # "/ repl." column
    assert slots["replicated slots (default)"] == 1.0
    assert slots["ZeRO-1 (slots split over data)"] <= 1 / 8 + 0.05
    assert slots["slots in pinned_host"] == slots["ZeRO-1 + pinned_host"] == 0.0


@pytest.mark.slow
@pytest.mark.torch
def test_pretrained_benchmark_prints_its_rows_and_ratios():
    done = subprocess.run(
        [sys.executable, str(BENCH / "pretrained.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(BENCH.parent)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for row in (
        "| load_file + device_put [reference]",
        "| init_from_checkpoint (abstract, FSDP)",
        "| export_safetensors (sharded variables)",
        "| examples/gpt2.py load + first logits",
        "| examples/llama.py load + first logits",
        "| Llama step, ps.function + ps.Optimizer",
    ):
        assert row in done.stdout, done.stdout
    # the two Llama steps start from the same weights: the same first loss
    losses = re.findall(r"first loss (\d+\.\d+)", done.stdout)
    assert len(losses) == 2 and losses[0] == losses[1], done.stdout


@pytest.mark.slow
def test_recipes_benchmark_prints_its_targets_and_op_counts():
    root = str(BENCH.parent)
    done = subprocess.run(
        [sys.executable, str(BENCH / "recipes.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "target: EMA of every parameter, ps / reference" in done.stdout
    assert "target: all but the head frozen, ps / reference" in done.stdout
    frozen = re.search(r"\| ps.function, blocks frozen \| (\d+) \|", done.stdout)
    hand = re.search(r"\| jax.jit, head only \[reference\] \| (\d+) \|", done.stdout)
    assert frozen and hand and frozen.group(1) == hand.group(1)  # no slot work when frozen


@pytest.mark.slow
def test_recipes_precision_benchmark_prints_the_targets():
    out = run("recipes_precision.py", "--quick", timeout=600)
    assert "step, ps mixed_bfloat16 / jax bf16" in out
    assert "temp memory, ps mixed_bfloat16 / ps float32" in out
    assert "step, ps LossScaleOptimizer / jax+optax loss scaling" in out
    assert "temp memory at batch 8, ps mixed_bfloat16 / ps float32" in out


@pytest.mark.slow
def test_recurrent_benchmark_prints_ratios_and_first_calls():
    out = run("recurrent.py", "--quick")
    assert "pure JAX: lax.scan cell, jax.jit, donated [reference]" in out
    assert "step, ps.function / pure JAX:" in out and "Keras" in out
    assert "trace + compile, seq 16 / seq 4:" in out


@pytest.mark.slow
def test_quantized_benchmark_prints_its_rows():
    out = run("quantized.py", "--quick")
    assert "QLoRA argument bytes / float32 LoRA's" in out
    assert "init_from_checkpoint / anchor" in out and "ps.plan:" in out
