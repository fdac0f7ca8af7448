"""``ps.Checkpoint``: object-based checkpoints, as ``tf.train.Checkpoint``.

Contract (docs/api.md, "Checkpoints"; docs/checkpoints.md):

* ``Checkpoint(**objects)``: each keyword names a Module, an Optimizer, a Variable, a
  ``ps.random.Generator`` (any object whose ``.state`` is a Variable), another Checkpoint,
  or any object exposing ``.variables``. A variable is saved under its attribute path from
  the root: ``model/layers/0/w`` (attributes of a Module in sorted order, list and tuple
  items by index, dict items by key, as ``Module.variables`` walks them: one traversal,
  ``paramstore._traverse``), an optimizer's ``optimizer/iterations``, its per-parameter
  slots under the parameter's path and the optax state's own path
  (``optimizer/model/dense/kernel/mu``; never by position, so adding a layer shifts no
  other key; a parameter that is not in the checkpoint lends its name instead:
  ``optimizer/dense/kernel/mu``), its shared state under its optax path (``optimizer/count``), a generator's
  ``rng/state``, other objects' ``name/variables/<i>``. Store names play no part, so a model
  rebuilt under new names (a re-run notebook cell: ``dense_1/...``) restores. A variable
  reachable twice is saved once, under its first path (``Module.variables``' order: a
  module's own attributes before its submodules'), and restoring it restores every
  place that holds it.
* ``save(path) -> str`` writes any format ``ps.Saver`` writes (``sharded=`` as there).
* ``restore(path) -> CheckpointStatus``: every value for an existing variable is read,
  verified and checked (shape, dtype) before any is assigned. Values under a Module path
  whose variable does not exist yet (a layer that builds ``self.w`` on its first call) are
  kept, verified, and assigned when the variable is set on that Module (deferred
  restoration, through ``Module.__setattr__``); inside a ``ps.function`` trace they become
  the variable's initial value. ``status.assert_consumed()`` raises CheckpointError unless
  every value of the file went to a variable and every variable of the objects got one;
  ``assert_existing_objects_matched()`` checks only the variables that exist now;
  ``expect_partial()`` states that a partial restore is intended (returns the status).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from paramstore._core.store import preview_names
from paramstore._traverse import Key, Relative, walk
from paramstore.checkpoint.format import CheckpointError, PathLike
from paramstore.checkpoint.readers import opened
from paramstore.checkpoint.saver import (
    Saver,
    assign_all,
    mismatch,
    outside_traces,
    placements_for,
)
from paramstore.module import PENDING, Module, on_attribute_set, on_child_created
from paramstore.typing import Trackable
from paramstore.variable import Variable, set_initial_value

__all__ = ["Checkpoint", "CheckpointStatus"]


def object_paths(root: Any, prefix: str = "") -> tuple[dict[str, Variable], dict[str, Module]]:
    """``({path: Variable}, {path: Module})`` reachable from ``root`` (the shared traversal,
    ``paramstore._traverse.walk``, with holders; each object under its first path)."""
    variables: dict[str, Variable] = {}
    modules: dict[str, Module] = {}
    for path, obj in walk(root, prefix, holders=True):
        assert path is not None
        if isinstance(obj, Variable):
            if path in variables:
                raise CheckpointError(
                    f"ps.Checkpoint: two variables ('{variables[path].name}' and '{obj.name}') "
                    f"have the same path '{path}' (keys such as 1 and '1' in one dict); "
                    "rename one of them."
                )
            variables[path] = obj
        elif isinstance(obj, Module):
            modules[path] = obj
    return variables, modules


def _deepest_module(name: str, modules: Mapping[str, Module]) -> tuple[str, Module] | None:
    head = name
    while "/" in head:
        head = head.rpartition("/")[0]
        if head in modules:
            return head, modules[head]
    return None


def _apply(v: Variable, value: np.ndarray, name: str, path: str) -> None:
    """Give a newly created variable its saved value (deferred restoration)."""
    if tuple(v.shape) != value.shape or v.dtype != value.dtype:
        raise CheckpointError(mismatch(path, name, value.shape, value.dtype, v))
    set_initial_value(v, value)


class _Pending:
    """The values waiting for variables of one Module: ``{relative path: value}``."""

    def __init__(self, status: CheckpointStatus) -> None:
        self.status = status
        self.values: dict[str, tuple[str, np.ndarray]] = {}  # rel -> (name in file, value)
        self._paths: dict[int, str] | None = None  # id(variable) -> its path (Relative keys)

    def snapshot(self) -> dict[str, tuple[str, np.ndarray]]:
        """The values still waiting (``restore`` puts them back: a build that failed)."""
        return dict(self.values)

    def restore(self, snapshot: dict[str, tuple[str, np.ndarray]]) -> None:
        self.values.clear()
        self.values.update(snapshot)

    def _relative(self, key: Relative) -> str:
        """The path a ``Relative`` child has below this module: ``<owner's path>/<rest>``
        where the owner is among the checkpoint's variables, else its fallback."""
        if self._paths is None or id(key.owner) not in self._paths:
            variables, _ = object_paths(self.status._checkpoint)
            self._paths = {id(v): p for p, v in variables.items()}
        owner = self._paths.get(id(key.owner))
        return key.fallback if owner is None else f"{owner}/{key.rest}"

    def created(self, module: Module, key: Key, var: Variable) -> bool:
        """``module`` got ``var`` as a child under ``key`` (an average's shadow): give it
        its saved value, if one waits. One of another shape or dtype raises and stays."""
        rel = self._relative(key) if isinstance(key, Relative) else key
        entry = self.values.get(rel)
        if entry is None:
            return False
        full, saved = entry
        if tuple(var.shape) != saved.shape or var.dtype != saved.dtype:
            raise CheckpointError(
                mismatch(self.status.path, full, saved.shape, saved.dtype, var)
                + " The saved value stays pending until the variable is created with "
                "its shape and dtype."
            )
        del self.values[rel]
        self.status.apply(var, saved, full)
        if not self.values:
            module.__dict__.pop(PENDING, None)
        return True

    def attached(self, module: Module, name: str, value: Any) -> None:
        """``module.<name> = value`` happened: restore what ``value`` holds."""
        variables, modules = object_paths(value, name)
        keys = [k for k in self.values if k == name or k.startswith(name + "/")]
        direct = [(k, variables[k]) for k in keys if k in variables]
        for key, target in direct:  # check them all before giving any its value
            full, saved = self.values[key]
            if tuple(target.shape) != saved.shape or target.dtype != saved.dtype:
                raise CheckpointError(
                    mismatch(self.status.path, full, saved.shape, saved.dtype, target)
                    + " The saved value stays pending until the variable is created with "
                    "its shape and dtype."
                )
        for key, target in direct:
            full, saved = self.values.pop(key)
            self.status.apply(target, saved, full)
        for key in keys:
            if key in variables:
                continue
            found = _deepest_module(key, modules)
            if found is not None:
                sub_path, sub = found
                full, saved = self.values.pop(key)
                defer(sub, key[len(sub_path) + 1 :], full, saved, self.status)
        if not self.values:
            del module.__dict__[PENDING]


