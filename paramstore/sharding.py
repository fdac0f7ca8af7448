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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from paramstore import _trace
from paramstore._collect import variables_of
from paramstore._placement import (
    check_fits,
    current_placement,
    describe,
    device,
    place,
    placement,
    replicated,
    resolve_device,
)

__all__ = [
    "device",
    "resolve_device",
    "placement",
    "current_placement",
    "check_fits",
    "place",
    "reshard",
    "replicated",
    "settle_unplaced",
    "describe",
]


def settle_unplaced(assigned: Iterable[Any], inputs: Iterable[Any]) -> None:
    """Before the first call of a compiled step: move each assigned variable that has no
    placement (an uncommitted array) to where the step's committed inputs are, replicated.

    JAX runs a computation where its committed inputs live and returns its outputs there,
    committed; an uncommitted variable assigned by a step on a mesh would come back
    replicated over the mesh, and the second call, seeing a new input sharding, would
    compile again. Moving it first gives every call the same signature. A step whose
    inputs are all uncommitted (one default device) changes nothing.
    """
    committed = [
        x.sharding
        for x in inputs
        if isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)
        and getattr(x, "committed", False)
    ]
    if not committed:
        return
    home = replicated(max(committed, key=lambda sh: len(sh.device_set)))
    for v in assigned:
        x = v._value
        if isinstance(x, jax.Array) and not getattr(x, "committed", True):
            v._write(jax.device_put(x, home))


def reshard(
    variables: Any,
    sharding: Sharding | Mesh | Mapping[str, Sharding] | Callable[[Any], Sharding | None],
) -> None:
    """Move ``variables`` (a Variable, a list, a dict, a Module) to new shardings.

    ``sharding`` is one ``Sharding`` for all (a ``Mesh`` replicates over it), a dict
    ``{variable full name: Sharding}`` (variables not in it stay), or a callable
    ``fn(variable) -> Sharding | None`` (None: stays). Every target is checked against its
    variable's shape before any variable moves: a sharding that does not fit raises
    ``ValueError`` naming the variable, and then no variable changes.
    """
    if _trace.active():
        raise RuntimeError(
            "reshard moves variables between devices; call it outside ps.function, ps.pure "
            "and the gradient functions."
        )
    targets = plan(variables_of(variables), sharding)
    moved = [(v, jax.device_put(v._value, sh)) for v, sh in targets]  # all, then write
    for v, value in moved:
        v._write(value)


def plan(
    variables: list[Any],
    sharding: Sharding | Mesh | Mapping[str, Sharding] | Callable[[Any], Sharding | None],
) -> list[tuple[Any, Sharding]]:
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
