"""Checkpoints across processes: SIGKILL during a save, async flush at exit, the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import paramstore as ps
from paramstore import checkpoint
from paramstore.checkpoint import CheckpointManager

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    """The environment of a child Python: this checkout importable, CPU only."""
    return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", **extra)


def _python(*args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python *args`` to completion (bounded) and capture its output."""
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=_env(**extra_env), timeout=120
    )


# A child that saves checkpoint 1 of 16 variables of 4 MiB (64 MiB), then checkpoint 2 with
# every value + 1. With PAUSE set, it stops in the middle of writing checkpoint 2.
CHILD = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import paramstore as ps
    from paramstore import checkpoint
    from paramstore.checkpoint.formats.safetensors import file as _checkpoint_file

    directory, pause = sys.argv[1], sys.argv[2] == "pause"
    variables = [ps.Variable(np.full(2**20, i, np.float32), name=f"layer_{i}/w") for i in range(16)]
    manager = checkpoint.CheckpointManager(directory, variables)
    manager.save(1)
    if pause:
        real, written = _checkpoint_file._write_tensor, []

        def write_then_hang(f, t, checksums):
            real(f, t, checksums)
            written.append(t.name)
            if len(written) == 5:
                f.flush()
                print("MIDWAY", flush=True)
                time.sleep(120)

        _checkpoint_file._write_tensor = write_then_hang
    step = 2
    while True:
        for v in variables:
            v.assign(v.value() + 1)
        manager.save(step)
        print("SAVED", step, flush=True)
        step += 1
        if pause:
            break
    """
)


def _spawn(directory: Path, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )


def _fresh_variables() -> list[ps.Variable]:
    return [ps.Variable(np.zeros(2**20, np.float32), name=f"layer_{i}/w") for i in range(16)]


def test_sigkill_mid_save_keeps_the_previous_checkpoint(tmp_path):
    child = _spawn(tmp_path, "pause")
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip() == "MIDWAY", child.stderr.read() if child.stderr else line
    temps = [n for n in os.listdir(tmp_path) if n.startswith(".ckpt-2.safetensors.tmp-")]
    assert len(temps) == 1 and (tmp_path / temps[0]).stat().st_size > 4 * 2**20
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    assert not (tmp_path / "ckpt-2.safetensors").exists()
    variables = _fresh_variables()
    manager = CheckpointManager(tmp_path, variables)  # cleans the dead writer's temp file
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-1.safetensors"]
    assert not (tmp_path / temps[0]).exists()
    assert manager.restore_latest() == str(tmp_path / "ckpt-1.safetensors")
    assert [float(v.value()[0]) for v in variables] == [float(i) for i in range(16)]


def test_sigkill_at_a_random_moment_never_leaves_a_broken_checkpoint(tmp_path):
    child = _spawn(tmp_path, "loop")
    assert child.stdout is not None
    assert child.stdout.readline().startswith("SAVED")
    time.sleep(np.random.default_rng().uniform(0.0, 0.5))
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    variables = _fresh_variables()
    manager = CheckpointManager(tmp_path, variables, max_to_keep=None)
    assert manager.checkpoints, os.listdir(tmp_path)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    for path in manager.checkpoints:  # every listed checkpoint is complete and verified
        step = int(Path(path).stem.split("-")[1])
        manager.saver.restore(path)
        assert [float(v.value()[-1]) for v in variables] == [i + step - 1.0 for i in range(16)]


def test_async_save_is_flushed_at_interpreter_exit(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import paramstore as ps
        from paramstore import checkpoint

        v = ps.Variable(np.arange(2**22, dtype=np.float32), name="big")
        manager = checkpoint.CheckpointManager(sys.argv[1], [v], async_save=True)
        manager.save(7)
        print("RETURNED", flush=True)  # no wait(): exit must flush
        """
    )
    run = _python("-c", code, str(tmp_path))
    assert run.returncode == 0, run.stderr
    value = checkpoint.load_variable(tmp_path / "ckpt-7.safetensors", "big")
    assert np.array_equal(value, np.arange(2**22, dtype=np.float32))


def test_async_save_error_at_exit_is_reported(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        import paramstore as ps
        from paramstore import checkpoint
        from paramstore.checkpoint import manager as _checkpoint_manager

        def fail(path, arrays):
            raise OSError("disk on fire")

        manager = checkpoint.CheckpointManager(sys.argv[1], [ps.Variable(1.0)], async_save=True)
        _checkpoint_manager.write_arrays = fail
        manager.save(1)
        """
    )
    run = _python("-c", code, str(tmp_path))
    assert "background checkpoint save failed" in run.stderr and "disk on fire" in run.stderr


def test_python_m_paramstore_inspect(tmp_path):
    v = ps.Variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="dense/w")
    path = checkpoint.Saver([v]).save(tmp_path / "m.safetensors")
    ok = _python("-m", "paramstore", "inspect", path, "--values")
    assert ok.returncode == 0, ok.stderr
    assert "dense/w" in ok.stdout and "[2, 3]" in ok.stdout and "2.5" in ok.stdout
    Path(path).write_bytes(b"\x10" + Path(path).read_bytes()[1:])  # header length now lies
    bad = _python("-m", "paramstore", "inspect", path)
    assert bad.returncode != 0 and "corrupt" in bad.stderr and path in bad.stderr
    assert "Traceback" not in bad.stderr


def test_restore_keeps_multi_device_sharding_and_placement(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        import jax
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        import paramstore as ps
        from paramstore import checkpoint

        mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
        sharding = NamedSharding(mesh, P("x", "y"))
        expected = np.arange(64, dtype=np.float32).reshape(8, 8)
        w = ps.Variable(expected, name="w", sharding=sharding)
        b = ps.Variable(np.ones(3, np.float32), name="b", device=jax.devices()[3])
        manager = checkpoint.CheckpointManager(sys.argv[1], [w, b], async_save=True)
        manager.save(1)
        w.assign(np.zeros((8, 8), np.float32))
        b.assign(np.zeros(3, np.float32))
        manager.restore_latest()
        assert w.value().sharding == sharding and len(w.value().addressable_shards) == 4
        assert b.device == jax.devices()[3]
        assert np.array_equal(w.numpy(), expected) and np.all(b.numpy() == 1)
        print("OK")
        """
    )
    run = _python("-c", code, str(tmp_path), XLA_FLAGS="--xla_force_host_platform_device_count=4")
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr
