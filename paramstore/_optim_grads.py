"""What an optimizer is built over, and the one path by which its gradients come in.

Contract (used by ``ps.Optimizer``):

* ``Targets.parse(variables)``: a list or tuple of Variables, a dict ``{key: Variable}``
  or a Module (its trainable variables now). ``tree(entries)`` builds the pytree optax
  sees: a list/tuple/dict like the input, and for a Module a dict keyed by the variables'
  full names (so optax masks and labels can be functions of the names), unless two of its
  variables share a name (variables from different stores), then a tuple.
* ``Targets.gradients(grads_and_vars)``: the gradients aligned with the variables
  (``None`` for those not optimized), every one checked (structure, keys, shape, numeric
  dtype, no complex gradient for a real variable) before the caller changes anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import DictKey, SequenceKey

from paramstore._collect import variables_of
from paramstore.module import Module
from paramstore.scope import preview_names
from paramstore.variable import Variable

__all__ = ["Targets"]

_KINDS = {"list": "a list", "tuple": "a tuple", "dict": "a dict", "module": "a Module"}


def optimizable(var: Variable) -> bool:
    """Trainable and floating point (or complex): what an optimizer updates."""
    try:
        return var.trainable and bool(jnp.issubdtype(var.dtype, jnp.inexact))
    except TypeError:  # strings
        return False


def _holds_many(x: Any) -> bool:
    """Whether ``x`` (an item of a list) is itself a collection of variables."""
    if isinstance(x, Variable):
        return False
    if isinstance(x, (Module, list, tuple, Mapping)):
        return True
    return isinstance(getattr(x, "state", None), Variable) or hasattr(x, "variables")


def _error(msg: str, exc: type[Exception] = ValueError) -> Exception:
    return exc(f"apply_gradients{msg}")


@dataclass(frozen=True)
class Targets:
    """The variables of an optimizer and how optax sees them (see the module docstring)."""

    kind: str  # "list", "tuple", "dict" or "module"
    keys: tuple[Any, ...]  # dict keys, or the variables' names for a Module
    variables: tuple[Variable, ...]
    optimized: tuple[bool, ...]

    @staticmethod
    def parse(variables: Any) -> Targets:
        if isinstance(variables, Module):
            found = list(variables.trainable_variables)
            if not found:
                raise ValueError(
                    f"ps.Optimizer: Module '{variables.scope_name}' has no trainable variables "
                    "yet. Create the optimizer after the model's variables exist (e.g. after "
                    "calling the model once)."
                )
            kind, keys = "module", [v.name for v in found]
        elif isinstance(variables, Mapping):
            kind, keys, found = "dict", list(variables), list(variables.values())
        elif isinstance(variables, (list, tuple)) and not any(map(_holds_many, variables)):
            kind = "list" if isinstance(variables, list) else "tuple"
            keys, found = [], list(variables)
        elif isinstance(variables, Variable):
            raise TypeError(
                "ps.Optimizer expects its variables as a collection (gradients come back in "
                "its structure): a list or tuple of Variables, a dict {key: Variable}, a "
                "Module, or any collection ps.grad accepts; got one Variable (wrap it in a "
                "list: [v])."
            )
        else:  # nested lists, Modules and Optimizers in a list, a store, a Generator...:
            try:  # the shared parser's order, as a list
                found = variables_of(variables)
            except TypeError as e:
                raise TypeError(f"ps.Optimizer: {e}") from None
            kind, keys = "list", []
        for k, v in zip(keys if kind == "dict" else range(len(found)), found):
            if not isinstance(v, Variable):
                where = f"key {k!r}" if kind == "dict" else f"position {k}"
                raise TypeError(
                    f"ps.Optimizer: the item at {where} is a {type(v).__name__}, not a ps.Variable."
                )
        if not found:
            raise ValueError("ps.Optimizer needs at least one variable to optimize.")
        seen: set[Any] = set()
        for v in found:
            if v.ref() in seen:
                raise ValueError(f"ps.Optimizer: variable '{v.name}' is given twice.")
            seen.add(v.ref())
        if kind == "module" and len(set(keys)) != len(keys):
            keys = []  # names collide (several stores): optax sees a tuple
        optimized = tuple(optimizable(v) for v in found)
        if not any(optimized):
            raise ValueError(
                "ps.Optimizer: none of the given variables is a trainable floating-point "
                f"variable ({', '.join(v.name for v in found)}), so there is nothing to "
                "optimize."
            )
        return Targets(kind, tuple(keys), tuple(found), optimized)

    # ------------------------------------------------------------ the optax pytree

    def tree(self, entries: list[Any]) -> Any:
        """A pytree in the structure optax sees, from entries aligned with the variables."""
        if self.keys:
            return dict(zip(self.keys, entries))
        return list(entries) if self.kind == "list" else tuple(entries)

    def entries(self, tree: Any) -> list[Any]:
        return [tree[k] for k in self.keys] if self.keys else list(tree)

    def param_keys(self) -> dict[Any, Variable]:
        """The key of each optimized variable in optax's pytree -> the variable."""
        return {
            (DictKey(self.keys[i]) if self.keys else SequenceKey(i)): v
            for i, v in enumerate(self.variables)
            if self.optimized[i]
        }

    def params(self) -> Any:
        return self.tree([v.value() if o else None for v, o in zip(self.variables, self.optimized)])

    # ------------------------------------------------------------ gradient intake

    def gradients(self, g: Any) -> list[Any]:
        """The checked gradients aligned with the variables (see the module docstring)."""
        n, kind = len(self.variables), self.kind
        what = f"{_KINDS[kind]} of {n} variables"
        if isinstance(g, (Variable, jax.Array, np.ndarray)) or np.isscalar(g) or g is None:
            raise _error(
                f" expects gradients in the structure of the optimizer's variables ({what}) "
                f"or zip(grads, vars), got a {type(g).__name__}.",
                TypeError,
            )
        if isinstance(g, Mapping):
            if not self.keys:
                raise _error(
                    f" got a dict of gradients, but this optimizer was built over {what}: "
                    "pass the gradients as a list or tuple in the same order.",
                    TypeError,
                )
            missing = [k for k in self.keys if k not in g]
            unexpected = [k for k in g if k not in set(self.keys)]
            if missing or unexpected:
                raise _error(
                    ": the gradients' keys do not match the variables': "
                    f"missing {missing}, unexpected {unexpected}."
                )
            return [self._check(i, g[k]) for i, k in enumerate(self.keys)]
        if not isinstance(g, (list, tuple)):
            if not isinstance(g, Iterable):
                raise _error(
                    f" expects gradients ({what}) or zip(grads, vars), got a {type(g).__name__}.",
                    TypeError,
                )
            g = list(g)
            if not g:
                return self._from_pairs(g)
        if g and all(
            isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[1], Variable) for p in g
        ):
            return self._from_pairs(list(g))
        if kind == "dict":
            raise _error(
                f" got a {type(g).__name__} of gradients, but this optimizer was built over "
                f"{what}: pass a dict with the same keys.",
                TypeError,
            )
        if len(g) != n:
            hint = ""
            if kind == "module":
                hint = (
                    " (the optimizer took the Module's trainable variables when it was "
                    "built; create it after the model's variables exist)"
                )
            raise _error(f" got {len(g)} gradients for {what}{hint}.")
        return [self._check(i, x) for i, x in enumerate(g)]

    def _from_pairs(self, pairs: list[Any]) -> list[Any]:
        """The gradients of ``zip(grads, vars)`` aligned with the variables."""
        index = {v.ref(): i for i, v in enumerate(self.variables)}
        found: dict[int, Any] = {}
        for pair in pairs:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise _error(
                    " with zip(grads, vars) expects (gradient, Variable) pairs, got a "
                    f"{type(pair).__name__}.",
                    TypeError,
                )
            grad, var = pair
            if not isinstance(var, Variable):
                raise _error(
                    " with zip(grads, vars) expects (gradient, Variable) pairs; the second "
                    f"item is a {type(var).__name__}.",
                    TypeError,
                )
            i = index.get(var.ref())
            if i is None:
                names = preview_names([v.name for v in self.variables], limit=8)
                raise _error(
                    f" got a gradient for variable '{var.name}', which this optimizer does "
                    f"not update (it was built over {len(self.variables)} variables: {names})."
                )
            if i in found:
                raise _error(f" got two gradients for variable '{var.name}'.")
            found[i] = grad
        missing = [
            v.name for i, v in enumerate(self.variables) if self.optimized[i] and i not in found
        ]
        if missing:
            raise _error(
                f" with zip(grads, vars) has no gradient for {len(missing)} of the optimizer's "
                f"variables: {preview_names(missing, limit=8)}. Pass gradients for all of them "
                "(zeros to leave one as it is), or build an optimizer over the variables you "
                "train."
            )
        return [self._check(i, found.get(i)) for i in range(len(self.variables))]

    def _check(self, i: int, grad: Any) -> Any:
        var = self.variables[i]
        if not self.optimized[i]:
            return None
        if grad is None:
            raise _error(
                f": no gradient (None) for variable '{var.name}'. Pass zeros to leave it as "
                "it is, or build the optimizer over the variables you train."
            )
        if isinstance(grad, Variable):
            grad = grad.value()
        if not isinstance(grad, jax.Array):
            try:
                grad = jnp.asarray(grad)
            except TypeError:
                raise _error(
                    f": the gradient for variable '{var.name}' is a {type(grad).__name__}, "
                    "not an array.",
                    TypeError,
                ) from None
        if not jnp.issubdtype(grad.dtype, jnp.number):
            raise _error(
                f": the gradient for variable '{var.name}' has dtype {grad.dtype}, not a "
                "numeric dtype.",
                TypeError,
            )
        if jnp.issubdtype(grad.dtype, jnp.complexfloating) and not jnp.issubdtype(
            var.dtype, jnp.complexfloating
        ):
            raise _error(
                f": the gradient for variable '{var.name}' is complex ({grad.dtype}), but the "
                f"variable is real ({var.dtype}). Take the real part (jnp.real(g)) if that is "
                "what you mean, or make the variable complex.",
                TypeError,
            )
        if tuple(grad.shape) != var.shape:
            raise _error(
                f": the gradient for variable '{var.name}' has shape {tuple(grad.shape)}, "
                f"but the variable has shape {var.shape}."
            )
        return grad
