"""Device placement and sharding of variables, on JAX's own distributed runtime.

Contract (API.md, "Devices and sharding"; docs/sharding.md has the guide):

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

import contextlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

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

_local = threading.local()


# ------------------------------------------------------------------------------ devices


def _local_devices(kind: str) -> list[jax.Device]:
    try:
        return list(jax.local_devices(backend=kind))
    except (RuntimeError, ValueError):  # an unknown or unavailable backend
        return []


def _available() -> str:
    names = []
    for platform in dict.fromkeys(d.platform for d in jax.local_devices()):
        names += [f"{platform}:{i}" for i in range(len(_local_devices(platform)))]
    return ", ".join(names)


def resolve_device(spec: str | jax.Device) -> jax.Device:
    """A ``jax.Device`` from ``"cpu:0"``, ``"gpu:1"``, ``"/device:GPU:1"``, ``"cpu"`` or a
    ``jax.Device``. Names index this process's local devices of that platform."""
    if isinstance(spec, jax.Device):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"A device is a string like 'cpu:0' or a jax.Device, got {type(spec).__name__}."
        )
    text = spec.strip().lower().removeprefix("/").removeprefix("device:")
    kind, _, index = text.partition(":")
    index = index or "0"
    devices = _local_devices(kind) if kind.isidentifier() else []
    if devices and index.isdigit() and int(index) < len(devices):
        return devices[int(index)]
    raise ValueError(f"No device '{spec}' exists here; the devices are: {_available()}.")


@contextlib.contextmanager
def device(spec: str | jax.Device | Sharding | Mesh) -> Iterator[Any]:
    """Place the Variables created inside this block on ``spec``: a device (``"cpu:0"``,
    ``"gpu:1"``, a ``jax.Device``), a ``Sharding``, or a ``Mesh`` (replicated over it).
    Yields the ``jax.Device`` (or the sharding)."""
    if isinstance(spec, Mesh):
        target: Sharding = NamedSharding(spec, PartitionSpec())
        given: Any = target
    elif isinstance(spec, Sharding):
        target = given = spec
    else:
        given = resolve_device(spec)
        target = SingleDeviceSharding(given)
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(target)
    try:
        yield given
    finally:
        stack.pop()


def current_placement() -> Sharding | None:
    """The sharding set by the innermost ``ps.device`` block, if any."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def placement(device: Any = None, sharding: Sharding | None = None) -> Sharding | None:
    """The sharding a new variable asks for: explicit sharding, device, context, or None."""
    if sharding is not None and device is not None:
        raise ValueError("Give a Variable either device= or sharding=, not both.")
    if sharding is not None:
        if isinstance(sharding, Mesh):
            return NamedSharding(sharding, PartitionSpec())
        if not isinstance(sharding, Sharding):
            raise TypeError(
                f"sharding= must be a jax.sharding.Sharding, got {type(sharding).__name__}."
            )
        return sharding
    if device is not None:
        if isinstance(device, Sharding):
            return device
        return SingleDeviceSharding(resolve_device(device))
    return current_placement()


# ----------------------------------------------------------------------------- checking


def describe(sharding: Sharding) -> str:
    """A short human description: ``"device cpu:0"`` or ``"mesh {'data': 8} spec P('data',)"``."""
    if isinstance(sharding, NamedSharding):
        mesh = dict(sharding.mesh.shape)
        return f"mesh {mesh} spec {sharding.spec}"
    devices = sharding.device_set
    if len(devices) == 1:
        d: Any = next(iter(devices))
        return f"device {d.platform}:{d.id}"
    return f"{type(sharding).__name__} over {len(devices)} devices"


def _named_splits(sharding: NamedSharding, ndim: int, what: str) -> list[tuple[int, str]]:
    """For each dimension, (number of pieces, mesh axes) of a NamedSharding's spec."""
    spec = tuple(sharding.spec)
    if len(spec) > ndim:
        raise ValueError(
            f"The sharding of {what} does not fit: its spec {sharding.spec} names "
            f"{len(spec)} dimensions, but the value has {ndim}. Give one entry per "
            f"dimension at most (on {describe(sharding)})."
        )
    sizes = dict(sharding.mesh.shape)
    out = []
    for entry in spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        unknown = [a for a in axes if a not in sizes]
        if unknown:
            raise ValueError(
                f"The sharding of {what} names mesh axes {unknown} that the mesh "
                f"{sizes} does not have."
            )
        label = f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"mesh axes {axes!r}"
        out.append((math.prod(sizes[a] for a in axes), label))
    return out


def check_fits(sharding: Sharding, shape: tuple[int, ...], what: str) -> None:
    """Raise ``ValueError`` naming ``what`` (e.g. ``"variable 'w'"``), its shape and the
    mesh when ``sharding`` cannot hold an array of ``shape``."""
    shape = tuple(shape)
    if isinstance(sharding, NamedSharding):
        for dim, ((pieces, axes), size) in enumerate(
            zip(_named_splits(sharding, len(shape), what), shape)
        ):
            if size % pieces:
                raise ValueError(
                    f"The sharding of {what} with shape {shape} does not fit: dimension "
                    f"{dim} (size {size}) would be split {pieces} ways by {axes} of "
                    f"{describe(sharding)}, and {size} is not divisible by {pieces}. Use a "
                    "spec that fits (P() replicates), a mesh axis that divides it, or pad "
                    "the dimension."
                )
    try:
        sharding.shard_shape(shape)
    except Exception as e:  # jax's own check, for every kind of Sharding
        raise ValueError(
            f"The sharding of {what} with shape {shape} does not fit ({describe(sharding)}): {e}"
        ) from None


def place(value: Any, sharding: Sharding | None, what: str) -> Any:
    """``value`` put onto ``sharding`` after ``check_fits`` (None: as it is)."""
    if sharding is None:
        return value
    check_fits(sharding, tuple(np.shape(value)), what)
    return jax.device_put(value, sharding)


# ---------------------------------------------------------------------------- placement


def replicated(where: Sharding | Mesh) -> Sharding:
    """A sharding that replicates a value over the devices of ``where``."""
    if isinstance(where, Mesh):
        return NamedSharding(where, PartitionSpec())
    if isinstance(where, NamedSharding):
        return NamedSharding(where.mesh, PartitionSpec())
    devices = list(where._device_assignment)
    if len(devices) == 1:
        return SingleDeviceSharding(devices[0])
    return NamedSharding(Mesh(np.array(devices), ("devices",)), PartitionSpec())


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
            v._value = jax.device_put(x, home)


def _variables_of(variables: Any) -> list[Any]:
    from paramstore.module import Module
    from paramstore.variable import Variable

    if isinstance(variables, Variable):
        return [variables]
    if isinstance(variables, Module):
        return list(variables.variables)
    if isinstance(variables, Mapping):
        return list(variables.values())
    return list(variables)


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
    from paramstore import _trace

    if _trace.depth and _trace.active():
        raise RuntimeError(
            "reshard moves variables between devices; call it outside ps.function, ps.pure "
            "and the gradient functions."
        )
    targets = plan(_variables_of(variables), sharding)
    moved = [(v, jax.device_put(v._value, sh)) for v, sh in targets]
    for v, value in moved:
        with v._lock:
            v._value = value


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