def defer(module: Module, rel: str, name: str, value: np.ndarray, status: CheckpointStatus) -> None:
    """Keep the file's ``name`` = ``value`` for ``module``'s variable at relative path
    ``rel``, assigned when it is created."""
    pending = module.__dict__.get(PENDING)
    if pending is None:
        pending = module.__dict__[PENDING] = _Pending(status)
    pending.values[rel] = (name, value)


@on_child_created
def _child(module: Module, key: Key, var: Variable) -> bool:
    """A child created other than by an attribute assignment: restore it if a value waits."""
    pending = module.__dict__.get(PENDING)
    return isinstance(pending, _Pending) and pending.created(module, key, var)


@on_attribute_set
def _attached(module: Module, name: str, value: Any) -> None:
    """``module.<name> = value`` on a module with deferred values: restore what it holds."""
    pending = module.__dict__.get(PENDING)
    if isinstance(pending, _Pending):
        pending.attached(module, name, value)


class CheckpointStatus:
    """What a ``Checkpoint.restore`` matched (see the module docstring)."""

    def __init__(self, checkpoint: Checkpoint, path: str, names: list[str]) -> None:
        self._checkpoint = checkpoint
        self.path = path
        self._unused = set(names)  # file values not yet given to a variable
        self._restored: set[int] = set()
        self._deferred: set[str] = set()  # values kept for variables not created yet

    def apply(self, v: Variable, value: np.ndarray, name: str) -> None:
        _apply(v, value, name, self.path)
        self.consumed(name, v)

    def consumed(self, name: str, v: Variable) -> None:
        self._unused.discard(name)
        self._restored.add(id(v))

    def _unmatched_variables(self) -> list[str]:
        variables, _ = object_paths(self._checkpoint)
        return [p for p, v in variables.items() if id(v) not in self._restored]

    def _check_any_matched(self) -> None:
        """A file none of whose values matched: say why (a ``ps.Saver`` file, most often)."""
        if self._restored or self._deferred or not self._unused:
            return
        variables, _ = object_paths(self._checkpoint)
        store_names = {v.name for v in variables.values()}
        saver = sorted(self._unused & store_names)
        why = (
            f"its names are the variables' own names ({preview_names(saver)}): it was "
            "written by ps.Saver, which keys values by variable name. Restore it with "
            "ps.Saver(model).restore(path), or save with ps.Checkpoint"
            if saver
            else "the file's names are not the objects' attribute paths (ps.Checkpoint keys "
            "a value by its path from the keyword: model=... gives 'model/...'); check the "
            "keywords match the ones used to save, or use ps.Saver for a ps.Saver file"
        )
        raise CheckpointError(
            f"Nothing was restored from checkpoint '{self.path}': none of its "
            f"{len(self._unused)} value(s) matches a variable of the objects, so "
            f"expect_partial() would not help: {why}."
        )

    def assert_existing_objects_matched(self) -> CheckpointStatus:
        """Raise CheckpointError if a variable of the objects got no value from the file."""
        self._check_any_matched()
        unmatched = self._unmatched_variables()
        if unmatched:
            raise CheckpointError(
                f"Checkpoint '{self.path}' has no value for {len(unmatched)} variable(s) of "
                f"the objects: {preview_names(unmatched)}. The model differs from the saved "
                "one; call status.expect_partial() if that is intended."
            )
        return self

    def assert_consumed(self) -> CheckpointStatus:
        """Raise CheckpointError unless every value of the file was restored (deferred ones
        count once their variable exists) and every variable of the objects got one."""
        self.assert_existing_objects_matched()
        if self._unused:
            unused = sorted(self._unused)
            raise CheckpointError(
                f"{len(unused)} value(s) of checkpoint '{self.path}' were not restored: "
                f"{preview_names(unused)} (no such attribute path in the objects, or a layer "
                "not built yet: call it once, then check again)."
            )
        return self

    def expect_partial(self) -> CheckpointStatus:
        """Declare that not everything is expected to match (as in TensorFlow); returns
        the status. The assert methods still report what did not (it changes nothing)."""
        return self


