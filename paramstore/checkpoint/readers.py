"""Reader dispatch: which format is on disk at a path (private).

``open_reader`` resolves a path (a manager directory: its latest checkpoint) and opens the
``checkpoint.format.Reader`` of what is there: a sharded Orbax directory, a TensorFlow checkpoint
prefix or directory, a Keras ``.weights.h5`` file, a Hugging Face checkpoint
(``model.safetensors.index.json``, or a directory holding it or ``model.safetensors``), or a
safetensors file (paramstore's own, or a foreign one read unverified). A path that is not
a regular file or a directory (a FIFO, a device) is refused before anything opens it.
``scan`` lists the ``ckpt-<step>`` checkpoints of a manager's directory, in write order;
``opened`` reads again what a writer in another process replaced meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

from paramstore._core.interrupts import deferred
from paramstore.checkpoint.atomic import order_key
from paramstore.checkpoint.format import CheckpointError, EntryInfo, PathLike, Reader
from paramstore.checkpoint.formats.huggingface import read as _hf
from paramstore.checkpoint.formats.orbax import format as _orbax
from paramstore.checkpoint.formats.orbax import read as _orbax_read
from paramstore.checkpoint.formats.tensorflow import checkpoint as _tf
from paramstore.checkpoint.formats.tensorflow.keras import KerasWeights, is_hdf5
from paramstore.checkpoint.io import check_regular, path_lock

_RESCANS = 5  # listings of a directory whose checkpoints vanish while it is read
CKPT_RE = re.compile(r"^ckpt-(?P<step>\d+)(?P<file>\.safetensors)?$")


_ORBAX_MARKS = (_orbax.ARRAYS, "_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt")


def _resolve(path: PathLike) -> str:
    """A checkpoint: ``path`` itself, or the latest checkpoint of a manager directory.
    Anything but a regular file or a directory is refused here, before any reader opens
    it (CheckpointError)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if _orbax.is_checkpoint(path) or _tf.is_checkpoint_dir(path):
            return path
        hf = _hf.find(path)
        if hf is not None:
            return hf
        if any(os.path.exists(os.path.join(path, m)) for m in _ORBAX_MARKS):
            raise CheckpointError(
                f"Sharded checkpoint '{path}' lacks its metadata "
                f"({_orbax.META}/metadata): it is incomplete or damaged. Restore another "
                "checkpoint."
            )
        found = scan(path)
        if not found:
            raise FileNotFoundError(
                f"No checkpoint in directory '{path}' (expected ckpt-<step>.safetensors files "
                "or ckpt-<step> sharded checkpoint directories written by a "
                "CheckpointManager)."
            )
        return found[-1][1]  # the newest written
    if os.path.exists(path):
        check_regular(path)
    elif not _tf.is_prefix(path):
        raise FileNotFoundError(f"No checkpoint file or directory '{path}'.")
    return path


def open_reader(path: PathLike, allow_unverified: bool = False) -> Reader:
    """The ``checkpoint.format.Reader`` for what is on disk at ``path`` (a manager directory: its
    latest checkpoint): a sharded (Orbax) directory, a TensorFlow checkpoint prefix (or
    directory), a Keras ``.weights.h5`` file, a Hugging Face index, or a safetensors file
    (a ``PlainSafetensors``). Close it after use."""
    resolved = _resolve(path)
    if os.path.isdir(resolved) and _orbax.is_checkpoint(resolved):
        return _orbax_read.ShardedCheckpoint(resolved)
    if _tf.is_prefix(resolved) or os.path.isdir(resolved):
        return _tf.TensorFlowCheckpoint(resolved)
    if is_hdf5(resolved):
        return KerasWeights(resolved)
    if _hf.is_index(resolved):
        return _hf.ShardedSafetensors(resolved, allow_unverified)
    return _hf.PlainSafetensors(resolved, allow_unverified)


@contextlib.contextmanager
def opened(path: PathLike, allow_unverified: bool = False) -> Iterator[Reader]:
    """The reader of the checkpoint at ``path`` (``open_reader``), closed after the block; a
    checkpoint that a writer replaces or a manager prunes while it is opened or read is
    read again (see ``Reopening``).

    A read that holds a checkpoint path's lock (a sharded directory, the sharded latest of
    a manager directory, a TensorFlow prefix) holds signal handlers' exceptions (Ctrl-C)
    back until the block ends and the lock is released, then raises them as they were: an
    interrupt meanwhile would leave the lock taken (the next read or save of that path
    waiting forever) or Orbax's threads running, and came back as a "corrupt checkpoint"
    (issue 36 item 10, issue 38 item 4). A regular file (also one a directory resolves to,
    a Hugging Face model directory's) takes no lock and stops at once."""
    given = os.fspath(path)
    locks = not os.path.isfile(given)
    reader: Reopening | None = None
    try:
        with deferred() if locks else contextlib.nullcontext():
            reader = Reopening(given, allow_unverified, locks)
            if reader.locked:
                try:
                    yield reader
                finally:
                    reader.close()
                return
        yield reader  # no lock held: Ctrl-C stops the read at once
    finally:
        if reader is not None:
            reader.close()


