"""The checkpoint I/O engine (private): checksums beside the I/O, gathered writes, atomic
file replacement, and opening only regular files.

* ``Checksums`` computes XXH3-64 (format 2) or CRC-32 (format 1) digests of buffers, the
  big ones on a worker thread (xxhash and zlib release the GIL) while the next I/O runs.
* ``Gather`` hands many small buffers to one ``os.writev`` call.
* ``datasync``: flush a file's data (the temporaries, renames and the write order are
  ``checkpoint.atomic``'s).
* ``open_regular`` opens a file for reading only if it is a regular file: a FIFO, a device
  or a socket is refused before ``open()`` can block on it or trigger a device's side
  effects (CheckpointError).

Nothing here knows the file format; ``paramstore.checkpoint.formats.safetensors.file`` drives it.
"""

from __future__ import annotations

import collections
import functools
import io
import os
import queue
import stat
import sys
import threading
import weakref
import zlib
from collections.abc import Callable, Collection, Iterable
from typing import Any, BinaryIO

import numpy as np
import xxhash

from paramstore._core.interrupts import deferred
from paramstore.checkpoint.format import CheckpointError

CHUNK = 16 * 2**20  # bytes per write/read call and checksum job
PARALLEL_MIN = 2**20  # smaller buffers are checksummed inline
READ_CHUNK = 2**18  # reads are checksummed inline, while the chunk is in the CPU cache
BUFFER = 2**20  # write buffer, for many small tensors
RUN = 2**20  # adjacent small tensors are read with one call into one buffer of this size


# --------------------------------------------------------------------- regular files


