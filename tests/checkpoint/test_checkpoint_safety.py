"""Checkpoints that survive interrupts, full and read-only disks, exits and other writers
(issue 28): the previous checkpoint stays until a new one is complete (re-saves of a sharded
path included, interrupted at every point), leftovers of failed or killed saves go (never a
live writer's), async saves pending at exit finish, retention follows the write order, a
restore while a manager prunes reads a complete checkpoint, sharded checkpoints keep every
dtype bit for bit, and the small bad arguments of the issue.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import paramstore as ps
from paramstore import checkpoint
from paramstore.checkpoint import CheckpointManager, Saver, atomic, readers
from paramstore.checkpoint.formats.orbax import format as orbax_format
from paramstore.checkpoint.formats.orbax import integrity
from paramstore.checkpoint.formats.orbax import read as orbax_read
from paramstore.checkpoint.formats.safetensors import file as safetensors_file

needs_orbax = pytest.mark.skipif(
    importlib.util.find_spec("orbax") is None, reason="orbax-checkpoint missing"
)
ROOT = str(Path(__file__).resolve().parents[2])  # this checkout's paramstore
TIMEOUT = 120  # seconds for a subprocess: longer is a hang


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, out.get("PYTHONPATH")]))
    return out


def values(path) -> list[float]:
    return checkpoint.load_variable(path, "w").tolist()


def leftovers(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


# --------------------------------------------- the previous checkpoint stays until the new


class Interrupt(BaseException):
    """What a signal handler raises (as KeyboardInterrupt), at a chosen point of a save."""


# The steps of a sharded save an interrupt may land between (each patched to raise first).
_STEPS = [
    (orbax_format, "_write_arrays"),
    (integrity, "digest_files"),
    (integrity, "write_json"),  # the process file, then the metadata
    (orbax_format, "install_dir"),
    (atomic, "_exchange"),
    (atomic.shutil, "rmtree"),  # the old checkpoint, once swapped out
    (orbax_format, "release"),
]


@needs_orbax
@pytest.mark.parametrize("how", [pytest.param("saver", marks=pytest.mark.slow), "manager"])
def test_a_sharded_resave_interrupted_anywhere_keeps_a_complete_checkpoint(
    tmp_path, monkeypatch, how
):
    w = ps.Variable(np.zeros(4, np.float32), name="w")
    directory = tmp_path / "run"
    manager = CheckpointManager(directory, [w], sharded=True)

    def save() -> str:
        if how == "manager":
            return manager.save(1)
        return Saver([w], sharded=True).save(directory / "ckpt-1")

    path = save()
    reals = {(id(mod), name): getattr(mod, name) for mod, name in _STEPS}
    points = 0
    for n in range(40):
        count = [0]

        def patched(real, count=count, at=n + 1):
            def call(*args, **kwargs):
                count[0] += 1
                if count[0] == at:
                    raise Interrupt(f"interrupted at call {at}")
                return real(*args, **kwargs)

            return call

        for mod, name in _STEPS:
            monkeypatch.setattr(mod, name, patched(reals[(id(mod), name)]))
        before = values(path)
        w.assign(np.full(4, n + 1.0, np.float32))
        try:
            save()
        except Interrupt:
            points += 1
        monkeypatch.undo()
        got = values(path)  # a complete checkpoint: the previous one or the new one
        assert got in (before, [n + 1.0] * 4), (n, got)
        ps.CheckpointManager(directory, [w], sharded=True)  # the next manager cleans up
        assert leftovers(directory) == [], (n, leftovers(directory))
        if count[0] <= n:  # the save ran to the end without reaching call n + 1
            break
    assert points >= 7, points  # every step was interrupted at least once


def test_a_full_disk_is_an_oserror_naming_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    w = ps.Variable(np.arange(4, dtype=np.float32), name="w")
    path = Saver([w]).save(tmp_path / "model.safetensors")
    raw = Path(path).read_bytes()
    w.assign(np.zeros(4, np.float32))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "writev", full)
    with pytest.raises(OSError, match="No space left") as info:
        Saver([w]).save(path)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC and info.value.filename == path
    message = str(info.value)
    assert f"Cannot save checkpoint '{path}'" in message and "previous checkpoint" in message
    assert "Free disk space" in message
    assert Path(path).read_bytes() == raw and os.listdir(tmp_path) == ["model.safetensors"]


def test_a_read_only_directory_is_an_oserror_naming_the_file(tmp_path, monkeypatch):
    w = ps.Variable(np.arange(4, dtype=np.float32), name="w")
    path = Saver([w]).save(tmp_path / "model.safetensors")
    raw = Path(path).read_bytes()

    def read_only(file, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), file)

    monkeypatch.setattr(safetensors_file, "open", read_only, raising=False)
    with pytest.raises(OSError, match="Read-only file system") as info:
        Saver([w]).save(path)
    monkeypatch.undo()
    assert info.value.errno == errno.EROFS and path in str(info.value)
    assert Path(path).read_bytes() == raw and os.listdir(tmp_path) == ["model.safetensors"]
    with pytest.raises(PermissionError, match="Cannot save checkpoint"):  # EACCES keeps its type
        monkeypatch.setattr(
            os, "makedirs", lambda *a, **k: (_ for _ in ()).throw(PermissionError(13, "denied"))
        )
        Saver([w]).save(tmp_path / "sub" / "model.safetensors")


@needs_orbax
@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_in_a_sharded_save_keeps_the_old_checkpoint(tmp_path, monkeypatch, async_save):
    w = ps.Variable(np.arange(4, dtype=np.float32), name="w")
    directory = tmp_path / "run"
    manager = CheckpointManager(directory, [w], sharded=True, async_save=async_save)
    path = manager.save(1)
    manager.wait()
    w.assign(np.zeros(4, np.float32))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(integrity, "write_json", full)
    with pytest.raises(OSError, match="No space left") as info:
        manager.save(1)
        manager.wait()
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    assert f"Cannot save sharded checkpoint '{path}'" in str(info.value)
    assert values(path) == [0.0, 1.0, 2.0, 3.0]
    assert os.listdir(directory) == ["ckpt-1"]  # no staging directory left


@needs_orbax
def test_a_full_disk_reported_by_tensorstore_is_an_oserror_too(tmp_path, monkeypatch):
    """TensorStore writes in C++: a full disk reaches Python as another exception whose
    message holds the system's words; it is raised as the OSError it is."""
    w = ps.Variable(np.arange(4, dtype=np.float32), name="w")
    path = Saver([w], sharded=True).save(tmp_path / "ckpt")

    def full(*args, **kwargs):
        raise ValueError(
            f"Error writing local file: [OS error {errno.ENOSPC}: No space left on device]"
        )

    monkeypatch.setattr(orbax_format, "_write_arrays", full)
    with pytest.raises(OSError, match=f"Cannot save sharded checkpoint '{path}'") as info:
        Saver([w], sharded=True).save(path)
    assert info.value.errno == errno.ENOSPC and isinstance(info.value.__cause__, ValueError)
    monkeypatch.undo()
    assert values(path) == [0.0, 1.0, 2.0, 3.0] and os.listdir(tmp_path) == ["ckpt"]


