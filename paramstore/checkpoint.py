"""Checkpoints: ``Saver``, ``CheckpointManager``, ``list_variables``, ``load_variable``.

Contract (the file format is described in docs/checkpoints.md):

* A checkpoint is one standard safetensors file (readable by ``safetensors.safe_open``):
  an 8-byte little-endian header length, a JSON header, then the raw little-endian bytes
  of each tensor. paramstore adds, in the header's ``__metadata__``, a format version and,
  per tensor, a CRC-32 of its bytes (checked on every load) and the true dtype and shape of
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
import math
import operator
import os
import re
import shutil
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from paramstore import _orbax, _trace
from paramstore import sharding as _sharding
from paramstore._safetensors import (
    _CHUNK,
    _KEY_VERSION,
    _TEMP_RE,
    FORMAT_VERSION,
    CheckpointError,
    PathLike,
    _check_name,
    _dtype_name,
    _Entry,
    _is_string,
    _Reader,
    _suggest,
    write_arrays,
)
from paramstore.module import Module
from paramstore.scope import VariableStore, default_store, preview_names
from paramstore.variable import Variable

__all__ = [
    "Saver",
    "CheckpointManager",
    "CheckpointError",
    "list_variables",
    "load_variable",
    "inspect_main",
    "write_arrays",
    "read_arrays",
    "FORMAT_VERSION",
]


def _resolve(path: PathLike) -> str:
    """A checkpoint file: ``path`` itself, or the latest checkpoint of a manager directory."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if _orbax.is_checkpoint(path):
            return path
        found = _scan(path)
        if not found:
            raise FileNotFoundError(
                f"No checkpoint in directory '{path}' (expected ckpt-<step>.safetensors files "
                "or ckpt-<step> sharded checkpoint directories written by a "
                "CheckpointManager)."
            )
        return found[-1][1]
    if not os.path.exists(path):
        raise FileNotFoundError(f"No checkpoint file or directory '{path}'.")
    return path


def list_variables(path: PathLike) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """``[(name, shape, dtype)]`` of a checkpoint, sorted by name, read from its header only.

    ``path`` is a checkpoint file or a CheckpointManager directory (its latest checkpoint).
    String variables have dtype ``np.dtypes.StringDType()``. Works on sharded (Orbax)
    checkpoints too, from their metadata alone.
    """
    resolved = _resolve(path)
    if os.path.isdir(resolved):
        entries = _sharded_entries(resolved)
        return sorted((e["name"], e["shape"], e["dtype"]) for e in entries.values())
    with _Reader(resolved) as r:
        return [(e.name, e.shape, e.dtype) for e in sorted(r.entries.values(), key=_by_name)]


def _by_name(e: _Entry) -> str:
    return e.name


def load_variable(path: PathLike, name: str) -> np.ndarray:
    """The value of variable ``name`` in a checkpoint (file or manager directory), checked
    against its checksum. Raises CheckpointError if absent or corrupt."""
    resolved = _resolve(path)
    if os.path.isdir(resolved):
        entries = _sharded_entries(resolved)
        if name not in entries:
            raise CheckpointError(
                f"Checkpoint '{resolved}' has no variable '{name}'{_suggest(name, entries)}. "
                f"Its variables: {preview_names(sorted(entries))}."
            )
        return _sharded_load(resolved, {name: (entries[name], None)})[name]
    with _Reader(resolved) as r:
        return r.load(name)


