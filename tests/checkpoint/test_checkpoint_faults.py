"""On-disk faults of issue 36 and issue 38 (item 4): what an interrupt (Ctrl-C, swept over
every point where CPython can run a signal's handler), a kill, a concurrent writer or a
hostile Hugging Face file does to checkpoints and exports. Whole or absent on disk, no
temporary left, no descriptor closed twice, no lock or thread left behind, and the
KeyboardInterrupt arrives as itself."""

from __future__ import annotations

import _thread
import gc
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _bounded import in_thread
from _interrupting import _tracer, count_events

import paramstore as ps
from paramstore.checkpoint import atomic
from paramstore.checkpoint import io as ckio

BOUND = 120.0  # seconds for one sweep


@pytest.fixture(autouse=True)
def default_sigint_handler():
    """Python's own SIGINT handler (what ``_thread.interrupt_main`` reaches) during each test."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def interrupted(op: Callable[[], Any], k: int) -> tuple[bool, BaseException | None]:
    """Run ``op`` with an interrupt at its k-th point: (it fired, what was raised)."""
    n, fired = [0], [False]

    def point() -> None:
        n[0] += 1
        if n[0] == k:
            fired[0] = True
            _thread.interrupt_main()

    error: BaseException | None = None
    sys.settrace(_tracer(point))
    try:
        try:
            op()
        finally:
            sys.settrace(None)
        (lambda: None)()  # a pending interrupt lands here at the latest
    except BaseException as e:  # noqa: BLE001 - what arrived, checked by the caller
        error = e
    return fired[0], error


def points(op: Callable[[], Any], most: int | None = None) -> list[int]:
    total = count_events(op)
    ks = list(range(1, total + 2))
    if most is not None and most < len(ks):
        ks = sorted({int(x) for x in np.linspace(1, total, most)})
    return ks


def open_fds() -> set[int]:
    return set(int(n) for n in os.listdir("/proc/self/fd"))


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")


# ------------------------------------------------------------ open_regular (item 4)


@needs_proc
def test_open_regular_interrupted_anywhere_closes_its_descriptor_exactly_once(tmp_path):
    """An interrupt right after the open closed the descriptor twice (through the dropped
    file object and in the except clause): another thread's file could be closed under it,
    or Ctrl-C surfaced as OSError EBADF."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 64)
    unraisable: list[Any] = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:

        def op() -> None:
            with ckio.open_regular(str(path)) as f:
                f.read(8)

        gc.collect()
        before = open_fds()
        start = time.monotonic()
        raised = 0
        for k in points(op):
            fired, error = interrupted(op, k)
            gc.collect()
            assert error is None or isinstance(error, KeyboardInterrupt), (k, repr(error))
            raised += error is not None
            assert open_fds() == before, f"interrupt at point {k}: a descriptor leaked"
            assert not unraisable, (k, [u.exc_value for u in unraisable])
            assert time.monotonic() - start < BOUND
        assert raised >= 5
    finally:
        sys.unraisablehook = old_hook


# ------------------------------------ sharded restores and saves (items 10, 12; 38.4)

needs_orbax = pytest.mark.skipif(
    importlib.util.find_spec("orbax") is None, reason="orbax-checkpoint missing"
)


def no_lock_held() -> None:
    held = [i for i, lock in enumerate(ckio._PATH_LOCKS) if lock.locked()]
    assert not held, f"path lock(s) {held} left taken"


def settled_threads(before: set[str], timeout: float = 10.0) -> set[str]:
    """The names of threads started since ``before`` that are still alive after waiting up
    to ``timeout`` for them to end."""
    deadline = time.monotonic() + timeout
    while True:
        extra = {t.name for t in threading.enumerate()} - before
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.01)