# ------------------------------------------------------------------------------ leftovers

_KILLED = """
import os, signal, sys
import numpy as np
import paramstore as ps
from paramstore.checkpoint.formats.orbax import integrity
w = ps.Variable(np.ones(4, np.float32), name="w")
manager = ps.CheckpointManager(sys.argv[1], [w], sharded=sys.argv[2] == "1")
manager.save(1)
w.assign(np.full(4, 2.0, np.float32))
real = integrity.write_json
def killed(path, *args):
    if path.endswith("metadata"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, *args)
integrity.write_json = killed
if sys.argv[2] == "1":
    manager.save(1)  # a re-save of the same step, killed before its metadata
else:
    os.writev = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    manager.save(1)
"""


@needs_orbax
@pytest.mark.slow
@pytest.mark.parametrize("sharded", [True, False])
def test_a_killed_resave_leaves_the_old_checkpoint_and_the_next_manager_cleans_up(
    tmp_path, sharded
):
    directory = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", _KILLED, str(directory), "1" if sharded else "0"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert leftovers(directory), "the kill left no temporary: the test proves nothing"
    if sharded:
        assert any(".orbax-checkpoint-tmp" in n or ".tmp-" in n for n in leftovers(directory))
    w = ps.Variable(np.zeros(4, np.float32), name="w")
    manager = CheckpointManager(directory, [w], sharded=sharded)
    assert leftovers(directory) == []
    assert manager.restore_latest() is not None
    assert w.numpy().tolist() == [1.0] * 4