def read_arrays(path: PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint as ``{name: NumPy array}`` (checksums verified)."""
    resolved = _resolve(path)
    if os.path.isdir(resolved):
        entries = _sharded_entries(resolved)
        return _sharded_load(resolved, {n: (e, None) for n, e in entries.items()})
    with _Reader(resolved) as r:
        return dict(r.load_many(r.entries))


# -------------------------------------------------------------------------------- Saver


class Saver:
    """Saves and restores variables as safetensors checkpoints (see the module docstring).

    ``var_list``: None (every live variable of the current default store, listed at each
    save/restore), a ``{checkpoint_name: Variable}`` dict, a list of Variables, or a Module
    (both keyed by ``v.name``).

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
        self._store: VariableStore | None = None
        self._module: Module | None = None
        self._fixed: dict[str, Variable] | None = None
        if var_list is None:
            self._store = default_store()
        elif isinstance(var_list, Module):
            self._module = var_list
        elif isinstance(var_list, Mapping):
            self._fixed = dict(var_list)
        elif isinstance(var_list, (list, tuple)):
            self._fixed = _by_full_name(var_list)
        else:
            raise TypeError(
                "Saver(var_list) takes None, a dict {name: Variable}, a list of Variables or "
                f"a ps.Module, got {type(var_list).__name__}."
            )
        self._mapping()  # validate now

    def _mapping(self) -> dict[str, Variable]:
        """``{checkpoint_name: Variable}`` as it stands now."""
        if self._store is not None:
            out = _by_full_name(self._store.variables())
        elif self._module is not None:
            out = _by_full_name(self._module.variables)
        else:
            assert self._fixed is not None
            out = self._fixed
        for name, v in out.items():
            _check_name(name)
            if not isinstance(v, Variable):
                raise TypeError(f"Saver: '{name}' maps to a {type(v).__name__}, not a ps.Variable.")
        return out

    # -- saving
    def save(self, path: PathLike, step: int | None = None) -> str:
        """Write the variables to ``path`` (``f"{path}-{step}"`` with ``step``) atomically:
        a file, or a directory for a sharded checkpoint (see ``sharded``). Every process
        of a multi-process run must call it. Returns the path written."""
        path = os.fspath(path)
        if step is not None:
            path = f"{path}-{operator.index(step)}"
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
        _outside_traces("save")
        return {name: _current(name, v, sharded=True) for name, v in self._mapping().items()}

    def _snapshot(self, copy: bool) -> dict[str, np.ndarray]:
        """Host copies of the values, ``{checkpoint_name: np.ndarray}``. With ``copy=False``
        an array may still share the device buffer (CPU); ``copy=True`` makes it independent."""
        _outside_traces("save")
        mapping = self._mapping()
        values = {name: _current(name, v) for name, v in mapping.items()}
        if jax.default_backend() != "cpu":  # start every transfer before waiting on any
            for x in values.values():
                if isinstance(x, jax.Array):
                    x.copy_to_host_async()
        return {name: _to_host(name, x, copy) for name, x in values.items()}

    # -- restoring
    def restore(
        self, path: PathLike, allow_missing: bool = False, *, sharding: Any = None
    ) -> list[Variable]:
        """Fill the variables in place from a checkpoint (a file, a sharded checkpoint
        directory, or a manager directory: its latest).

        Everything is validated and loaded before any variable is assigned; on error no
        variable changes. Raises CheckpointError for a name missing from the file (unless
        ``allow_missing``), a shape or dtype that differs, or a corrupt file. Returns the
        variables skipped because the file lacks them (empty without ``allow_missing``).

        Each value lands on its variable's current sharding, or, with ``sharding``, on a
        new one, which the variable then keeps: a ``Sharding`` or ``Mesh`` (replicated) for
        all, a dict ``{variable name: Sharding}``, or a function ``variable -> Sharding |
        None`` (as for ``ps.sharding.reshard``). A target that does not fit its variable's
        shape raises ValueError before anything is read.
        """
        _outside_traces("restore")
        mapping = self._mapping()
        moves: dict[int, Any] = {}
        if sharding is not None:
            for v, sh in _sharding.plan(list(mapping.values()), sharding):
                moves[id(v)] = sh
        resolved = _resolve(path)
        if os.path.isdir(resolved):
            return self._restore_sharded(resolved, mapping, allow_missing, moves)
        with _Reader(resolved) as r:
            present = {n: v for n, v in mapping.items() if n in r.entries}
            skipped = [v for n, v in mapping.items() if n not in r.entries]
            if skipped and not allow_missing:
                missing = [n for n in mapping if n not in r.entries]
                raise CheckpointError(
                    f"Checkpoint '{r.path}' lacks {len(missing)} variable(s) of this Saver: "
                    f"{preview_names(missing)}{_suggest(missing[0], r.entries)}. Pass "
                    "allow_missing=True to restore the others."
                )
            for name, v in present.items():
                _check_fits(r.path, r.entries[name], v)
                _check_assignable(name, v)
            values = _load_placed(r, present, moves)
        _assign_all(present, values, moves)
        return skipped

    def _restore_sharded(
        self,
        path: str,
        mapping: dict[str, Variable],
        allow_missing: bool,
        moves: Mapping[int, Any],
    ) -> list[Variable]:
        entries = _sharded_entries(path)
        present = {n: v for n, v in mapping.items() if n in entries}
        skipped = [v for n, v in mapping.items() if n not in entries]
        if skipped and not allow_missing:
            missing = [n for n in mapping if n not in entries]
            raise CheckpointError(
                f"Checkpoint '{path}' lacks {len(missing)} variable(s) of this Saver: "
                f"{preview_names(missing)}{_suggest(missing[0], entries)}. Pass "
                "allow_missing=True to restore the others."
            )
        wanted = {}
        for name, v in present.items():
            e = entries[name]
            if e["shape"] != tuple(v.shape) or e["dtype"] != v.dtype:
                raise CheckpointError(_mismatch(path, name, e["shape"], e["dtype"], v))
            _check_assignable(name, v)
            wanted[name] = (e, None if _is_string(v.dtype) else moves.get(id(v), v.sharding))
        _assign_all(present, _sharded_load(path, wanted), moves)
        return skipped


def _assign_all(
    present: Mapping[str, Variable], values: Mapping[str, Any], moves: Mapping[int, Any]
) -> None:
    """Assign every loaded value (cannot fail: exact shapes, dtypes, placement); a variable
    restored onto a new sharding (``moves``) takes the value's placement."""
    for name, value in values.items():
        v = present[name]
        if id(v) in moves:
            v._write(value, owned=True)
        else:
            v.assign(value, read_value=False)


def _sharded_entries(path: str) -> dict[str, dict[str, Any]]:
    try:
        return {e["name"]: e for e in _orbax.read_metadata(path)}
    except _orbax.FormatError as e:
        raise CheckpointError(f"Checkpoint '{path}' is not readable: {e}.") from None


def _sharded_load(path: str, wanted: Mapping[str, tuple[dict[str, Any], Any]]) -> dict[str, Any]:
    try:
        return _orbax.load(path, wanted)
    except ImportError:
        raise
    except Exception as e:  # Orbax / TensorStore: missing or corrupt array data
        raise CheckpointError(
            f"Checkpoint '{path}' could not be read ({type(e).__name__}: {e}). Restore "
            "another checkpoint."
        ) from e


def _by_full_name(variables: Iterable[Any]) -> dict[str, Variable]:
    out: dict[str, Variable] = {}
    for v in variables:
        if not isinstance(v, Variable):
            raise TypeError(f"Saver: expected ps.Variable, got {type(v).__name__}.")
        if v.name in out and out[v.name] is not v:
            raise ValueError(
                f"Saver: two different variables are named '{v.name}' (from different "
                "stores?); pass a dict {checkpoint_name: variable} to name them."
            )
        out[v.name] = v
    return out


def _outside_traces(what: str) -> None:
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


def _check_assignable(name: str, v: Variable) -> None:
    if type(v) is not Variable:
        raise TypeError(
            f"Saver: '{name}' is a detached copy of variable '{v.name}' (it went through a "
            "JAX transformation as a pytree) and cannot be assigned; restore the original."
        )


def _check_fits(path: str, e: _Entry, v: Variable) -> None:
    if e.shape != tuple(v.shape) or e.dtype != v.dtype:
        raise CheckpointError(_mismatch(path, e.name, e.shape, e.dtype, v))


def _mismatch(path: str, name: str, shape: tuple[int, ...], dtype: np.dtype, v: Variable) -> str:
    return (
        f"Checkpoint '{path}' holds '{name}' with shape {shape} and dtype "
        f"{_dtype_name(dtype)}, but variable '{v.name}' has shape {tuple(v.shape)} and "
        f"dtype {_dtype_name(v.dtype)}. Restore into a model built with the same "
        "configuration, or leave this variable out of the Saver."
    )


def _load_placed(
    r: _Reader, variables: Mapping[str, Variable], moves: Mapping[int, Any]
) -> dict[str, Any]:
    """Each tensor, verified, and put where its variable lives or moves to (``device_put``
    in batches of ``_CHUNK`` bytes, so host memory holds at most a batch beyond what jax
    keeps)."""
    out: dict[str, Any] = {}
    batch: list[tuple[str, np.ndarray, Any]] = []
    size = 0
    for name, arr in r.load_many(variables):  # raises at the end if a checksum fails
        v = variables[name]
        if _is_string(v.dtype):
            out[name] = arr
            continue
        batch.append((name, arr, moves.get(id(v), v.sharding)))
        size += arr.nbytes
        if size >= _CHUNK:
            out.update(_put(batch))
            batch, size = [], 0
    out.update(_put(batch))
    return out


def _put(batch: list[tuple[str, np.ndarray, Any]]) -> dict[str, Any]:
    if not batch:
        return {}
    names, arrays, shardings = zip(*batch)
    placed = jax.device_put(list(arrays), list(shardings), may_alias=True)
    return dict(zip(names, placed))


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
            m = _TEMP_RE.match(name)
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
        if isinstance(saver_or_vars, Saver):
            if sharded is not None and sharded != saver_or_vars.sharded:
                raise ValueError(
                    "CheckpointManager: sharded= conflicts with the Saver's own setting; "
                    "give it to the Saver."
                )
            self.saver = saver_or_vars
        else:
            self.saver = Saver(saver_or_vars, sharded=sharded)
        self.max_to_keep = max_to_keep
        self.async_save = bool(async_save)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._orbax_async: Any = None  # an Orbax AsyncCheckpointer, for sharded async saves
        self._orbax_pending = False
        if jax.process_index() == 0:
            os.makedirs(self.directory, exist_ok=True)
            _remove_stale_temps(self.directory)

    def path_for(self, step: int) -> str:
        name = f"ckpt-{operator.index(step)}"
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
        if self.saver._writes_sharded():
            values = self.saver._device_values()
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
            self._write(path, self.saver._snapshot(copy=False))
            return path
        arrays = self.saver._snapshot(copy=True)
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
            from jax.experimental import multihost_utils

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
        directory has none."""
        path = self.latest_checkpoint
        if path is not None:
            self.saver.restore(path, allow_missing=allow_missing)
        return path


# --------------------------------------------------------------------------- inspection


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError


def _stats(arr: np.ndarray) -> list[str]:
    """min, max, mean (over the finite values) and the count of NaN/inf values."""
    if _is_string(arr.dtype) or not arr.size:
        return ["-", "-", "-", "-"]
    if arr.dtype.kind == "c":
        return ["-", "-", f"{complex(arr.mean()):.6g}", str(int(np.sum(~np.isfinite(arr))))]
    x = arr.reshape(-1)
    if x.dtype.kind not in "iu":
        x = x.astype(np.float64)
    finite = x[np.isfinite(x)] if x.dtype.kind == "f" else x
    bad = str(x.size - finite.size)
    if not finite.size:
        return ["-", "-", "-", bad]
    mean = float(np.mean(finite, dtype=np.float64))
    return [f"{finite.min():.6g}", f"{finite.max():.6g}", f"{mean:.6g}", bad]


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _inspect_sharded(path: str, values: bool, name: str | None) -> str:
    entries = _sharded_entries(path)
    if name is not None and name not in entries:
        raise CheckpointError(
            f"Checkpoint '{path}' has no variable '{name}'{_suggest(name, entries)}. "
            f"Its variables: {preview_names(sorted(entries))}."
        )
    chosen = [entries[name]] if name is not None else [entries[n] for n in sorted(entries)]
    loaded = _sharded_load(path, {e["name"]: (e, None) for e in chosen}) if values else {}
    head = ["name", "shape", "dtype", "size", "bytes"]
    rows = [head + (["min", "max", "mean", "nan/inf"] if values else [])]
    total = 0
    for e in chosen:
        size = math.prod(e["shape"])
        nbytes = (
            sum(len(t.encode("utf-8")) for t in e["strings"])
            if _is_string(e["dtype"])
            else size * e["dtype"].itemsize
        )
        total += nbytes
        row = [e["name"], str(list(e["shape"])), _dtype_name(e["dtype"]), str(size)]
        row.append(_human(nbytes))
        if values:
            row += _stats(loaded[e["name"]])
        rows.append(row)
    lines = [
        f"{path}: {len(chosen)} variables, {_human(total)}, sharded (Orbax), "
        f"format version {_orbax.VERSION}",
        _table(rows),
    ]
    if values and name is not None:
        with np.printoptions(threshold=1000, edgeitems=5):
            lines.append(f"\n{name} =\n{loaded[name]!r}")
    return "\n".join(lines)


def _inspect(path: PathLike, values: bool, name: str | None) -> str:
    resolved = _resolve(path)
    if os.path.isdir(resolved):
        return _inspect_sharded(resolved, values, name)
    with _Reader(resolved) as r:
        entries = sorted(r.entries.values(), key=_by_name)
        if name is not None:
            entries = [r.entry(name)]
        head = ["name", "shape", "dtype", "size", "bytes"]
        rows = [head + (["min", "max", "mean", "nan/inf"] if values else [])]
        loaded = {}
        for e in entries:
            row = [e.name, str(list(e.shape)), _dtype_name(e.dtype)]
            row += [str(math.prod(e.shape)), _human(e.nbytes)]
            if values:
                loaded[e.name] = r.load(e.name)
                row += _stats(loaded[e.name])
            rows.append(row)
        total = sum(e.nbytes for e in entries)
        version = r.metadata.get(_KEY_VERSION, "none (plain safetensors)")
        lines = [f"{r.path}: {len(entries)} variables, {_human(total)}, format version {version}"]
        lines.append(_table(rows))
    if values and name is not None:
        with np.printoptions(threshold=1000, edgeitems=5):
            lines.append(f"\n{name} =\n{loaded[name]!r}")
    return "\n".join(lines)


def inspect_main(path: PathLike, values: bool = False, name: str | None = None) -> int:
    """``python -m paramstore inspect``: print a checkpoint's variables (name, shape, dtype,
    size; with ``values`` also min/max/mean, and the full value of ``name``). Returns the exit
    status: 0, or 1 after printing the error for a missing or corrupt checkpoint."""
    try:
        print(_inspect(path, values, name))
    except (OSError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