_ATTEMPTS = 5  # reads of a checkpoint that writers keep replacing, before giving up


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class Reopening:
    """A ``checkpoint.format.Reader`` of what is at a path that stays right while other
    writers work on it.

    A sharded directory is resolved and read under its path's lock: a save or a prune
    from another thread of this process waits for the read. A regular file is renamed
    atomically: no lock. A manager directory resolves to its latest checkpoint, read
    under that checkpoint's lock. Another process cannot see these locks: when opening
    or reading fails and the checkpoint is gone or is another one than when it was
    resolved (a save swapped a new one in, a manager pruned it), the path is resolved
    again (a manager directory: its newest remaining checkpoint) and read again, up to
    ``_ATTEMPTS`` times; the values asked for must have the shapes and dtypes already
    checked, else CheckpointError. A failure of an unchanged checkpoint (corruption) is
    raised at once. ``locks=False`` (a regular file) takes no lock; with a lock, use it
    through ``opened``, which holds interrupts back until the lock is released.
    """

    def __init__(self, given: str, allow_unverified: bool, locks: bool = True) -> None:
        self._asked = given
        self._locks = locks  # whether ``given`` is read under its path's lock
        self._allow_unverified = allow_unverified
        self._stack = contextlib.ExitStack()
        self._reader: Reader
        self.path = self.description = ""
        self._resolved = ""
        self._identity: tuple[int, int] | None = None
        self.locked = False  # whether the open checkpoint's path lock is held
        self._open()

    def _open(self) -> None:
        for attempt in range(_ATTEMPTS):
            stack = contextlib.ExitStack()
            locked = False
            try:
                if self._locks:
                    stack.enter_context(path_lock(self._asked))
                    locked = True
                resolved = _resolve(self._asked)
                if resolved != self._asked:
                    stack.close()  # never two path locks at once (they are striped)
                    locked = self._locks and os.path.isdir(resolved)
                    if locked:
                        stack.enter_context(path_lock(resolved))
                identity = _identity(resolved)
                try:
                    reader = open_reader(resolved, self._allow_unverified)
                except (FileNotFoundError, CheckpointError):
                    # gone, or another one: a writer was at work (a TensorFlow prefix is
                    # no file: it has no identity; a manager directory's latest may vanish
                    # between its resolution and its identity)
                    now = _identity(resolved)
                    moved = now != identity if identity else resolved != self._asked
                    if attempt + 1 < _ATTEMPTS and moved:
                        stack.close()
                        continue
                    raise
                stack.callback(reader.close)
            except BaseException:
                stack.close()
                raise
            self._stack, self._reader, self.locked = stack, reader, locked
            self._resolved, self._identity = resolved, identity
            self.path, self.description = reader.path, reader.description
            return

    def _changed(self) -> bool:
        return self._identity is not None and _identity(self._resolved) != self._identity

    @property
    def entries(self) -> Mapping[str, EntryInfo]:
        return self._reader.entries

    def __getattr__(self, name: str) -> Any:  # a format's own extras (``skipped``...)
        return getattr(self._reader, name)

    def load(self, wanted: Mapping[str, Any]) -> dict[str, Any]:
        for attempt in range(_ATTEMPTS):
            try:
                return self._reader.load(wanted)
            except (OSError, CheckpointError):
                if attempt + 1 == _ATTEMPTS or not self._changed():
                    raise
            before = self._reader.entries
            self.close()
            self._open()
            for name in wanted:
                old, new = before.get(name), self._reader.entries.get(name)
                if old is None or new is None or (old.shape, old.dtype) != (new.shape, new.dtype):
                    raise CheckpointError(
                        f"Checkpoint '{self._asked}' was replaced while it was read, and "
                        f"'{name}' differs in the new one ({self._reader.path}). Restore again."
                    )
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        self._stack.close()


def scan(directory: str) -> list[tuple[int, str]]:
    """``[(step, path)]`` of the checkpoints in ``directory`` in the order they were
    written, oldest first (``checkpoint.atomic.order_key``: modification times, which
    ``CheckpointManager`` keeps increasing, then steps): files ``ckpt-<step>.safetensors``
    and sharded checkpoint directories ``ckpt-<step>`` (temporaries do not match)."""
    # A manager in another process may replace its one checkpoint between the listing and
    # the checks (the old one pruned, the new one renamed in after the listing): when every
    # checkpoint listed has vanished, the directory is listed again (a few times).
    for _ in range(_RESCANS):
        try:
            names = os.listdir(directory)
        except (FileNotFoundError, NotADirectoryError):
            return []
        found, listed = [], 0
        for name in names:
            m = CKPT_RE.match(name)
            if not m:
                continue
            listed += 1
            path = os.path.join(directory, name)
            if os.path.isfile(path) if m["file"] else _orbax.is_checkpoint(path):
                step = int(m["step"])
                found.append((order_key(path, step), step, path))
        if found or not listed:
            break
    return [(step, path) for _, step, path in sorted(found)]
