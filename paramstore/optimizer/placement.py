"""Where an optimizer's slots live: ``slot_sharding=`` and ``slot_memory_kind=``.

Contract (used by ``ps.Optimizer``; docs/api.md "Optimizer state placement", the guide in
docs/sharding.md "Optimizer memory"):

* ``plan(slot_sharding, memory_kind, owners, leaves, replicated) -> SlotPlacement``: for
  each optax state leaf (``owners[j]`` the parameter a per-parameter slot belongs to, None
  for shared state such as ``count``), the ``sharding=`` of its Variable (``homes``) and
  the sharding its update is computed with (``computes``, None: as it is). Everything is
  checked here, before the optimizer creates a single variable.

  - ``slot_sharding`` places the slots that have their parameter's shape: a
    ``ps.sharding.LayoutMap`` looked up with the *parameter's* full name (``"dense/kernel"``,
    so one entry places all its slots, mu and nu alike; an exact key wins, two matching
    regexes are an error, a name no key matches keeps the parameter's own sharding, a key
    mapped to ``None`` replicates), one ``Sharding`` for every such slot, or a callable
    ``(parameter) -> Sharding | None`` (None: the parameter's own sharding). The sharding
    must be over the parameter's devices (for two ``NamedSharding``\\ s, the parameter's
    mesh), fit the shape, and have no more dimensions than it: else ``ValueError`` naming
    the parameter.
  - ``memory_kind`` (``"pinned_host"``, ``"unpinned_host"``, ``"device"``) puts every
    per-parameter slot (of any shape) in that memory of its devices; without it, a
    ``slot_sharding`` that carries a memory kind is kept as it is. A kind JAX does not know
    (``"host"``), or one the slot's devices lack, is a ``ValueError`` naming the parameter.
    Shared state (step counters, injected hyperparameters) stays in device memory,
    replicated, as without these arguments.
* ``SlotPlacement.initial(leaves)``: the initial values, moved home at once (also inside a
  ``ps.function``'s first trace), and the ``sharding=`` their Variables still need.
* ``SlotPlacement.fetch(values)`` moves the state's values to where the update is computed
  (device memory, the slot's sharding); ``store(values)`` constrains the new values to that
  sharding and moves them home (host memory). Inside a trace these are ``jax.device_put``
  calls in the compiled program: a sharding constraint, or a copy between memories (the
  host slots are the program's arguments and results in host memory, copied to the device
  inside it). Eagerly the same calls are copies. A placement with nothing to do returns its
  inputs (``active`` is False).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from paramstore._core.layout import LayoutMap
from paramstore._core.placement import check_fits, describe, device_memory_kind, in_host_memory
from paramstore.optimizer.slots import state_sharding
from paramstore.typing import SlotSharding
from paramstore.variable import Variable

__all__ = ["SlotPlacement", "check", "plan", "memory_kinds", "KNOWN_KINDS"]

KNOWN_KINDS = ("device", "pinned_host", "unpinned_host")
"""The memory kinds JAX names (``Device.addressable_memories()``)."""


@dataclass(frozen=True)
class SlotPlacement:
    """Per optax state leaf: its Variable's ``sharding=`` (``homes``) and where its update
    is computed (``computes``; None: where it is)."""

    homes: tuple[Sharding | None, ...]
    computes: tuple[Sharding | None, ...]

    @property
    def active(self) -> bool:
        return any(c is not None for c in self.computes)

    def initial(self, leaves: Sequence[Any]) -> tuple[list[Any], list[Sharding | None]]:
        """The state leaves and the ``sharding=`` of their new Variables. With a placement,
        each concrete leaf is moved home here, evaluated now even inside a ``ps.function``
        trace (where a ``device_put`` at creation would be traced), and its Variable then
        needs no ``sharding=``; abstract leaves keep theirs."""
        if not self.active:
            return list(leaves), list(self.homes)
        out: list[Any] = []
        shardings: list[Sharding | None] = []
        with jax.ensure_compile_time_eval():
            for leaf, home in zip(leaves, self.homes):
                concrete = isinstance(leaf, jax.Array)
                if concrete and home is not None and leaf.sharding != home:
                    leaf = jax.device_put(leaf, home)
                out.append(leaf)
                shardings.append(None if concrete else home)
        return out, shardings

    def fetch(self, values: Sequence[Any]) -> list[Any]:
        """The state's values where the update is computed (device memory)."""
        if not self.active:
            return list(values)
        return [
            x if c is None or not _moves(h, c) else jax.device_put(x, c)
            for x, h, c in zip(values, self.homes, self.computes)
        ]

    def store(self, values: Sequence[Any]) -> list[Any]:
        """The new values constrained to the update's sharding, then moved home."""
        if not self.active:
            return list(values)
        out = []
        for x, h, c in zip(values, self.homes, self.computes):
            if c is not None:
                x = jax.device_put(x, c)  # traced: a constraint, also on Explicit mesh axes
                if h is not None and _moves(h, c):
                    x = jax.device_put(x, h)
            out.append(x)
        return out