def test_leftovers_go_but_never_a_live_writers(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    dead = 999_999_999  # no such process
    alive = os.getppid()  # a live process: its writes are in flight
    names = {
        f".ckpt-1.tmp-{dead}-0123abcd": False,  # a dead writer's staging directory
        f".ckpt-1.tmp-{dead}-0123abcd.orbax-checkpoint-tmp-1732480000": False,  # Orbax's
        f".ckpt-2.tmp-{alive}-0123abcd": True,
        f".ckpt-2.tmp-{alive}-0123abcd.orbax-checkpoint-tmp-1732480000": True,
        "ckpt-3.orbax-checkpoint-tmp-1732480000": False,  # an earlier version's, untouched
        "ckpt-4.orbax-checkpoint-tmp-1732480001": True,  # an earlier version's, recent
    }
    old = 1_000_000_000  # 2001
    for name in names:
        (run / name / "arrays").mkdir(parents=True)
        (run / name / "arrays" / "data").write_bytes(b"partial")
        if name.startswith("ckpt-3"):
            for p in (run / name / "arrays" / "data", run / name / "arrays", run / name):
                os.utime(p, (old, old))
    CheckpointManager(run, [ps.Variable(1.0, name="v")])
    assert sorted(os.listdir(run)) == sorted(n for n, kept in names.items() if kept)


# ----------------------------------------------------------------------- async at exit

_AT_EXIT = """
import atexit, sys
import numpy as np
import paramstore as ps
w = ps.Variable(np.ones(256, np.float32), name="w")
manager = ps.CheckpointManager(sys.argv[1], [w], sharded=sys.argv[2] == "1", async_save=True)
manager.save(1)
manager.wait()
w.assign(np.full(256, 2.0, np.float32))
manager.save(2)  # pending when the script ends
if sys.argv[3] == "late":  # a save started when Python is already shutting down
    def late():
        w.assign(np.full(256, 3.0, np.float32))
        manager.save(3)
    atexit.register(late)
"""


def at_exit_run(directory: Path, sharded: str, late: bool) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _AT_EXIT, str(directory), sharded, "late" if late else "-"],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def check_at_exit(directory: Path, sharded: str, late: bool, err: str) -> None:
    w = ps.Variable(np.zeros(256, np.float32))
    manager = CheckpointManager(directory, {"w": w}, sharded=sharded == "1")
    manager.restore_latest()
    if late and sharded == "1":  # Orbax needs threads: refused, loudly; the others kept
        assert "Cannot save the sharded checkpoint" in err and "at interpreter exit" in err
    elif late:  # a single file is written at once
        assert manager.latest_step == 3 and w.numpy().tolist() == [3.0] * 256, err[-3000:]
        return
    assert "background checkpoint save failed" not in err, err[-3000:]
    assert manager.latest_step == 2 and w.numpy().tolist() == [2.0] * 256, err[-3000:]
    assert leftovers(directory) == []


