"""``CheckpointManager``: numbered checkpoints in a directory (private; exported by
``paramstore.checkpoint``, whose docstring states the contract)."""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook is registered before ours
import importlib
import operator
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

import jax
import numpy as np

from paramstore._core.interrupts import deferred
from paramstore.checkpoint.atomic import remove_stale_temps, retire, set_newest
from paramstore.checkpoint.format import PathLike
from paramstore.checkpoint.formats.orbax import format as _orbax
from paramstore.checkpoint.formats.orbax.staging import shutting_down
from paramstore.checkpoint.formats.safetensors.file import write_arrays
from paramstore.checkpoint.io import path_lock
from paramstore.checkpoint.readers import scan
from paramstore.checkpoint.saver import Saver, check_step
from paramstore.typing import VariablesLike

if TYPE_CHECKING:
    from paramstore.checkpoint.objects import Checkpoint


class Background(Protocol):
    """One save in flight (the manager's async hook, for any format): ``wait()`` blocks
    until it is on disk and the old checkpoints are pruned, and re-raises its error."""

    def wait(self) -> None: ...

    def done(self) -> bool:
        """Whether ``wait`` has nothing left to do (the save, and what follows it, ran;
        its error, if any, was raised)."""
        ...


class ThreadSave:
    """A single-file save written by a background thread."""

    def __init__(self, write: Callable[[], None], path: str) -> None:
        self._error: BaseException | None = None
        self._path = path
        self._write = write
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"paramstore-save-{path}")
        self._thread.start()  # started before any other thread can see it (no join race)

    def _run(self) -> None:
        try:
            self._write()
        except BaseException as e:
            e.add_note(f"(raised by the background save of '{self._path}')")
            self._error = e
        finally:
            self._finished.set()

    def wait(self) -> None:
        """Block until the file is written (and the old checkpoints pruned); re-raise its
        error. It waits on an Event, not ``Thread.join``: on Python 3.11 an interrupted
        join marks the thread stopped, and every later join returns at once."""
        self._finished.wait()
        self._thread.join()  # it is ending
        error, self._error = self._error, None
        if error is not None:
            raise error

    def done(self) -> bool:
        return self._finished.is_set()


def sharded_background(path: str, values: dict[str, Any], prune: Callable[[], None]) -> Background:
    """Start an async sharded save (``checkpoint.formats.orbax.format.save_async``, which holds the path's lock until
    the files are written); ``prune`` runs once it is on disk."""
    return _Then(_orbax.save_async(path, values), prune)


class _Then:
    """``inner``, then ``after`` (the prune) in the thread that waits; interrupted, the next
    ``wait`` waits again and runs ``after`` again (a prune is idempotent)."""

    def __init__(self, inner: Background, after: Callable[[], None]) -> None:
        self._inner, self._after = inner, after
        self._finished = False

    def wait(self) -> None:
        try:
            self._inner.wait()
        except BaseException:
            self._finished = self._inner.done()  # its own error: nothing to prune
            raise
        self._after()
        self._finished = True

    def done(self) -> bool:
        return self._finished


_PENDING: dict[int, CheckpointManager] = {}  # managers with a save in flight (held until done)
_PENDING_LOCK = threading.Lock()
_HOOKED = False


def _flush_at_exit() -> None:
    """Finish every save in flight at interpreter exit. Runs before Python joins its
    threads and shuts down ``concurrent.futures`` (``threading._register_atexit``, in
    reverse order of registration: registered at the first async save, it runs before
    the executors it needs stop taking work)."""
    while True:
        with _PENDING_LOCK:
            if not _PENDING:
                return
            _, manager = _PENDING.popitem()
        try:
            manager.wait()
        except Exception as e:  # nothing can be raised at exit; say it loudly
            print(
                f"paramstore: a background checkpoint save failed at exit: {e!r} (the "
                "previous checkpoint at its path is unchanged)",
                file=sys.stderr,
            )


def _hook_exit() -> None:
    global _HOOKED
    if _HOOKED:
        return
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_flush_at_exit)
    else:  # pragma: no cover - CPython has it since 3.9
        atexit.register(_flush_at_exit)
    _HOOKED = True


