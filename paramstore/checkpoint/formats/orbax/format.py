"""Sharded checkpoints through Orbax: the format behind ``ps.Saver(..., sharded=...)``.

A sharded checkpoint is a directory:

* ``arrays/``: written by an Orbax ``Checkpointer`` (``CompositeCheckpointHandler``, one item):
  a flat pytree ``{"v0": array, "v1": ...}`` (positional keys, so that no variable name has
  to be escaped). Each process writes only the shards it holds (TensorStore, one OCDBT
  store per process); restoring reads, for each device, only the pieces its shard needs,
  so the checkpoint restores onto any mesh and process count.
* ``paramstore/process_<i>.json``, one per writing process: the sums of every shard the
  process wrote and the digests of its files (``paramstore.checkpoint.formats.orbax.integrity``).
* ``paramstore/metadata``, written by process 0 last: the format version, the number of
  writing processes and, per variable, its name, key, shape and dtype; string variables
  keep their values here, and empty arrays (which Orbax cannot store) need nothing more.

A save writes all of this into a staging directory beside the checkpoint
(``.<name>.tmp-<pid>-<random>``, the same on every process) and, once complete, swaps it
with what was at the path (``checkpoint.atomic.install_dir``: atomically on Linux), so the
previous checkpoint stays intact until then; a failed save removes its staging directory,
and a killed one leaves it to the next ``CheckpointManager``. The metadata appears only
after every process file is there, so a directory without it is no checkpoint: readers and
``CheckpointManager`` skip it. One-byte ``ml_dtypes`` values (int4, float8...) are stored
as bytes (``checkpoint.formats.orbax.packed``).
Restoring checks the metadata and process files' digests, that the writers' shards tile
each array, every file's digest, and the sums of the restored values, shard by shard where
the layout is the writer's and as a total otherwise, before any variable is assigned.
paramstore reads the JSON itself (``list_variables`` needs no Orbax). Orbax is imported
only here, lazily (``importlib``). ``checkpoint.formats.orbax.read.ShardedCheckpoint`` is this format's
``checkpoint.format.Reader``.
"""

from __future__ import annotations

import importlib
import math
import os
import threading
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from paramstore._core.interrupts import deferred
from paramstore.checkpoint.atomic import hold, install_dir, release
from paramstore.checkpoint.format import CheckpointError
from paramstore.checkpoint.formats.orbax import integrity, packed
from paramstore.checkpoint.formats.orbax.staging import (
    discard,
    failed,
    shutting_down,
    staging_path,
)
from paramstore.checkpoint.io import path_lock

FORMAT = "paramstore-sharded"
PROCESS_FORMAT = "paramstore-sharded-process"
VERSION = integrity.WRAPPER_VERSION
ARRAYS = "arrays"
META = "paramstore"
_META_FILE = "metadata"
_STRING = np.dtypes.StringDType()
PEER_TIMEOUT = 600.0  # seconds process 0 waits for the other processes' files


class FormatError(ValueError):
    """The metadata of a sharded checkpoint is missing or malformed."""


