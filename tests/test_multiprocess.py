"""Multi-process training and a sharded checkpoint, on JAX's own distributed runtime.

Two processes on 127.0.0.1 (``jax.distributed.initialize``, CPU collectives through gloo),
each with 2 local CPU devices, train a few Adam steps of an MLP whose variables are sharded
over all 4 devices, and save a checkpoint with ``ps.Saver`` (Orbax: each process writes
only its own shards). A third process, alone with 2 devices, builds the model on a
different mesh and restores it: every value equals what the trainers held.

This file is also the processes' script: ``python tests/test_multiprocess.py train
PROCESS_ID PORT DIR`` or ``... restore DIR``.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a worker process: configure JAX before it starts
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest

STEPS = 3
SIZES = [8, 16, 16, 4]
# (w spec, b spec) per layer over the 1-D mesh axis "x": column-, row-, column-parallel
SPECS = [((None, "x"), ("x",)), (("x", None), ()), ((None, "x"), ("x",))]
WORKER_TIMEOUT = 90  # seconds, per process


# ------------------------------------------------------------------------------ workers


def _model(mesh):
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import paramstore as ps

    rng = np.random.default_rng(0)
    layers = []
    with ps.name_scope("mlp"):
        for i, ((a, b), (w_spec, b_spec)) in enumerate(zip(zip(SIZES[:-1], SIZES[1:]), SPECS)):
            w = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
            layers.append(
                (
                    ps.Variable(w, name=f"w{i}", sharding=NamedSharding(mesh, P(*w_spec))),
                    ps.Variable(
                        np.zeros(b, np.float32),
                        name=f"b{i}",
                        sharding=NamedSharding(mesh, P(*b_spec)),
                    ),
                )
            )
    params = [v for pair in layers for v in pair]
    opt = ps.Optimizer(optax.adam(1e-2), params)
    return layers, params, opt


def _forward(layers, x):
    import jax

    for i, (w, b) in enumerate(layers):
        x = x @ w + b
        if i < len(layers) - 1:
            x = jax.nn.relu(x)
    return x


def train(process_id: int, port: int, directory: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import paramstore as ps

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    assert jax.process_count() == 2 and len(jax.devices()) == 4
    assert len(jax.local_devices()) == 2
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    layers, params, opt = _model(mesh)
    w0 = params[0]
    assert not w0.value().is_fully_addressable  # each process holds 2 of its 4 shards
    assert repr(w0) == "<ps.Variable 'mlp/w0' shape=(8, 16) dtype=float32, sharded over 4 devices>"

    @ps.function
    def step(x, y):
        loss, grads = ps.value_and_grad(lambda: jnp.mean((_forward(layers, x) - y) ** 2), params)()
        opt.apply_gradients(grads)
        return loss

    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, SIZES[0])).astype(np.float32)
    y = rng.standard_normal((32, SIZES[-1])).astype(np.float32)
    replicated = NamedSharding(mesh, P())
    xs, ys = jax.device_put(x, replicated), jax.device_put(y, replicated)  # same on both
    losses = [float(step(xs, ys)) for _ in range(STEPS)]
    assert step.trace_count == 1
    assert sum(e.runner._cache_size() for e in step._cache.values()) == 1  # no recompiling

    # a process-local variable (no placement) and a string one are saved from process 0
    epoch = ps.Variable(7 + process_id, name="epoch")
    note = ps.Variable(["trained", "on 4 devices"], name="note")
    variables = params + list(opt.variables) + [epoch, note]
    path = ps.Saver(variables).save(os.path.join(directory, "ckpt"), step=STEPS)
    variables = variables[:-2]
    # what every process holds, gathered, for the restoring process to compare with
    full = {
        v.name: np.asarray(multihost_utils.process_allgather(v.value(), tiled=True))
        for v in variables
    }
    if process_id == 0:
        np.savez(os.path.join(directory, "expected.npz"), **full)
        Path(directory, "result.json").write_text(json.dumps({"path": path, "losses": losses}))
    multihost_utils.sync_global_devices("done")
    jax.distributed.shutdown()


def restore(directory: str) -> None:
    import jax
    import numpy as np
    from jax.sharding import AxisType

    import paramstore as ps

    assert jax.process_count() == 1 and len(jax.devices()) == 2
    result = json.loads(Path(directory, "result.json").read_text())
    expected = dict(np.load(os.path.join(directory, "expected.npz")))
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,))  # a different mesh
    _, params, opt = _model(mesh)
    variables = params + list(opt.variables)
    listed = {
        name: (shape, dtype) for name, shape, dtype in ps.checkpoint.list_variables(result["path"])
    }
    assert set(listed) == set(expected) | {"epoch", "note"}, (sorted(listed), sorted(expected))
    for name, arr in expected.items():
        assert listed[name] == (arr.shape, arr.dtype), (name, listed[name], arr.shape, arr.dtype)
    before = {v.name: v.sharding for v in variables}
    epoch = ps.Variable(0, name="epoch")
    note = ps.Variable(["", ""], name="note")
    ps.Saver([*variables, epoch, note]).restore(result["path"])
    assert int(epoch.numpy()) == 7 and note.numpy().tolist() == ["trained", "on 4 devices"]
    for v in variables:
        assert v.sharding == before[v.name], (v.name, v.sharding)
        np.testing.assert_array_equal(v.numpy(), expected[v.name], err_msg=v.name)
    w0 = expected["mlp/w0"]
    np.testing.assert_array_equal(ps.checkpoint.load_variable(result["path"], "mlp/w0"), w0)
    assert int(opt.iterations.numpy()) == STEPS
    print("restored", len(variables), "variables")


# ---------------------------------------------------------------------------- the test


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(procs: list[tuple[subprocess.Popen, Path]], timeout: float) -> list[tuple[int, str]]:
    """Wait for every process, at most ``timeout`` seconds; as soon as one fails (its peer
    would wait for it until JAX's own timeouts), or at the deadline, kill the others.
    Returns ``(return code, output)`` per process, -9 for a killed one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p, _ in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            break
        time.sleep(0.1)
    out = []
    for p, log in procs:
        if p.poll() is None:
            p.kill()
        rc = p.wait()
        text = log.read_text(errors="replace")
        out.append((rc, text + ("\n[killed]" if rc == -9 else "")))
    return out


def _spawn(log: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, __file__, *args], env=env, stdout=f, stderr=subprocess.STDOUT
        )
    return proc, log


