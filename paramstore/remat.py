"""``ps.remat``: rematerialization (``jax.checkpoint``) for code that uses Variables.

Contract (docs/api.md, "Layers"):

* ``ps.remat(fn, policy=None)`` returns ``fn`` wrapped so that, under a gradient
  (``ps.grad``, ``jax.grad`` of a ``ps.pure`` function), the activations computed inside
  it are not kept for the backward pass but recomputed from its inputs, as
  ``jax.checkpoint`` does. ``policy`` is a ``jax.checkpoint_policies`` policy (which
  intermediates to save anyway), or None (save nothing but the inputs).
* ``fn`` may read and assign Variables as eager code does (the binding frames make reads
  and writes inside a ``jax.checkpoint`` body ref effects). Arguments that are not arrays
  (a Module ``self``, Python flags, Variables) are passed through unchanged, so
  ``@ps.remat`` decorates a layer's or Module's method too; array arguments are the
  checkpointed function's inputs.
* Outside any gradient it is a plain call: same results, no cost.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast, overload

import jax
import numpy as np

from paramstore._core import frames
from paramstore.variable import Variable, VariableSlice

__all__ = ["remat", "checkpoint_policy"]

F = TypeVar("F", bound=Callable[..., Any])
Policy = Callable[..., Any]


def checkpoint_policy(remat: bool | Policy | None, who: str) -> Policy | None:
    """The ``jax.checkpoint`` policy that ``remat`` (None/False/True or a policy) means."""
    if remat is None or isinstance(remat, bool):
        return None
    if not callable(remat):
        raise TypeError(
            f"{who}: remat must be True, False/None, or a jax.checkpoint_policies policy "
            f"(e.g. jax.checkpoint_policies.dots_saveable), got {type(remat).__name__}."
        )
    return remat


def _is_variable(x: Any) -> bool:
    return isinstance(x, (Variable, VariableSlice))


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


@overload
def remat(fn: F, policy: Policy | None = None) -> F: ...
@overload
def remat(fn: None = None, policy: Policy | None = None) -> Callable[[F], F]: ...
def remat(fn: F | None = None, policy: Policy | None = None) -> F | Callable[[F], F]:
    """``fn`` rematerialized in the backward pass (see the module docstring). Use as
    ``ps.remat(fn)``, ``@ps.remat`` or ``@ps.remat(policy=...)``."""
    if fn is None:
        return lambda f: remat(f, policy=policy)
    if not callable(fn):
        raise TypeError(f"ps.remat expects a function, got {type(fn).__name__}.")
    checkpoint_policy(policy, "ps.remat")

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_variable)
        where = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

        def call(arrays: Sequence[Any]) -> Any:
            full = list(leaves)
            for i, a in zip(where, arrays):
                full[i] = a
            a, kw = jax.tree_util.tree_unflatten(tree, full)
            return fn(*a, **kw)

        arrays = [leaves[i] for i in where]
        read, written = _variables_used(call, arrays)
        bound = [*read, *written]

        def inner(values: list[Any], arrays: list[Any]) -> tuple[Any, list[Any]]:
            frame = frames.Frame(owner, frames.PURE, list(zip(bound, values)))
            with frames.push(frame):
                out = call(arrays)
                out = jax.tree_util.tree_map(_value, out, is_leaf=_is_variable)
            return out, [frame.final(v) for v in written]

        owner = f"ps.remat({getattr(fn, '__name__', 'fn')})"
        values = [v.value() for v in bound]
        out, new = jax.checkpoint(inner, policy=policy)(values, arrays)
        for v, x in zip(written, new):
            v.assign(x, read_value=False)
        return out

    return cast(F, wrapped)


def _value(x: Any) -> Any:
    return x.value() if _is_variable(x) else x


def _variables_used(
    call: Callable[[Sequence[Any]], Any], arrays: list[Any]
) -> tuple[list[Variable], list[Variable]]:
    """The variables ``call(arrays)`` reads (only) and those it assigns, found by tracing it
    abstractly once on its own."""
    frame = frames.Frame("ps.remat (discovery)", frames.CAPTURE)

    def run(arrays: list[Any]) -> Any:
        with frames.push(frame):
            out = call(arrays)
            return jax.tree_util.tree_map(_value, out, is_leaf=_is_variable)

    specs = [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in arrays]
    with frames.no_frames():
        jax.eval_shape(run, specs)
    written = [v for v in frame.assigned.values() if not v._is_string]
    w_ids = {id(v) for v in written}
    read = [v for k, v in frame.vars.items() if k not in w_ids and not v._is_string]
    return read, written
