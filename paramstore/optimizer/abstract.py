"""An optimizer over abstract variables (``ps.abstract()``): abstract state too.

Contract (used by ``ps.Optimizer``; docs/sharding.md, "Abstract models"):

* ``any_abstract(targets)``: whether an optimized variable is abstract; then the optimizer
  creates its state abstract (inside ``ps.abstract()``), nothing allocated.
* ``abstract_state(tx, targets)``: ``jax.eval_shape(tx.init, ...)`` on the parameters'
  shapes and dtypes: the state's structure, with ``jax.ShapeDtypeStruct`` leaves (no
  sharding: each slot gets its parameter's, as for a concrete optimizer).
* ``defer_init(tx, targets, state)``: gives each abstract state variable a joint
  initializer (``paramstore._variable.abstract.Joint``) running ``tx.init`` on the parameters'
  values once they are concrete, so ``ps.initialize(opt)`` after the model is restored or
  initialized (or ``ps.initialize([model, opt])`` in one call) gives exactly the state a
  concrete optimizer built on those values has (Adam: zero moments, ``count`` 0; an
  optimizer whose state copies the parameters, such as ``optax.lookahead``, copies them).
  A checkpoint restore gives the state its saved values instead, and runs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from paramstore._variable import abstract as _abstract
from paramstore.optimizer.grads import Targets
from paramstore.variable import Variable

__all__ = ["any_abstract", "abstract_state", "defer_init"]


def any_abstract(targets: Targets) -> bool:
    """Whether one of the optimized variables is abstract."""
    return any(v.is_abstract for v, o in zip(targets.variables, targets.optimized) if o)


def _specs(targets: Targets) -> Any:
    return targets.tree(
        [
            jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) if o else None
            for v, o in zip(targets.variables, targets.optimized)
        ]
    )


def abstract_state(tx: optax.GradientTransformation, targets: Targets) -> Any:
    """The optax state's structure, its leaves ``jax.ShapeDtypeStruct`` (shape, dtype)."""
    state = jax.eval_shape(tx.init, _specs(targets))
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)


def defer_init(
    tx: optax.GradientTransformation,
    targets: Targets,
    state: Sequence[Variable],
    placed: bool = False,
) -> None:
    """Give the abstract ``state`` variables (aligned with the flattened optax state) one
    joint initializer: ``tx.init`` on the parameters' values, run once by ``ps.initialize``
    when the parameters are concrete. ``placed``: the state has placements of its own
    (``slot_sharding=``, ``slot_memory_kind=``), so the values are computed straight onto
    the state variables' shardings."""

    def init(params: Any) -> list[Any]:
        leaves = jax.tree_util.tree_leaves(tx.init(params))
        return [jnp.asarray(a, dtype=jnp.result_type(a)) for a in leaves]

    shardings = [v.sharding for v in state] if placed else None

    def compute() -> list[Any]:
        return list(jax.jit(init, out_shardings=shardings)(targets.params()))

    reads = [v for v, o in zip(targets.variables, targets.optimized) if o]
    for j, var in enumerate(state):
        if var.is_abstract:
            _abstract.remember(var, _abstract.Joint(compute, j, reads))
