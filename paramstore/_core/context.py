"""The one thread-local context: every per-thread stack paramstore keeps lives here.

* ``frames``: active binding frames (``ps.function`` traces, ``ps.pure``, gradients).
* ``scopes``: ``name_scope`` / ``variable_scope`` / module scopes, innermost last.
* ``stores``: ``with ps.VariableStore():`` blocks, innermost last.
* ``placements``: ``with ps.device(...):`` blocks, innermost last.
* ``names``: variables whose initializer is running, for name-derived PRNG keys.
* ``recorders``: ``_seed.recording()`` blocks (the initializers of the variables created
  inside), innermost last.
* ``axis_rules``: ``axis_rules(mesh, rules)`` blocks (``_core.layout``), innermost last.
* ``abstract``: how many ``with ps.abstract():`` blocks are open (``_variable.abstract``).
* ``training``: the ``training=`` value an enclosing call passes down (``_core.training``),
  None outside any.
* ``journals``: open ``_core.store.journal()`` blocks (names taken by a construction or a
  build, given back if it fails), innermost last.

Each thread starts with empty stacks (as TensorFlow's graph and device stacks do).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any

__all__ = ["ctx", "Scope", "prefixed", "STATE_LOCK", "TRACE_EPOCH"]


@dataclass(frozen=True)
class Scope:
    """One entered scope: its name, whether it is a variable scope, and the reuse mode in
    force inside it (already combined with the enclosing scopes)."""

    name: str
    is_variable_scope: bool
    reuse: Any


class _Context(threading.local):
    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.scopes: list[Scope] = []
        self.stores: list[Any] = []
        self.placements: list[Any] = []
        self.names: list[list[Any]] = []
        self.recorders: list[dict[str, Any]] = []
        self.axis_rules: list[Any] = []
        self.abstract = 0
        self.training: bool | None = None
        self.journals: list[list[Any]] = []


ctx = _Context()


def prefixed(name: str, *, variable_scopes_only: bool = False) -> str:
    """``name`` under the current scopes (all of them, or only the variable scopes)."""
    parts = [
        s.name for s in ctx.scopes if s.name and (s.is_variable_scope or not variable_scopes_only)
    ]
    return "/".join([*parts, name]) if parts else name


# The state lock: every write of a variable's array, and each ps.function call (gather,
# dispatch, swap), holds it, so each is atomic with respect to the variables it touches.
# Re-entrant: a write path may call another.
STATE_LOCK = threading.RLock()


class _TraceEpoch:
    """How many times something a ``ps.function`` trace depends on besides its signature
    has changed, process-wide: a variable's ``trainable`` flag (``v.trainable = ...``,
    ``module.trainable = ...``: ``bump``), its placement (any write that moves a variable
    to a new sharding, ``_core.ownership``'s one write path: ``placed``), or a variable
    *retired* (``retire``: a module replaced it, as quantizing a layer replaces a float
    kernel by an int8 one, so a trace that read it is stale). A trace records the epoch
    and, when it has moved, checks the flags and shardings of the variables it captured:
    the trace is redone where one it saw changed (freezing between calls takes effect; a
    step compiled before a reshard or a restore onto a new sharding does not write its
    variables back on their old shardings). ``flags`` counts the flag changes alone: a trace
    during which one changed is redone (it may have seen either value). ``restructure()``
    also moves ``structure``: a change to what a module computes with the same variables
    (LoRA enabled or merged), after which every trace is redone on its next call."""

    __slots__ = ("epoch", "flags", "_count", "_retired", "structure")

    def __init__(self) -> None:
        self._count = itertools.count(1)
        self.epoch = 0
        self.flags = 0
        self._retired: dict[int, weakref.ref[Any]] = {}
        self.structure = 0

    def bump(self) -> None:
        """A trainable flag changed."""
        # next() on a count is atomic: threads bumping at once each get a new value
        epoch = next(self._count)
        self.flags = epoch
        self.epoch = epoch

    def placed(self) -> None:
        """A variable moved to a new sharding."""
        self.epoch = next(self._count)

    def retire(self, var: object) -> None:
        """Mark ``var`` replaced for good: every trace that captured it is traced anew."""
        key = id(var)
        self._retired[key] = weakref.ref(var, lambda _r: self._retired.pop(key, None))
        self.bump()

    def is_retired(self, var: object) -> bool:
        """Whether ``retire(var)`` was called."""
        ref = self._retired.get(id(var))
        return ref is not None and ref() is var

    def restructure(self) -> None:
        """A module now computes differently (LoRA enabled or merged): every trace is stale."""
        self.structure = next(self._count)
        self.bump()


TRACE_EPOCH = _TraceEpoch()
