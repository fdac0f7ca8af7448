"""Checkpoints: ``Saver``, ``CheckpointManager``, ``list_variables``, ``load_variable``.

(``ps.Checkpoint``, object-based, is in ``paramstore.object_checkpoint``; every format
implements the reader interface of ``paramstore._format``, and ``open_reader`` picks one
from what is on disk: a paramstore file, a sharded Orbax directory, a TensorFlow
checkpoint or a Keras ``.weights.h5`` file, the last two read-only.)

Contract (the file format is described in docs/checkpoints.md):

* A checkpoint is one standard safetensors file (readable by ``safetensors.safe_open``):
  an 8-byte little-endian header length, a JSON header, then the raw little-endian bytes
  of each tensor. paramstore adds, in the header's ``__metadata__``, a format version and,
  per tensor, an XXH3-64 of its bytes (checked on every load) and the true dtype and shape of
  the tensors that safetensors cannot describe (strings, complex128, ...). Nothing is ever
  pickled or executed on load; every size in the header is checked against the file.
* ``Saver(var_list)`` saves and restores a fixed set of variables under fixed names: ``None``
  is every live variable of the store that was the default when the Saver was made (listed
  at each call), a dict maps checkpoint names to variables, a list or Module uses each
  variable's full name.
* Saving is atomic: the file is written under a temporary name in the same directory,
  fsynced, renamed over the target and the directory fsynced. A crash leaves either the old
  file or the new one, never a half-written file under the checkpoint's name. Tensors are
  streamed to the file one at a time (no second in-memory copy of the state).
* Restoring validates everything (names present, shapes, dtypes, file sizes, checksums)
  and loads every tensor before it assigns any variable: on any error no variable changes.
  Each value is ``jax.device_put`` onto the variable's current sharding.
* ``CheckpointManager`` keeps the newest ``max_to_keep`` checkpoints ``ckpt-<step>.safetensors``
  of a directory. The directory itself is the index (it is scanned, temporary files are
  ignored and stale ones removed), so a new manager continues where an old one stopped.
  With ``async_save=True`` the host copy is taken inside ``save`` and the file written by a
  background thread; ``wait()`` (also run at interpreter exit) flushes it and re-raises
  the error of a failed background write, as does the next ``save``.
* Sharded checkpoints (docs/sharding.md): where ``jax.process_count() > 1``, or with
  ``Saver(..., sharded=True)``, a checkpoint is instead an Orbax directory (see
  ``paramstore._orbax``) in which each process writes only its own shards; the same
  ``Saver``/``CheckpointManager``/``list_variables``/``load_variable`` API reads and writes
  it, and restoring recognises the format from what is on disk. ``restore(...,
  sharding=...)`` restores onto new shardings (another mesh), checked before anything is
  read.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import operator
import os
import re
import shutil
import sys
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from paramstore import _orbax, _tf, _trace
from paramstore import sharding as _sharding
from paramstore._collect import named
from paramstore._context import STATE_LOCK
from paramstore._format import (
    CheckpointError,
    PathLike,
    Reader,
    dtype_name,
    is_string,
    lacks_variables,
    no_such_variable,
)
from paramstore._safetensors import (
    FORMAT_VERSION,
    TEMP_RE,
    SafetensorsFile,
    check_name,
    write_arrays,
)
from paramstore.scope import default_store
from paramstore.variable import Variable

__all__ = [
    "Saver",
    "CheckpointManager",
    "CheckpointError",
    "list_variables",
    "load_variable",
    "open_reader",
    "write_arrays",
    "read_arrays",
    "FORMAT_VERSION",
]


def _resolve(path: PathLike) -> str:
    """A checkpoint: ``path`` itself, or the latest checkpoint of a manager directory."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if _orbax.is_checkpoint(path) or _tf.is_checkpoint_dir(path):
            return path
        found = _scan(path)
        if not found:
            raise FileNotFoundError(
                f"No checkpoint in directory '{path}' (expected ckpt-<step>.safetensors files "
                "or ckpt-<step> sharded checkpoint directories written by a "
                "CheckpointManager)."
            )
        return found[-1][1]
    if not os.path.exists(path) and not _tf.is_prefix(path):
        raise FileNotFoundError(f"No checkpoint file or directory '{path}'.")
    return path