def check_regular(path: str, what: str = "Checkpoint") -> os.stat_result:
    """``os.stat(path)`` if ``path`` is a regular file (following symlinks); CheckpointError
    for a FIFO, a device, a socket or a directory, which are never opened; FileNotFoundError
    if nothing is there."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(
            f"{what} '{path}' is not a regular file ({_kind(st.st_mode)}); paramstore reads "
            "checkpoints only from regular files, so that a read cannot block or touch a "
            "device. Pass the path of the checkpoint file itself."
        )
    return st


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a file"


def open_regular(path: str, what: str = "Checkpoint") -> BinaryIO:
    """``path`` opened unbuffered for reading, refused (CheckpointError) unless it is a regular
    file: checked with ``stat`` before ``open`` and with ``fstat`` after it (opened with
    ``O_NONBLOCK``, so a file swapped for a FIFO in between cannot block the open).

    An interrupt (Ctrl-C) landing anywhere closes the descriptor exactly once (issue 36):
    the descriptor is recorded in ``held`` by the same C call that opens it, and leaves
    ``held`` in the same C call that hands it to the file object (which then owns it), so
    no signal handler can run while nothing, or two things, own it."""
    check_regular(path, what)
    held: list[int] = []
    close_held = map(os.close, held)  # made now: the except clause's first call runs it
    try:
        _EXHAUST(map(held.append, map(os.open, (path,), (_READ_FLAGS,))))
        mode = os.fstat(held[0]).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{what} '{path}' is not a regular file ({_kind(mode)}).")
        if hasattr(os, "set_blocking"):
            os.set_blocking(held[0], True)
        file: BinaryIO = next(map(_READER, map(held.pop, (0,))))
        return file
    except BaseException:
        _EXHAUST(close_held)  # nothing once the file object owns the descriptor
        raise


_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_READER = functools.partial(io.FileIO, mode="rb")  # owns (and closes) the descriptor
_EXHAUST: Callable[[Iterable[Any]], None] = collections.deque(maxlen=0).extend  # in C


def aligned_empty(nbytes: int) -> np.ndarray:
    """A new uint8 buffer aligned to 64 bytes, which jax on CPU can adopt without a copy."""
    raw = np.empty(nbytes + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + nbytes]


# ------------------------------------------------------------------------ path locks

_PATH_LOCKS = [threading.Lock() for _ in range(64)]  # striped: bounded, whatever the paths


def path_lock(path: str) -> threading.Lock:
    """The lock of one checkpoint path in this process (one of 64, by the path's hash):
    saves to one path from several threads run one at a time (each writes a temporary and
    renames it over the last; Orbax needs its directory to itself), so the previous
    checkpoint is never lost; a sharded directory is read under it too (its files are
    replaced one by one). Two paths may share a lock; no code holds two."""
    return _PATH_LOCKS[hash(os.path.realpath(path)) % len(_PATH_LOCKS)]


# ------------------------------------------------------------------------- checksums


class _Hash:
    """One running checksum: XXH3-64 (format 2) or CRC-32 (format 1)."""

    __slots__ = ("_h", "_crc")

    def __init__(self, algorithm: str) -> None:
        self._h = xxhash.xxh3_64() if algorithm == "xxh3" else None
        self._crc = 0

    def update(self, data: memoryview) -> None:
        if self._h is not None:
            self._h.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return self._h.hexdigest() if self._h is not None else f"{self._crc:08x}"


def checksum(data: Any) -> str:
    """The XXH3-64 of a buffer, as 16 hex digits (what format 2 and the sharded manifest store)."""
    return xxhash.xxh3_64_hexdigest(data)


class Checksums:
    """Checksums computed beside the file I/O. Buffers of at least ``PARALLEL_MIN`` bytes go
    to one worker thread (xxhash and zlib release the GIL); smaller ones are computed inline,
    where a thread hand-off would cost more. The worker starts with the first big buffer, or
    with ``deferred`` only at ``start()``: a writer starts it when its data goes to disk, so
    the checksums use the CPU while the disk flushes rather than competing with the copies
    into the page cache."""

    def __init__(
        self, algorithm: str = "xxh3", deferred: bool = False, done: Collection[Any] = ()
    ) -> None:
        self._algorithm = algorithm
        self._done = done  # keys checksummed already: their data is not hashed again
        self._deferred = deferred
        self._hashes: dict[Any, _Hash] = {}
        self._digests: dict[Any, str] = {}
        self._threaded: set[Any] = set()  # keys with data sent to the worker
        self._jobs: queue.SimpleQueue[tuple[_Hash, memoryview] | None] = queue.SimpleQueue()
        self._queued = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._inline = False  # no thread could start (interpreter exit): checksum inline

    def __enter__(self) -> Checksums:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    @property
    def queued(self) -> bool:
        """Whether some buffers are (or were) left to the worker thread."""
        return self._queued

    def add(self, key: Any, data: memoryview) -> None:
        """Checksum ``data`` (appending to earlier data of the same ``key``)."""
        if key in self._done:
            return
        h = self._hashes.get(key)
        if h is None:
            h = self._hashes[key] = _Hash(self._algorithm)
        if data.nbytes < PARALLEL_MIN and key not in self._threaded:
            h.update(data)
            return
        self._threaded.add(key)  # its later data must follow in the worker's queue, in order
        self._jobs.put((h, data))
        self._queued = True
        if not self._deferred:
            self.start()

    def add_whole(self, key: Any, data: memoryview) -> None:
        """Checksum all of ``key``'s data, given at once (inline if small): no running
        hash object, for the many small tensors of a checkpoint."""
        if data.nbytes >= PARALLEL_MIN or key in self._hashes:
            self.add(key, data)
        elif self._algorithm == "xxh3":
            self._digests[key] = xxhash.xxh3_64_hexdigest(data)
        else:
            self._digests[key] = f"{zlib.crc32(data):08x}"

    def start(self) -> None:
        """Start the worker on the queued buffers (once). Where no thread can start (at
        interpreter exit, Python 3.12 refuses new threads: a background save flushed then),
        the queued buffers are checksummed here, inline."""
        if self._inline:
            self._drain()
            return
        if self._queued and self._thread is None:
            thread = threading.Thread(
                target=_work,
                args=(self._jobs, weakref.ref(self)),
                name="paramstore-checksum",
                daemon=True,
            )
            # Held back over the start: CPython's Thread.start waits on a Condition, whose
            # exit an interrupt turns into "RuntimeError: release unlocked lock".
            try:
                with deferred():
                    thread.start()
                    self._thread = thread
            except RuntimeError as e:
                if not _at_shutdown(e):
                    raise
                self._inline = True
                self._drain()

    def _drain(self) -> None:
        """Checksum the queued buffers in this thread."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job[0].update(job[1])

    def _stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def result(self) -> dict[Any, str]:
        """``{key: hex digest}`` once every checksum is done."""
        self.start()
        self._stop()
        if self._error is not None:
            raise self._error
        out = {k: h.hexdigest() for k, h in self._hashes.items()}
        out.update(self._digests)
        return out


def _work(jobs: queue.SimpleQueue[tuple[_Hash, memoryview] | None], owner: Any) -> None:
    """The checksum worker: runs the jobs until the ``None`` that ``_stop`` queues, or, if
    an interrupt cut the owner's exit short before it was queued, until the owner
    (``weakref`` to a ``Checksums``) is gone: no thread is left waiting forever."""
    while True:
        try:
            job = jobs.get(timeout=_IDLE)
        except queue.Empty:
            if owner() is None:
                return
            continue
        if job is None:
            return
        h, data = job
        try:
            h.update(data)
        except BaseException as e:  # pragma: no cover - hashes do not fail on buffers
            holder = owner()
            if holder is not None:
                holder._error = e


def _at_shutdown(error: RuntimeError) -> bool:
    """Whether ``error`` (from ``Thread.start``) says that Python is shutting down (from
    3.12 it refuses new threads once its exit has begun, before ``sys.is_finalizing()``)."""
    return sys.is_finalizing() or "interpreter shutdown" in str(error)


_IDLE = 0.5  # seconds between the worker's looks at whether its owner is gone


# ---------------------------------------------------------------------- writes


def datasync(fd: int) -> None:
    getattr(os, "fdatasync", os.fsync)(fd)


_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "writev") else 0


class Gather:
    """A writer over the file ``f`` that holds the buffers given to ``write`` (without
    copying them; they must stay unchanged) and writes them ``_IOV_MAX`` at a time with
    one ``os.writev``: for many small tensors, a few system calls instead of one per
    buffer. ``flush`` writes what it holds and flushes ``f``."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._views: list[memoryview] = []

    def write(self, data: memoryview) -> None:
        self._views.append(data)
        if len(self._views) >= max(_IOV_MAX, 1):
            self.flush()

    def flush(self) -> None:
        write_views(self._f, self._views)
        self._views = []
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()


def write_views(f: BinaryIO, views: list[memoryview]) -> None:
    """Write ``views`` at ``f``'s position: with ``os.writev``, many buffers a system call
    and no copy into the file's buffer (``f`` is flushed first), else ``f.write`` each."""
    if not _IOV_MAX:
        for v in views:
            f.write(v)
        return
    f.flush()
    fd = f.fileno()
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_MAX]
        n = os.writev(fd, batch)
        if n <= 0:
            raise OSError(f"writev wrote {n} bytes")
        for v in batch:  # skip what was written; a partial write resumes mid-buffer
            if n < v.nbytes:
                views[i] = v[n:]
                break
            n -= v.nbytes
            i += 1
