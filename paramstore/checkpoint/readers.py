"""Reader dispatch: which format is on disk at a path (private).

``open_reader`` resolves a path (a manager directory: its latest checkpoint) and opens the
``checkpoint.format.Reader`` of what is there: a sharded Orbax directory, a TensorFlow checkpoint
prefix or directory, a Keras ``.weights.h5`` file, a Hugging Face checkpoint
(``model.safetensors.index.json``, or a directory holding it or ``model.safetensors``), or a
safetensors file (paramstore's own, or a foreign one read unverified). A path that is not
a regular file or a directory (a FIFO, a device) is refused before anything opens it.
``scan`` lists the ``ckpt-<step>`` checkpoints of a manager's directory.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

from paramstore.checkpoint.format import CheckpointError, PathLike, Reader
from paramstore.checkpoint.formats.huggingface import read as _hf
from paramstore.checkpoint.formats.orbax import format as _orbax
from paramstore.checkpoint.formats.orbax import read as _orbax_read
from paramstore.checkpoint.formats.tensorflow import checkpoint as _tf
from paramstore.checkpoint.formats.tensorflow.keras import KerasWeights, is_hdf5
from paramstore.checkpoint.io import check_regular, path_lock

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
        return found[-1][1]
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
    # A sharded directory is resolved and read under its path's lock: a save from another
    # thread of this process deletes and rewrites it (Orbax), so even the check of what
    # ``path`` is must not run while one is under way (it would see no directory, or one
    # without its metadata). A regular file is renamed atomically: no lock. A manager
    # directory resolves to its latest checkpoint, read under that checkpoint's lock.
    given = os.fspath(path)
    with contextlib.ExitStack() as stack:
        if not os.path.isfile(given):
            stack.enter_context(path_lock(given))
        resolved = _resolve(given)
        if resolved != given:
            stack.close()  # never two path locks at once (they are striped)
            if _orbax.is_checkpoint(resolved):
                stack.enter_context(path_lock(resolved))
        reader = open_reader(resolved, allow_unverified)
        try:
            yield reader
        finally:
            reader.close()


def scan(directory: str) -> list[tuple[int, str]]:
    """``[(step, path)]`` of the checkpoints in ``directory``, oldest step first: files
    ``ckpt-<step>.safetensors`` and sharded checkpoint directories ``ckpt-<step>`` (Orbax's
    temporary directories do not match)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = CKPT_RE.match(name)
        path = os.path.join(directory, name)
        if m and (os.path.isfile(path) if m["file"] else _orbax.is_checkpoint(path)):
            found.append((int(m["step"]), path))
    return sorted(found)
