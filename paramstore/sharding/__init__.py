"""Device placement and sharding of variables, on JAX's own distributed runtime.

Contract (docs/api.md, "Devices and sharding"; docs/sharding.md has the guide):

* ``with ps.device("cpu:0"):`` (also ``"gpu:1"``, ``"/device:GPU:1"``, ``"cpu"`` for the
  first one, or a ``jax.Device``) places every Variable created inside on that device. A
  name counts this process's *local* devices, as TensorFlow does. ``ps.device`` also takes
  a ``jax.sharding.Sharding`` (every variable created inside gets it) or a
  ``jax.sharding.Mesh`` (shorthand for replicated over the mesh: the usual data-parallel
  model). An unknown name raises ``ValueError`` listing the devices that exist.
* ``Variable(..., device=...)`` or ``Variable(..., sharding=jax.sharding.Sharding)`` places
  one variable; an explicit argument wins over the context. A sharding that does not fit
  the variable's shape (a dimension of 7 split over 2 devices, a spec longer than the
  rank) raises ``ValueError`` naming the variable, its shape and the mesh, and no variable
  is created.
* A variable keeps its placement: every assign (also sliced ones and ``assign_add``) puts
  the new value where the old one was, ``ps.function`` returns each assigned variable with
  the sharding it went in with (so the second call does not recompile), ``ps.Optimizer``
  places its slots like their variables, and restoring a checkpoint ``device_put``s each
  value onto its variable's sharding. A variable with no placement (an uncommitted array)
  that a step on committed inputs assigns is first moved where the step runs
  (``settle_unplaced``), as JAX would return it, so that no call compiles twice.
* ``reshard(variables, sharding)`` moves existing variables to new shardings (all of them
  or none: every target is checked first); so does ``Saver.restore(path, sharding=...)``.
  Nothing else changes a placement.
* Multi-process (``jax.distributed.initialize``): a variable may be sharded over the
  devices of all processes; every process creates it with the same initial value and keeps
  only its own shards. Checkpoints are then written through Orbax, each process writing
  its own shards (see ``paramstore.checkpoint``).

Models larger than one device (docs/api.md; ``paramstore._core.layout`` and ``paramstore._variable.abstract``
hold what variable creation consults):

* ``LayoutMap(mesh)`` (name regexes -> layouts, Keras 3 semantics) used through
  ``with ps.device(layout_map):``; ``partition=`` on variables and layers, mapped to mesh
  axes inside ``with axis_rules(mesh, rules):``. ``specs(model)`` gives each variable's
  ``PartitionSpec`` over the mesh axes (``P()`` for a variable on one device or none).
* A variable that gets a sharding from an initializer is computed by a program compiled
  with that output sharding: no device ever holds more than its shards.
* ``with ps.abstract():`` creates variables with shape, dtype and sharding only;
  ``initialize(model)`` runs the initializers of its abstract variables as one sharded
  program (a checkpoint restore makes them concrete too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from paramstore._collect import variables_of
from paramstore._core import frames
from paramstore._core.interrupts import deferred
from paramstore._core.layout import Layout, LayoutMap, Partition, axis_rules
from paramstore._core.ownership import ownership
from paramstore._core.placement import (
    check_fits,
    current_placement,
    describe,
    device,
    place,
    placement,
    replicated,
    resolve_device,
)
from paramstore._variable import abstract as _abstract
from paramstore._variable.abstract import abstract
from paramstore.typing import ShardingTargets, VariablesLike
from paramstore.variable import Variable, set_initial_value

__all__ = [
    "LayoutMap",
    "Layout",
    "Partition",
    "axis_rules",
    "specs",
    "abstract",
    "initialize",
    "device",
    "resolve_device",
    "placement",
    "current_placement",
    "check_fits",
    "place",
    "reshard",
    "plan",
    "replicated",
    "settle_unplaced",
    "describe",
]


def settle_unplaced(
    assigned: Iterable[Variable], inputs: Iterable[object], captured: Iterable[Variable] = ()
) -> None:
    """Before the first call of a compiled step: move each assigned variable that has no
    placement (an uncommitted array) to where the step's committed inputs are, replicated.

    JAX runs a computation where its committed inputs live and returns its outputs there,
    committed; an uncommitted variable assigned by a step on a mesh would come back
    replicated over the mesh, and the second call, seeing a new input sharding, would
    compile again. Moving it first gives every call the same signature. A step whose
    inputs (array arguments ``inputs``, variables read ``captured``) are all uncommitted
    (one default device) changes nothing.
    """
    committed = [
        x.sharding
        for x in inputs
        if isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)
        and getattr(x, "committed", False)
    ]
    committed += [
        ownership.peek(v).sharding
        for v in captured
        if getattr(ownership.peek(v), "committed", False)  # metadata only
    ]
    if not committed:
        return
    home = replicated(max(committed, key=lambda sh: len(sh.device_set)))
    for v in assigned:
        ownership.commit(v, home)


def reshard(variables: VariablesLike, sharding: ShardingTargets) -> None:
    """Move ``variables`` (a Variable, a list, a dict, a Module) to new shardings.

    ``sharding`` is one ``Sharding`` for all (a ``Mesh`` replicates over it), a dict
    ``{variable full name: Sharding}`` (variables not in it stay), or a callable
    ``fn(variable) -> Sharding | None`` (None: stays). Every target is checked against its
    variable's shape before any variable moves: a sharding that does not fit raises
    ``ValueError`` naming the variable, and then no variable changes. The moves are
    atomic, as a restore is: a compiled step in another thread sees all of them or none.
    A ``ps.function`` compiled before the move traces again on its next call (its program
    would write the variables back on their old shardings).
    """
    if frames.active():
        raise RuntimeError(
            "reshard moves variables between devices; call it outside ps.function, ps.pure "
            "and the gradient functions."
        )
    targets = plan(variables_of(variables), sharding)
    if not targets:
        return
    # As a restore does (checkpoint.saver.assign_all): under the state lock, so a compiled
    # step in another thread runs wholly before or after the move (never between two
    # variables, never losing an update); each array is copied by ownership (never donated
    # while it is copied: the copy is private) and all are written at once.
    with ownership.lock:
        moved = [ownership.copy(v, sh) for v, sh in targets]
        # a new placement moves TRACE_EPOCH (the one write path): the programs that pinned
        # the old shardings are traced anew
        ownership.write_many([v for v, _ in targets], moved)


def plan(variables: list[Variable], sharding: ShardingTargets) -> list[tuple[Variable, Sharding]]:
    """``(variable, target sharding)`` for each variable that ``sharding`` moves, each
    checked with ``check_fits``; raises before anything changes."""
    if isinstance(sharding, Mesh):
        sharding = NamedSharding(sharding, PartitionSpec())
    if isinstance(sharding, Mapping):
        known = {v.name for v in variables}
        unknown = [k for k in sharding if k not in known]
        if unknown:
            raise ValueError(
                f"reshard: no variable named {unknown[0]!r} among the {len(variables)} given."
            )
    out = []
    for v in variables:
        if isinstance(sharding, Sharding):
            target: Any = sharding
        elif isinstance(sharding, Mapping):
            target = sharding.get(v.name)
        elif callable(sharding):
            target = sharding(v)
        else:
            raise TypeError(
                "reshard expects a jax.sharding.Sharding, a Mesh, a dict {name: Sharding} or "
                f"a callable variable -> Sharding, got {type(sharding).__name__}."
            )
        if target is None:
            continue
        if isinstance(target, Mesh):
            target = NamedSharding(target, PartitionSpec())
        if not isinstance(target, Sharding):
            raise TypeError(
                f"reshard: the target for variable '{v.name}' is a {type(target).__name__}, "
                "not a jax.sharding.Sharding."
            )
        if v._is_string:
            if isinstance(sharding, Sharding):
                continue  # one sharding for all: host-side string variables stay
            raise TypeError(f"reshard: string variable '{v.name}' lives on the host.")
        check_fits(target, v.shape, f"variable '{v.name}'")
        out.append((v, target))
    return out


def specs(variables: VariablesLike) -> dict[str, PartitionSpec]:
    """``{full name: PartitionSpec}`` of ``variables`` (a Module, a list, a dict ...): each
    variable's spec over its mesh's axes, ``P()`` when it is replicated, on one device, or
    a host-side string variable. Abstract variables give the spec they will have."""
    out: dict[str, PartitionSpec] = {}
    for v in variables_of(variables):
        sharding = v.sharding
        out[v.name] = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
    return out


def initialize(variables: VariablesLike) -> list[Variable]:
    """Give the abstract variables of ``variables`` (a Module, an Optimizer, a list ...)
    their initial values: their initializers run as one program compiled with their
    shardings as output shardings, each under its own name-derived key (the values an
    eager creation would give). Concrete variables are left alone. Returns the variables
    it initialized. A variable made abstract from a shape only (``ps.Variable(
    jax.ShapeDtypeStruct(...))``) has no initializer: then ``ValueError`` naming it, and no
    variable changes; restore a checkpoint into it instead. The state of an optimizer
    built over abstract variables is computed last, by ``tx.init`` on its parameters'
    values: they must be concrete by then or initialized by this same call (else
    ``ValueError`` naming both, and no variable changes)."""
    if frames.active():
        raise RuntimeError(
            "ps.initialize creates the variables' arrays; call it outside ps.function, "
            "ps.pure and the gradient functions."
        )
    todo = [v for v in variables_of(variables) if v.is_abstract]
    plain: list[Variable] = []
    makes = []
    joint: list[tuple[Variable, _abstract.Joint]] = []
    for v in todo:
        _, make = _abstract.initializer_of(v)
        if isinstance(make, _abstract.Joint):
            joint.append((v, make))
            continue
        if make is None:
            raise ValueError(
                f"Variable '{v.name}' is abstract with no initializer (it was made from a "
                "shape only, e.g. ps.Variable(jax.ShapeDtypeStruct(...))), so "
                "ps.initialize cannot give it a value. Restore a checkpoint into it, or "
                "create it with an initializer."
            )
        plain.append(v)
        makes.append(make)
    _check_reads(joint, {id(v) for v in plain})
    placed = [i for i, v in enumerate(plain) if v.sharding is not None]
    free = [i for i, v in enumerate(plain) if v.sharding is None and not v._is_string]
    # A string variable's value is host data (NumPy StringDType), which XLA cannot hold:
    # its initial value is made on the host, not in the compiled program (issue 28).
    values: dict[int, Any] = {i: makes[i]() for i, v in enumerate(plain) if v._is_string}
    for group, shardings in ((placed, [plain[i].sharding for i in placed]), (free, None)):
        if not group:
            continue
        got = (
            _abstract.run_sharded([makes[i] for i in group], shardings)
            if shardings is not None
            else jax.jit(lambda group=group: [makes[i]() for i in group])()
        )
        values.update(zip(group, got))
    with deferred():  # all or none, Ctrl-C included (held back to the end)
        for i, v in enumerate(plain):
            set_initial_value(v, values[i], owned=True)
    computed: dict[int, list[Any]] = {}  # each joint computation once (all an optimizer's slots)
    for _, j in joint:
        if id(j.compute) not in computed:
            computed[id(j.compute)] = j.compute()
    with deferred():
        for v, j in joint:
            set_initial_value(v, computed[id(j.compute)][j.index])
    return todo


def _check_reads(joint: list[tuple[Variable, _abstract.Joint]], initialized: set[int]) -> None:
    """Raise, before anything changes, if a joint initializer reads a variable that stays
    abstract (not initialized by this call)."""
    for v, j in joint:
        for r in j.reads:
            if r.is_abstract and id(r) not in initialized:
                raise ValueError(
                    f"Variable '{v.name}' is initialized from the value of '{r.name}', which is "
                    "abstract and not initialized by this call, so ps.initialize cannot give "
                    f"'{v.name}' a value. Restore or initialize '{r.name}' first, or pass both "
                    "(ps.initialize([model, optimizer]))."
                )
