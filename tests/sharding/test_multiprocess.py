"""Multi-process FSDP training with an async sharded checkpoint, killed and resumed elsewhere.

Two processes on 127.0.0.1 (``jax.distributed.initialize``, CPU collectives through gloo),
each with 4 local CPU devices, train an MLP whose parameters and Adam slots are sharded
FSDP-style over all 8 devices (rows split over the mesh axis ``"data"``). They save step 2
with an async ``CheckpointManager`` (each process writes only its own shards) and wait for
it, train two more steps, start an async save of step 4 and are killed (``SIGKILL``, each
process itself) while it is being written. A third process, alone with 8 devices, builds
the model on its own mesh, restores the latest checkpoint (step 2, or step 4 if it was
complete before the kill): every value equals what the trainers held at that step, and
training goes on.

This file is also the processes' script: ``python tests/sharding/test_multiprocess.py train
PROCESS_ID PORT DIR`` or ``... resume DIR`` (docs/sharding.md starts N processes the same
way).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a worker process: configure JAX before it starts
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4 if sys.argv[1] == "train" else 8)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")

import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

SIZES = [16, 32, 32, 8]
WORKER_TIMEOUT = 120  # seconds, per group of processes (a run takes ~25 s each)


# ------------------------------------------------------------------------------ workers


def _model(mesh):
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import paramstore as ps

    rng = np.random.default_rng(0)
    fsdp = NamedSharding(mesh, P("data"))  # rows split over every device
    params = []
    with ps.name_scope("mlp"):
        for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
            w = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
            params.append(ps.Variable(w, name=f"w{i}", sharding=fsdp))
            params.append(ps.Variable(np.zeros(b, np.float32), name=f"b{i}", sharding=fsdp))
    opt = ps.Optimizer(optax.adam(1e-2), params)
    return params, opt


def _step_fn(params, opt):
    import jax
    import jax.numpy as jnp

    import paramstore as ps

    def forward(x):
        for i in range(0, len(params), 2):
            x = x @ params[i] + params[i + 1]
            if i < len(params) - 2:
                x = jax.nn.relu(x)
        return x

    @ps.function
    def step(x, y):
        loss, grads = ps.value_and_grad(lambda: jnp.mean((forward(x) - y) ** 2), params)()
        opt.apply_gradients(grads)
        return loss

    return step


def _batch(mesh):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, SIZES[0])).astype(np.float32)
    y = rng.standard_normal((64, SIZES[-1])).astype(np.float32)
    batch = NamedSharding(mesh, P("data"))  # each process feeds the same global batch
    return jax.device_put(x, batch), jax.device_put(y, batch)


def train(process_id: int, port: int, directory: str) -> None:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType

    import paramstore as ps

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=30,
    )
    assert jax.process_count() == 2 and len(jax.devices()) == 8
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    params, opt = _model(mesh)
    assert not params[0].value().is_fully_addressable  # 4 of its 8 shards live here
    step = _step_fn(params, opt)
    x, y = _batch(mesh)
    note = ps.Variable(["trained", "on 2 x 4 devices"], name="note")
    variables = [*params, *opt.variables, note]
    manager = ps.CheckpointManager(os.path.join(directory, "ckpts"), variables, async_save=True)
    assert manager.saver._writes_sharded()  # the default with several processes

    def gathered() -> dict:
        return {
            v.name: np.asarray(multihost_utils.process_allgather(v.value(), tiled=True))
            for v in variables[:-1]
        }

    losses = []
    expected = {}
    for target in (2, 4):
        while int(opt.iterations.numpy()) < target:
            losses.append(float(step(x, y)))
        expected[target] = gathered()
        if process_id == 0:
            np.savez(os.path.join(directory, f"expected-{target}.npz"), **expected[target])
            Path(directory, "losses.json").write_text(json.dumps(losses))
        multihost_utils.sync_global_devices(f"expected-{target}")
        manager.save(target)  # returns once the values are off the devices
        if target == 2:
            manager.wait()
            _corrupt_copy_is_refused_by_every_process(directory, variables, process_id)
    assert step.trace_count == 1
    sys.stdout.flush()
    # Both reach this point before either dies: a process still inside save(4)'s
    # cross-process steps when its peer is killed is aborted by JAX's coordination
    # service (rc -6) instead of killing itself mid-write.
    multihost_utils.sync_global_devices("kill")
    os.kill(os.getpid(), signal.SIGKILL)  # killed while step 4 is written


def _corrupt_copy_is_refused_by_every_process(directory, variables, process_id) -> None:
    """A flipped bit in a file of process 1's shard store: process 1 checks that store's
    digests, yet both processes raise (the verdict is shared) and no variable changes."""
    import shutil

    import numpy as np
    from jax.experimental import multihost_utils

    import paramstore as ps

    corrupt = os.path.join(directory, "corrupt")
    if process_id == 0:
        shutil.copytree(os.path.join(directory, "ckpts", "ckpt-2"), corrupt)
        store = Path(corrupt, "arrays", "ocdbt.process_1")
        victim = max((f for f in store.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        victim.write_bytes(bytes(raw))
    multihost_utils.sync_global_devices("corrupt-copy")
    before = [
        np.asarray(multihost_utils.process_allgather(v.value(), tiled=True)) for v in variables[:-1]
    ]
    try:
        ps.Saver(variables).restore(corrupt)
    except ps.checkpoint.CheckpointError as e:
        assert "corrupt" in str(e), e
    else:
        raise AssertionError(f"process {process_id} restored a corrupt checkpoint")
    after = [
        np.asarray(multihost_utils.process_allgather(v.value(), tiled=True)) for v in variables[:-1]
    ]
    assert all(np.array_equal(b, a) for b, a in zip(before, after))


def resume(directory: str) -> None:
    import jax
    import numpy as np
    from jax.sharding import AxisType

    import paramstore as ps

    assert jax.process_count() == 1 and len(jax.devices()) == 8
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    params, opt = _model(mesh)  # rows split over "data" (2 ways) of another mesh
    note = ps.Variable(["", ""], name="note")
    variables = [*params, *opt.variables, note]
    shardings = {v.name: v.sharding for v in variables}
    manager = ps.CheckpointManager(os.path.join(directory, "ckpts"), variables)
    latest = manager.latest_step
    assert latest in (2, 4), manager.checkpoints
    assert manager.restore_latest() is not None
    expected = dict(np.load(os.path.join(directory, f"expected-{latest}.npz")))
    assert note.numpy().tolist() == ["trained", "on 2 x 4 devices"]
    for v in variables[:-1]:
        assert v.sharding == shardings[v.name], v.name
        np.testing.assert_array_equal(v.numpy(), expected[v.name], err_msg=v.name)
    assert int(opt.iterations.numpy()) == latest
    step = _step_fn(params, opt)
    loss = float(step(*_batch(mesh)))
    assert np.isfinite(loss) and int(opt.iterations.numpy()) == latest + 1
    print(f"resumed from step {latest} on 8 devices; loss {loss:.4f}")


# ---------------------------------------------------------------------------- the test


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(procs: list[tuple[subprocess.Popen, Path]], timeout: float) -> list[tuple[int, str]]:
    """Wait for every process, at most ``timeout`` seconds; as soon as one fails (its peer
    would wait for it until JAX's own timeouts), or at the deadline, kill the others.
    Returns ``(return code, output)`` per process."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p, _ in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0, -9) for c in codes):
            break
        time.sleep(0.1)
    out = []
    for p, log in procs:
        timed_out = p.poll() is None
        if timed_out:
            p.kill()
        rc = p.wait()
        text = log.read_text(errors="replace")
        out.append((rc, text + ("\n[killed by the test: timeout]" if timed_out else "")))
    return out


def _spawn(log: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    root = str(Path(__file__).resolve().parents[2])  # this checkout's paramstore
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, __file__, *args], env=env, stdout=f, stderr=subprocess.STDOUT
        )
    return proc, log