def _moves(home: Sharding | None, compute: Sharding) -> bool:
    return home is not None and home.memory_kind != compute.memory_kind


def plan(
    slot_sharding: SlotSharding | None,
    memory_kind: str | None,
    owners: Sequence[Variable | None],
    leaves: Sequence[Any],
    replicated: Sharding | None,
) -> SlotPlacement:
    """Each state leaf's home and compute shardings (see the module docstring); raises
    ``TypeError``/``ValueError`` naming the parameter before anything is created."""
    _check_arguments(slot_sharding, memory_kind)
    defaults = [state_sharding(o, leaf, replicated) for o, leaf in zip(owners, leaves)]
    if slot_sharding is None and memory_kind is None:
        return SlotPlacement(tuple(defaults), (None,) * len(leaves))
    homes: list[Sharding | None] = []
    computes: list[Sharding | None] = []
    targets: dict[int, Sharding | None] = {}  # one lookup per parameter, shared by its slots
    for owner, leaf, default in zip(owners, leaves, defaults):
        if owner is None:
            homes.append(default)
            computes.append(None)
            continue
        same_shape = tuple(owner.shape) == tuple(leaf.shape)
        if id(owner) not in targets:
            targets[id(owner)] = _target(slot_sharding, owner)
        target = targets[id(owner)] if same_shape else None
        where = target or default or getattr(leaf, "sharding", None) or _param_sharding(owner)
        kind = memory_kind if memory_kind is not None else where.memory_kind
        if kind is not None:
            _check_kind(kind, where, owner)
            home = where.with_memory_kind(kind)
        else:
            home = where
        compute = home.with_memory_kind(device_memory_kind(home)) if in_host_memory(home) else home
        explicit = target is not None or kind is not None
        homes.append(home if explicit else default)
        computes.append(compute if explicit else None)
    return SlotPlacement(tuple(homes), tuple(computes))


def check(
    slot_sharding: SlotSharding | None, memory_kind: str | None, params: Sequence[Variable]
) -> None:
    """The checks of ``plan`` for each parameter's slots, before the optimizer reserves its
    name or creates anything (``ps.Optimizer.__new__``)."""
    _check_arguments(slot_sharding, memory_kind)
    for param in params:
        where = _target(slot_sharding, param) or _param_sharding(param)
        kind = memory_kind if memory_kind is not None else where.memory_kind
        if kind is not None:
            _check_kind(kind, where, param)


def _check_arguments(slot_sharding: Any, memory_kind: Any) -> None:
    if slot_sharding is not None and not (
        isinstance(slot_sharding, (LayoutMap, Sharding)) or callable(slot_sharding)
    ):
        raise TypeError(
            "ps.Optimizer: slot_sharding must be a ps.sharding.LayoutMap, a "
            "jax.sharding.Sharding or a callable (variable) -> Sharding | None, got "
            f"{type(slot_sharding).__name__}."
        )
    if memory_kind is not None and not isinstance(memory_kind, str):
        raise TypeError(
            "ps.Optimizer: slot_memory_kind must be a str such as 'pinned_host' (or None), "
            f"got {type(memory_kind).__name__}."
        )


