"""Atomic replacement of checkpoints, their temporaries and their write order (private).

* ``temp_path`` / ``live_temp``: a temporary name beside a checkpoint (short enough for any
  name a file system takes), marked in use while a save runs.
* ``install_dir`` / ``retire``: a sharded checkpoint directory put in place (swapped with the
  old one atomically where the system can) or removed without a reader ever seeing half of
  it; ``fsync_dir`` for the renames of single files.
* ``remove_stale_temps``: the leftovers of failed or killed saves, never a live writer's;
  ``remove_temps``: one operation's temporaries (named with one ``new_token()``).
* ``directory_lock``: a directory held against other processes and threads (``flock``),
  for commits of several files (``export_safetensors`` into a directory).
* ``save_error``: a failed write (full or read-only disk) as an ``OSError`` naming the path.
* ``set_newest`` / ``order_key``: the write order ``CheckpointManager`` keeps, in the
  checkpoints' modification times.

The file format writers (``checkpoint.formats.*``) and the manager use these; nothing here
knows a format. ``install_dir`` and ``retire`` hold Ctrl-C back until they end (each is
whole).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

from paramstore._core.interrupts import deferred

NAME_MAX = 255  # bytes of one file name (Linux, macOS, Windows)
_TEMP_ROOM = 64  # bytes a temporary name may need beyond the base (and Orbax's own suffix)
_LIVE: set[str] = set()  # this process's temporaries in use (a save or a removal runs)
_LIVE_LOCK = threading.Lock()


def temp_path(path: str, token: str | None = None) -> str:
    """A fresh temporary name beside ``path``, matched by ``TEMP_RE`` with this pid:
    ``.<name>.tmp-<pid>-<random>``, or, for a name too long to leave room for that
    (and for Orbax's ``.orbax-checkpoint-tmp-<time>`` under a staging directory),
    ``.<hash of the name>.tmp-<pid>-<random>``, so that every name a file system takes
    can be saved. ``token`` (8 hex digits, ``new_token()``) stands for the random part:
    the temporaries of one operation share it, so ``remove_temps`` finds them all."""
    head, base = os.path.split(path)
    if len(os.fsencode(base)) + _TEMP_ROOM > NAME_MAX:
        base = "h" + hashlib.sha256(os.fsencode(base)).hexdigest()[:12]
    return os.path.join(head, f".{base}.tmp-{os.getpid()}-{token or new_token()}")


def new_token() -> str:
    """The random part of a temporary's name (``temp_path``)."""
    return secrets.token_hex(4)


def remove_temps(directory: str, token: str) -> None:
    """Remove this process's temporaries named with ``token`` in ``directory`` (after an
    operation that wrote several failed, wherever it stopped)."""
    suffix = f".tmp-{os.getpid()}-{token}"
    with contextlib.suppress(OSError):
        for name in os.listdir(directory or "."):
            if name.endswith(suffix) and name.startswith("."):
                remove_path(os.path.join(directory, name))


# A temporary, possibly with a suffix that Orbax adds to a staging directory's name.
TEMP_RE = re.compile(
    r"^(?P<temp>\.(?P<base>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8})(?:\.orbax-checkpoint-tmp.*)?$"
)


@contextlib.contextmanager
def live_temp(path: str, name: str | None = None) -> Iterator[str]:
    """A temporary name beside ``path`` (``name`` if given), marked in use in this process
    while the block runs: ``remove_stale_temps`` never removes it, and removes this
    process's own temporaries that are not in use (the leftovers of a failed save)."""
    tmp = name or temp_path(path)
    hold(tmp)
    try:
        yield tmp
    finally:
        release(tmp)


def _key(tmp: str) -> str:
    head, base = os.path.split(tmp)
    return os.path.join(os.path.realpath(head or "."), base)


def hold(tmp: str) -> None:
    """Mark ``tmp`` in use until ``release(tmp)`` (a save that outlives its call: async)."""
    with _LIVE_LOCK:
        _LIVE.add(_key(tmp))


def release(tmp: str) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(_key(tmp))


def _writer_alive(directory: str, temp: str, pid: int) -> bool:
    if pid == os.getpid():
        with _LIVE_LOCK:
            return _key(os.path.join(directory, temp)) in _LIVE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's live process
        return True
    return True


_LEGACY_ORBAX_RE = re.compile(r"^ckpt-\d+\.orbax-checkpoint-tmp-\d+$")
LEGACY_STALE_AFTER = 3600.0  # seconds without a change in a legacy Orbax temporary


def remove_stale_temps(directory: str, only: Callable[[str], Any] | None = None) -> list[str]:
    """Delete the leftovers of failed or killed saves in ``directory`` (the names removed):
    temporaries (files and staging directories, with the Orbax temporaries inside their
    names) whose writer, a process of this host, no longer runs, or which this process
    no longer uses; and the ``ckpt-<step>.orbax-checkpoint-tmp-<time>`` directories that
    earlier paramstore versions let Orbax write (no pid in the name), once nothing in them
    changed for an hour. ``only``: just the temporaries whose name (without the
    temporary's prefix and suffix) it accepts."""
    removed: list[str] = []
    try:
        names = os.listdir(directory or ".")
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for name in names:
        full = os.path.join(directory, name)
        m = TEMP_RE.match(name)
        if only is not None and (m is None or not only(m["base"])):
            continue
        if m:
            stale = not _writer_alive(directory, m["temp"], int(m["pid"]))
        else:
            stale = bool(_LEGACY_ORBAX_RE.match(name)) and _untouched(full, LEGACY_STALE_AFTER)
        if stale and remove_path(full):
            removed.append(name)
    return removed


def _untouched(path: str, seconds: float) -> bool:
    """Whether nothing under ``path`` changed in the last ``seconds``."""
    limit = time.time() - seconds
    try:
        if os.lstat(path).st_mtime > limit:
            return False
        for root, dirs, files in os.walk(path):
            for n in dirs + files:
                if os.lstat(os.path.join(root, n)).st_mtime > limit:
                    return False
    except OSError:
        return False
    return True


def remove_path(path: str) -> bool:
    """Remove a file, a link or a directory tree; whether something was removed."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError:
        return False
    return True


def retire(path: str) -> None:
    """Remove the checkpoint at ``path`` so that no reader sees it half-deleted: it is
    first renamed to a temporary name (atomic; readers then see no checkpoint there),
    then deleted. A link loses the link, never its target. A removal interrupted leaves
    a temporary, which the next manager deletes."""
    if os.path.islink(path) or not os.path.isdir(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    with deferred(), live_temp(path) as aside:  # Ctrl-C: raised once the aside is gone
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        shutil.rmtree(aside, ignore_errors=True)


_RENAME_EXCHANGE = 2
_libc: Any = None


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or the file system cannot."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.renameat2.argtypes = [
                ctypes.c_int,
                ctypes.c_char_p,
                ctypes.c_int,
                ctypes.c_char_p,
                ctypes.c_uint,
            ]
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return False
    at_cwd = -100
    if _libc.renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def install_dir(staging: str, path: str) -> None:
    """Put the complete directory ``staging`` at ``path``, replacing what is there only
    now: where ``path`` exists the two are swapped atomically (Linux; a reader sees the
    old checkpoint or the new one, never neither) and the old one, now at the staging
    name, is deleted; elsewhere the old one is renamed aside first. The parent
    directory is fsynced."""
    with deferred():  # Ctrl-C: raised once the new one is in place and the old one gone
        if os.path.islink(path):
            os.unlink(path)  # a linked checkpoint loses its link, never its target
        try:
            os.rename(staging, path)  # nothing there (or an empty directory)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
            if _exchange(staging, path):
                remove_path(staging)  # the old checkpoint (a directory, or a file)
            else:
                with live_temp(path) as aside:
                    os.rename(path, aside)
                    os.rename(staging, path)
                    remove_path(aside)
        fsync_dir(os.path.dirname(path))


@contextlib.contextmanager
def directory_lock(directory: str) -> Iterator[None]:
    """Hold ``directory`` exclusively against every other process and thread that takes
    this lock (``flock`` of the directory itself: no lock file is left behind; released
    when the block ends or the process dies). Where the system or the file system has no
    ``flock``, only the threads of this process are kept apart."""
    with _DIR_LOCK:
        try:
            fd = os.open(directory or ".", os.O_RDONLY)
        except OSError:  # e.g. Windows: directories cannot be opened
            yield
            return
        try:
            if fcntl is not None:
                with contextlib.suppress(OSError):  # a file system without flock
                    fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock


_DIR_LOCK = threading.Lock()  # directory_lock between this process's threads (flock too)


def save_error(e: OSError, path: str, what: str = "checkpoint") -> OSError:
    """``e`` (a full or read-only disk, a permission...) as the same kind of ``OSError``
    naming the checkpoint being saved and saying that the previous one is kept."""
    reason = e.strerror or str(e)
    err = OSError(
        e.errno,
        f"Cannot save {what} '{path}': {reason}. Nothing was replaced: the previous checkpoint "
        "at that path (if any) is unchanged and no temporary file is left. Free disk space, "
        "or save to a writable directory",
        path,
    )
    if e.errno is None:
        err = type(e)(str(err))
    return err


def set_newest(path: str, others: Collection[str]) -> None:
    """Give ``path`` a modification time later than that of each of ``others`` (the write
    order CheckpointManager keeps; see ``order_key``), also where the clock went back or
    the file system keeps coarse times."""
    newest = 0
    for other in others:
        with contextlib.suppress(OSError):
            newest = max(newest, os.stat(other, follow_symlinks=False).st_mtime_ns)
    now = time.time_ns()
    if os.stat(path).st_mtime_ns > newest:
        return
    step = 1_000
    for _ in range(8):  # ns, then coarser, until the file system keeps it apart
        t = max(now, newest + step)
        os.utime(path, ns=(t, t))
        if os.stat(path).st_mtime_ns > newest:
            return
        step *= 10 if step < 10**9 else 2


def order_key(path: str, step: int) -> tuple[int, int]:
    """A checkpoint's place in the write order: its modification time (``set_newest``),
    then its step."""
    try:
        return os.stat(path, follow_symlinks=False).st_mtime_ns, step
    except OSError:
        return 0, step


def fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