@needs_orbax
def test_a_sharded_restore_interrupted_anywhere_raises_the_interrupt_and_releases_everything(
    tmp_path,
):
    """Ctrl-C during a sharded restore was reported as a corrupt checkpoint (issue 36
    item 10), or lost, or left the path lock taken so that the next read waited forever
    (issue 38 item 4), or left Orbax's threads behind."""
    w = ps.Variable(np.arange(8, dtype=np.float32), name="w")
    path = ps.Saver([w], sharded=True).save(tmp_path / "ckpt-1")
    saved = np.arange(8, dtype=np.float32)

    def op() -> None:
        ps.Saver([w]).restore(path)

    op()  # warm: Orbax imported, its programs compiled
    threads = {t.name for t in threading.enumerate()}
    start = time.monotonic()
    raised = 0
    for k in points(op, most=30):
        w.assign(np.zeros(8, np.float32))
        fired, error = interrupted(op, k)
        assert error is None or isinstance(error, KeyboardInterrupt), (k, repr(error))
        assert fired == (error is not None), (k, fired, repr(error))
        raised += error is not None
        no_lock_held()
        assert w.numpy().tolist() in (saved.tolist(), [0.0] * 8)
        got = in_thread(lambda: ps.checkpoint.load_variable(path, "w"))  # bounded
        assert got is None, repr(got)
        assert time.monotonic() - start < BOUND
    assert raised >= 10
    assert not settled_threads(threads), "threads left behind"


