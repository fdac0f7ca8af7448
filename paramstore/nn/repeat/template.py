"""The template block of a ``ps.nn.Repeat`` and how its variables are learned.

``make_block()`` is called once; the block it returns is the *template*: its variables live
in a private store (never trained or saved) and are found by running it twice on the first
input's shapes (the first run builds lazy layers, the second must create nothing). ``learn``
does that and checks the block fits a ``lax.scan`` (it creates variables, creates them once,
and keeps its input's shape and dtype); it raises, creating nothing real, otherwise.

* Concretely (no ``ps.abstract()`` involved), the block runs eagerly on zeros, as any first
  call does; the template keeps one block's worth of arrays.
* Abstractly (built inside ``with ps.abstract():``, or made there), the block is only
  traced, by ``jax.eval_shape`` inside ``ps.abstract()``: every template variable is
  abstract, read through a ``shapes`` frame that binds it to zeros staged in that trace
  (``paramstore._core.frames.bound``), so no block is ever computed or allocated, whatever its
  size; each variable's initializer is known from its creation (recorded, or the one
  ``ps.abstract()`` keeps: ``sources``). A variable the block's first call creates from a
  value computed in that call (not an initializer) cannot be known without running the
  block: ``ValueError`` naming it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paramstore._core import frames
from paramstore._core import seed as _seed
from paramstore._core.jax_api import EVAL, Tracer, current_trace, in_trace, trace_of
from paramstore._core.store import VariableStore
from paramstore._variable import abstract as _abstract
from paramstore.module import Module
from paramstore.nn.repeat.layout import generators
from paramstore.variable import Variable

__all__ = ["Template", "describe", "learn", "sources", "takes_training"]


def takes_training(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` accepts a ``training=`` keyword."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "training" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _probe(x: Any) -> Any:
    """A concrete stand-in (zeros) for an array argument, so the template runs eagerly."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
        return np.zeros(np.shape(x), x.dtype)
    return x


def describe(block: Any) -> str:
    """How error messages name a block."""
    if isinstance(block, Module):
        return f"{type(block).__name__} '{block.scope_name}'"
    return f"{type(block).__name__} {block!r:.60}"


class Template:
    """The block ``make_block()`` returned and its per-block variables (kept out of every
    store the user sees, and out of Module/Checkpoint traversal: not a Module)."""

    def __init__(self, block: Any, store: VariableStore, inits: dict[str, Any]) -> None:
        self.block = block
        self.store = store
        self.inits = inits
        self.tvars: list[Variable] = []  # aligned with Repeat._order
        self.takes_training = takes_training(block)
        self.compiled: Any = None  # the eager path's ps.function
        self.others: dict[Any, tuple[list[Variable], list[Variable]]] = {}  # Repeat._others


def _shaped(
    t: Template, me: str, x: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Any, set[int], jax.ShapeDtypeStruct]:
    """Trace the template twice on the inputs' shapes (``jax.eval_shape``, inside
    ``ps.abstract()``, its abstract variables bound to staged zeros); nothing is computed.
    Returns both outputs' ``ShapeDtypeStruct``, the ids of the variables before the second
    call, and the probe's."""
    leaves, tree = jax.tree_util.tree_flatten((x, args, kwargs))
    kinds = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
    where = [i for i, a in enumerate(leaves) if isinstance(a, kinds)]
    specs = [jax.ShapeDtypeStruct(np.shape(leaves[i]), leaves[i].dtype) for i in where]
    before: set[int] = set()

    def run(*arrays: Any) -> tuple[Any, Any]:
        full = list(leaves)
        for i, a in zip(where, arrays):
            full[i] = a
        h, a_args, a_kwargs = jax.tree_util.tree_unflatten(tree, full)
        if t.takes_training:
            a_kwargs = {**a_kwargs, "training": False}
        frame = frames.Frame(f"{me} (abstract build)", frames.CAPTURE, shapes=True)
        with frames.push(frame):
            y = t.block(h, *a_args, **a_kwargs)
            before.update(map(id, t.store.variables()))
            y2 = t.block(h, *a_args, **a_kwargs)
        return (
            y.value() if isinstance(y, Variable) else y,
            y2.value() if isinstance(y2, Variable) else y2,
        )

    with frames.no_frames(), _abstract.abstract():
        y, y2 = jax.eval_shape(run, *specs)
    return y, y2, before, specs[0]