@needs_orbax
@pytest.mark.slow
def test_async_saves_pending_at_exit_finish_in_every_format(tmp_path):
    """A save pending when the script ends finishes, five runs of the sharded format (which
    lost it, or hung 1 exit in 3), two of the single file; in two of them (one for the
    single file) a save is also started when Python is past its threads (an atexit
    function): the single file is written at once, the sharded one refused loudly. Two
    processes at a time (one per core), each bounded."""
    plan = [("1", i, i >= 3) for i in range(5)] + [("0", i, i == 1) for i in range(2)]
    if sys.version_info >= (3, 12):
        # Python 3.12 starts no thread once its exit has begun, and Orbax needs new threads
        # to finish a save: a sharded save pending at exit can fail or hang there (a known
        # limit, docs/checkpoints.md: wait() before a script ends). The single file is kept.
        plan = [run for run in plan if run[0] == "0"]
    for first in range(0, len(plan), 2):
        runs = [
            (tmp_path / f"run-{sharded}-{i}", sharded, late)
            for sharded, i, late in plan[first : first + 2]
        ]
        procs = [at_exit_run(*run) for run in runs]
        for run, proc in zip(runs, procs):
            try:
                _, err = proc.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                pytest.fail(f"the exit hung with a pending save ({run})")
            assert proc.returncode == 0, err[-3000:]
            check_at_exit(*run, err)


# ------------------------------------------------------------------- retention, order


@pytest.mark.parametrize("sharded", [False, pytest.param(True, marks=needs_orbax)])
def test_retention_keeps_a_rollbacks_saves_in_write_order(tmp_path, sharded):
    w = ps.Variable(0.0, name="w")
    directory = tmp_path / "run"
    manager = CheckpointManager(directory, [w], max_to_keep=2, sharded=sharded)
    for step in (9, 10):
        w.assign(float(step))
        manager.save(step)
    w.assign(3.0)
    path = manager.save(3)  # a rollback
    assert os.path.exists(path)
    name = os.path.basename
    assert [name(p) for p in manager.checkpoints] == [name(manager.path_for(s)) for s in (10, 3)]
    assert manager.latest_checkpoint == path and manager.latest_step == 3
    again = CheckpointManager(directory, [w], max_to_keep=2, sharded=sharded)
    assert again.checkpoints == manager.checkpoints  # the order is on disk
    w.assign(-1.0)
    assert again.restore_latest() == path and float(w.numpy()) == 3.0
    assert ps.checkpoint.load_variable(directory, "w") == 3.0  # a directory: its latest
    again.save(4)
    assert [name(p) for p in again.checkpoints] == [name(again.path_for(s)) for s in (3, 4)]


def test_the_write_order_holds_where_modification_times_tie(tmp_path):
    """A file system with coarse times (or a clock set back): the manager moves the new
    checkpoint's time past the others'."""
    w = ps.Variable(0.0, name="w")
    manager = CheckpointManager(tmp_path, [w], max_to_keep=3)
    for step in (5, 6):
        manager.save(step)
    future = 4_000_000_000  # 2096: every later save is "older" by the clock
    for step in (5, 6):
        os.utime(manager.path_for(step), (future, future))
    manager.save(1)
    assert [os.path.basename(p) for p in manager.checkpoints] == [
        "ckpt-5.safetensors",
        "ckpt-6.safetensors",
        "ckpt-1.safetensors",
    ]
    manager.save(2)
    assert manager.latest_step == 2 and len(manager.checkpoints) == 3


# ------------------------------------------------------------- restores while a manager prunes