@pytest.mark.slow
def test_two_processes_train_save_shards_and_restore_on_another_mesh(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    for attempt in range(2):  # a second try only if the free port was taken meanwhile
        directory = tmp_path / f"run{attempt}"
        directory.mkdir()
        port = _free_port()
        procs = [
            _spawn(tmp_path / f"train{attempt}-{i}.log", "train", str(i), str(port), str(directory))
            for i in range(2)
        ]
        results = _run(procs, WORKER_TIMEOUT)
        ok = len(results) == 2 and all(rc == 0 for rc, _ in results)
        if ok or not any("address already in use" in out.lower() for _, out in results):
            break
    logs = "\n".join(f"--- process (rc {rc}):\n{out[-3000:]}" for rc, out in results)
    assert ok, f"the training processes failed:\n{logs}"
    result = json.loads((directory / "result.json").read_text())
    assert len(result["losses"]) == STEPS and result["losses"][-1] < result["losses"][0]

    # each process wrote its own shards (Orbax's per-process OCDBT stores)
    ckpt = Path(result["path"])
    stores = sorted(p.name for p in ckpt.rglob("ocdbt.process_*") if p.is_dir())
    assert stores == ["ocdbt.process_0", "ocdbt.process_1"], stores
    for store in ckpt.rglob("ocdbt.process_*"):
        assert any(f.is_file() for f in store.rglob("*")), store

    [(rc, out)] = _run(
        [_spawn(tmp_path / "restore.log", "restore", str(directory))], WORKER_TIMEOUT
    )
    assert rc == 0, f"the restoring process failed (rc {rc}):\n{out[-5000:]}"
    assert "restored" in out


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        restore(sys.argv[2])
