"""The compiled entry of one traced ``ps.function`` signature: its runner (a ``jax.jit`` of
the lifted jaxpr), the variables it moves, and the per-call work of the steady path.

``Entry.__call__`` is what every ``ps.function`` call runs once its signature is known: the
check that it is not called inside a plain JAX transformation, the selection of the array
arguments, and ``ownership.call`` (gather the variables' arrays, dispatch, swap the new ones
in under the state lock). It is performance-critical (~5 us per call in all): no call
layers are added to it.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import jax

from paramstore._core.jax_api import EVAL, current_trace, staging
from paramstore._core.ownership import Program, ownership
from paramstore.variable import Variable

__all__ = ["Entry"]

_CLOCK = itertools.count()  # ticks for least-recently-used eviction of traces


class Entry:
    """One traced signature: the lifted jaxpr's runner and the variables it moves."""

    def __init__(
        self,
        owner: str,
        runner: Callable[..., Any],
        donated: list[Variable],
        readonly: list[Variable],
        assigned: list[Variable],
        out_tree: Any,
        ref_pos: list[int],
        refs: list[Any],
        n_leaves: int,
        donate: bool,
        wait: bool,
        shared: list[Variable],
        layout: tuple[Any, ...],
    ) -> None:
        self.owner = owner
        self.runner = runner
        self.donated = donated
        self.readonly = readonly
        self.assigned = assigned
        # What ownership runs: the runner and the variables it moves (``shared``: whose
        # array an output is, or may be, after each call; recorded as handed out).
        self.program = Program(
            runner, donated, readonly, assigned, shared, donate, wait, self._flags_hold, layout
        )
        self.touches = bool(donated or readonly or assigned)
        self.out_tree = out_tree
        self.one_out = out_tree is not None and out_tree.num_nodes == out_tree.num_leaves == 1
        self.ref_pos = ref_pos
        self.refs = [weakref.ref(r) for r in refs]
        self.array_pos = [i for i in range(n_leaves) if i not in set(ref_pos)]
        self.tick = next(_CLOCK)  # when last called, for least-recently-used eviction
        # The trainable flags the trace saw (freezing between calls must take effect) and
        # the shardings its program writes back on (Program.current): checked again only
        # when some flag or sharding somewhere has changed since (TRACE_EPOCH).
        self.moved = list({id(v): v for v in (*donated, *readonly, *assigned)}.values())
        self.flags: list[bool] | None = [v.trainable for v in self.moved]
        self.epoch = self.program.epoch

    def _flags_hold(self) -> bool:
        """Whether the variables' trainable flags are those the trace saw."""
        return self.flags is not None and [v.trainable for v in self.moved] == self.flags

    def still_holds(self) -> bool:
        """Whether the variables' trainable flags and shardings are those the trace saw
        (then the entry is current again; else it must be traced anew)."""
        if not self.program.current():
            return False
        self.epoch = self.program.epoch
        return True

    def __call__(self, leaves: list[Any]) -> Any:
        self.tick = next(_CLOCK)  # ~40 ns
        trace = current_trace()
        if trace is not EVAL and self.touches and (self.assigned or staging(trace)):
            self._transformed()
        if self.ref_pos:  # Variables/Modules passed as arguments are read, not passed
            leaves = [leaves[i] for i in self.array_pos]
        out = ownership.call(self.program, leaves)
        return out[0] if self.one_out else jax.tree_util.tree_unflatten(self.out_tree, out)

    def _transformed(self) -> None:
        names = ", ".join(v.name for v in (self.assigned or [*self.donated, *self.readonly]))
        what = "assigns" if self.assigned else "reads"
        raise TypeError(
            f"{self.owner}, which {what} variables ({names:.200}), was called inside a plain "
            "JAX transformation (jax.jit, jax.vmap, jax.grad, lax control flow ...), where "
            "new values would be leaked tracers and read values would be baked in. Call it "
            "outside, make the outer function a ps.function too, or use ps.pure."
        )

    def alive(self, leaves: list[Any]) -> bool:
        """Whether the Variables/Modules this entry was traced with are still these."""
        return all(r() is leaves[i] for r, i in zip(self.refs, self.ref_pos))