def open_reader(path: PathLike, allow_unverified: bool = False) -> Reader:
    """The ``_format.Reader`` for what is on disk at ``path`` (a manager directory: its
    latest checkpoint): a sharded (Orbax) directory, a TensorFlow checkpoint prefix (or
    directory), a Keras ``.weights.h5`` file, or a paramstore file. Close it after use."""
    resolved = _resolve(path)
    if os.path.isdir(resolved) and _orbax.is_checkpoint(resolved):
        return _orbax.ShardedCheckpoint(resolved)
    if _tf.is_prefix(resolved) or os.path.isdir(resolved):
        return _tf.TensorFlowCheckpoint(resolved)
    if _tf.is_hdf5(resolved):
        return _tf.KerasWeights(resolved)
    return SafetensorsFile(resolved, allow_unverified)


@contextlib.contextmanager
def opened(path: PathLike, allow_unverified: bool = False) -> Iterator[Reader]:
    reader = open_reader(path, allow_unverified)
    try:
        yield reader
    finally:
        reader.close()


def list_variables(
    path: PathLike, *, allow_unverified: bool = False
) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """``[(name, shape, dtype)]`` of a checkpoint, sorted by name, read from its header or
    metadata only.

    ``path`` is a checkpoint file, a sharded checkpoint directory, a CheckpointManager
    directory (its latest checkpoint), a TensorFlow checkpoint prefix or a Keras
    ``.weights.h5`` file (both need ``paramstore[tensorflow]``). String variables have dtype
    ``np.dtypes.StringDType()``. A safetensors file without paramstore checksums is read
    only with ``allow_unverified=True``.
    """
    with opened(path, allow_unverified) as r:
        return sorted((e.name, e.shape, e.dtype) for e in r.entries.values())


def load_variable(path: PathLike, name: str, *, allow_unverified: bool = False) -> np.ndarray:
    """The value of variable ``name`` in a checkpoint (any ``list_variables`` accepts),
    checked against its checksum; strings come back as a NumPy string array. Raises
    CheckpointError if absent or corrupt."""
    with opened(path, allow_unverified) as r:
        if name not in r.entries:
            raise no_such_variable(r.path, name, r.entries)
        return r.load({name: None})[name]


def read_arrays(path: PathLike, *, allow_unverified: bool = False) -> dict[str, np.ndarray]:
    """Every value of a checkpoint as ``{name: NumPy array}`` (checksums verified)."""
    with opened(path, allow_unverified) as r:
        return r.load(dict.fromkeys(r.entries))


