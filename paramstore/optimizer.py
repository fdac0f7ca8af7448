"""``ps.Optimizer``: any optax ``GradientTransformation`` over Variables.

Contract (API.md, "Optimizers"):

* ``Optimizer(tx, variables, *, name=None, jit_compile=True)``. ``variables`` is a list or
  tuple of Variables, a dict ``{key: Variable}``, or a Module (then its
  ``trainable_variables`` *at construction*: build the model before its optimizer).
  Of these, the trainable floating-point variables are optimized; the others (integer,
  bool, string or non-trainable variables) are carried along untouched, and their
  gradients are ignored (``None`` is fine).
* The optax state ``tx.init(params)`` lives in non-trainable Variables, one per array
  leaf, created in ``__init__`` (so build the optimizer eagerly, or during a
  ``ps.function``'s first trace, never on a later one), under the optimizer's name scope
  (``"optimizer"``, then ``"optimizer_1"``...; ``name=`` changes it). Names come from the optax state paths:
  a per-parameter slot is ``"<opt>/<variable name>/<slot>"`` (``"optimizer/dense/w/mu"``),
  anything else ``"<opt>/<path>"`` (``"optimizer/count"``,
  ``"optimizer/hyperparams/learning_rate"``); list indices of ``optax.chain`` are left out
  unless two names would collide. Slots are placed like their variable (same sharding);
  counters and other shared state replicated over the first variable's devices.
  So the state checkpoints, threads through ``ps.function`` (and is donated there) like
  any other state. ``opt.variables`` is all of it, ``opt.iterations`` (an int32 step
  counter, incremented by each ``apply_gradients``) first. An Optimizer is a
  ``ps.Module``: held as an attribute of another Module, its state is part of that
  module's ``variables``.
* ``opt.apply_gradients(grads, **extra_args)``: ``grads`` has the structure of
  ``variables``, as ``ps.grad(fn, variables)`` returns it (a list or tuple for a list or
  tuple, a dict with the same keys for a dict, a tuple for a Module), or is the TF form
  ``zip(grads, vars)``, which must name every optimized variable once. It runs one
  ``tx.update`` on the whole pytree (``extra_args`` go to it, e.g. ``value=loss`` for
  ``optax.contrib.reduce_on_plateau``), one ``optax.apply_updates``, and assigns.
  Everything is checked first: a wrong structure, length, key or shape, a missing
  gradient, or a variable the optimizer does not own raises ``ValueError``/``TypeError``
  naming what is wrong, and then nothing changes.
* Works eagerly and inside ``ps.function`` / ``ps.pure`` / ``ps.grad``. With
  ``jit_compile=True`` (the default, as for Keras 3 optimizers) an eager call runs a
  compiled ``ps.function`` of the update (traced once per gradient signature), with the
  state and parameters donated; inside another ``ps.function`` it is simply inlined.
  ``jit_compile=False`` runs optax op by op (handy for debugging).
* Hyperparameters that change between steps without a retrace: build ``tx`` with
  ``optax.inject_hyperparams`` (``optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)``);
  its hyperparameters are then state Variables. ``opt.learning_rate`` is that Variable
  (``opt.learning_rate = 1e-4`` assigns it), ``opt.set_hyperparam(name, value)`` /
  ``opt.get_hyperparam(name)`` reach any of them, and ``opt.hyperparams`` lists them. A
  hyperparameter given as a schedule is recomputed by optax at every step, so setting it
  has no lasting effect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from paramstore.function import function
from paramstore.module import Module
from paramstore.scope import preview_names
from paramstore.variable import Reference, Variable

__all__ = ["Optimizer"]


class _Hidden:
    """A holder that ``Module`` traversal does not look into: the optimizer's own
    references to the variables it updates must not make them its ``variables``."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _optimizable(var: Variable) -> bool:
    if not var.trainable:
        return False
    try:
        return bool(jnp.issubdtype(var.dtype, jnp.inexact))
    except TypeError:  # strings
        return False