def test_a_restore_while_another_process_prunes_reads_the_newest_remaining(tmp_path, monkeypatch):
    w = ps.Variable(0.0, name="w")
    directory = tmp_path / "run"
    manager = CheckpointManager(directory, [w], max_to_keep=None)
    for step in (1, 2):
        w.assign(float(step))
        manager.save(step)
    real = readers.open_reader
    pruned = []

    def racing(path, *args):  # between resolving the latest and opening it
        if not pruned:
            pruned.append(path)
            os.unlink(path)  # another process's manager (no lock of ours)
        return real(path, *args)

    monkeypatch.setattr(readers, "open_reader", racing)
    w.assign(-1.0)
    assert Saver([w]).restore(directory) == []
    assert pruned == [manager.path_for(2)] and float(w.numpy()) == 1.0


@needs_orbax
def test_a_sharded_restore_while_another_process_prunes_or_replaces_it(tmp_path, monkeypatch):
    w = ps.Variable(np.zeros(4, np.float32), name="w")
    directory = tmp_path / "run"
    manager = CheckpointManager(directory, [w], max_to_keep=None, sharded=True)
    for step in (1, 2):
        w.assign(np.full(4, float(step), np.float32))
        manager.save(step)
    real = orbax_read.ShardedCheckpoint.load
    calls: list[str] = []

    def racing(self, wanted):
        if not calls:
            calls.append(self.path)
            if what == "prune":
                atomic.retire(self.path)  # another process's manager: no lock of ours
            else:  # another process's save of the same step swaps a new one in
                new = {"w": np.full(4, 7.0, np.float32)}
                orbax_format.save(self.path, {"w": ps.Variable(new["w"]).value()})
        return real(self, wanted)

    monkeypatch.setattr(orbax_read.ShardedCheckpoint, "load", racing)
    for what, expected in (("prune", 1.0), ("replace", 7.0)):
        calls.clear()
        w.assign(np.zeros(4, np.float32))
        Saver([w]).restore(directory)
        assert calls and w.numpy().tolist() == [expected] * 4, what


@needs_orbax
def test_a_corrupt_checkpoint_that_nobody_replaced_is_not_retried(tmp_path, monkeypatch):
    w = ps.Variable(np.zeros(4, np.float32), name="w")
    path = Saver([w], sharded=True).save(tmp_path / "ckpt")
    calls = []
    real = orbax_read.ShardedCheckpoint.load

    def counted(self, wanted):
        calls.append(1)
        return real(self, wanted)

    monkeypatch.setattr(orbax_read.ShardedCheckpoint, "load", counted)
    (Path(path) / "paramstore" / "process_0.json").write_text("{}")
    with pytest.raises(checkpoint.CheckpointError, match="corrupt or incomplete"):
        Saver([w]).restore(path)
    assert calls == [1]


_PRUNER = """
import os, sys
import numpy as np
import paramstore as ps
directory, stop = sys.argv[1], sys.argv[2]
w = ps.Variable(np.zeros(64, np.float32), name="w")
manager = ps.CheckpointManager(directory, [w], max_to_keep=1, sharded=sys.argv[3] == "1")
step = 0
while not os.path.exists(stop) and step < 2000:
    step += 1
    w.assign(np.full(64, float(step), np.float32))
    manager.save(step)  # each save deletes the one before
"""