def check_step(step: Any) -> int:
    """A checkpoint step: a non-negative int (TypeError for bool, float, str...;
    ValueError for a negative one)."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise TypeError(
            f"A checkpoint step must be an int, got {type(step).__name__} {step!r}; pass "
            "e.g. int(opt.iterations.numpy())."
        )
    if step < 0:
        raise ValueError(f"A checkpoint step must be >= 0, got {step}.")
    return operator.index(step)


# -------------------------------------------------------------------------------- Saver


class Saver:
    """Saves and restores variables as safetensors checkpoints (see the module docstring).

    ``var_list``: None (every live variable of the current default store, listed at each
    save/restore), a ``{checkpoint_name: Variable}`` dict, a list of Variables (Modules and
    Optimizers in the list stand for their ``.variables``), or a Module; lists and Modules
    are keyed by ``v.name``. To key variables by where they sit in the model (so a rebuilt
    model with new store names restores), use ``ps.Checkpoint`` instead.

    ``sharded``: the format ``save`` writes. None (the default) picks a sharded Orbax
    checkpoint (a directory; each process writes its own shards) when
    ``jax.process_count() > 1`` and a single safetensors file otherwise; True always
    writes the sharded format, False always the single file (an error with several
    processes). ``restore`` reads either.
    """

    def __init__(self, var_list: Any = None, *, sharded: bool | None = None) -> None:
        if sharded is not None and not isinstance(sharded, bool):
            raise TypeError(f"Saver: sharded must be None, True or False, got {sharded!r}.")
        self.sharded = sharded
        if isinstance(var_list, Mapping):
            var_list = dict(var_list)  # a snapshot of the names, as a list would be
        self._source: Any = default_store() if var_list is None else var_list
        self._mapping()  # validate now

    def _mapping(self) -> dict[str, Variable]:
        """``{checkpoint_name: Variable}`` as it stands now (a store or a Module is read
        again at every save and restore, so variables created later are included)."""
        try:
            names, found = named(self._source, strings=True)
        except TypeError as e:
            bad = [
                k for k, v in getattr(self._source, "items", dict)() if not isinstance(v, Variable)
            ]
            hint = (
                f"ps.Checkpoint({bad[0]}=...)" if bad else "ps.Checkpoint(model=..., optimizer=...)"
            )
            raise TypeError(f"Saver: {e} To save objects by attribute path, use {hint}.") from None
        except ValueError as e:
            raise ValueError(f"Saver: {e}") from None
        for name in names:
            check_name(name)
        return dict(zip(names, found))

    # -- saving
    def save(self, path: PathLike, step: int | None = None) -> str:
        """Write the variables to ``path`` (``f"{path}-{step}"`` with ``step``) atomically:
        a file, or a directory for a sharded checkpoint (see ``sharded``). Every process
        of a multi-process run must call it. Returns the path written."""
        path = os.fspath(path)
        if step is not None:
            path = f"{path}-{check_step(step)}"
        if self._writes_sharded():
            return _orbax.save(path, self._device_values())
        return write_arrays(path, self._snapshot(copy=False))

    def _writes_sharded(self) -> bool:
        """Whether ``save`` writes the sharded (Orbax) format now."""
        if self.sharded is None:
            return jax.process_count() > 1
        if not self.sharded and jax.process_count() > 1:
            raise CheckpointError(
                f"Saver(sharded=False) writes one file, which {jax.process_count()} "
                "processes cannot share; use sharded=True (or None, the default), in which "
                "each process writes its own shards."
            )
        return self.sharded

    def _device_values(self) -> dict[str, Any]:
        """``{checkpoint_name: jax.Array or NumPy string array}``, for a sharded save."""
        outside_traces("save")
        mapping = self._mapping()
        with STATE_LOCK:  # one consistent snapshot: no step lands between two variables
            return {name: _current(name, v, sharded=True) for name, v in mapping.items()}

    def _snapshot(self, copy: bool) -> dict[str, np.ndarray]:
        """Host copies of the values, ``{checkpoint_name: np.ndarray}``. With ``copy=False``
        an array may still share the device buffer (CPU); ``copy=True`` makes it independent."""
        outside_traces("save")
        mapping = self._mapping()
        with STATE_LOCK:  # one consistent snapshot: no step lands between two variables
            values = {name: _current(name, v) for name, v in mapping.items()}
        if jax.default_backend() != "cpu":  # start every transfer before waiting on any
            for x in values.values():
                if isinstance(x, jax.Array):
                    x.copy_to_host_async()
        return {name: _to_host(name, x, copy) for name, x in values.items()}

    # -- restoring
    def restore(
        self,
        path: PathLike,
        allow_missing: bool = False,
        *,
        sharding: Any = None,
        allow_unverified: bool = False,
    ) -> list[Variable]:
        """Fill the variables in place from a checkpoint (anything ``list_variables``
        reads: a file, a sharded directory, a manager directory (its latest), a TensorFlow
        checkpoint or a Keras ``.weights.h5`` file, whose names you map with a dict).

        Everything is validated, read and verified before any variable is assigned; on
        error no variable changes. Raises CheckpointError for a name missing from the file
        (unless ``allow_missing``), a shape or dtype that differs, or a corrupt file.
        Returns the variables skipped because the file lacks them (empty without
        ``allow_missing``). ``allow_missing=True`` that would restore no variable at all
        raises CheckpointError too (the names do not match: a rebuilt model? see
        ``ps.Checkpoint``).

        Each value lands on its variable's current sharding, or, with ``sharding``, on a
        new one, which the variable then keeps: a ``Sharding`` or ``Mesh`` (replicated) for
        all, a dict ``{variable name: Sharding}``, or a function ``variable -> Sharding |
        None`` (as for ``ps.sharding.reshard``). A target that does not fit its variable's
        shape raises ValueError before anything is read.
        """
        outside_traces("restore")
        mapping = self._mapping()
        moves: dict[int, Any] = {}
        if sharding is not None:
            for v, sh in _sharding.plan(list(mapping.values()), sharding):
                moves[id(v)] = sh
        with opened(path, allow_unverified) as r:
            return restore_into(r, mapping, allow_missing, moves)


def restore_into(
    r: Reader,
    mapping: Mapping[str, Variable],
    allow_missing: bool,
    moves: Mapping[int, Any] | None = None,
    hint: str = "Pass allow_missing=True to restore the others.",
) -> list[Variable]:
    """Restore ``{checkpoint name: Variable}`` from an open checkpoint (see
    ``Saver.restore``); returns the variables the file lacks."""
    moves = moves or {}
    entries = r.entries
    present = {n: v for n, v in mapping.items() if n in entries}
    missing = [n for n in mapping if n not in entries]
    if missing and not allow_missing:
        raise lacks_variables(r.path, missing, entries, hint)
    if missing and not present:
        raise CheckpointError(
            f"Checkpoint '{r.path}' holds none of the {len(mapping)} variable(s) to restore "
            f"({missing[0]!r}, ...), so allow_missing=True would restore nothing. Its names "
            "differ: a model rebuilt under new store names (dense_1/...) restores with "
            "ps.Checkpoint(model=...), which keys variables by attribute path."
        )
    assign_all(present, r.load(placements_for(r.path, entries, present, moves)), moves)
    return [mapping[n] for n in missing]


def assign_all(
    present: Mapping[str, Variable], values: Mapping[str, Any], moves: Mapping[int, Any]
) -> None:
    """Assign every loaded value (cannot fail: exact shapes, dtypes, placement); a variable
    restored onto a new sharding (``moves``) takes the value's placement."""
    for name, value in values.items():
        v = present[name]
        if id(v) in moves:
            v._write(value, owned=True)
        elif (
            not _trace.depth
            and isinstance(value, jax.Array)
            and value.dtype == v.dtype
            and not value.weak_type
            and value.shape == v.shape
            and value.sharding == v._value.sharding
        ):
            v._write(value)  # what assign ends in for this value (not owned: it was given)
        else:
            v.assign(value, read_value=False)


