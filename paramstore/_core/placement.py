"""Placement of new variables: device names, ``ps.device`` blocks, and sharding checks.

The part of ``paramstore.sharding`` that a Variable needs when it is created (so it sits
below ``variable``); ``paramstore.sharding`` re-exports it and adds what moves variables.

* ``with ps.device("cpu:0"):`` (also ``"gpu:1"``, ``"/device:GPU:1"``, ``"cpu"``, a
  ``jax.Device``, a ``Sharding`` or a ``Mesh``, which replicates) places the variables
  created inside. A name counts this process's *local* devices, as TensorFlow does; an
  unknown one raises ``ValueError`` listing the devices that exist.
* ``placement(device, sharding)`` is what a new variable asks for (explicit argument, then
  the innermost block); ``check_fits`` refuses a sharding that cannot hold a shape.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding
from jax.typing import ArrayLike

from paramstore._core.context import ctx
from paramstore._core.jax_api import device_assignment
from paramstore.typing import DeviceLike, PlacementLike

__all__ = [
    "Layouts",
    "device",
    "resolve_device",
    "placement",
    "current_placement",
    "unplaced",
    "check_fits",
    "place",
    "replicated",
    "describe",
    "device_memory_kind",
    "in_host_memory",
    "on_cpu",
    "private_copy",
]


# ------------------------------------------------------------------------------ devices


class Layouts:
    """Base of a name -> sharding map that ``ps.device`` accepts (``ps.sharding.LayoutMap``,
    defined above this module): a variable created inside gets ``sharding_for(name,
    shape)``, or ``replicated()`` when that is None."""

    def sharding_for(self, name: str, shape: tuple[int, ...]) -> Sharding | None:
        raise NotImplementedError

    def replicated(self) -> Sharding:
        raise NotImplementedError


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
def device(spec: PlacementLike) -> Iterator[jax.Device | Sharding | Layouts]:
    """Place the Variables created inside this block on ``spec``: a device (``"cpu:0"``,
    ``"gpu:1"``, a ``jax.Device``), a ``Sharding``, a ``Mesh`` (replicated over it), or a
    ``ps.sharding.LayoutMap`` (each variable as its name maps). Yields the ``jax.Device``
    (or the sharding, or the layout map)."""
    target: Sharding | Layouts
    given: jax.Device | Sharding | Layouts
    if isinstance(spec, Layouts):
        target = given = spec
    elif isinstance(spec, Mesh):
        target = given = NamedSharding(spec, PartitionSpec())
    elif isinstance(spec, Sharding):
        target = given = spec
    else:
        given = resolve_device(spec)
        target = SingleDeviceSharding(given)
    ctx.placements += (target,)  # no call, so no signal check, before the try
    try:
        yield given
    finally:
        ctx.placements.pop()


@contextlib.contextmanager
def unplaced() -> Iterator[None]:
    """Inside this block no enclosing ``ps.device`` applies: a variable created with no
    ``device=``/``sharding=`` of its own stays where its initial value is (used for
    optimizer state, which must sit exactly where its parameters are)."""
    ctx.placements += (None,)  # no call, so no signal check, before the try
    try:
        yield
    finally:
        ctx.placements.pop()


def current_placement() -> Sharding | Layouts | None:
    """The sharding (or layout map) set by the innermost ``ps.device`` block, if any."""
    stack = ctx.placements
    return stack[-1] if stack else None


def placement(
    device: DeviceLike | Sharding | None = None, sharding: Sharding | Mesh | None = None
) -> Sharding | Layouts | None:
    """The sharding a new variable asks for: explicit sharding, device, context (a
    ``Layouts`` map there is resolved by ``paramstore._core.layout.target``), or None."""
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
        d: Any = next(iter(devices))  # (jax.Device: its stubs lack platform and id)
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


_Value = TypeVar("_Value", bound=ArrayLike)


def place(value: _Value, sharding: Sharding | None, what: str) -> _Value | jax.Array:
    """``value`` put onto ``sharding`` after ``check_fits`` (None: as it is)."""
    if sharding is None:
        return value
    check_fits(sharding, tuple(np.shape(value)), what)
    placed: jax.Array = jax.device_put(value, sharding)
    return placed


# ---------------------------------------------------------------------------- placement


def replicated(where: Sharding | Mesh) -> Sharding:
    """A sharding that replicates a value over the devices of ``where``."""
    if isinstance(where, Mesh):
        return NamedSharding(where, PartitionSpec())
    if isinstance(where, NamedSharding):
        return NamedSharding(where.mesh, PartitionSpec())
    devices = device_assignment(where)
    if len(devices) == 1:
        return SingleDeviceSharding(devices[0])
    return NamedSharding(Mesh(np.array(devices), ("devices",)), PartitionSpec())


def device_memory_kind(sharding: Sharding) -> str:
    """The default memory kind of ``sharding``'s devices (``"device"`` on CPU, GPU, TPU)."""
    # The first device in the sharding's own order (a tuple): JAX hands out its cached
    # device_set itself, so code that popped from it (Array.devices().pop()) emptied it.
    first: Any = device_assignment(sharding)[0]  # (jax's stubs lack default_memory)
    return str(first.default_memory().kind)


def in_host_memory(sharding: Sharding) -> bool:
    """Whether ``sharding`` puts its array in a memory other than its devices' default
    (``"pinned_host"``: an optimizer's offloaded slots)."""
    kind = sharding.memory_kind
    return kind is not None and kind != device_memory_kind(sharding)


def on_cpu(sharding: Sharding | None) -> bool:
    """Whether an array of ``sharding`` (None: a host value, True) is (also) on a CPU device."""
    if sharding is None:
        return True
    return any(d.platform == "cpu" for d in sharding.device_set)  # type: ignore[attr-defined]


def private_copy(x: jax.Array) -> jax.Array:
    """A copy of array ``x`` in a new buffer, with exactly ``x``'s sharding and commitment
    (so a step fed with it sees the same input signature and does not compile again)."""
    copy: jax.Array = jax.device_put(x, x.sharding if x.committed else None, may_alias=False)
    return copy
