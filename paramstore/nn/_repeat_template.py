"""The template block of a ``ps.nn.Repeat`` and how its variables are learned.

``make_block()`` is called once; the block it returns is the *template*: its variables live
in a private store (never trained or saved) and are found by running it eagerly, twice, on
zeros shaped like the first input (the first run builds lazy layers, the second must create
nothing). ``learn`` does that and checks the block fits a ``lax.scan`` (it creates
variables, creates them once, and keeps its input's shape and dtype); it raises, creating
nothing real, otherwise.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paramstore import _seed, _trace
from paramstore._jax import EVAL, in_trace
from paramstore._store import VariableStore
from paramstore.module import Module
from paramstore.variable import Variable

__all__ = ["Template", "describe", "learn", "takes_training"]


def takes_training(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` accepts a ``training=`` keyword."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "training" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _probe(x: Any) -> Any:
    """A concrete stand-in (zeros) for an array argument, so the template runs eagerly."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
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


def learn(
    t: Template, me: str, x: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[Variable]:
    """Run the template eagerly (twice) on zeros shaped like the inputs; return its
    variables. Raises (``me`` names the Repeat), creating nothing real, if the block is
    unfit for a scan."""
    what = describe(t.block)
    probe, p_args, p_kwargs = jax.tree_util.tree_map(_probe, (x, args, kwargs))
    if t.takes_training:
        p_kwargs = {**p_kwargs, "training": False}
    with t.store, _seed.recording() as inits, _trace.no_frames(), in_trace(EVAL):
        y = t.block(probe, *p_args, **p_kwargs)
        before = set(map(id, t.store.variables()))
        y2 = t.block(probe, *p_args, **p_kwargs)
        after = t.store.variables()
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
