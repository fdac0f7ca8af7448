"""A sharded save's staging directory (private; the format is
``paramstore.checkpoint.formats.orbax.format``): its name (the same on every process), its
removal after a failed save, the error that names the checkpoint, and whether Python can
still run a save (not once it is shutting its threads down).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import sys
import threading

import jax
import numpy as np

from paramstore.checkpoint.atomic import remove_path, save_error, temp_path


def discard(root: str) -> None:
    remove_path(root)
    parent, base = os.path.split(root)
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            if name.startswith(base + ".orbax-checkpoint-tmp"):
                remove_path(os.path.join(parent, name))


_DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def failed(error: BaseException, path: str) -> BaseException:
    """A failed sharded save's error: an ``OSError`` (a full or read-only disk) as one naming
    the checkpoint, also where TensorStore reports it in another exception's message (its
    writes are not Python's); any other error with a note saying so."""
    if isinstance(error, OSError):
        return save_error(error, path, "sharded checkpoint")
    text = str(error)
    for code in _DISK_ERRORS:
        if isinstance(error, Exception) and os.strerror(code) in text:
            converted = save_error(OSError(code, os.strerror(code)), path, "sharded checkpoint")
            converted.__cause__ = error
            return converted
    if isinstance(error, Exception):
        error.add_note(
            f"(while saving the sharded checkpoint '{path}'; the previous checkpoint at that "
            "path, if any, is unchanged)"
        )
    return error


def shutting_down() -> bool:
    """Whether the interpreter is past running background work (exiting: the threads'
    exit hooks ran, ``concurrent.futures`` takes no new work)."""
    return bool(getattr(threading, "_SHUTTING_DOWN", False)) or sys.is_finalizing()


def staging_path(path: str) -> str:
    """The staging directory of a save to ``path``: a temporary name beside it
    (``checkpoint.atomic.temp_path``), the same on every process (process 0's)."""
    name = temp_path(path)
    if jax.process_count() > 1:
        multihost_utils = importlib.import_module("jax.experimental.multihost_utils")
        raw = os.fsencode(os.path.basename(name)).ljust(256, b"\0")
        got = multihost_utils.broadcast_one_to_all(np.frombuffer(raw, np.uint8))
        name = os.path.join(os.path.dirname(path), os.fsdecode(bytes(got).rstrip(b"\0")))
    return name
