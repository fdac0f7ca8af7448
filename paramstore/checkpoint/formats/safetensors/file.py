"""Checkpoint files: ``write_arrays`` and ``SafetensorsFile`` (private; the format is
``paramstore.checkpoint.formats.safetensors.format``, the I/O engine ``paramstore.checkpoint.io``).

``write_arrays`` streams the tensors to a temporary file beside the target, with their
checksums computed beside the writes, and renames it over the target atomically.
``SafetensorsFile`` is the single-file format's ``checkpoint.format.Reader``: it opens only a regular
file, checks every size in the header against the file (``checkpoint.formats.safetensors.header``) and every
checksum before it returns data. ``paramstore.checkpoint`` builds Saver and
CheckpointManager on these.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, BinaryIO

import numpy as np

from paramstore.checkpoint.atomic import fsync_dir, live_temp, save_error
from paramstore.checkpoint.format import CheckpointError, PathLike, is_string, no_such_variable
from paramstore.checkpoint.formats.safetensors.format import (
    KEY_VERSION,
    MAX_HEADER,
    Entry,
    NotACheckpoint,
    Tensor,
    build_header,
    check_name,
    decode,
    encode,
)
from paramstore.checkpoint.formats.safetensors.header import read_header
from paramstore.checkpoint.io import (
    BUFFER,
    CHUNK,
    PARALLEL_MIN,
    READ_CHUNK,
    RUN,
    Checksums,
    Gather,
    aligned_empty,
    checksum,
    datasync,
    open_regular,
)
from paramstore.checkpoint.placement import put


def write_arrays(path: PathLike, arrays: Mapping[str, np.ndarray]) -> str:
    """Atomically write ``arrays`` ({name: NumPy array}) as a checkpoint file at ``path``.

    Streams: the header (with placeholder checksums of the same length) goes first, then
    each tensor's bytes while their XXH3-64 checksums are computed beside the writes, then the final
    header over the placeholder; fsync, rename over ``path``, fsync the directory. Only a
    string tensor is ever encoded into a new buffer. Returns ``path`` as a string.
    """
    for name in arrays:
        check_name(name)
    return write_checked(path, arrays)


def write_checked(path: PathLike, arrays: Mapping[str, np.ndarray]) -> str:
    """``write_arrays`` of names already checked (``check_name``: a ``Saver`` checks its
    names once, when it reads its mapping)."""
    path = os.fspath(path)
    tensors = [encode(name, np.asarray(a)) for name, a in arrays.items()]
    tensors.sort(key=lambda t: -t.itemsize)  # so each tensor starts aligned to its itemsize
    directory = os.path.dirname(path)
    if directory:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise save_error(e, path) from e
    with live_temp(path) as tmp:
        try:
            _write_file(path, tmp, tensors)
            os.replace(tmp, path)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(e, OSError):
                raise save_error(e, path) from e
            raise
    fsync_dir(directory)
    return path


def _write_file(path: str, tmp: str, tensors: list[Tensor]) -> None:
    """The file ``tmp``: header, tensors, checksums, fsynced (``write_arrays``)."""
    # Small tensors are checksummed now, so a file of only small tensors is written
    # with its final header at once; big ones are checksummed while the data flushes.
    crcs = {t.name: checksum(t.data) for t in tensors if t.data.nbytes < PARALLEL_MIN}
    header = build_header(tensors, crcs)
    if len(header) - 8 > MAX_HEADER:
        raise CheckpointError(
            f"Cannot save {len(tensors)} variables to '{path}': the header would take "
            f"{len(header) - 8} bytes, more than the {MAX_HEADER // 2**20} MiB a reader "
            "accepts. Save fewer, larger variables (or use Saver(..., sharded=True))."
        )
    with open(tmp, "xb", buffering=BUFFER) as f:
        f.write(header)
        with Checksums(deferred=True, done=crcs.keys()) as checksums:
            gather = Gather(f)
            for t in tensors:
                _write_tensor(gather, t, checksums)
            gather.flush()
            if checksums.queued:  # checksum the big tensors while the data goes to disk
                checksums.start()
                datasync(f.fileno())
            big = checksums.result()
        if big:
            crcs.update(big)
            f.seek(0)
            f.write(build_header(tensors, crcs))
            f.flush()
        os.fsync(f.fileno())


def _write_tensor(f: BinaryIO | Gather, t: Tensor, checksums: Checksums) -> None:
    if not t.data.nbytes:
        checksums.add(t.name, t.data)
    for i in range(0, t.data.nbytes, CHUNK):
        chunk = t.data[i : i + CHUNK]
        checksums.add(t.name, chunk)
        f.write(chunk)


class SafetensorsFile:
    """An open checkpoint file with its checked header (the ``checkpoint.format.Reader`` of the
    single-file format); ``load``/``load_many`` read tensors and verify their checksums."""

    def __init__(self, path: PathLike, allow_unverified: bool = False) -> None:
        self.path = os.fspath(path)  # a file: directories are resolved by the caller
        self._f: BinaryIO = open_regular(self.path)  # see close()
        try:
            size = os.fstat(self._f.fileno()).st_size
            self.entries, self.metadata = read_header(self._f, size, allow_unverified)
        except NotACheckpoint as e:
            self._f.close()
            raise CheckpointError(
                f"'{self.path}' is not a paramstore checkpoint: {e}. A checkpoint is a file "
                "written by ps.Saver, a sharded checkpoint directory, a TensorFlow checkpoint "
                "prefix or a Keras .weights.h5 file."
            ) from None
        except ValueError as e:
            self._f.close()
            raise CheckpointError(f"Checkpoint '{self.path}' is corrupt: {e}.") from None
        except BaseException:
            self._f.close()
            raise
        version = self.metadata.get(KEY_VERSION)
        self.description = (
            f"format version {version}" if version else "plain safetensors, unverified"
        )

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    def entry(self, name: str) -> Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise no_such_variable(self.path, name, self.entries) from None

    def load(self, wanted: Mapping[str, Any]) -> dict[str, Any]:
        """``{name: placement}`` -> ``{name: value}``, verified (see ``checkpoint.format.Reader``).
        Values are ``jax.device_put`` in batches of ``CHUNK`` bytes, one call per batch,
        so host memory holds at most a batch beyond what JAX keeps."""
        out: dict[str, Any] = {}
        batch: list[tuple[str, np.ndarray, Any]] = []
        size = 0
        for name, arr in self.load_many(wanted):  # raises at the end if a checksum fails
            placement = wanted[name]
            if placement is None or is_string(arr.dtype):
                out[name] = arr
                continue
            batch.append((name, arr, placement))
            size += arr.nbytes
            if size >= CHUNK:
                out.update(put(batch))
                batch, size = [], 0
        out.update(put(batch))
        return out

    def load_many(self, names: Iterable[str]) -> Iterator[tuple[str, np.ndarray]]:
        """``(name, value)`` for each name, in file order, as soon as each is read.

        Checksums are computed beside the reads and verified after the last item: the
        iterator raises CheckpointError instead of finishing if any fails, so a consumer
        must not act on the values before the iteration ends. ``load`` is always verified.
        """
        entries = sorted((self.entry(n) for n in names), key=lambda e: e.start)
        algorithm = entries[0].algorithm if entries else ""
        with Checksums(algorithm or "xxh3") as checksums:
            for run in _runs(entries):
                if len(run) == 1:
                    yield self._decoded(run[0], self._read(run[0], checksums))
                    continue
                buf = self._read_run(run, checksums)
                first = run[0].start
                for e in run:
                    yield self._decoded(e, buf[e.start - first : e.end - first])
            digests = checksums.result()
        for e in entries:
            if e.checksum is not None and digests[e.name] != e.checksum:
                raise CheckpointError(
                    f"Checkpoint '{self.path}' is corrupt: the data of variable '{e.name}' "
                    f"fails its checksum ({e.algorithm} {digests[e.name]}, expected "
                    f"{e.checksum}). Restore an older checkpoint."
                )

    def _read(self, e: Entry, checksums: Checksums) -> np.ndarray:
        buf = aligned_empty(e.nbytes)
        view = buf.data
        self._f.seek(e.start)
        got = 0
        if not e.nbytes:
            checksums.add(e.name, view)
        # A big tensor is hashed by the worker in pieces of PARALLEL_MIN while the next
        # ones are read; a small one inline, each chunk while it is in the CPU cache.
        piece = PARALLEL_MIN if e.nbytes >= PARALLEL_MIN else 1
        hashed = 0
        while got < e.nbytes:
            n = self._f.readinto(view[got : got + READ_CHUNK])  # type: ignore[attr-defined]
            if not n:
                raise CheckpointError(
                    f"Checkpoint '{self.path}' is truncated inside variable '{e.name}'."
                )
            got += n
            if got - hashed >= piece or got == e.nbytes:
                checksums.add(e.name, view[hashed:got])
                hashed = got
        return buf

    def _read_run(self, run: list[Entry], checksums: Checksums) -> np.ndarray:
        """Adjacent small tensors in one read into one buffer (each tensor a view of it,
        aligned like the first when the sizes before it are multiples of 64 bytes)."""
        first = run[0].start
        buf = aligned_empty(run[-1].end - first)
        view = buf.data
        self._f.seek(first)
        got = 0
        while got < buf.size:
            n = self._f.readinto(view[got:])  # type: ignore[attr-defined]
            if not n:
                e = next(e for e in run if e.end > first + got)
                raise CheckpointError(
                    f"Checkpoint '{self.path}' is truncated inside variable '{e.name}'."
                )
            got += n
        for e in run:
            checksums.add_whole(e.name, view[e.start - first : e.end - first])
        return buf

    def _decoded(self, e: Entry, buf: np.ndarray) -> tuple[str, np.ndarray]:
        try:
            return e.name, decode(e, buf)
        except ValueError as err:
            raise CheckpointError(
                f"Checkpoint '{self.path}' is corrupt: variable '{e.name}': {err}."
            ) from None


def _runs(entries: list[Entry]) -> Iterator[list[Entry]]:
    """``entries`` (in file order) in groups read with one call: adjacent tensors smaller
    than ``PARALLEL_MIN``, up to ``RUN`` bytes a group; any other tensor alone."""
    run: list[Entry] = []
    size = 0
    for e in entries:
        small = e.end - e.start < PARALLEL_MIN
        if run and (not small or e.start != run[-1].end or size + e.end - e.start > RUN):
            yield run
            run, size = [], 0
        if not small:
            yield [e]
            continue
        run.append(e)
        size += e.end - e.start
    if run:
        yield run