def orbax() -> Any:
    """``orbax.checkpoint``, or ImportError saying how to get it."""
    try:
        ocp = importlib.import_module("orbax.checkpoint")
    except ImportError as e:
        raise ImportError(
            "Sharded checkpoints need Orbax: pip install 'paramstore[sharded]' (or "
            "orbax-checkpoint). It is used when jax.process_count() > 1 or with "
            f"Saver(..., sharded=True). ({e})"
        ) from e
    return ocp


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` is a (finished) sharded paramstore checkpoint directory."""
    return os.path.isfile(os.path.join(path, META, _META_FILE))


def process_file(path: str, process: int) -> str:
    return os.path.join(path, META, f"process_{process}.json")


# ----------------------------------------------------------------------------- metadata


def _dtype(name: Any) -> np.dtype:
    if name == "string":
        return _STRING
    if not isinstance(name, str) or not name.isidentifier():
        raise FormatError(f"unknown dtype {name!r}")
    try:
        dt = np.dtype(getattr(ml_dtypes, name, name))
    except TypeError:
        raise FormatError(f"unknown dtype {name!r}") from None
    if dt.name != name:
        raise FormatError(f"unknown dtype {name!r}")
    return dt


def _dtype_name(dt: np.dtype) -> str:
    return "string" if dt == _STRING else dt.name


def read_metadata(path: str) -> tuple[int, list[dict[str, Any]]]:
    """``(number of writing processes, [{"name", "key", "shape", "dtype", "strings"?}])``
    of a sharded checkpoint, in save order, verified (FormatError if damaged)."""
    file = os.path.join(path, META, _META_FILE)
    if not os.path.isfile(file):
        raise FormatError(f"'{path}' is not a sharded paramstore checkpoint (no {file})")
    try:
        meta = integrity.read_json(file, FORMAT)
    except integrity.IntegrityError as e:
        raise FormatError(f"its metadata {META}/{_META_FILE} cannot be read: {e}") from None
    processes = meta.get("processes") if isinstance(meta, dict) else None
    if type(processes) is not int or processes < 1:
        raise FormatError(f"{file} has no valid process count")
    out = []
    seen: set[str] = set()
    for entry in meta.get("variables", ()):
        if not isinstance(entry, dict):
            raise FormatError("a variable entry is not an object")
        name, key, shape = entry.get("name"), entry.get("key"), entry.get("shape")
        if not isinstance(name, str) or name in seen:
            raise FormatError(f"bad or duplicate variable name {name!r}")
        seen.add(name)
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise FormatError(f"variable '{name}' has a bad shape {shape!r}")
        dtype = _dtype(entry.get("dtype"))
        item = {"name": name, "key": key, "shape": tuple(shape), "dtype": dtype}
        stored = entry.get("stored")
        if stored is not None:
            if stored != packed.STORED or not packed.needs_packing(dtype):
                raise FormatError(f"variable '{name}' has a bad stored dtype {stored!r}")
            item["stored"] = np.dtype(stored)
        if dtype == _STRING:
            values = entry.get("strings")
            if not (
                isinstance(values, list)
                and len(values) == math.prod(shape)
                and all(isinstance(s, str) for s in values)
            ):
                raise FormatError(f"string variable '{name}' has bad values")
            item["strings"] = values
        elif math.prod(shape) != 0 and not isinstance(key, str):
            raise FormatError(f"variable '{name}' has no array key")
        out.append(item)
    return processes, out


# ------------------------------------------------------------------------------- saving


def host_value(x: Any) -> Any:
    """What goes into the Orbax tree for one variable's array: the ``jax.Array`` itself,
    except a process-local one in a multi-process run (a variable not placed over the
    global devices), which is saved from process 0 as NumPy."""
    if jax.process_count() > 1 and x.is_fully_addressable:
        return np.asarray(x)
    return x


class _Plan:
    """One save: the metadata, the Orbax tree and the pending shard sums. The files go to
    ``root``, a staging directory beside ``path`` that ``_install`` puts in its place."""

    def __init__(self, path: str, root: str, values: Mapping[str, Any]) -> None:
        self.path = path
        self.root = root
        self.process = jax.process_index()
        self.processes = jax.process_count()
        self.entries: list[dict[str, Any]] = []
        self.arrays: dict[str, Any] = {}
        mine: dict[str, Any] = {}
        for i, (name, x) in enumerate(values.items()):
            dtype = np.dtype(x.dtype)
            entry: dict[str, Any] = {
                "name": name,
                "key": None,
                "shape": [int(d) for d in x.shape],
                "dtype": _dtype_name(dtype),
            }
            if dtype == _STRING:
                entry["strings"] = [str(s) for s in np.asarray(x).reshape(-1).tolist()]
            elif math.prod(x.shape) != 0:  # Orbax cannot store an empty array
                entry["key"] = key = f"v{i}"
                value = host_value(x)
                if packed.needs_packing(dtype):  # bytes that Orbax can store
                    entry["stored"] = packed.STORED
                    value = packed.pack(value)
                self.arrays[key] = value
                local = not isinstance(value, jax.Array) or (
                    self.processes > 1 and value.is_fully_addressable
                )
                if not local or self.process == 0:  # a local value is process 0's
                    mine[key] = value
            self.entries.append(entry)
        self.pending = integrity.dispatch_sums(mine)  # runs on the devices, not waited for

    def finish(self) -> None:
        """After Orbax finished: write this process's sums and file digests, and (process
        0, once every process's file is there) the metadata that makes it a checkpoint."""
        shards = {
            key: [[box, integrity.hexsums(s)] for box, s in integrity.fetch(p)]
            for key, p in self.pending.items()
        }
        os.makedirs(os.path.join(self.root, META), exist_ok=True)
        files = integrity.digest_files(
            self.root, integrity.files_of(self.root, self.process, skip=META)
        )
        body = {"process": self.process, "shards": shards, "files": files}
        integrity.write_json(process_file(self.root, self.process), PROCESS_FORMAT, body)
        if self.process != 0:
            return
        others = [process_file(self.root, p) for p in range(1, self.processes)]
        missing = integrity.wait_for(others, PEER_TIMEOUT)
        if missing:
            raise CheckpointError(
                f"Sharded checkpoint '{self.path}' is incomplete: after {PEER_TIMEOUT:.0f} s "
                f"{len(missing)} process(es) have not written their part ({missing[0]}). Every "
                "process must call save with the same variables; the previous checkpoint is "
                "untouched."
            )
        meta = {"processes": self.processes, "variables": self.entries}
        integrity.write_json(os.path.join(self.root, META, _META_FILE), FORMAT, meta)

    def install(self) -> None:
        """Put the finished staging directory at ``path`` (process 0; every process
        returns once it is there): the previous checkpoint stays until then."""
        _barrier("paramstore.sharded.written")
        if self.process == 0:
            install_dir(self.root, self.path)
        _barrier("paramstore.sharded.installed")

    def discard(self, error: BaseException) -> BaseException:
        """After a failed save: remove the staging directory (and Orbax's temporary of
        it); ``error`` as what the caller raises, naming the checkpoint."""
        if self.process == 0:
            discard(self.root)
        return failed(error, self.path)


def _handler(ocp: Any) -> Any:
    """Orbax's composite handler, with the arrays written uncompressed: zstd (Orbax's
    default) shrank 64 MiB of trained-like float32 (normal) values by 3% and cost more than
    the whole rest of a save (512 MiB on 8 CPU devices: see benchmarks/README.md)."""
    return ocp.CompositeCheckpointHandler(
        **{ARRAYS: ocp.PyTreeCheckpointHandler(use_compression=False)}
    )


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils = importlib.import_module("jax.experimental.multihost_utils")
        multihost_utils.sync_global_devices(name)


def _write_arrays(ocp: Any, checkpointer: Any, plan: _Plan) -> None:
    if plan.arrays:
        args = ocp.args.Composite(**{ARRAYS: ocp.args.PyTreeSave(plan.arrays)})
        checkpointer.save(plan.root, args, force=True)
        return
    if plan.process == 0:  # nothing for Orbax: the metadata says it all
        os.makedirs(os.path.join(plan.root, META))
    _barrier("paramstore.sharded.empty")


def save(path: str, values: Mapping[str, Any], checkpointer: AsyncWriter | None = None) -> str:
    """Write ``{name: jax.Array | NumPy string array}`` as a sharded checkpoint at ``path``
    (replacing one there only once the new one is complete: it is written to a staging
    directory beside ``path``, then swapped in). Every process must call it with the same
    names. With an ``AsyncWriter`` it returns once the values are copied off the devices;
    the writer's ``wait_until_finished`` completes it. The caller holds ``path_lock(path)``
    (the one lock of a checkpoint path, ``checkpoint.io``); an ``AsyncWriter`` takes it
    itself and holds it until the files are written, so no reader or other save of this
    process sees a save in flight. A failed save leaves what was at ``path`` and removes
    its staging directory; an ``OSError`` (a full or read-only disk) is raised as one
    naming ``path``."""
    ocp = orbax()
    path = os.path.abspath(path)
    if shutting_down():
        raise RuntimeError(
            f"Cannot save the sharded checkpoint '{path}' at interpreter exit: Orbax writes "
            "with threads that Python has already shut down. Save before the program ends "
            "(a CheckpointManager's pending async saves are finished at exit); the previous "
            "checkpoint at that path, if any, is unchanged."
        )
    parent = os.path.dirname(path)
    if parent and jax.process_index() == 0:
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise failed(e, path) from e
    if checkpointer is not None:
        checkpointer.save(path, values)
        return path
    # Orbax writes with threads and an event loop that an interrupt would leave running
    # (still writing into a staging directory already removed): signal handlers'
    # exceptions (Ctrl-C) are held back until the save is installed or discarded, then
    # raised as they were; nothing temporary is left (issue 36 item 12).
    with deferred():
        root = staging_path(path)
        hold(root)
        try:
            plan = _Plan(path, root, values)
            try:
                _write_arrays(ocp, ocp.Checkpointer(_handler(ocp)), plan)
                plan.finish()
                plan.install()
            except BaseException as e:
                error = plan.discard(e)
                if error is e:
                    raise
                raise error from e
        finally:
            release(root)
    return path


class AsyncWriter:
    """Sharded saves in the background: ``save`` returns once Orbax has the values on the
    host (and the shard sums are dispatched); a thread waits for Orbax, then writes the
    process file and the metadata. ``wait_until_finished`` joins it and re-raises its
    error. One save at a time: a second ``save`` waits for the first."""

    def __init__(self, one_shot: bool = False) -> None:
        self._one_shot = one_shot  # close Orbax's checkpointer after the first save
        ocp = orbax()
        self._ocp = ocp
        self._checkpointer = ocp.AsyncCheckpointer(_handler(ocp))
        self._thread: threading.Thread | None = None
        self._finished = threading.Event()  # set once the save in flight is done
        self._error: BaseException | None = None

    def save(self, path: str, values: Mapping[str, Any]) -> None:
        self.wait_until_finished()
        lock = path_lock(path)
        # Held back until the lock is the background thread's (or released) and Orbax has
        # the values: an interrupt meanwhile would leave the lock taken or Orbax's threads
        # writing (issue 38 item 4).
        with deferred():
            lock.acquire()  # released by the background thread, once the files are written
            root = staging_path(path)
            hold(root)
            try:
                plan = _Plan(path, root, values)
                try:
                    _write_arrays(self._ocp, self._checkpointer, plan)
                except BaseException as e:
                    error = plan.discard(e)
                    if error is e:
                        raise
                    raise error from e
                self._finished = threading.Event()
                self._thread = threading.Thread(
                    target=self._finish,
                    args=(plan, lock),
                    name="paramstore-sharded-save",
                    daemon=True,
                )
                self._thread.start()
            except BaseException:
                self._thread = None
                release(root)
                lock.release()
                raise

    def _finish(self, plan: _Plan, lock: threading.Lock) -> None:
        try:
            self._checkpointer.wait_until_finished()
            plan.finish()
            plan.install()
        except BaseException as e:
            error = plan.discard(e)
            error.add_note(f"(raised by the background save of '{plan.path}')")
            self._error = error
        finally:
            release(plan.root)
            lock.release()
            try:
                if self._one_shot:
                    self._checkpointer.close()
            finally:
                self._finished.set()

    def wait_until_finished(self) -> None:
        """Block until the save in flight (if any) is done; re-raise its error. Interrupted
        (Ctrl-C), the save stays in flight: a later call waits for it again (it waits on an
        Event: on Python 3.11 an interrupted ``Thread.join`` marks the thread stopped, and
        every later join returns at once)."""
        thread = self._thread
        if thread is not None:
            self._finished.wait()
            thread.join()  # it is ending: no daemon thread left to die in the exit
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def done(self) -> bool:
        """Whether the save in flight (if any) has finished (its error, if any, is raised by
        ``wait_until_finished``)."""
        return self._thread is None or self._finished.is_set()

    def wait(self) -> None:
        """``wait_until_finished`` (the ``CheckpointManager``'s ``Background`` protocol)."""
        self.wait_until_finished()


def save_async(path: str, values: Mapping[str, Any]) -> AsyncWriter:
    """Start a sharded save in the background (``CheckpointManager(async_save=True)``):
    returns once the values are off the devices, as an object whose ``wait()`` completes
    it (and re-raises its error). Each save has its own writer (an Orbax AsyncCheckpointer
    costs ~3 ms to make), closed when the save is done."""
    writer = AsyncWriter(one_shot=True)
    save(os.path.abspath(path), values, writer)
    return writer
