"""``CheckpointManager``: numbered checkpoints in a directory (private; exported by
``paramstore.checkpoint``, whose docstring states the contract)."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import operator
import os
import shutil
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

import jax
import numpy as np

from paramstore.checkpoint.format import PathLike
from paramstore.checkpoint.formats.orbax import format as _orbax
from paramstore.checkpoint.formats.safetensors.file import write_arrays
from paramstore.checkpoint.io import TEMP_RE, path_lock
from paramstore.checkpoint.readers import scan
from paramstore.checkpoint.saver import Saver, check_step
from paramstore.typing import VariablesLike

if TYPE_CHECKING:
    from paramstore.checkpoint.objects import Checkpoint


def _remove_stale_temps(directory: str) -> None:
    """Delete temporary files left by writers (this host's processes) that no longer run."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            m = TEMP_RE.match(name)
            if m and not _pid_alive(int(m["pid"])):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


class Background(Protocol):
    """One save in flight (the manager's async hook, for any format): ``wait()`` blocks
    until it is on disk and the old checkpoints are pruned, and re-raises its error."""

    def wait(self) -> None: ...


class ThreadSave:
    """A single-file save written by a background thread."""

    def __init__(self, write: Callable[[], None], path: str) -> None:
        self._error: BaseException | None = None
        self._path = path
        self._write = write
        self._thread = threading.Thread(target=self._run, name=f"paramstore-save-{path}")
        self._thread.start()  # started before any other thread can see it (no join race)

    def _run(self) -> None:
        try:
            self._write()
        except BaseException as e:
            e.add_note(f"(raised by the background save of '{self._path}')")
            self._error = e

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def sharded_background(path: str, values: dict[str, Any], prune: Callable[[], None]) -> Background:
    """Start an async sharded save (``checkpoint.formats.orbax.format.save_async``, which holds the path's lock until
    the files are written); ``prune`` runs once it is on disk."""
    return _Then(_orbax.save_async(path, values), prune)


class _Then:
    def __init__(self, inner: Background, after: Callable[[], None]) -> None:
        self._inner, self._after = inner, after

    def wait(self) -> None:
        self._inner.wait()
        self._after()


_PENDING: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    for manager in list(_PENDING):
        try:
            manager.wait()
        except Exception as e:  # nothing can be raised at exit; say it loudly
            print(f"paramstore: a background checkpoint save failed: {e!r}", file=sys.stderr)


class CheckpointManager:
    """Numbered checkpoints ``ckpt-<step>.safetensors`` (or sharded ``ckpt-<step>``
    directories, see ``Saver``'s ``sharded``, which ``sharded=`` here sets) in
    ``directory``; keeps the newest ``max_to_keep`` (None keeps all). See the module
    docstring for ``async_save``."""

    def __init__(
        self,
        directory: PathLike,
        saver_or_vars: Saver | Checkpoint | VariablesLike | None = None,
        max_to_keep: int | None = 5,
        async_save: bool = False,
        *,
        sharded: bool | None = None,
    ) -> None:
        if max_to_keep is not None and (operator.index(max_to_keep) < 1):
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}.")
        self.directory = os.fspath(directory)
        self._checkpoint: Any = None  # a ps.Checkpoint, which makes a Saver at each call
        if isinstance(saver_or_vars, Saver) or hasattr(saver_or_vars, "as_saver"):
            own = cast("Saver | Checkpoint", saver_or_vars)
            if sharded is not None and sharded != own.sharded:
                raise ValueError(
                    "CheckpointManager: sharded= conflicts with the Saver's or Checkpoint's "
                    "own setting; give it to that object."
                )
            if isinstance(saver_or_vars, Saver):
                self._saver = saver_or_vars
            else:
                self._checkpoint = saver_or_vars
        else:
            self._saver = Saver(saver_or_vars, sharded=sharded)
        self.max_to_keep = max_to_keep
        self.async_save = bool(async_save)
        self._pending: Background | None = None  # the save in flight (async_save)
        self._lock = threading.RLock()  # one save (or wait) at a time
        if jax.process_index() == 0:
            os.makedirs(self.directory, exist_ok=True)
            _remove_stale_temps(self.directory)

    @property
    def saver(self) -> Saver:
        """The Saver that writes the checkpoints (for a ``ps.Checkpoint``, made at each
        call from its objects' attribute paths)."""
        if self._checkpoint is not None:
            saver: Saver = self._checkpoint.as_saver()
            return saver
        return self._saver

    def path_for(self, step: int) -> str:
        """The file path the checkpoint of ``step`` is (or would be) saved at."""
        name = f"ckpt-{check_step(step)}"
        if not self.saver._writes_sharded():
            name += ".safetensors"
        return os.path.join(self.directory, name)

    @property
    def checkpoints(self) -> list[str]:
        """The checkpoint paths, oldest step first (after any pending save finished)."""
        self.wait()
        return [p for _, p in scan(self.directory)]

    @property
    def latest_checkpoint(self) -> str | None:
        """The path of the highest step, or None."""
        found = self.checkpoints
        return found[-1] if found else None

    @property
    def latest_step(self) -> int | None:
        """The highest saved step, or None."""
        self.wait()
        found = scan(self.directory)
        return found[-1][0] if found else None

    def save(self, step: int) -> str:
        """Save the variables as checkpoint ``step`` (replacing one of the same step) and
        delete the oldest beyond ``max_to_keep``. Returns its path. With ``async_save`` the
        values are copied to host now and the file is written in the background. Safe from
        several threads: saves run one at a time (each waits for the one before)."""
        with self._lock:
            self.wait()
            path = self.path_for(step)
            saver = self.saver
            if saver._writes_sharded():
                values = saver._device_values()
                if not self.async_save:
                    with path_lock(path):
                        _orbax.save(path, values)
                    self._prune()
                    return path
                self._start(sharded_background(path, values, self._prune))
                return path
            if not self.async_save:
                self._write(path, saver._snapshot(copy=False))
                return path
            arrays = saver._snapshot(copy=True)
            self._start(ThreadSave(lambda: self._write(path, arrays), path))
            return path

    def _start(self, pending: Background) -> None:
        self._pending = pending
        _PENDING.add(self)

    def _write(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        _remove_stale_temps(self.directory)
        with path_lock(path):
            write_arrays(path, arrays)
        self._prune()

    def _prune(self) -> None:
        """Delete the oldest checkpoints beyond ``max_to_keep`` (process 0 only; the
        others wait for it). A symlinked checkpoint loses its link, never its target."""
        if self.max_to_keep is not None and jax.process_index() == 0:
            for _, old in scan(self.directory)[: -self.max_to_keep]:
                with contextlib.suppress(FileNotFoundError):
                    if os.path.islink(old) or not os.path.isdir(old):
                        os.unlink(old)
                    else:
                        shutil.rmtree(old)
        if jax.process_count() > 1:
            multihost_utils = importlib.import_module("jax.experimental.multihost_utils")
            multihost_utils.sync_global_devices("paramstore.CheckpointManager.prune")

    def wait(self) -> None:
        """Block until a pending background save is written; re-raise its error, if any."""
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is not None:
                _PENDING.discard(self)
                pending.wait()

    def restore_latest(self, allow_missing: bool = False) -> str | None:
        """Restore the latest checkpoint (see ``Saver.restore``); its path, or None if the
        directory has none. With a ``ps.Checkpoint`` this is ``checkpoint.restore(path)``
        followed, unless ``allow_missing``, by ``assert_existing_objects_matched()``."""
        with self._lock:
            path = self.latest_checkpoint
            if path is None:
                return None
            if self._checkpoint is not None:  # checked before anything is assigned
                self._checkpoint._restore(path, existing_matched=not allow_missing)
            else:
                self._saver.restore(path, allow_missing=allow_missing)
            return path