def outside_traces(what: str) -> None:
    if _trace.active():
        raise CheckpointError(
            f"Cannot {what} a checkpoint inside a traced function (ps.function, ps.pure, "
            "ps.grad): it would run once, at trace time, with trace-time values. Call it "
            "outside the compiled step."
        )


def _current(name: str, v: Any, sharded: bool = False) -> Any:
    x = v.value()
    if isinstance(x, jax.core.Tracer):
        raise CheckpointError(
            f"Cannot save variable '{name}' inside a traced function (jax.jit, jax.grad...): "
            "its value is not known there. Save outside the compiled step."
        )
    if not sharded and isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise CheckpointError(
            f"Variable '{name}' spans several processes, so no process can write it to one "
            "file: save a sharded checkpoint (Saver(..., sharded=True), the default when "
            "jax.process_count() > 1)."
        )
    return x


def _to_host(name: str, x: Any, copy: bool) -> np.ndarray:
    if not isinstance(x, jax.Array):
        return np.asarray(x)  # strings: immutable NumPy arrays, swapped (never mutated) on assign
    arr = np.asarray(x)
    if copy and any(d.platform == "cpu" for d in x.devices()):
        arr = arr.copy()  # on CPU np.asarray shares the device buffer, which a donation may reuse
    return arr


def placements_for(
    path: str, entries: Mapping[str, Any], present: Mapping[str, Variable], moves: Mapping[int, Any]
) -> dict[str, Any]:
    """Where each value of ``present`` goes (its variable's sharding, or a new one from
    ``moves``), after checking that every entry fits its variable; raises before loading."""
    placements: dict[str, Any] = {}
    for name, v in present.items():
        e = entries[name]
        if e.shape != tuple(v.shape) or e.dtype != v.dtype:
            raise CheckpointError(mismatch(path, name, e.shape, e.dtype, v))
        check_assignable(name, v)
        placements[name] = None if is_string(v.dtype) else moves.get(id(v), v.sharding)
    return placements


def check_assignable(name: str, v: Variable) -> None:
    if type(v) is not Variable:
        raise TypeError(
            f"Saver: '{name}' is a detached copy of variable '{v.name}' (it went through a "
            "JAX transformation as a pytree) and cannot be assigned; restore the original."
        )


def mismatch(path: str, name: str, shape: tuple[int, ...], dtype: np.dtype, v: Variable) -> str:
    return (
        f"Checkpoint '{path}' holds '{name}' with shape {shape} and dtype "
        f"{dtype_name(dtype)}, but variable '{v.name}' has shape {tuple(v.shape)} and "
        f"dtype {dtype_name(v.dtype)}. Restore into a model built with the same "
        "configuration, or leave this variable out of the Saver."
    )


# -------------------------------------------------------------------- CheckpointManager

_CKPT_RE = re.compile(r"^ckpt-(?P<step>\d+)(?P<file>\.safetensors)?$")