@needs_orbax
@pytest.mark.slow
@pytest.mark.parametrize("sharded", ["0", "1"])
def test_restores_while_another_process_saves_and_prunes(tmp_path, sharded):
    """A real second process keeps one checkpoint, replacing it as fast as it can; every
    restore of the directory here reads a complete one."""
    directory, stop = tmp_path / "run", tmp_path / "stop"
    proc = subprocess.Popen(
        [sys.executable, "-c", _PRUNER, str(directory), str(stop), sharded],
        env=env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        w = ps.Variable(np.zeros(64, np.float32))
        seen = set()
        start = time.monotonic()
        while len(seen) < 6 and time.monotonic() - start < TIMEOUT and proc.poll() is None:
            if not readers.scan(str(directory)):
                time.sleep(0.05)
                continue
            Saver({"w": w}).restore(directory)  # no FileNotFoundError, no false corruption
            value = w.numpy()
            assert (value == value[0]).all() and value[0] >= 1, value
            seen.add(float(value[0]))
        assert len(seen) >= 3, (seen, proc.poll())
    finally:
        stop.touch()
        try:
            proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("the saving process did not stop")
    assert proc.returncode == 0, proc.stderr.read()[-3000:] if proc.stderr else ""


# ------------------------------------------------------------------ dtypes, bit for bit

ONE_BYTE = [
    "int4",
    "uint4",
    "int2",
    "uint2",
    "float4_e2m1fn",
    "float8_e4m3",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e4m3b11fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e3m4",
    "float8_e8m0fnu",
]


@needs_orbax
def test_sharded_checkpoints_keep_every_dtype_of_the_single_file_bit_for_bit(tmp_path):
    rng = np.random.default_rng(0)
    variables = []
    for name in ONE_BYTE:
        dtype = np.dtype(getattr(ml_dtypes, name))
        bits = rng.integers(0, 256, 12, dtype=np.uint8)
        value = np.asarray(ps.Variable(np.zeros(12, dtype)).numpy())  # the values JAX keeps
        value = np.asarray(ps.Variable(bits.view(dtype) if dtype.itemsize == 1 else value).numpy())
        variables.append(ps.Variable(value.reshape(3, 4), name=name))
    single = Saver(variables).save(tmp_path / "one.safetensors")
    sharded = Saver(variables, sharded=True).save(tmp_path / "sharded")
    a, b = checkpoint.read_arrays(single), checkpoint.read_arrays(sharded)
    for v in variables:
        assert b[v.name].dtype == v.dtype and b[v.name].shape == (3, 4), v.name
        assert a[v.name].tobytes() == b[v.name].tobytes(), v.name
    saved = [np.asarray(v.numpy()).tobytes() for v in variables]
    for v in variables:
        v.assign(np.zeros(v.shape, v.dtype))
    Saver(variables).restore(sharded)
    assert [np.asarray(v.numpy()).tobytes() for v in variables] == saved
    meta = orbax_format.read_metadata(sharded)[1]
    assert [e.get("stored") for e in meta] == [np.uint8] * len(ONE_BYTE), meta


# ---------------------------------------------------------------------------- small ones


@pytest.mark.parametrize("length", [229, 240, 255])
@pytest.mark.parametrize("sharded", [False, pytest.param(True, marks=needs_orbax)])
def test_file_names_up_to_255_bytes_are_saved(tmp_path, length, sharded):
    w = ps.Variable(np.arange(3, dtype=np.float32), name="w")
    path = tmp_path / ("n" * length)
    Saver([w], sharded=sharded).save(path)
    Saver([w], sharded=sharded).save(path)  # a re-save: its temporary name fits too
    assert values(path) == [0.0, 1.0, 2.0] and os.listdir(tmp_path) == [path.name]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_to_keep": True}, TypeError, r"max_to_keep must be an int >= 1 or None, got bool"),
        ({"max_to_keep": 2.0}, TypeError, r"max_to_keep must be an int >= 1 or None, got float"),
        ({"max_to_keep": 0}, ValueError, r"max_to_keep must be >= 1 or None, got 0.*None"),
        ({"async_save": "no"}, TypeError, r"async_save must be True or False, got str 'no'"),
        ({"async_save": 1}, TypeError, r"async_save must be True or False, got int 1"),
    ],
)
def test_bad_manager_arguments_are_refused_before_anything_is_made(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        CheckpointManager(tmp_path / "run", [ps.Variable(1.0)], **kwargs)
    assert not (tmp_path / "run").exists()
    manager = CheckpointManager(tmp_path / "run", [ps.Variable(1.0)], max_to_keep=np.int64(2))
    assert manager.max_to_keep == 2 and type(manager.max_to_keep) is int
