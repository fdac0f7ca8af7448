"""Restores atomic with respect to steps, checked before anything is assigned; deferred
values that survive a wrong build; CheckpointManager and Saver from several threads; and the
smaller bad inputs of issue 16 (each: error type, message, nothing changed, time bound)."""

from __future__ import annotations

import os
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

import paramstore as ps
from paramstore import checkpoint
from paramstore.checkpoint import CheckpointError, CheckpointManager, Saver

BOUND = 60.0  # seconds for a threaded test: longer is a deadlock


def run_threads(*targets, timeout=BOUND):
    errors: list[BaseException] = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:
                errors.append(e)

        return run

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "deadlock: a thread is still running"
    return errors


@pytest.mark.parametrize("how", ["saver", "checkpoint", "manager"])
def test_a_restore_is_atomic_with_respect_to_steps(tmp_path, how):
    a = ps.Variable(jnp.zeros(()), name="a")
    b = ps.Variable(jnp.zeros(()), name="b")
    # many variables restored between a and b widen the window a torn restore would show
    others = [ps.Variable(jnp.zeros(8), name=f"m{i:02d}") for i in range(60)]
    holder = ps.Module()
    holder.a, holder.others, holder.z = a, others, b  # paths: a, others/*, z
    ckpt = ps.Checkpoint(model=holder)
    manager = CheckpointManager(tmp_path / "run", ckpt if how != "saver" else [a, *others, b])
    path = manager.save(0)  # a = b = 0

    @ps.function
    def step():
        a.assign_add(1.0)
        b.assign_add(1.0)

    @ps.function
    def gap():
        return b.value() - a.value()

    restore = {
        "saver": lambda: Saver([a, *others, b]).restore(path),
        "checkpoint": lambda: ckpt.restore(path),
        "manager": manager.restore_latest,
    }[how]
    stop = threading.Event()
    torn: list[float] = []

    def steps():
        while not stop.is_set():
            step()

    def restores():
        end = time.perf_counter() + 2.0
        while time.perf_counter() < end:
            restore()
        stop.set()

    def reads():
        while not stop.is_set():
            g = float(gap())
            if g != 0:
                torn.append(g)

    assert run_threads(steps, restores, reads) == []
    assert torn == []
    assert float(b.numpy()) == float(a.numpy())


def test_restore_latest_checks_before_assigning(tmp_path):
    model = ps.Module()
    model.w = ps.Variable(np.ones(3, np.float32), name="w")
    CheckpointManager(tmp_path / "run", ps.Checkpoint(model=model)).save(1)
    bigger = ps.Module()
    bigger.w = ps.Variable(np.zeros(3, np.float32), name="w")
    bigger.extra = ps.Variable(np.zeros(2, np.float32), name="extra")
    manager = CheckpointManager(tmp_path / "run", ps.Checkpoint(model=bigger))
    with pytest.raises(CheckpointError, match=r"no value for 1 variable\(s\).*model/extra"):
        manager.restore_latest()
    assert bigger.w.numpy().tolist() == [0, 0, 0]  # not half-restored
    assert manager.restore_latest(allow_missing=True).endswith("ckpt-1.safetensors")
    assert bigger.w.numpy().tolist() == [1, 1, 1]


def test_a_deferred_value_survives_a_build_of_the_wrong_shape(tmp_path):
    layer = ps.nn.Dense(3)
    layer(jnp.ones((1, 4)))
    layer.kernel.assign(np.full((4, 3), 5.0, np.float32))
    path = ps.Checkpoint(layer=layer).save(tmp_path / "c.safetensors")
    fresh = ps.nn.Dense(3)
    status = ps.Checkpoint(layer=fresh).restore(path)
    with pytest.raises(CheckpointError, match=r"shape \(4, 3\).*stays pending"):
        fresh(jnp.ones((1, 6)))
    with pytest.raises(CheckpointError, match="layer/kernel"):
        status.assert_consumed()  # still pending, and named
    fresh(jnp.ones((1, 4)))  # the right build receives the saved kernel
    np.testing.assert_array_equal(fresh.kernel.numpy(), np.full((4, 3), 5.0))
    status.assert_consumed()


def test_a_sharded_checkpoint_without_its_metadata_is_a_checkpoint_error(tmp_path):
    broken = tmp_path / "ckpt-3"
    (broken / "arrays").mkdir(parents=True)
    v = ps.Variable(np.ones(2, np.float32), name="v")
    for call in (lambda: checkpoint.list_variables(broken), lambda: Saver([v]).restore(broken)):
        with pytest.raises(CheckpointError, match="lacks its metadata"):
            call()
    assert v.numpy().tolist() == [1, 1]