def _scan(directory: str) -> list[tuple[int, str]]:
    """``[(step, path)]`` of the checkpoints in ``directory``, oldest step first: files
    ``ckpt-<step>.safetensors`` and sharded checkpoint directories ``ckpt-<step>`` (Orbax's
    temporary directories do not match)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = _CKPT_RE.match(name)
        path = os.path.join(directory, name)
        if m and (os.path.isfile(path) if m["file"] else _orbax.is_checkpoint(path)):
            found.append((int(m["step"]), path))
    return sorted(found)


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
        saver_or_vars: Any = None,
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
            if sharded is not None and sharded != saver_or_vars.sharded:
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
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._orbax_async: Any = None  # an Orbax AsyncCheckpointer, for sharded async saves
        self._orbax_pending = False
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
        name = f"ckpt-{check_step(step)}"
        if not self.saver._writes_sharded():
            name += ".safetensors"
        return os.path.join(self.directory, name)

    @property
    def checkpoints(self) -> list[str]:
        """The checkpoint paths, oldest step first (after any pending save finished)."""
        self.wait()
        return [p for _, p in _scan(self.directory)]

    @property
    def latest_checkpoint(self) -> str | None:
        """The path of the highest step, or None."""
        found = self.checkpoints
        return found[-1] if found else None

    @property
    def latest_step(self) -> int | None:
        """The highest saved step, or None."""
        self.wait()
        found = _scan(self.directory)
        return found[-1][0] if found else None

    def save(self, step: int) -> str:
        """Save the variables as checkpoint ``step`` (replacing one of the same step) and
        delete the oldest beyond ``max_to_keep``. Returns its path. With ``async_save`` the
        values are copied to host now and the file is written in the background."""
        self.wait()
        path = self.path_for(step)
        saver = self.saver
        if saver._writes_sharded():
            values = saver._device_values()
            if not self.async_save:
                _orbax.save(path, values)
                self._prune()
                return path
            if self._orbax_async is None:
                self._orbax_async = _orbax.async_checkpointer()
            _orbax.save(path, values, self._orbax_async)  # returns once copied to host
            self._orbax_pending = True
            _PENDING.add(self)
            return path
        if not self.async_save:
            self._write(path, saver._snapshot(copy=False))
            return path
        arrays = saver._snapshot(copy=True)
        self._thread = threading.Thread(
            target=self._background, args=(path, arrays), name=f"paramstore-save-{step}"
        )
        _PENDING.add(self)
        self._thread.start()
        return path

    def _write(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        _remove_stale_temps(self.directory)
        write_arrays(path, arrays)
        self._prune()

    def _prune(self) -> None:
        """Delete the oldest checkpoints beyond ``max_to_keep`` (process 0 only; the
        others wait for it)."""
        if self.max_to_keep is not None and jax.process_index() == 0:
            for _, old in _scan(self.directory)[: -self.max_to_keep]:
                with contextlib.suppress(FileNotFoundError):
                    if os.path.isdir(old):
                        shutil.rmtree(old)
                    else:
                        os.unlink(old)
        if jax.process_count() > 1:
            multihost_utils = importlib.import_module("jax.experimental.multihost_utils")
            multihost_utils.sync_global_devices("paramstore.CheckpointManager.prune")

    def _background(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        try:
            self._write(path, arrays)
        except BaseException as e:
            e.add_note(f"(raised by the background save of '{path}')")
            self._error = e

    def wait(self) -> None:
        """Block until a pending background save is written; re-raise its error, if any."""
        if self._orbax_pending:
            self._orbax_pending = False
            _PENDING.discard(self)
            self._orbax_async.wait_until_finished()
            self._prune()
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
            _PENDING.discard(self)
        error, self._error = self._error, None
        if error is not None:
            raise error

    def restore_latest(self, allow_missing: bool = False) -> str | None:
        """Restore the latest checkpoint (see ``Saver.restore``); its path, or None if the
        directory has none. With a ``ps.Checkpoint`` this is ``checkpoint.restore(path)``
        followed, unless ``allow_missing``, by ``assert_existing_objects_matched()``."""
        path = self.latest_checkpoint
        if path is None:
            return None
        if self._checkpoint is not None:
            status = self._checkpoint.restore(path)
            if not allow_missing:
                status.assert_existing_objects_matched()
        else:
            self._saver.restore(path, allow_missing=allow_missing)
        return path


# --------------------------------------------------------------------------- inspection
