"""What an optimizer is built over, and the one path by which its gradients come in.

Contract (used by ``ps.Optimizer``):

* ``Targets.parse(variables)``: any collection ``ps.grad`` accepts, through the same
  parser (``paramstore._collect.parse(..., trainable=True)``: a Module gives its trainable
  variables now). A variable the collection reaches twice is a ValueError naming it (an
  optimizer updates each variable once; ``ps.grad`` gives it its gradient in each place).
  ``tree(entries)`` builds the pytree optax sees: a list/tuple/dict like the input, and
  for a Module or a nested collection (Modules in a list...) a dict keyed by the
  variables' full names (so optax masks and labels can be functions of the names), unless
  two of its variables share a name (variables from different stores), then a tuple.
* ``Targets.gradients(grads_and_vars)``: the gradients aligned with the variables
  (``None`` for those not optimized), every one checked (structure, keys, shape, numeric
  dtype, no complex gradient for a real variable) before the caller changes anything.
  For a nested collection they come in the structure ``ps.grad`` returns for it, flat in
  the parser's order, or (names unique) as a dict keyed by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import DictKey, SequenceKey

from paramstore._collect import Parsed, parse
from paramstore.module import Module
from paramstore.scope import preview_names
from paramstore.variable import Variable

__all__ = ["Targets"]

_KINDS = {
    "list": "a list",
    "tuple": "a tuple",
    "dict": "a dict",
    "module": "a Module",
    "nested": "a collection",
}


def optimizable(var: Variable) -> bool:
    """Trainable and floating point (or complex): what an optimizer updates."""
    try:
        return var.trainable and bool(jnp.issubdtype(var.dtype, jnp.inexact))
    except TypeError:  # strings
        return False


def _check_once(found: list[Variable]) -> None:
    """The one rule for duplicates: ps.grad gives a variable listed twice its full gradient
    in both places, but an optimizer updates each variable once per step, so a variable
    that its collection reaches twice (``[v, v]``, ``[dense, dense]``, ``[model,
    model.dense]``) is refused, naming it."""
    seen: set[int] = set()
    for v in found:
        if id(v) in seen:
            raise ValueError(
                f"ps.Optimizer: variable '{v.name}' is given twice (listed twice, directly or "
                "through Modules that hold it); a step updates each variable once. Pass each "
                "variable once, e.g. one Module that holds them all."
            )
        seen.add(id(v))


def _flat(g: Any, n: int) -> bool:
    """Whether ``g`` is one gradient per variable, not a nested structure."""
    return len(g) == n and not any(isinstance(x, (list, tuple, Mapping)) for x in g)


def _error(msg: str, exc: type[Exception] = ValueError) -> Exception:
    return exc(f"apply_gradients{msg}")


@dataclass(frozen=True)
class Targets:
    """The variables of an optimizer and how optax sees them (see the module docstring)."""

    kind: str  # "list", "tuple", "dict" or "module"
    keys: tuple[Any, ...]  # dict keys, or the variables' names for a Module
    variables: tuple[Variable, ...]
    optimized: tuple[bool, ...]
    parsed: Parsed  # the collection as ps.grad reads it (its gradients' structure)
    source: Any  # the collection itself: re-read when some of its variables are frozen

    @staticmethod
    def parse(variables: Any) -> Targets:
        if isinstance(variables, Variable):
            raise TypeError(
                "ps.Optimizer expects its variables as a collection (gradients come back in "
                "its structure): a list or tuple of Variables, a dict {key: Variable}, a "
                "Module, or any collection ps.grad accepts; got one Variable (wrap it in a "
                "list: [v])."
            )
        try:  # the one parser, as ps.grad reads the same collection
            parsed = parse(variables, trainable=True)
        except TypeError as e:
            raise TypeError(f"ps.Optimizer: {e}") from None
        found = list(parsed.variables)
        if isinstance(variables, Module):
            kind = "module"
            if not found:
                raise ValueError(
                    f"ps.Optimizer: Module '{variables.scope_name}' has no trainable variables "
                    "yet. Create the optimizer after the model's variables exist (e.g. after "
                    "calling the model once)."
                )
        elif isinstance(variables, Mapping):
            kind = "dict"
        elif type(variables) in (list, tuple) and all(isinstance(v, Variable) for v in variables):
            kind = type(variables).__name__
        else:  # Modules in a list, nested lists, a store, a Generator...
            kind = "nested"
        if not found:
            raise ValueError("ps.Optimizer needs at least one variable to optimize.")
        _check_once(found)
        keys = list(variables) if kind == "dict" else []
        if kind in ("module", "nested"):  # optax sees a dict keyed by name (masks by name)
            keys = [v.name for v in found]
            if len(set(keys)) != len(keys):
                keys = []  # names collide (several stores): optax sees a tuple
        optimized = tuple(optimizable(v) for v in found)
        if not any(optimized):
            raise ValueError(
                "ps.Optimizer: none of the given variables is a trainable floating-point "
                f"variable ({', '.join(v.name for v in found)}), so there is nothing to "
                "optimize."
            )
        return Targets(kind, tuple(keys), tuple(found), optimized, parsed, variables)

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

    def frozen(self) -> tuple[bool, ...]:
        """Per variable: optimized, but frozen now (``trainable`` False): left alone."""
        return tuple(o and not v.trainable for v, o in zip(self.variables, self.optimized))

    def params(self) -> Any:
        return self.tree([v.value() if o else None for v, o in zip(self.variables, self.optimized)])

    # ------------------------------------------------------------ gradient intake

    def gradients(self, g: Any) -> list[Any]:
        """The checked gradients aligned with the variables (see the module docstring);
        None for a frozen variable, whose gradient may be left out (``ps.grad`` over a
        Module gives none for it) and is ignored when given."""
        frozen = self.frozen()
        if any(frozen):
            return self._frozen_gradients(g, frozen)
        return self._gradients(g)

    def _frozen_gradients(self, g: Any, frozen: tuple[bool, ...]) -> list[Any]:
        """``gradients`` while some variables are frozen: the gradients may come in the
        structure the collection has now (its frozen variables left out), or in full."""
        n = len(self.variables)
        if isinstance(g, Mapping) and self.keys:
            full = {k: g.get(k) for k in self.keys}
            unexpected = [k for k in g if k not in full]
            if not unexpected:
                g = full
        elif not isinstance(g, (list, tuple)) and isinstance(g, Iterable):
            g = list(g)
        if (
            isinstance(g, (list, tuple))
            and g
            and all(
                isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[1], Variable)
                for p in g
            )
        ):
            index = {v.ref(): i for i, v in enumerate(self.variables)}
            given = {index.get(p[1].ref()) for p in g}
            g = [
                *g,
                *((None, v) for i, v in enumerate(self.variables) if frozen[i] and i not in given),
            ]
        elif (
            self.kind in ("module", "nested")
            and isinstance(g, (list, tuple))
            and not (len(g) == n and (self.kind == "module" or _flat(g, n)))
        ):
            now = parse(self.source, trainable=True)
            try:
                flat = list(g) if _flat(g, len(now.variables)) else now.flatten(g)
            except ValueError as e:
                raise _error(
                    f" expects gradients in the structure ps.grad returns for the optimizer's "
                    f"collection (its frozen variables left out), or in full: {e}"
                ) from None
            if len(flat) != len(now.variables):
                raise _error(
                    f" got {len(flat)} gradients for the {len(now.variables)} trainable "
                    f"variables of the optimizer's collection (or {n} in full)."
                )
            by_id = {id(v): x for v, x in zip(now.variables, flat)}
            g = [by_id.get(id(v)) for v in self.variables]
        grads = self._gradients(g, frozen)
        return [None if f else x for x, f in zip(grads, frozen)]

    def _gradients(self, g: Any, frozen: tuple[bool, ...] = ()) -> list[Any]:
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
            return [self._check(i, g[k], frozen) for i, k in enumerate(self.keys)]
        if not isinstance(g, (list, tuple)):
            if not isinstance(g, Iterable):
                raise _error(
                    f" expects gradients ({what}) or zip(grads, vars), got a {type(g).__name__}.",
                    TypeError,
                )
            g = list(g)
            if not g:
                return self._from_pairs(g, frozen)
        if g and all(
            isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[1], Variable) for p in g
        ):
            return self._from_pairs(list(g), frozen)
        if kind == "dict":
            raise _error(
                f" got a {type(g).__name__} of gradients, but this optimizer was built over "
                f"{what}: pass a dict with the same keys.",
                TypeError,
            )
        if kind == "nested" and not _flat(g, n):  # the structure ps.grad returns
            try:
                g = self.parsed.flatten(g)
            except ValueError as e:
                raise _error(
                    f" expects gradients in the structure ps.grad returns for the optimizer's "
                    f"collection, or a flat list of its {n} variables: {e}"
                ) from None
        if len(g) != n:
            hint = ""
            if kind == "module":
                hint = (
                    " (the optimizer took the Module's trainable variables when it was "
                    "built; create it after the model's variables exist)"
                )
            raise _error(f" got {len(g)} gradients for {what}{hint}.")
        return [self._check(i, x, frozen) for i, x in enumerate(g)]

    def _from_pairs(self, pairs: list[Any], frozen: tuple[bool, ...] = ()) -> list[Any]:
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
        return [self._check(i, found.get(i), frozen) for i in range(len(self.variables))]

    def _check(self, i: int, grad: Any, frozen: tuple[bool, ...] = ()) -> Any:
        var = self.variables[i]
        if not self.optimized[i] or (frozen and frozen[i]):
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