def _segment(key: Any, keep_index: bool) -> str | None:
    if isinstance(key, SequenceKey):
        return str(key.idx) if keep_index else None
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    return str(key)


def _path_name(path: tuple, keep_index: bool) -> str:
    return "/".join(s for s in (_segment(k, keep_index) for k in path) if s)


def _describe(kind: str) -> str:
    return {"list": "a list", "tuple": "a tuple", "dict": "a dict", "module": "a Module"}[kind]


class Optimizer(Module):
    """An optax optimizer whose state lives in Variables (see the module docstring).

    Example::

        opt = ps.Optimizer(optax.adam(1e-3), model)

        @ps.function
        def train_step(x, y):
            loss, grads = ps.value_and_grad(lambda: loss_fn(model(x), y), model)()
            opt.apply_gradients(grads)
            return loss
    """

    def __init__(
        self,
        tx: optax.GradientTransformation,
        variables: Any,
        *,
        name: str | None = None,
        jit_compile: bool = True,
    ) -> None:
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            hint = ""
            if callable(tx) and getattr(tx, "__module__", "").startswith("optax"):
                hint = f" Did you mean {getattr(tx, '__name__', 'tx')}(learning_rate)?"
            elif hasattr(variables, "init") and hasattr(variables, "update"):
                hint = " The arguments are (tx, variables), in that order."
            raise TypeError(
                "ps.Optimizer expects an optax.GradientTransformation such as "
                f"optax.adam(1e-3) as its first argument, got {type(tx).__name__}.{hint}"
            )
        kind, keys, targets = _targets(variables)
        optimized = tuple(_optimizable(v) for v in targets)
        if not any(optimized):
            raise ValueError(
                "ps.Optimizer: none of the given variables is a trainable floating-point "
                f"variable ({', '.join(v.name for v in targets) or 'none given'}), so there "
                "is nothing to optimize."
            )
        self._tx = tx
        self._kind = kind
        self._keys = _Hidden(keys)
        self._targets = _Hidden(targets)
        self._optimized = optimized
        self._index = _Hidden({v.ref(): i for i, v in enumerate(targets)})
        self._jit_compile = bool(jit_compile)

        first = next(v for v, o in zip(targets, optimized) if o)
        replicated = _replicated_like(first.sharding)
        # concrete values even when built during a ps.function's first trace
        with jax.ensure_compile_time_eval():
            zero = jnp.zeros((), jnp.int32)
            params = self._build([v.value() if o else None for v, o in zip(targets, optimized)])
            init_state = tx.init(params)
        self._iterations = Variable(
            zero, trainable=False, name="iterations", sharding=_placement(replicated, zero)
        )
        path_leaves, self._treedef = jax.tree_util.tree_flatten_with_path(init_state)
        paths = [p for p, _ in path_leaves]
        leaves = [leaf for _, leaf in path_leaves]
        names, owners = self._slot_names(paths, leaves)
        state_vars = []
        for path, leaf, slot_name, owner in zip(paths, leaves, names, owners):
            try:
                with jax.ensure_compile_time_eval():
                    arr = jnp.asarray(leaf)
                    arr = jnp.asarray(arr, dtype=arr.dtype)  # drop weak types: one signature
            except TypeError:
                raise TypeError(
                    f"ps.Optimizer: the optax state has a leaf at {jax.tree_util.keystr(path)} "
                    f"that is not an array ({type(leaf).__name__}); it cannot be a Variable."
                ) from None
            # a slot is placed like its variable, anything else replicated beside the first
            per_param = owner is not None and owner.shape == arr.shape
            want = owner.sharding if per_param and owner is not None else replicated
            sharding = _placement(want, arr)
            state_vars.append(Variable(arr, trainable=False, name=slot_name, sharding=sharding))
        self._state_variables = state_vars
        self._hyper = _Hidden(self._find_hyperparams(paths))
        self._compiled: Callable[..., Any] = function(self._apply_tree)

    # ------------------------------------------------------------------ structure

    def _build(self, entries: list[Any]) -> Any:
        """A pytree in the structure optax sees: a list/tuple/dict aligned with the targets."""
        if self._kind == "dict":
            return dict(zip(self._keys.value, entries))
        if self._kind == "list":
            return list(entries)
        return tuple(entries)

    def _entries(self, tree: Any) -> list[Any]:
        if self._kind == "dict":
            return [tree[k] for k in self._keys.value]
        return list(tree)

    def _param_key(self, i: int) -> Any:
        return DictKey(self._keys.value[i]) if self._kind == "dict" else SequenceKey(i)

    def _slot_names(
        self, paths: list[tuple], leaves: list[Any]
    ) -> tuple[list[str], list[Variable | None]]:
        """Readable, stable, unique names for the state leaves, and the variable each
        per-parameter leaf belongs to."""
        targets: list[Variable] = self._targets.value
        by_key = {self._param_key(i): v for i, v in enumerate(targets) if self._optimized[i]}
        siblings: dict[tuple, list[int]] = {}
        for j, path in enumerate(paths):
            if path:
                siblings.setdefault(tuple(path[:-1]), []).append(j)

        def owner(j: int) -> Variable | None:
            path = paths[j]
            if not path or path[-1] not in by_key:
                return None
            group = siblings[tuple(path[:-1])]
            if not all(paths[s][-1] in by_key for s in group):
                return None
            shapes_match = all(np.shape(leaves[s]) == by_key[paths[s][-1]].shape for s in group)
            named_field = len(path) > 1 and not isinstance(path[-2], SequenceKey)
            return by_key[path[-1]] if shapes_match or named_field else None

        owners = [owner(j) for j in range(len(paths))]

        def name(j: int, keep_index: bool) -> str:
            own = owners[j]
            if own is None:
                return _path_name(paths[j], keep_index) or "state"
            slot = _path_name(paths[j][:-1], keep_index)
            return f"{own.name}/{slot}" if slot else own.name

        names = [name(j, False) for j in range(len(paths))]
        counts: dict[str, int] = {}
        for n in names:
            counts[n] = counts.get(n, 0) + 1
        names = [name(j, True) if counts[n] > 1 else n for j, n in enumerate(names)]
        return names, owners

    def _find_hyperparams(self, paths: list[tuple]) -> list[tuple[str, str, Variable]]:
        """``(short name, name relative to the optimizer, Variable)`` of every hyperparameter
        that ``optax.inject_hyperparams`` keeps in the state."""
        prefix = self.scope_name + "/"
        found = []
        for path, var in zip(paths, self._state_variables):
            if (
                len(path) >= 2
                and isinstance(path[-1], DictKey)
                and isinstance(path[-2], GetAttrKey)
                and path[-2].name == "hyperparams"
            ):
                rel = var.name[len(prefix) :] if var.name.startswith(prefix) else var.name
                found.append((str(path[-1].key), rel, var))
        return found

    # ------------------------------------------------------------------ properties

    @property
    def tx(self) -> optax.GradientTransformation:
        """The optax transformation."""
        return self._tx

    @property
    def iterations(self) -> Variable:
        """The step counter: an int32 Variable, incremented by each ``apply_gradients``."""
        return self._iterations

    @property
    def var_list(self) -> tuple[Variable, ...]:
        """The variables this optimizer was built over, in their order."""
        return tuple(self._targets.value)

    @property
    def opt_state(self) -> Any:
        """The current optax state, as ``tx.init`` structured it (arrays, not Variables)."""
        return jax.tree_util.tree_unflatten(
            self._treedef, [v.value() for v in self._state_variables]
        )

    # ------------------------------------------------------------------ hyperparameters

    @property
    def hyperparams(self) -> dict[str, Variable]:
        """The hyperparameters ``optax.inject_hyperparams`` put in the state, as Variables,
        keyed by name (``"learning_rate"``), or by their path below the optimizer where
        several injected transformations use the same name."""
        entries = self._hyper.value
        shorts = [s for s, _, _ in entries]
        return {(s if shorts.count(s) == 1 else rel): v for s, rel, v in entries}

    def get_hyperparam(self, name: str) -> Variable:
        """The Variable of an injected hyperparameter: ``name`` is its name
        (``"learning_rate"``) or, where that is ambiguous, its key in ``hyperparams``."""
        entries = self._hyper.value
        matches = [v for s, rel, v in entries if name in (s, rel)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            if not entries:
                raise KeyError(
                    f"This optimizer has no hyperparameter '{name}' it can change between "
                    "steps: none are in its state. Build the transformation with "
                    "optax.inject_hyperparams, e.g. "
                    "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)."
                )
            raise KeyError(
                f"This optimizer has no hyperparameter '{name}'; it has {sorted(self.hyperparams)}."
            )
        candidates = [rel for s, rel, _ in entries if name in (s, rel)]
        raise ValueError(
            f"Several injected transformations have a hyperparameter '{name}': {candidates}. "
            "Pass one of these names."
        )

    def set_hyperparam(self, name: str, value: Any) -> None:
        """Assign an injected hyperparameter (see ``get_hyperparam``); the next step uses it,
        with no retrace. Works eagerly and inside ``ps.function``."""
        self.get_hyperparam(name).assign(value, read_value=False)

    @property
    def learning_rate(self) -> Variable:
        """The injected ``learning_rate`` Variable (``opt.learning_rate = 1e-4`` assigns it)."""
        try:
            return self.get_hyperparam("learning_rate")
        except (KeyError, ValueError) as e:
            raise AttributeError(e.args[0]) from None

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        self.set_hyperparam("learning_rate", value)

    # ------------------------------------------------------------------ applying

    def apply_gradients(self, grads_and_vars: Any, **extra_args: Any) -> None:
        """Apply one optimizer step. ``grads_and_vars``: gradients in the structure of the
        variables (as ``ps.grad`` returns them), or ``zip(grads, vars)``. ``extra_args``
        are passed to ``tx.update``. On an error nothing changes."""
        grads = self._build(self._gradients(grads_and_vars))
        if self._jit_compile and _all_arrays(extra_args):
            self._compiled(grads, extra_args)
        else:
            self._apply_tree(grads, extra_args)

    def _gradients(self, grads_and_vars: Any) -> list[Any]:
        """The gradients aligned with the targets (None for the variables not optimized),
        checked; raises ValueError/TypeError before anything changes."""
        targets: list[Variable] = self._targets.value
        n = len(targets)
        what = f"{_describe(self._kind)} of {n} variables"
        g = grads_and_vars
        if isinstance(g, (Variable, jax.Array, np.ndarray)) or np.isscalar(g) or g is None:
            raise TypeError(
                f"apply_gradients expects gradients in the structure of the optimizer's "
                f"variables ({what}) or zip(grads, vars), got a {type(g).__name__}."
            )
        if isinstance(g, Mapping):
            if self._kind != "dict":
                raise TypeError(
                    f"apply_gradients got a dict of gradients, but this optimizer was built "
                    f"over {what}: pass the gradients as a list or tuple in the same order."
                )
            keys = self._keys.value
            missing = [k for k in keys if k not in g]
            unexpected = [k for k in g if k not in self._index_keys()]
            if missing or unexpected:
                raise ValueError(
                    "apply_gradients: the gradients' keys do not match the variables': "
                    f"missing {missing}, unexpected {unexpected}."
                )
            entries = [g[k] for k in keys]
        else:
            if not isinstance(g, (list, tuple)):
                if not isinstance(g, Iterable):
                    raise TypeError(
                        f"apply_gradients expects gradients ({what}) or zip(grads, vars), "
                        f"got a {type(g).__name__}."
                    )
                g = list(g)
                if not g or _is_pairs(g):
                    return self._from_pairs(g)
            elif g and _is_pairs(g):
                return self._from_pairs(list(g))
            if self._kind == "dict":
                raise TypeError(
                    f"apply_gradients got a {type(g).__name__} of gradients, but this optimizer "
                    f"was built over {what}: pass a dict with the same keys."
                )
            if len(g) != n:
                hint = ""
                if self._kind == "module":
                    hint = (
                        " (the optimizer took the Module's trainable variables when it was "
                        "built; create it after the model's variables exist)"
                    )
                raise ValueError(f"apply_gradients got {len(g)} gradients for {what}{hint}.")
            entries = list(g)
        return [self._check(i, x) for i, x in enumerate(entries)]

    def _index_keys(self) -> set[Any]:
        return set(self._keys.value)

    def _from_pairs(self, pairs: list[Any]) -> list[Any]:
        """The gradients of ``zip(grads, vars)`` aligned with the targets."""
        targets: list[Variable] = self._targets.value
        index: dict[Reference, int] = self._index.value
        found: dict[int, Any] = {}
        for pair in pairs:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise TypeError(
                    "apply_gradients with zip(grads, vars) expects (gradient, Variable) "
                    f"pairs, got a {type(pair).__name__}."
                )
            grad, var = pair
            if not isinstance(var, Variable):
                raise TypeError(
                    "apply_gradients with zip(grads, vars) expects (gradient, Variable) "
                    f"pairs; the second item is a {type(var).__name__}."
                )
            i = index.get(var.ref())
            if i is None:
                raise ValueError(
                    f"apply_gradients got a gradient for variable '{var.name}', which this "
                    f"optimizer does not update (it was built over {len(targets)} variables: "
                    f"{preview_names([v.name for v in targets], limit=8)})."
                )
            if i in found:
                raise ValueError(f"apply_gradients got two gradients for variable '{var.name}'.")
            found[i] = grad
        missing = [v.name for i, v in enumerate(targets) if self._optimized[i] and i not in found]
        if missing:
            raise ValueError(
                f"apply_gradients with zip(grads, vars) has no gradient for {len(missing)} "
                f"of the optimizer's variables: {preview_names(missing, limit=8)}. Pass gradients for all "
                "of them (zeros to leave one as it is), or build an optimizer over the "
                "variables you train."
            )
        return [self._check(i, found.get(i)) for i in range(len(targets))]

    def _check(self, i: int, grad: Any) -> Any:
        var: Variable = self._targets.value[i]
        if not self._optimized[i]:
            return None
        if grad is None:
            raise ValueError(
                f"apply_gradients: no gradient (None) for variable '{var.name}'. Pass zeros "
                "to leave it as it is, or build the optimizer over the variables you train."
            )
        if isinstance(grad, Variable):
            grad = grad.value()
        if not isinstance(grad, jax.Array):
            try:
                grad = jnp.asarray(grad)
            except TypeError:
                raise TypeError(
                    f"apply_gradients: the gradient for variable '{var.name}' is a "
                    f"{type(grad).__name__}, not an array."
                ) from None
        if not jnp.issubdtype(grad.dtype, jnp.number):
            raise TypeError(
                f"apply_gradients: the gradient for variable '{var.name}' has dtype "
                f"{grad.dtype}, not a numeric dtype."
            )
        if tuple(grad.shape) != var.shape:
            raise ValueError(
                f"apply_gradients: the gradient for variable '{var.name}' has shape "
                f"{tuple(grad.shape)}, but the variable has shape {var.shape}."
            )
        return grad

    def _apply_tree(self, grads: Any, extra_args: Mapping[str, Any]) -> None:
        """One step: read, ``tx.update``, ``optax.apply_updates``, check, assign."""
        targets: list[Variable] = self._targets.value
        params = self._build([v.value() if o else None for v, o in zip(targets, self._optimized)])
        state_vars: list[Variable] = self._state_variables
        state = jax.tree_util.tree_unflatten(self._treedef, [v.value() for v in state_vars])
        updates, new_state = self._tx.update(grads, state, params, **extra_args)
        new_params = self._entries(optax.apply_updates(params, updates))
        new_leaves, new_def = jax.tree_util.tree_flatten(new_state)
        if new_def != self._treedef:  # type: ignore[operator]
            raise ValueError(
                "ps.Optimizer: tx.update returned a state whose structure differs from "
                f"tx.init's:\n{new_def}\nvs\n{self._treedef}"
            )
        # check everything before assigning anything: a step is all or nothing
        writes: list[tuple[Variable, Any]] = []
        for var, x in zip(state_vars, new_leaves):
            x = jnp.asarray(x)
            if tuple(x.shape) != var.shape:
                raise ValueError(
                    f"ps.Optimizer: tx.update changed the shape of state '{var.name}' from "
                    f"{var.shape} to {tuple(x.shape)}."
                )
            writes.append((var, x.astype(var.dtype) if x.dtype != var.dtype else x))
        for var, x, opt in zip(targets, new_params, self._optimized):
            if not opt:
                continue
            if x is None or tuple(jnp.shape(x)) != var.shape:
                raise ValueError(
                    f"ps.Optimizer: the update for variable '{var.name}' has shape "
                    f"{None if x is None else tuple(jnp.shape(x))}, not {var.shape}."
                )
            writes.append((var, x))
        for var, x in writes:
            var.assign(x, read_value=False)
        self._iterations.assign_add(1, read_value=False)

    def __repr__(self) -> str:
        n = sum(self._optimized)
        return (
            f"<ps.Optimizer '{self.scope_name}' over {n} variables, "
            f"{len(self._state_variables)} state variables, "
            f"iterations={self._iterations.value()!s}>"
        )


def _targets(variables: Any) -> tuple[str, list[Any], list[Variable]]:
    """(kind, dict keys, variables) for a list/tuple/dict of Variables or a Module."""
    if isinstance(variables, Module):
        found = list(variables.trainable_variables)
        kind, keys = "module", []
        if not found:
            raise ValueError(
                f"ps.Optimizer: Module '{variables.scope_name}' has no trainable variables "
                "yet. Create the optimizer after the model's variables exist (e.g. after "
                "calling the model once)."
            )
    elif isinstance(variables, Mapping):
        kind, keys, found = "dict", list(variables), list(variables.values())
    elif isinstance(variables, (list, tuple)):
        kind = "list" if isinstance(variables, list) else "tuple"
        keys, found = [], list(variables)
    else:
        hint = " (wrap it in a list: [v])" if isinstance(variables, Variable) else ""
        raise TypeError(
            "ps.Optimizer expects its variables as a list or tuple of Variables, a dict "
            f"{{key: Variable}} or a Module, got a {type(variables).__name__}{hint}."
        )
    for k, v in zip(keys or range(len(found)), found):
        if not isinstance(v, Variable):
            where = f"key {k!r}" if kind == "dict" else f"position {k}"
            raise TypeError(
                f"ps.Optimizer: the item at {where} is a {type(v).__name__}, not a ps.Variable."
            )
    if not found:
        raise ValueError("ps.Optimizer needs at least one variable to optimize.")
    seen: set[Reference] = set()
    for v in found:
        if v.ref() in seen:
            raise ValueError(f"ps.Optimizer: variable '{v.name}' is given twice.")
        seen.add(v.ref())
    return kind, keys, found


def _replicated_like(sharding: Any) -> Any:
    """A replicated sharding over the devices of ``sharding`` (None: leave on the default)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
    if sharding is not None and len(sharding.device_set) == 1:
        return sharding
    return None


def _placement(want: Any, arr: Any) -> Any:
    """``want`` where it differs from where ``arr`` is; None keeps ``arr`` as it is (an
    uncommitted array on the default device stays uncommitted, like the variables there)."""
    return want if want is not None and want != arr.sharding else None


def _is_pairs(seq: list[Any] | tuple[Any, ...]) -> bool:
    return all(
        isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[1], Variable) for p in seq
    )


def _all_arrays(tree: Any) -> bool:
    return all(
        isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))
        for x in jax.tree_util.tree_leaves(tree)
    )