def learn(
    t: Template, me: str, x: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[Variable]:
    """Run the template (twice) on inputs shaped like these: eagerly on zeros, or only
    traced when abstract (see the module docstring); return its variables. Raises (``me``
    names the Repeat), creating nothing real, if the block is unfit for a scan."""
    what = describe(t.block)
    traced = _abstract.creating() or any(v.is_abstract for v in t.store.variables())
    with t.store, _seed.recording() as inits:
        if traced:
            y, y2, before, probe = _shaped(t, me, x, args, kwargs)
            after = t.store.variables()
        else:
            probe, p_args, p_kwargs = jax.tree_util.tree_map(_probe, (x, args, kwargs))
            if t.takes_training:
                p_kwargs = {**p_kwargs, "training": False}
            with frames.no_frames(), in_trace(EVAL):
                # the probe runs draw nothing: each layer's stream starts from the state the
                # block's generators were made with, as in an abstract build
                streams = [(g.state, g.state.value()) for g in generators(t.block)]
                y = t.block(probe, *p_args, **p_kwargs)
                before = set(map(id, t.store.variables()))
                y2 = t.block(probe, *p_args, **p_kwargs)
                after = t.store.variables()
                for state, value in streams:
                    state.assign(value, read_value=False)
    t.inits.update(inits)
    found = t.store.variables()
    if not found:
        raise ValueError(
            f"{me}: the block {what} created no variables on its first call, so there "
            "is nothing to stack. A block without variables needs no Repeat: call it "
            "in a Python loop; otherwise make its variables in __init__ or on its first "
            "call."
        )
    new = [v.name for v in after if id(v) not in before]
    if new:
        raise ValueError(
            f"{me}: the block {what} created different variables on its second call "
            f"({new}) than on its first. A repeated block must create its variables once "
            "(in __init__ or on its first call, e.g. `if self.w is None: ...`)."
        )
    for out in (y, y2):
        out = out.value() if isinstance(out, Variable) else out
        if np.shape(out) != np.shape(probe) or jnp.result_type(out) != probe.dtype:
            raise ValueError(
                f"{me}: the block {what} maps an input of shape {np.shape(probe)} and "
                f"dtype {probe.dtype} to an output of shape {np.shape(out)} and dtype "
                f"{jnp.result_type(out)}, but the blocks are chained through a lax.scan "
                "whose carry keeps its shape and dtype. Make the block return an array "
                "like its input (project outside the Repeat, or use a residual block)."
            )
    return found


def _stale(make: Callable[[], Any]) -> bool:
    """Whether ``make`` returns (or fails on) a tracer of a trace that has ended: the value
    of a variable created from a value computed inside the abstract build's trace."""
    found: list[bool] = []

    def probe() -> Any:
        out = make()
        found.append(isinstance(out, Tracer) and trace_of(out) is not current_trace())
        return out

    with _seed.recording():  # its creation was recorded already: record it in no outer build
        return _abstract.trace_shape(probe)[1] is not None or any(found)


def sources(t: Template, me: str, found: list[Variable]) -> dict[int, Any]:
    """``{id(v): what a stacked copy of v starts from}`` where it has no recorded
    initializer (or is a generator's state): its concrete value, or for an abstract one the initializer
    ``ps.abstract()`` kept (a zero-argument callable; None when it was made from a shape
    only, so it can only be restored). Raises ``ValueError`` naming a variable whose value
    was computed inside the abstract trace (see the module docstring)."""
    out: dict[int, Any] = {}
    for v in found:
        if not v.is_abstract:
            with frames.no_frames(), in_trace(EVAL):
                out[id(v)] = v.value()
            continue
        _, make = _abstract.initializer_of(v)
        if make is not None and _stale(make):
            raise ValueError(
                f"{me}: the block {describe(t.block)} created variable '{v.name}' on its "
                "first call from a value computed in that call, which an abstract build "
                "(inside ps.abstract()) cannot know without running the block. Pass an "
                "initializer (ps.Variable(lambda: jnp.zeros(shape)) or shape=...), create "
                "it in the block's __init__, or build the Repeat outside ps.abstract()."
            )
        out[id(v)] = make
    return out