def _check_arguments(max_to_keep: Any, async_save: Any) -> None:
    if max_to_keep is not None:
        if isinstance(max_to_keep, (bool, np.bool_)) or not isinstance(
            max_to_keep, (int, np.integer)
        ):
            raise TypeError(
                f"CheckpointManager: max_to_keep must be an int >= 1 or None, got "
                f"{type(max_to_keep).__name__} {max_to_keep!r}; pass e.g. max_to_keep=5, or "
                "None to keep every checkpoint."
            )
        if max_to_keep < 1:
            raise ValueError(
                f"CheckpointManager: max_to_keep must be >= 1 or None, got {max_to_keep}; "
                "pass None to keep every checkpoint."
            )
    if not isinstance(async_save, (bool, np.bool_)):
        raise TypeError(
            f"CheckpointManager: async_save must be True or False, got "
            f"{type(async_save).__name__} {async_save!r}; pass async_save=True to write in "
            "the background."
        )


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
        _check_arguments(max_to_keep, async_save)
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
        self.max_to_keep = None if max_to_keep is None else operator.index(max_to_keep)
        self.async_save = bool(async_save)
        self._pending: Background | None = None  # the save in flight (async_save)
        self._lock = threading.RLock()  # one save (or wait) at a time
        if jax.process_index() == 0:
            os.makedirs(self.directory, exist_ok=True)
            remove_stale_temps(self.directory)

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
        """The checkpoint paths in the order they were written, oldest first (after any
        pending save finished). A step saved again moves to the end; a rollback's saves
        (``save(3)`` after ``save(10)``) come after the steps they follow in time."""
        self.wait()
        return [p for _, p in scan(self.directory)]

    @property
    def latest_checkpoint(self) -> str | None:
        """The path of the checkpoint written last (what ``restore_latest`` restores), or
        None."""
        found = self.checkpoints
        return found[-1] if found else None

    @property
    def latest_step(self) -> int | None:
        """The step of the checkpoint written last, or None."""
        self.wait()
        found = scan(self.directory)
        return found[-1][0] if found else None

    def save(self, step: int) -> str:
        """Save the variables as checkpoint ``step`` (replacing one of the same step, which
        stays intact until the new one is complete) and delete the oldest written beyond
        ``max_to_keep``. Returns its path. With ``async_save`` the values are copied to host
        now and the file is written in the background (at interpreter exit, where no
        background work can start any more, the save is made at once). Safe from several
        threads: saves run one at a time (each waits for the one before)."""
        with self._lock:
            self.wait()
            path = self.path_for(step)
            saver = self.saver
            if jax.process_index() == 0:
                remove_stale_temps(self.directory)  # a failed or killed save's leftovers
            background = self.async_save and not shutting_down()
            if saver._writes_sharded():
                values = saver._device_values()
                if not background:
                    with path_lock(path):
                        _orbax.save(path, values)
                    self._written(path)
                    return path
                with deferred():  # started and recorded as pending, or neither
                    self._start(sharded_background(path, values, lambda: self._written(path)))
                return path
            if not background:
                self._write(path, saver._snapshot(copy=False))
                return path
            arrays = saver._snapshot(copy=True)
            with deferred():  # started and recorded as pending, or neither
                self._start(ThreadSave(lambda: self._write(path, arrays), path))
            return path

    def _start(self, pending: Background) -> None:
        _hook_exit()
        self._pending = pending
        with _PENDING_LOCK:
            _PENDING[id(self)] = self

    def _write(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        with path_lock(path):
            write_arrays(path, arrays)
        self._written(path)

    def _written(self, path: str) -> None:
        """After ``path`` is complete: mark it the newest (its modification time, the
        write order), then delete the oldest written beyond ``max_to_keep``."""
        if jax.process_index() == 0:
            set_newest(path, [p for _, p in scan(self.directory) if p != path])
        self._prune(path)

    def _prune(self, written: str) -> None:
        """Delete the oldest written checkpoints beyond ``max_to_keep`` (process 0 only; the
        others wait for it), never ``written``, the one just saved. A symlinked checkpoint
        loses its link, never its target; a directory is renamed away before it is deleted
        (``checkpoint.atomic.retire``), under its path's lock (so no reader in this process
        is cut off; readers in others read the newest remaining)."""
        if self.max_to_keep is not None and jax.process_index() == 0:
            found = [p for _, p in scan(self.directory)]
            for old in found[: -self.max_to_keep]:
                if old == written:
                    continue
                with path_lock(old):
                    retire(old)
        if jax.process_count() > 1:
            multihost_utils = importlib.import_module("jax.experimental.multihost_utils")
            multihost_utils.sync_global_devices("paramstore.CheckpointManager.prune")

    def wait(self) -> None:
        """Block until a pending background save is written; re-raise its error, if any.
        Interrupted (Ctrl-C), the save stays pending: the next ``wait`` (and ``save``,
        ``checkpoints``...) waits for it again, raises its error, and prunes only after it."""
        with self._lock:
            pending = self._pending
            if pending is None:
                return
            try:
                pending.wait()
            finally:
                if pending.done():
                    self._pending = None
                    with _PENDING_LOCK:
                        _PENDING.pop(id(self), None)

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
