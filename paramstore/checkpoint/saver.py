"""``Saver`` and the restore steps every restore shares (private; the public names are in
``paramstore.checkpoint``, the contract in its docstring and docs/checkpoints.md).

A restore is: map checkpoint names to variables, check every entry against its variable
(``placements_for``), load and verify every value (the reader), then assign them all
(``assign_all``), so that on any error no variable changes.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from paramstore import sharding as _sharding
from paramstore._collect import named
from paramstore._core import frames
from paramstore._core.context import STATE_LOCK
from paramstore._core.interrupts import deferred
from paramstore._core.ownership import ownership
from paramstore.checkpoint.format import (
    CheckpointError,
    PathLike,
    Reader,
    dtype_name,
    is_string,
    lacks_variables,
)
from paramstore.checkpoint.formats.orbax import format as _orbax
from paramstore.checkpoint.formats.safetensors.file import write_checked
from paramstore.checkpoint.formats.safetensors.format import check_name
from paramstore.checkpoint.io import path_lock
from paramstore.checkpoint.readers import opened
from paramstore.scope import default_store
from paramstore.typing import ShardingTargets, VariablesLike
from paramstore.variable import Variable, set_initial_value


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

    def __init__(
        self, var_list: VariablesLike | None = None, *, sharded: bool | None = None
    ) -> None:
        if sharded is not None and not isinstance(sharded, bool):
            raise TypeError(f"Saver: sharded must be None, True or False, got {sharded!r}.")
        self.sharded = sharded
        if isinstance(var_list, Mapping):
            bad = [k for k in var_list if not isinstance(k, str)]
            if bad:
                raise TypeError(
                    f"Saver: a checkpoint name must be a str, got {type(bad[0]).__name__} "
                    f"{bad[0]!r}; write {{'{bad[0]}': variable}} if that is the name you mean."
                )
            var_list = dict(var_list)  # a snapshot of the names, as a list would be
        self._source: Any = default_store() if var_list is None else var_list
        # validated now; a dict is a snapshot (copied above), so its mapping is built and its
        # names checked here once, not again at each save and restore
        fixed = self._read_mapping()
        self._fixed = fixed if isinstance(var_list, Mapping) else None

    def _mapping(self) -> dict[str, Variable]:
        """``{checkpoint_name: Variable}`` as it stands now (a store or a Module is read
        again at every save and restore, so variables created later are included)."""
        return self._fixed if self._fixed is not None else self._read_mapping()

    def _read_mapping(self) -> dict[str, Variable]:
        """The mapping read from the source, every name checked (``check_name``)."""
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
        with path_lock(path):
            if self._writes_sharded():
                return _orbax.save(path, self._device_values())
            return write_checked(path, self._snapshot(copy=False))

    def _writes_sharded(self) -> bool:
        """Whether ``save`` writes the sharded (Orbax) format now."""
        if self.sharded is None:
            several: bool = jax.process_count() > 1
            return several
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
        with ownership.consistent():  # one snapshot: no step lands between two variables
            return {name: _current(name, v, sharded=True) for name, v in mapping.items()}

    def _snapshot(self, copy: bool) -> dict[str, np.ndarray]:
        """Host copies of the values, ``{checkpoint_name: np.ndarray}``. With ``copy=False``
        an array may still share the device buffer (CPU); ``copy=True`` makes it independent."""
        outside_traces("save")
        mapping = self._mapping()
        with ownership.consistent():  # one snapshot: no step lands between two variables
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
        sharding: ShardingTargets | None = None,
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
    skipped: Mapping[str, str] = getattr(r, "skipped", {})
    unreadable = [n for n in missing if n in skipped]
    if unreadable:
        raise CheckpointError(
            f"Checkpoint '{r.path}': '{unreadable[0]}' holds {skipped[unreadable[0]]}, which "
            "paramstore cannot restore into a variable; leave it out of the names to restore."
        )
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
    restored onto a new sharding (``moves``) takes the value's placement.

    All the writes happen under ``STATE_LOCK``, the lock a ``ps.function`` step and every
    eager write hold: a step (or an atomic read of several variables) sees either none of
    the restored values or all of them, and a step's outputs cannot land between two.
    A signal's exception (Ctrl-C) is held back until all are written (issue 28)."""
    with deferred(), STATE_LOCK:
        _assign_all(present, values, moves)


def _assign_all(
    present: Mapping[str, Variable], values: Mapping[str, Any], moves: Mapping[int, Any]
) -> None:
    for name, value in values.items():
        v = present[name]
        if v.is_abstract:  # ps.abstract(): the value (already on its sharding) makes it concrete
            set_initial_value(v, value, owned=True)
        elif id(v) in moves:
            v._write(value, owned=True)
        elif (
            not frames.depth
            and isinstance(value, jax.Array)
            and value.dtype == v.dtype
            and not value.weak_type
            and value.shape == v.shape
            and value.sharding == ownership.peek(v).sharding
        ):
            v._write(value)  # what assign ends in for this value (not owned: it was given)
        else:
            v.assign(value, read_value=False)


def outside_traces(what: str) -> None:
    if frames.active():
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
    if type(v) is not Variable and not v.is_abstract:  # an abstract one: set_initial_value
        raise TypeError(
            f"Saver: '{name}' is a detached copy of variable '{v.name}' (it went through a "
            "JAX transformation as a pytree) and cannot be assigned; restore the original."
        )


def mismatch(path: str, name: str, shape: tuple[int, ...], dtype: np.dtype, v: Variable) -> str:
    head = (
        f"Checkpoint '{path}' holds '{name}' with shape {shape} and dtype "
        f"{dtype_name(dtype)}, but variable '{v.name}' has shape {tuple(v.shape)} and "
        f"dtype {dtype_name(v.dtype)}."
    )
    if (
        shape == tuple(v.shape)
        and np.dtype(dtype).kind in "iu"
        and np.dtype(v.dtype).kind in "iu"
        and np.dtype(dtype).itemsize > np.dtype(v.dtype).itemsize
    ):
        return (
            f"{head} TensorFlow keeps counters such as global_step as {dtype_name(dtype)}, "
            f"which JAX holds only with jax_enable_x64. Leave '{name}' out of the Saver and "
            f"assign it yourself: {v.name}.assign(int(ps.checkpoint.load_variable(path, "
            f"'{name}'))), or create the variable with dtype={dtype_name(dtype)} after "
            "jax.config.update('jax_enable_x64', True)."
        )
    return (
        f"{head} Restore into a model built with the same configuration, or leave this "
        "variable out of the Saver."
    )