def test_a_symlinked_checkpoint_does_not_break_later_saves(tmp_path):
    elsewhere = tmp_path / "kept"
    (elsewhere / "paramstore").mkdir(parents=True)
    (elsewhere / "paramstore" / "metadata").write_text("{}")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(elsewhere, run / "ckpt-0")  # a sharded-looking directory, linked in
    v = ps.Variable(np.ones(2, np.float32), name="v")
    manager = CheckpointManager(run, [v], max_to_keep=2)
    for step in (1, 2, 3):
        manager.save(step)
    assert [os.path.basename(p) for p in manager.checkpoints] == [
        "ckpt-2.safetensors",
        "ckpt-3.safetensors",
    ]
    assert (elsewhere / "paramstore" / "metadata").exists()  # the link went, not its target


def test_bad_saver_and_checkpoint_arguments_are_type_errors():
    v = ps.Variable(np.ones(2, np.float32), name="v")
    with pytest.raises(TypeError, match="checkpoint name must be a str, got int 1"):
        Saver({1: v})
    with pytest.raises(TypeError, match="sharded must be None, True or False, got 'yes'"):
        ps.Checkpoint(v=v, sharded="yes")


def test_an_int64_global_step_into_int32_gives_specific_advice(tmp_path):
    path = checkpoint.write_arrays(tmp_path / "c.safetensors", {"global_step": np.int64(41)})
    step = ps.Variable(np.int32(0), name="global_step")
    with pytest.raises(CheckpointError, match=r"global_step as int64.*load_variable"):
        Saver({"global_step": step}).restore(path)
    assert int(step.numpy()) == 0
    step.assign(int(checkpoint.load_variable(path, "global_step")))  # the advice works
    assert int(step.numpy()) == 41


def test_an_async_manager_from_two_threads(tmp_path):
    v = ps.Variable(np.zeros(64, np.float32), name="v")
    manager = CheckpointManager(tmp_path / "run", [v], max_to_keep=3, async_save=True)
    counter = iter(range(10_000))
    lock = threading.Lock()

    def saves():
        for _ in range(40):
            with lock:
                step = next(counter)
            manager.save(step)

    assert run_threads(saves, saves) == []
    manager.wait()
    assert len(manager.checkpoints) == 3
    for path in manager.checkpoints:
        assert checkpoint.load_variable(path, "v").shape == (64,)


def test_saves_to_one_path_from_two_threads_never_lose_the_checkpoint(tmp_path):
    v = ps.Variable(np.arange(1000, dtype=np.float32), name="v")
    path = Saver([v]).save(tmp_path / "c.safetensors")
    stop = threading.Event()
    seen: list[int] = []

    def saves():
        for _ in range(30):
            Saver([v]).save(path)
        stop.set()

    def reads():
        while not stop.is_set():
            seen.append(int(checkpoint.load_variable(path, "v")[-1]))
            time.sleep(0)

    assert run_threads(saves, saves, reads) == []
    assert seen and set(seen) == {999}
    assert [n for n in os.listdir(tmp_path) if n != "c.safetensors"] == []


def test_sharded_saves_and_reads_of_one_path_from_threads(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    v = ps.Variable(np.arange(100, dtype=np.float32), name="v")
    path = Saver([v], sharded=True).save(tmp_path / "s")
    errors: list[str] = []

    def saves():
        for _ in range(4):
            Saver([v], sharded=True).save(path)

    def reads():
        for _ in range(12):
            try:  # before: the directory's files were read while another thread replaced them
                assert checkpoint.load_variable(path, "v")[-1] == 99
            except Exception as e:
                errors.append(repr(e)[:300])

    assert run_threads(saves, saves, reads) == []
    assert errors == []
    assert checkpoint.load_variable(path, "v").tolist() == list(range(100))
    manager = CheckpointManager(tmp_path / "run", [v], max_to_keep=2, async_save=True, sharded=True)

    def manager_saves(offset):
        return lambda: [manager.save(offset + i) for i in range(4)]

    assert run_threads(manager_saves(0), manager_saves(100)) == []
    manager.wait()
    kept = [os.path.basename(p) for p in manager.checkpoints]  # the last two written
    assert len(kept) == 2 and set(kept) <= {"ckpt-2", "ckpt-3", "ckpt-102", "ckpt-103"}
    assert kept[-1] in ("ckpt-3", "ckpt-103")  # a thread's last save is the newest


def test_strings_that_are_not_utf8_are_a_checkpoint_error_naming_them(tmp_path):
    try:
        bad = np.array([b"\xff\xfe"]).astype(np.dtypes.StringDType())  # bytes kept undecoded
    except TypeError:  # NumPy >= 2.5 refuses them: no such array can reach a save there
        pytest.skip("this NumPy refuses invalid UTF-8 in a StringDType array")
    with pytest.raises(CheckpointError, match=r"Cannot save 's': its strings are not valid"):
        checkpoint.write_arrays(tmp_path / "c.safetensors", {"s": bad, "x": np.ones(2)})
    assert os.listdir(tmp_path) == []  # nothing written, no temporary left
