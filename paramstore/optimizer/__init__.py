"""``ps.Optimizer``: any optax ``GradientTransformation`` over Variables.

Contract (docs/api.md, "Optimizers"):

* ``Optimizer(tx, variables, *, name=None, jit_compile=True, slot_sharding=None,
  slot_memory_kind=None)``. ``variables`` is any
  collection ``ps.grad`` accepts, read by the same parser (``paramstore._collect``): a
  list or tuple of Variables, a dict ``{key: Variable}``, a Module (then its
  ``trainable_variables`` *at construction*: build the model before its optimizer), Modules
  in a list, nested lists... One bare Variable is a TypeError (wrap it in a list:
  gradients come back in the structure of ``variables``). A variable the collection
  reaches twice (``[v, v]``, ``[dense, dense]``, ``[model, model.dense]``) is a ValueError
  naming it: a step updates each variable once (``ps.grad`` gives such a variable its full
  gradient in each place). ``name`` must be a str (else TypeError, and nothing is created).
* Masks and labels by name: optax sees the parameters as a pytree shaped like
  ``variables`` (a list, tuple or dict with the same keys); for a Module or a nested
  collection (Modules in a list...), a dict keyed by the variables' full names
  (``"dense/kernel"``). So ``optax.adamw(1e-3,
  mask=lambda p: {k: not k.endswith("bias") for k in p})`` leaves the biases out of weight
  decay, and ``optax.multi_transform(txs, lambda p: {k: "slow" if k.startswith("emb")
  else "fast" for k in p})`` labels by name. ``ps.Optimizer.by_name(fn)`` wraps
  ``fn(name) -> value`` into such a callable.
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
  unless two names would collide. Slots are placed like their variable (same sharding;
  see ``slot_sharding`` below);
  counters and other shared state replicated over the first variable's devices.
  In a ``ps.Checkpoint`` a slot is keyed by its parameter's path and its optax path
  (``optimizer/model/dense/kernel/mu``), never by position (``_ps_children`` gives the
  shared traversal ``Relative`` keys), so adding a layer shifts no other key.
  So the state checkpoints, threads through ``ps.function`` (and is donated there) like
  any other state. ``opt.variables`` is all of it, ``opt.iterations`` (an int32 step
  counter, incremented by each ``apply_gradients``) first. An Optimizer is a
  ``ps.Module``: held as an attribute of another Module, its state is part of that
  module's ``variables``.
* ``slot_sharding`` places each parameter's slots instead of its own sharding (ZeRO-1) and
  ``slot_memory_kind="pinned_host"`` keeps them in host memory, moved to the device for the
  update inside the compiled step: ``paramstore.optimizer.placement`` has the contract.
* Over abstract variables (``ps.abstract()``) the state is abstract too, same names and
  shardings (``paramstore.optimizer.abstract``): a checkpoint restore or ``ps.initialize``
  makes it concrete (docs/sharding.md, "Abstract models").
* ``opt.apply_gradients(grads, **extra_args)``: ``grads`` has the structure of
  ``variables``, as ``ps.grad(fn, variables)`` returns it (a list or tuple for a list or
  tuple, a dict with the same keys for a dict, a tuple for a Module, a list of tuples for
  a list of Modules; a nested collection's gradients may also come flat), or is the TF form
  ``zip(grads, vars)``, which must name every optimized variable once. It runs one
  ``tx.update`` on the whole pytree (``extra_args`` go to it, e.g. ``value=loss`` for
  ``optax.contrib.reduce_on_plateau``), one ``optax.apply_updates``, and assigns.
  Everything is checked first: a wrong structure, length, key or shape, a missing
  gradient, a complex gradient for a real variable, or a variable the optimizer does not
  own raises ``ValueError``/``TypeError`` naming what is wrong, and then nothing changes.
  Gradients for a Module may also be a dict keyed by the variables' names.
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

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from paramstore._core.interrupts import deferred
from paramstore._core.placement import unplaced
from paramstore._traverse import Key, Relative
from paramstore._variable import abstract as _abstract
from paramstore.function import function
from paramstore.module import Module
from paramstore.optimizer import placement
from paramstore.optimizer.abstract import abstract_state, any_abstract, defer_init
from paramstore.optimizer.grads import Targets
from paramstore.optimizer.slots import (
    as_state_array,
    constrained,
    hyperparam_leaves,
    replicated_like,
    slot_names,
    state_sharding,
    zero_int32,
)
from paramstore.typing import SlotSharding, ValueLike, VariablesLike
from paramstore.variable import Variable

__all__ = ["Optimizer"]


# The optimizer's own attributes, visited through _ps_children (not by attribute name).
_OWN_ATTRIBUTES = frozenset(
    (
        "_tx",
        "_targets",
        "_jit_compile",
        "_iterations",
        "_treedef",
        "_state_variables",
        "_state_keys",
        "_slot_owners",
        "_hyper",
        "_compiled",
        "_placement",
    )
)


_T = TypeVar("_T")


class _Hidden(Generic[_T]):
    """A holder that ``Module`` traversal does not look into: the optimizer's own
    references to the variables it updates must not make them its ``variables``."""

    __slots__ = ("value",)

    def __init__(self, value: _T) -> None:
        self.value = value


def _check_tx(tx: Any, variables: Any) -> None:
    if callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None)):
        return
    hint = ""
    if callable(tx) and getattr(tx, "__module__", "").startswith("optax"):
        hint = f" Did you mean {getattr(tx, '__name__', 'tx')}(learning_rate)?"
    elif hasattr(variables, "init") and hasattr(variables, "update"):
        hint = " The arguments are (tx, variables), in that order."
    raise TypeError(
        "ps.Optimizer expects an optax.GradientTransformation such as "
        f"optax.adam(1e-3) as its first argument, got {type(tx).__name__}.{hint}"
    )


class Optimizer(Module):
    """An optax optimizer whose state lives in Variables (see the module docstring).

    Example::

        opt = ps.Optimizer(optax.adamw(1e-3, mask=ps.Optimizer.by_name(
            lambda name: not name.endswith("bias"))), model)

        @ps.function
        def train_step(x, y):
            loss, grads = ps.value_and_grad(lambda: loss_fn(model(x), y), model)()
            opt.apply_gradients(grads)
            return loss
    """

    def __new__(
        cls,
        *args: Any,
        name: Any = None,
        slot_sharding: Any = None,
        slot_memory_kind: Any = None,
        **kwargs: Any,
    ) -> Optimizer:
        if name is not None and not isinstance(name, str):  # before any scope is reserved
            raise TypeError(
                f"ps.Optimizer: name must be a str such as 'adam', got {type(name).__name__} "
                f"{name!r}."
            )
        variables = args[1] if len(args) > 1 else kwargs.get("variables")
        placed = slot_sharding is not None or slot_memory_kind is not None
        if placed and variables is not None:
            params = list(Targets.parse(variables).param_keys().values())
            placement.check(slot_sharding, slot_memory_kind, params)  # so is this
        return super().__new__(cls)

    def __init__(
        self,
        tx: optax.GradientTransformation,
        variables: VariablesLike,
        *,
        name: str | None = None,
        jit_compile: bool = True,
        slot_sharding: SlotSharding | None = None,
        slot_memory_kind: str | None = None,
    ) -> None:
        _check_tx(tx, variables)
        targets = Targets.parse(variables)
        self._tx = tx
        self._targets = _Hidden(targets)
        self._jit_compile = bool(jit_compile)
        first = next(v for v, o in zip(targets.variables, targets.optimized) if o)
        replicated = replicated_like(first.sharding)
        abstract = any_abstract(targets)  # then the state is abstract too: shapes only,
        # traced outside compile-time evaluation (which would compute the zeros)
        init_state = abstract_state(tx, targets) if abstract else None
        with jax.ensure_compile_time_eval():  # concrete even in a ps.function's first trace
            zero = jnp.zeros((), jnp.int32)
            if init_state is None:
                init_state = tx.init(targets.params())
            path_leaves, self._treedef = jax.tree_util.tree_flatten_with_path(init_state)
            paths = [p for p, _ in path_leaves]
            leaves = [leaf if abstract else as_state_array(p, leaf) for p, leaf in path_leaves]
        names, owners = slot_names(paths, [a.shape for a in leaves], targets.param_keys())
        self._placement = _Hidden(
            placement.plan(slot_sharding, slot_memory_kind, owners, leaves, replicated)
        )
        leaves, homes = self._placement.value.initial(leaves)
        # each slot exactly where its variable is, whatever ps.device says
        with unplaced(), _abstract.abstract() if abstract else contextlib.nullcontext():
            self._iterations = Variable(
                zero_int32 if abstract else zero,  # abstract: an initializer, no array held
                trainable=False,
                name="iterations",
                sharding=state_sharding(None, zero, replicated),
            )
            self._state_variables = [
                Variable(arr, trainable=False, name=slot, sharding=home)
                for arr, slot, home in zip(leaves, names, homes)
            ]
        if abstract:
            defer_init(tx, targets, self._state_variables, self._placement.value.active)
        self._slot_owners = _Hidden(owners)
        # checkpoint keys: a slot under its parameter's path, never its position
        self._state_keys: list[Key] = [
            slot if owner is None else Relative(owner, slot[len(owner.name) + 1 :], slot)
            for slot, owner in zip(names, owners)
        ]
        self._hyper = _Hidden(
            [(short, self._state_variables[j]) for j, short in hyperparam_leaves(paths)]
        )
        self._compiled: Callable[..., Any] = function(self._step)

    def _ps_children(self) -> list[tuple[Key, Any]]:
        """What the shared traversal visits (``Module.variables``, ``ps.Checkpoint``): the
        step counter, then each state variable keyed by its parameter's path and its optax
        path (``Relative``), then any attribute a subclass added."""
        own = [("iterations", self._iterations), *zip(self._state_keys, self._state_variables)]
        extra = [(k, v) for k, v in super()._ps_children() if k not in _OWN_ATTRIBUTES]
        return [*own, *extra]

    @staticmethod
    def by_name(fn: Callable[[str], Any]) -> Callable[[Any], Any]:
        """``fn(name) -> value`` as an optax mask/label callable for an optimizer built over a
        Module or a dict: ``mask=ps.Optimizer.by_name(lambda n: not n.endswith("bias"))``."""

        def per_name(params: Any) -> Any:
            if not isinstance(params, Mapping):
                raise TypeError(
                    "ps.Optimizer.by_name needs parameters keyed by name: build the optimizer "
                    "over a Module or a dict of variables (a list has no names)."
                )
            return {k: fn(k) for k in params}

        return per_name

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
        return self._targets.value.variables

    @property
    def opt_state(self) -> optax.OptState:
        """The current optax state, as ``tx.init`` structured it (arrays, not Variables)."""
        return jax.tree_util.tree_unflatten(
            self._treedef, [v.value() for v in self._state_variables]
        )

    # ------------------------------------------------------------------ hyperparameters

    def _hyper_entries(self) -> list[tuple[str, str, Variable]]:
        """``(short name, name relative to the optimizer, Variable)`` per hyperparameter."""
        prefix = self.scope_name + "/"
        return [(s, v.name.removeprefix(prefix), v) for s, v in self._hyper.value]

    @property
    def hyperparams(self) -> dict[str, Variable]:
        """The hyperparameters ``optax.inject_hyperparams`` put in the state, as Variables,
        keyed by name (``"learning_rate"``), or by their path below the optimizer where
        several injected transformations use the same name."""
        entries = self._hyper_entries()
        shorts = [s for s, _, _ in entries]
        return {(s if shorts.count(s) == 1 else rel): v for s, rel, v in entries}

    def get_hyperparam(self, name: str) -> Variable:
        """The Variable of an injected hyperparameter: ``name`` is its name
        (``"learning_rate"``) or, where that is ambiguous, its key in ``hyperparams``."""
        entries = self._hyper_entries()
        matches = [(rel, v) for s, rel, v in entries if name in (s, rel)]
        if len(matches) == 1:
            return matches[0][1]
        if matches:
            raise ValueError(
                f"Several injected transformations have a hyperparameter '{name}': "
                f"{[rel for rel, _ in matches]}. Pass one of these names."
            )
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

    def set_hyperparam(self, name: str, value: ValueLike) -> None:
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
    def learning_rate(self, value: ValueLike) -> None:
        self.set_hyperparam("learning_rate", value)

    # ------------------------------------------------------------------ the step

    def apply_gradients(
        self,
        grads_and_vars: optax.Updates | Iterable[tuple[ValueLike | None, Variable]],
        **extra_args: Any,
    ) -> None:
        """Apply one optimizer step. ``grads_and_vars``: gradients in the structure of the
        variables (as ``ps.grad`` returns them), or ``zip(grads, vars)``. ``extra_args``
        are passed to ``tx.update``. On an error nothing changes."""
        targets: Targets = self._targets.value
        grads = targets.tree(targets.gradients(grads_and_vars))
        if self._jit_compile and _all_arrays(extra_args):
            self._compiled(grads, extra_args)
        else:
            self._step(grads, extra_args)

    def _step(self, grads: Any, extra_args: Mapping[str, Any]) -> None:
        """One step: read, ``tx.update``, ``optax.apply_updates``, check, assign."""
        writes = self._new_values(grads, extra_args)
        with deferred():  # all or nothing, Ctrl-C included (held back to the end)
            for var, x in writes:
                var.assign(x, read_value=False)
            self._iterations.assign_add(1, read_value=False)

    def _new_values(
        self, grads: Any, extra_args: Mapping[str, Any]
    ) -> list[tuple[Variable, jax.Array]]:
        """What one step would assign (state and parameters, checked), assigning nothing;
        ``iterations`` aside (``LossScaleOptimizer`` selects between these and the old
        values)."""
        targets: Targets = self._targets.value
        params = targets.params()
        frozen = targets.frozen()
        if any(frozen):  # zeros in, and nothing of theirs written back (so XLA drops it)
            zeros = [
                jnp.zeros(v.shape, v.dtype) if f else x
                for v, f, x in zip(targets.variables, frozen, targets.entries(grads))
            ]
            grads = targets.tree(zeros)
        still = {id(v) for v, f in zip(targets.variables, frozen) if f}
        state_vars: list[Variable] = self._state_variables
        place = self._placement.value
        values = place.fetch([v.value() for v in state_vars])  # where the update is computed
        state = jax.tree_util.tree_unflatten(self._treedef, values)
        updates, new_state = self._tx.update(grads, state, params, **extra_args)
        new_params = targets.entries(optax.apply_updates(params, updates))
        new_leaves, new_def = jax.tree_util.tree_flatten(new_state)
        if new_def != self._treedef:  # type: ignore[operator]
            raise ValueError(
                "ps.Optimizer: tx.update returned a state whose structure differs from "
                f"tx.init's:\n{new_def}\nvs\n{self._treedef}"
            )
        # check everything before assigning anything: a step is all or nothing
        checked = []
        for var, x in zip(state_vars, new_leaves):
            x = jnp.asarray(x)
            if tuple(x.shape) != var.shape:
                raise ValueError(
                    f"ps.Optimizer: tx.update changed the shape of state '{var.name}' from "
                    f"{var.shape} to {tuple(x.shape)}."
                )
            checked.append(x.astype(var.dtype) if x.dtype != var.dtype else x)
        homed = place.store(checked)  # back where the slots live (aligned with self.homes)
        writes: list[tuple[Variable, Any]] = [
            (var, x)
            for var, x, owner in zip(state_vars, homed, self._slot_owners.value)
            if owner is None or id(owner) not in still  # a frozen variable's slot: unchanged
        ]
        for var, x, opt, f in zip(targets.variables, new_params, targets.optimized, frozen):
            if not opt or f:
                continue
            if x is None or tuple(jnp.shape(x)) != var.shape:
                raise ValueError(
                    f"ps.Optimizer: the update for variable '{var.name}' has shape "
                    f"{None if x is None else tuple(jnp.shape(x))}, not {var.shape}."
                )
            if var.constraint is not None:  # as Keras 3: projected after each update
                x = constrained(var, x)
            writes.append((var, x))
        return writes

    def __repr__(self) -> str:
        return (
            f"<ps.Optimizer '{self.scope_name}' over {sum(self._targets.value.optimized)} "
            f"variables, {len(self._state_variables)} state variables, "
            f"iterations={self._iterations.value()!s}>"
        )


def _all_arrays(tree: Any) -> bool:
    return all(
        isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))
        for x in jax.tree_util.tree_leaves(tree)
    )