def staged(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


@needs_orbax
@pytest.mark.parametrize("async_save", [False, True])
def test_a_sharded_save_interrupted_anywhere_leaves_no_temporary(tmp_path, async_save):
    """An interrupted sharded save left its ``.tmp-<pid>-*`` staging directory (or Orbax's)
    behind, which nothing removed while the process lived (issue 36 item 12)."""
    w = ps.Variable(np.zeros(8, np.float32), name="w")
    directory = tmp_path / "run"
    manager = ps.CheckpointManager(directory, [w], sharded=True, async_save=async_save)
    manager.save(1)
    manager.wait()
    path = str(directory / "ckpt-1")

    def op() -> None:
        manager.save(1)
        manager.wait()

    op()
    threads = {t.name for t in threading.enumerate()}
    start = time.monotonic()
    raised = 0
    for i, k in enumerate(points(op, most=30)):
        old = ps.checkpoint.load_variable(path, "w").tolist()
        w.assign(np.full(8, i + 1.0, np.float32))
        fired, error = interrupted(op, k)
        assert error is None or isinstance(error, KeyboardInterrupt), (k, repr(error))
        raised += error is not None
        got = in_thread(lambda: manager.wait())  # bounded: a save in flight finishes
        assert got is None, repr(got)
        no_lock_held()
        assert staged(directory) == [], (k, staged(directory))
        now = ps.checkpoint.load_variable(path, "w").tolist()
        assert now in (old, [i + 1.0] * 8), (k, now)
        assert time.monotonic() - start < BOUND
    assert raised >= 10
    assert not settled_threads(threads), "threads left behind"


# ---------------------------------------------- an interrupted manager.wait() (item 5)


def interrupt_main_after(seconds: float) -> threading.Timer:
    """A real SIGINT to the main thread after ``seconds`` (it wakes a blocked wait, which
    ``_thread.interrupt_main`` does not)."""
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(seconds, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    return timer


def blocked_writes(
    monkeypatch, sharded: bool, fail: bool
) -> tuple[threading.Event, threading.Event]:
    """Make the background part of the next save wait for the first returned Event (then
    fail with a full disk, with ``fail``); the second is set once it wrote."""
    go, wrote = threading.Event(), threading.Event()
    if sharded:
        module, name = ps.checkpoint.formats.orbax.integrity, "write_json"
    else:
        module, name = ps.checkpoint.manager, "write_arrays"
    real = getattr(module, name)

    def slow(*args, **kwargs):
        assert go.wait(BOUND)
        try:
            if fail:
                raise OSError(28, "No space left on device")
            return real(*args, **kwargs)
        finally:
            wrote.set()

    monkeypatch.setattr(module, name, slow)
    return go, wrote


@pytest.mark.parametrize("sharded", [False, pytest.param(True, marks=needs_orbax)])
def test_an_interrupted_wait_leaves_the_save_pending_and_its_error_raised_later(
    tmp_path, monkeypatch, sharded
):
    w = ps.Variable(np.ones(4, np.float32), name="w")
    manager = ps.CheckpointManager(tmp_path, [w], async_save=True, sharded=sharded)
    manager.save(1)
    manager.wait()
    go, _ = blocked_writes(monkeypatch, sharded, fail=True)
    manager.save(2)
    timer = interrupt_main_after(0.3)
    with pytest.raises(KeyboardInterrupt):
        manager.wait()
    timer.join()
    threading.Timer(0.3, go.set).start()
    error = in_thread(manager.wait)  # still pending: it waits, then raises the save's error
    assert isinstance(error, OSError) and "No space left" in str(error), repr(error)
    assert in_thread(manager.wait) is None  # raised once
    assert [os.path.basename(p) for p in manager.checkpoints] == [
        "ckpt-1" if sharded else "ckpt-1.safetensors"
    ]
    no_lock_held()


@pytest.mark.parametrize("sharded", [False, pytest.param(True, marks=needs_orbax)])
def test_an_interrupted_wait_never_lets_its_prune_delete_what_checkpoints_listed(
    tmp_path, monkeypatch, sharded
):
    w = ps.Variable(np.ones(4, np.float32), name="w")
    manager = ps.CheckpointManager(tmp_path, [w], max_to_keep=1, async_save=True, sharded=sharded)
    manager.save(1)
    manager.wait()
    go, wrote = blocked_writes(monkeypatch, sharded, fail=False)
    w.assign(np.full(4, 2.0, np.float32))
    manager.save(2)
    timer = interrupt_main_after(0.3)
    with pytest.raises(KeyboardInterrupt):
        manager.wait()
    timer.join()
    threading.Timer(0.3, go.set).start()
    listed: list[list[str]] = []
    assert in_thread(lambda: listed.append(manager.checkpoints)) is None
    assert in_thread(manager.wait) is None
    assert wrote.wait(BOUND)
    time.sleep(0.3)  # (a save orphaned by the interrupt, as before the fix, prunes now)
    for path in listed[0]:  # each one listed is still there, and restores
        assert os.path.exists(path), (listed, os.listdir(tmp_path))
    assert manager.restore_latest() == listed[0][-1]
    assert w.numpy().tolist() == [2.0] * 4
    no_lock_held()


# --------------------------------------------------- sharded re-exports (item 1)

_TENSORS = 6


def export(directory, fill: float) -> str:
    arrays = {f"t{i}": np.full(256, fill, np.float32) for i in range(_TENSORS)}
    return ps.checkpoint.export_safetensors(directory, arrays, max_shard_size=2 * 1024)


class Replaced(Exception):
    """The index was replaced while its shards were read: the read saw no one export."""


def _identity(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_ctime_ns, st.st_mtime_ns


def exported(directory) -> float:
    """The one value every tensor of the export in ``directory`` holds, read as
    ``transformers`` reads it (the index's shards through the ``safetensors`` library);
    AssertionError for a mix of two exports under one index, ``Replaced`` where the index
    changed during the read (a reader then reads again)."""
    from safetensors.numpy import load_file

    index = os.path.join(directory, "model.safetensors.index.json")
    before = _identity(index)
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    assert sorted(weight_map) == [f"t{i}" for i in range(_TENSORS)]
    values: set[float] = set()
    files = [os.path.join(directory, file) for file in sorted(set(weight_map.values()))]
    seen = [_identity(file) for file in files]
    for file in files:
        for name, arr in load_file(file).items():
            assert weight_map[name] == os.path.basename(file)
            values.update(np.unique(arr).tolist())
    if [_identity(index)] + [_identity(file) for file in files] != [before, *seen]:
        raise Replaced(index)
    assert len(values) == 1, f"tensors of several exports under one index: {values}"
    return values.pop()


def export_leftovers(directory) -> list[str]:
    """Temporaries, and shard files that the index does not list."""
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        listed = set(json.load(f)["weight_map"].values())
    return sorted(
        n
        for n in os.listdir(directory)
        if n.startswith(".") or (n.endswith(".safetensors") and n not in listed)
    )


def test_a_sharded_re_export_interrupted_anywhere_leaves_one_whole_export(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    export(directory, 1.0)
    start = time.monotonic()
    raised = 0
    for i, k in enumerate(points(lambda: export(directory, 2.0), most=60)):
        old = exported(directory)
        new = 10.0 + i
        fired, error = interrupted(lambda new=new: export(directory, new), k)
        assert error is None or isinstance(error, KeyboardInterrupt), (k, repr(error))
        raised += error is not None
        assert exported(directory) in (old, new), k
        assert export_leftovers(directory) == [], (k, export_leftovers(directory))
        assert (directory / "config.json").read_text() == "{}"
        assert time.monotonic() - start < BOUND
    assert raised >= 20


_EXPORTS = """
import sys
import numpy as np
import paramstore as ps
directory, base = sys.argv[1], float(sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()
for j in range(25):
    arrays = {f"t{i}": np.full(256, base + j, np.float32) for i in range(6)}
    ps.checkpoint.export_safetensors(directory, arrays, max_shard_size=2 * 1024)
"""


def child_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


@pytest.mark.slow
def test_concurrent_sharded_exports_into_one_directory_leave_one_whole_export(tmp_path):
    """Two processes export into one directory at once while this one reads it."""
    directory = tmp_path / "model"
    directory.mkdir()
    export(directory, 0.0)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _EXPORTS, str(directory), str(base)],
            env=child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for base in (100.0, 200.0)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        reads = 0
        deadline = time.monotonic() + BOUND
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "the exports hung"
            try:
                exported(directory)  # never a mix of two exports
                reads += 1
            except (FileNotFoundError, Replaced):  # a commit meanwhile: read again
                pass
        for p in procs:
            assert p.wait() == 0, p.stderr.read()[-3000:] if p.stderr else ""
    finally:
        for p in procs:
            p.kill()
    assert exported(directory) in (124.0, 224.0)
    assert export_leftovers(directory) == []
    assert reads, "the reader never read an export"


_KILLED_EXPORT = """
import os, signal, sys
import numpy as np
import paramstore as ps
directory, at, fill = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
count = [0]
for name in ("replace", "link", "unlink", "rename"):
    real = getattr(os, name)
    def call(*args, real=real, **kwargs):
        count[0] += 1
        if count[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    setattr(os, name, call)
arrays = {f"t{i}": np.full(256, fill, np.float32) for i in range(6)}
ps.checkpoint.export_safetensors(directory, arrays, max_shard_size=2 * 1024)
"""


@pytest.mark.slow
def test_a_killed_re_export_leaves_one_whole_export_and_the_next_one_cleans_up(tmp_path):
    env = child_env()
    directory = tmp_path / "model"
    directory.mkdir()
    export(directory, 1.0)
    kills = 0
    for at in range(1, 40):
        old = exported(directory)
        done = subprocess.run(
            [sys.executable, "-c", _KILLED_EXPORT, str(directory), str(at), str(at + 10.0)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode in (0, -signal.SIGKILL), done.stderr[-3000:]
        assert exported(directory) in (old, at + 10.0), at
        if done.returncode == 0:
            break
        kills += 1
    assert kills >= 8, kills
    export(directory, 99.0)  # the next export removes what the killed ones left
    assert exported(directory) == 99.0
    assert export_leftovers(directory) == []


def test_a_big_endian_array_is_exported_little_endian(tmp_path):
    """It was refused as "float32, which safetensors cannot hold" (issue 36 item 15)."""
    from safetensors.numpy import load_file

    values = {"be": np.arange(6, dtype=">f4").reshape(2, 3), "le": np.arange(3, dtype="<i4")}
    path = ps.checkpoint.export_safetensors(tmp_path / "m.safetensors", values)
    got = load_file(path)
    assert got["be"].dtype == np.dtype("<f4") and got["be"].tolist() == values["be"].tolist()
    assert got["le"].tolist() == [0, 1, 2]
    assert ps.checkpoint.load_variable(path, "be", allow_unverified=True).tolist() == [
        [0.0, 1.0, 2.0],
        [3.0, 4.0, 5.0],
    ]


# ------------------------------------------- Hugging Face files (items 6, 14, 15)

_TRUNCATED_WHILE_READ = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
import paramstore as ps
from safetensors.numpy import save_file
path = sys.argv[1]
save_file({"w": np.ones((64, 1024), np.float32)}, path)
with open(path, "rb") as f:
    header_end = 8 + int.from_bytes(f.read(8), "little")
layout = ps.sharding.LayoutMap(jax.make_mesh((8,), ("d",)))
layout["w"] = ("d", None)
with ps.abstract(), ps.device(layout):
    w = ps.Variable(jax.ShapeDtypeStruct((64, 1024), jnp.float32), name="w")
real = jax.make_array_from_callback
def make_array_from_callback(shape, sharding, callback):
    def shard(index):  # after the first device's shard, the file is cut back to its header
        out = callback(index)  # in place (as a re-download or cp over it does)
        os.truncate(path, header_end)
        return out
    return real(shape, sharding, shard)
jax.make_array_from_callback = make_array_from_callback
try:
    ps.checkpoint.init_from_checkpoint(path, {"w": w}, allow_unverified=True)
except ps.checkpoint.CheckpointError as e:
    print("CheckpointError:", e)
    sys.exit(3)
print("returned")
"""


def test_a_hugging_face_file_truncated_while_it_is_read_is_a_checkpoint_error(tmp_path):
    """It killed the interpreter with SIGBUS (a memory map read past the file's new end)."""
    done = subprocess.run(
        [sys.executable, "-c", _TRUNCATED_WHILE_READ, str(tmp_path / "model.safetensors")],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, (done.returncode, done.stderr[-3000:])
    assert "is truncated inside tensor 'w'" in done.stdout, done.stdout


def hf_cache_layout(root: Path) -> Path:
    """A sharded model as ``huggingface_hub`` caches it: every file of
    ``snapshots/<revision>/`` a relative link to its content in ``../../blobs``."""
    export(root / "export", 3.0)  # an export dir would do: make it first
    blobs = root / "models--org--name" / "blobs"
    snapshot = root / "models--org--name" / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(root / "export"))):
        os.replace(root / "export" / name, blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / name)
    return snapshot


def test_a_sharded_model_in_the_hugging_face_cache_layout_loads(tmp_path):
    """Its shards were refused as "a link outside its directory" (issue 36 item 14)."""
    snapshot = hf_cache_layout(tmp_path)
    assert exported(snapshot) == 3.0  # (what transformers reads)
    names = [n for n, _, _ in ps.checkpoint.list_variables(snapshot, allow_unverified=True)]
    assert names == [f"t{i}" for i in range(_TENSORS)]
    v = ps.Variable(np.zeros(256, np.float32), name="v")
    ps.checkpoint.init_from_checkpoint(snapshot, {"t4": v}, allow_unverified=True)
    assert v.numpy().tolist() == [3.0] * 256
    u = ps.Variable(np.zeros(256, np.float32), name="u")
    ps.Saver({"t5": u}).restore(snapshot, allow_unverified=True)
    assert u.numpy().tolist() == [3.0] * 256


def test_a_shard_that_is_a_dangling_link_or_not_a_file_is_a_checkpoint_error(tmp_path):
    snapshot = hf_cache_layout(tmp_path)
    first = snapshot / "model-00001-of-00003.safetensors"
    target = os.path.realpath(first)
    os.remove(target)
    v = ps.Variable(np.zeros(256, np.float32), name="v")
    with pytest.raises(
        ps.checkpoint.CheckpointError, match=r"does not exist \(a link to nothing\)"
    ):
        ps.checkpoint.init_from_checkpoint(snapshot, {"t0": v}, allow_unverified=True)
    os.mkfifo(target)  # a link to a FIFO: refused before anything opens it
    error = in_thread(lambda: ps.checkpoint.list_variables(snapshot, allow_unverified=True))
    assert isinstance(error, ps.checkpoint.CheckpointError), repr(error)
    assert "is not a regular file (a FIFO)" in str(error)
    assert not v.numpy().any()


# ------------------------------------------- single-file saves and restores (the class)


@pytest.mark.parametrize("op", ["save", "restore"])
def test_a_single_file_save_or_restore_interrupted_anywhere_leaves_nothing_behind(tmp_path, op):
    """Big tensors are checksummed by a worker thread: an interrupt that cut the exit of
    the save or read short left that thread waiting forever; and no temporary stays."""
    w = ps.Variable(np.zeros(2**19 + 7, np.float32), name="w")  # > 1 MiB: the worker runs
    path = str(tmp_path / "ckpt.safetensors")
    ps.Saver([w]).save(path)
    saver = ps.Saver([w])

    def run() -> None:
        if op == "save":
            saver.save(path)
        else:
            saver.restore(path)

    run()
    gc.collect()
    threads = {t.name for t in threading.enumerate()}
    start = time.monotonic()
    raised = 0
    for i, k in enumerate(points(run, most=40)):
        w.assign(np.full(w.shape, float(i + 1), np.float32))
        old = ps.checkpoint.load_variable(path, "w")[:2].tolist()
        fired, error = interrupted(run, k)
        assert error is None or isinstance(error, KeyboardInterrupt), (k, repr(error))
        raised += error is not None
        del error
        assert os.listdir(tmp_path) == ["ckpt.safetensors"], (k, os.listdir(tmp_path))
        now = ps.checkpoint.load_variable(path, "w")[:2].tolist()
        assert now in (old, [i + 1.0] * 2), (k, now)
        assert time.monotonic() - start < BOUND
    assert raised >= 10
    gc.collect()
    assert not settled_threads(threads), "threads left behind"


def test_a_sharded_export_to_a_new_directory_interrupted_anywhere_is_whole_or_absent(tmp_path):
    target = tmp_path / "model"
    start = time.monotonic()
    raised = 0
    for k in points(lambda: export(target, 2.0) and atomic.remove_path(str(target)), most=40):
        fired, error = interrupted(lambda: export(target, 5.0), k)
        assert error is None or isinstance(error, KeyboardInterrupt), (k, repr(error))
        raised += error is not None
        assert [n for n in os.listdir(tmp_path) if n != "model"] == [], os.listdir(tmp_path)
        if target.exists():
            assert exported(target) == 5.0 and export_leftovers(target) == [], k
            atomic.remove_path(str(target))
        assert time.monotonic() - start < BOUND
    assert raised >= 10


def test_ctrl_c_stops_a_read_of_a_hugging_face_directory_at_once(tmp_path):
    """Only a read holding a path lock (a sharded directory) holds Ctrl-C back until it
    ends; a Hugging Face model directory resolves to a file: no lock, and an interrupt
    stops it where it lands (nothing assigned)."""
    export(tmp_path / "model", 4.0)
    v = ps.Variable(np.zeros(256, np.float32), name="v")

    def op() -> None:
        ps.checkpoint.init_from_checkpoint(tmp_path / "model", {"t3": v}, allow_unverified=True)

    op()
    stopped = 0
    for k in points(op, most=9)[1:-1]:
        v.assign(np.zeros(256, np.float32))
        fired, error = interrupted(op, k)
        assert fired and isinstance(error, KeyboardInterrupt), (k, repr(error))
        stopped += not v.numpy().any()
        no_lock_held()
    assert stopped >= 4, stopped