class Checkpoint:
    """Object-based checkpoints, as ``tf.train.Checkpoint`` (see the module docstring).

    Example::

        ckpt = ps.Checkpoint(model=model, optimizer=opt)
        path = ckpt.save("run/ckpt.safetensors")
        ckpt.restore(path).assert_consumed()
    """

    def __init__(self, *args: object, sharded: bool | None = None, **objects: Trackable) -> None:
        if args:
            kinds = ", ".join(type(a).__name__ for a in args)
            raise TypeError(
                f"ps.Checkpoint takes its objects as keywords, got {len(args)} positional "
                f"argument(s) ({kinds}). The keyword names each object in the file: write "
                "ps.Checkpoint(model=model) (and optimizer=opt, ...), as tf.train.Checkpoint."
            )
        if not objects:
            raise ValueError("ps.Checkpoint needs at least one object: Checkpoint(model=m).")
        for key, obj in objects.items():
            if not isinstance(obj, (Module, Variable, Checkpoint, list, tuple, dict)) and not (
                isinstance(getattr(obj, "state", None), Variable) or hasattr(obj, "variables")
            ):
                raise TypeError(
                    f"ps.Checkpoint: {key}= is a {type(obj).__name__}; expected a Module, an "
                    "Optimizer, a Variable, a ps.random.Generator or a Checkpoint."
                )
        if sharded is not None and not isinstance(sharded, bool):
            raise TypeError(f"ps.Checkpoint: sharded must be None, True or False, got {sharded!r}.")
        self.objects: dict[str, Any] = objects
        self.sharded = sharded

    def _ps_children(self) -> list[tuple[str, Any]]:
        """The objects by keyword, sorted (for the shared traversal)."""
        return sorted(self.objects.items())

    def variables_by_path(self) -> dict[str, Variable]:
        """``{attribute path: Variable}`` as the objects stand now (what ``save`` writes)."""
        return object_paths(self)[0]

    def as_saver(self) -> Saver:
        """A ``ps.Saver`` over ``variables_by_path()`` (what CheckpointManager uses)."""
        return Saver(self.variables_by_path(), sharded=self.sharded)

    def save(self, path: PathLike) -> str:
        """Write every variable of the objects under its attribute path; returns the path."""
        return self.as_saver().save(path)

    def restore(self, path: PathLike) -> CheckpointStatus:
        """Restore the objects' variables from ``path`` (any checkpoint ``ps.Saver``
        reads) and keep the values of variables not created yet (see the module
        docstring). On a corrupt file, or a shape or dtype that differs, raises
        CheckpointError and changes nothing. The variables change together, under the lock
        a step takes: a step runs before all of them or after all of them."""
        return self._restore(path, existing_matched=False)

    def _restore(self, path: PathLike, existing_matched: bool) -> CheckpointStatus:
        """``restore``; with ``existing_matched``, a variable of the objects that the file
        lacks is an error raised before anything is assigned (what
        ``assert_existing_objects_matched`` checks after, for ``restore_latest``)."""
        outside_traces("restore")
        variables, modules = object_paths(self)
        with opened(path) as reader:
            entries = reader.entries
            status = CheckpointStatus(self, reader.path, list(entries))
            present = {n: v for n, v in variables.items() if n in entries}
            later: dict[str, tuple[str, Module]] = {}
            for name in entries:
                if name not in present:
                    found = _deepest_module(name, modules)
                    if found is not None:
                        later[name] = found
            if existing_matched and len(present) < len(variables):
                status._restored = {id(v) for v in present.values()}
                status.assert_existing_objects_matched()
            placements = placements_for(reader.path, entries, present, {})
            placements.update(dict.fromkeys(later))
            values = reader.load(placements)
        assign_all(present, {n: values[n] for n in present}, {})
        for name, v in present.items():
            status.consumed(name, v)
        status._deferred = set(later)
        for name, (module_path, module) in later.items():
            defer(module, name[len(module_path) + 1 :], name, values[name], status)
        return status

    def __repr__(self) -> str:
        return f"ps.Checkpoint({', '.join(sorted(self.objects))})"
