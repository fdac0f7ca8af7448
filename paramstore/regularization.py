"""``ps.regularization_loss``: the sum of the weight penalties of a collection.

Contract (docs/api.md, "Weight averaging, constraints and regularizers"):

* ``regularization_loss(module_or_variables=None)`` -> a float32 scalar (or the widest
  penalty dtype): the sum, over the variables given (any collection ``ps.state`` takes; None:
  every live variable of the default store, as TF1's ``tf.losses.get_regularization_loss()``),
  of ``v.regularizer(v)`` for each variable that has a regularizer and is trainable now
  (frozen ones do not count, as in Keras 3's ``layer.losses``). Each variable counts once.
* It reads the variables like any other code, so it is differentiable and works inside
  ``ps.grad``, ``ps.function`` and ``lax`` bodies. No regularized variable: ``0.0``.
* A penalty that is not a scalar is a ``ValueError`` naming the variable (the
  regularizers a variable is created with are checked then; this catches the rest).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paramstore._collect import variables_of
from paramstore._core.store import default_store
from paramstore.typing import VariablesLike

__all__ = ["regularization_loss"]


def regularization_loss(module_or_variables: VariablesLike | None = None) -> jax.Array:
    """The sum of the penalties of the regularized, trainable variables given (None: of
    the default store). See the module docstring."""
    found = variables_of(default_store() if module_or_variables is None else module_or_variables)
    terms = []
    for v in found:
        if v.regularizer is None or not v.trainable:
            continue
        penalty = jnp.asarray(v.regularizer(v.value()))
        if penalty.shape != ():
            raise ValueError(
                f"The regularizer of variable '{v.name}' ({v.regularizer!r:.60}) returned shape "
                f"{tuple(penalty.shape)}, not a scalar penalty. Reduce it (e.g. jnp.sum)."
            )
        terms.append(penalty)
    if not terms:
        return jnp.zeros((), jnp.float32)
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total