@pytest.mark.slow
def test_two_processes_train_fsdp_are_killed_mid_save_and_resume_on_one(tmp_path):
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
        ok = all(rc == -signal.SIGKILL for rc, _ in results)  # each killed itself mid-save
        if ok or not any("address already in use" in out.lower() for _, out in results):
            break
    logs = "\n".join(f"--- process (rc {rc}):\n{out[-3000:]}" for rc, out in results)
    assert ok, f"the training processes did not reach the kill:\n{logs}"
    losses = json.loads((directory / "losses.json").read_text())
    assert len(losses) == 4 and losses[-1] < losses[0]

    # step 2: each process wrote its own shards (Orbax's per-process OCDBT stores) and
    # its own part of the manifest
    ckpt = directory / "ckpts" / "ckpt-2"
    stores = sorted(p.name for p in ckpt.rglob("ocdbt.process_*") if p.is_dir())
    assert stores == ["ocdbt.process_0", "ocdbt.process_1"], stores
    parts = sorted(p.name for p in (ckpt / "paramstore").iterdir())
    assert parts == ["metadata", "process_0.json", "process_1.json"], parts

    [(rc, out)] = _run([_spawn(tmp_path / "resume.log", "resume", str(directory))], WORKER_TIMEOUT)
    assert rc == 0, f"the resuming process failed (rc {rc}):\n{out[-5000:]}"
    assert "resumed from step" in out


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        resume(sys.argv[2])