def _param_sharding(owner: Variable) -> Sharding:
    """The parameter's sharding; one with no placement at all (abstract, created with
    none): JAX's default device."""
    return owner.sharding or SingleDeviceSharding(jax.devices()[0])


def _target(slot_sharding: SlotSharding | None, owner: Variable) -> Sharding | None:
    """``slot_sharding``'s sharding for the slots of ``owner`` (None: the default), checked."""
    what = f"variable '{owner.name}'"
    if slot_sharding is None:
        return None
    if isinstance(slot_sharding, LayoutMap):
        if slot_sharding.lookup(owner.name) is None:
            return None
        try:
            target = slot_sharding.sharding_for(owner.name, tuple(owner.shape))
        except ValueError as e:
            raise ValueError(f"ps.Optimizer(slot_sharding=LayoutMap): {e}") from None
    elif isinstance(slot_sharding, Sharding):
        target = slot_sharding
    else:
        target = slot_sharding(owner)
        if target is None:
            return None
        if not isinstance(target, Sharding):
            hint = (
                " A PartitionSpec needs its mesh: return NamedSharding(mesh, spec)."
                if isinstance(target, PartitionSpec)
                else ""
            )
            raise TypeError(
                f"ps.Optimizer: slot_sharding returned {target!r} for {what}; it must return a "
                f"jax.sharding.Sharding, or None for the variable's own.{hint}"
            )
    assert target is not None
    _check_target(target, owner)
    return target


def _check_target(target: Sharding, owner: Variable) -> None:
    what = f"variable '{owner.name}'"
    shape = tuple(owner.shape)
    if isinstance(target, NamedSharding) and len(target.spec) > len(shape):
        raise ValueError(
            f"ps.Optimizer: slot_sharding gives the slots of {what} (shape {shape}, rank "
            f"{len(shape)}) the spec {target.spec}, of rank {len(target.spec)}. Give at most "
            "one entry per dimension of the variable (None: not split)."
        )
    own = _param_sharding(owner)
    same_mesh = not (isinstance(target, NamedSharding) and isinstance(own, NamedSharding)) or (
        target.mesh == own.mesh
    )
    if target.device_set != own.device_set or not same_mesh:
        raise ValueError(
            f"ps.Optimizer: slot_sharding places the slots of {what} on {describe(target)}, "
            f"but the variable is on {describe(own)}. A slot is updated with its variable "
            "in one program: use a sharding over the variable's own mesh (devices), e.g. "
            "NamedSharding(variable.sharding.mesh, spec)."
        )
    try:
        check_fits(target, shape, f"the slots of {what}")
    except ValueError as e:
        raise ValueError(f"ps.Optimizer(slot_sharding=...): {e}") from None


def _check_kind(kind: str, where: Sharding, owner: Variable) -> None:
    """``kind`` must be a memory kind of every device of ``where``."""
    have = set.intersection(*(set(memory_kinds(d)) for d in where.device_set))
    if kind in have:
        return
    what = f"the slots of variable '{owner.name}'"
    if kind not in KNOWN_KINDS:
        raise ValueError(
            f"ps.Optimizer: slot_memory_kind {kind!r} (for {what}) is not a memory kind. JAX's "
            f"memory kinds are {', '.join(map(repr, KNOWN_KINDS))}; to keep optimizer state "
            "in host memory use 'pinned_host'."
        )
    first: Any = next(iter(where.device_set))  # (jax's stubs lack .platform)
    platform = first.platform
    raise ValueError(
        f"ps.Optimizer: slot_memory_kind {kind!r} (for {what}) is not a memory of the "
        f"variable's {platform} devices, which have {', '.join(map(repr, sorted(have)))}. "
        "Use one of these, or leave slot_memory_kind=None (device memory)."
    )


def memory_kinds(device: jax.Device) -> list[str]:
    """The memory kinds ``device`` has (``Device.addressable_memories()``)."""
    return [str(m.kind) for m in device.addressable_memories()]
