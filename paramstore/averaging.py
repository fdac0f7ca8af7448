"""``ps.ExponentialMovingAverage``: shadow variables averaging others, as
``tf.train.ExponentialMovingAverage``.

Contract (docs/api.md, "Weight averaging, constraints and regularizers"):

* ``ExponentialMovingAverage(decay, num_updates=None, zero_debias=False,
  name="ExponentialMovingAverage")``: ``decay`` a number in [0, 1] (else ``ValueError``,
  nothing created) or a Variable read at each ``apply``; ``num_updates`` None, a number or
  a Variable (``opt.iterations``), read at each ``apply``.
* ``apply(var_list=None)``: on the first sight of a variable, creates its shadow: a
  non-trainable Variable with the variable's value, dtype, shape and sharding, named
  ``<variable's full name>/<name>`` in the default store. Then every shadow of
  ``var_list`` is updated as TF does, in float32 for the decay:
  ``d = decay`` or ``min(decay, (1 + num_updates) / (10 + num_updates))``, then
  ``shadow -= (shadow - value) * cast(1 - d, shadow.dtype)``. ``var_list``: any
  collection ``ps.state`` takes (a Module, or Modules in a list: their floating-point
  variables, the shadows of this average left out), or None: the trainable variables of the
  default store (TF1's default). A variable listed that is not floating point is a
  ``TypeError`` naming it (as TF).
  Works eagerly, inside ``ps.function`` (shadows may be created in its first trace) and
  inside ``lax.scan`` / ``fori_loop`` bodies once the shadows exist (call ``apply`` once
  before a fused loop, e.g. eagerly: a first update leaves a fresh shadow unchanged).
* ``zero_debias``: as in TF, it applies only to averages of *tensors*, which start at
  zero; a variable's shadow starts at its value and is never debiased, so it has no
  effect here (every ``apply`` takes variables). It is kept for TF code.
* ``average(v)`` -> the shadow Variable (``KeyError`` naming ``v`` if it has none);
  ``average_name(v)`` -> its full name (the name it will have, before ``apply``).
* ``variables_to_restore(moving_avg_variables=None)`` -> ``{name: Variable}`` for
  ``ps.Saver``, as TF's: each variable of ``moving_avg_variables`` (default: those this
  average tracks and the trainable variables of the default store) under its average's
  name, and every other variable of the default store under its own name (shadows
  excluded), so an evaluation model restores the averages into its variables.
* ``with ema.swap(module_or_variables=None):`` assigns each tracked variable of the
  collection (None: all tracked) its average and puts the trained values back on exit,
  also on an exception.
* The average is a ``ps.Module`` whose variables are the shadows: ``ps.Checkpoint(ema=ema)``
  keys each shadow under its variable's path (``ema/model/dense/kernel/<name>``; the
  shadow's full name when the variable is not in the checkpoint), ``ps.Saver`` saves them
  by full name (the default store holds them).
"""

from __future__ import annotations

import numbers
import weakref
from typing import Any, Generic, TypeVar

import jax.numpy as jnp
import numpy as np

from paramstore._collect import variables_of
from paramstore._core.context import STATE_LOCK, ctx
from paramstore._core.interrupts import deferred
from paramstore._core.ownership import ownership
from paramstore._core.store import default_store, give_back, journal
from paramstore._function.initial import initial_from_first_call
from paramstore._traverse import Key, Relative
from paramstore.module import Module, child_created
from paramstore.typing import VariablesLike
from paramstore.variable import Variable

__all__ = ["ExponentialMovingAverage"]

_T = TypeVar("_T")

_FLOATS = (np.float16, np.float32, np.float64, jnp.bfloat16)


class _Hidden(Generic[_T]):
    """A holder the Module traversal does not look into (the averaged variables must not
    become the average's own ``variables``)."""

    __slots__ = ("value",)

    def __init__(self, value: _T) -> None:
        self.value = value


def _check_decay(decay: Any) -> None:
    if isinstance(decay, Variable):
        return
    if isinstance(decay, bool) or not isinstance(decay, numbers.Real):
        raise TypeError(
            f"ps.ExponentialMovingAverage: decay must be a number in [0, 1] or a Variable, got "
            f"{type(decay).__name__} {decay!r:.40}."
        )
    if not 0.0 <= float(decay) <= 1.0:
        raise ValueError(
            f"ps.ExponentialMovingAverage: decay must be in [0, 1] (the weight of the old "
            f"average, e.g. 0.999), got {decay!r}."
        )


def _check_num_updates(num_updates: Any) -> None:
    if num_updates is not None and not isinstance(num_updates, (Variable, numbers.Real)):
        raise TypeError(
            "ps.ExponentialMovingAverage: num_updates must be None, a number or a Variable "
            f"(e.g. opt.iterations), got {type(num_updates).__name__}."
        )


class ExponentialMovingAverage(Module):
    """Shadow variables averaging others, as ``tf.train.ExponentialMovingAverage`` (see the
    module docstring).

    Example::

        ema = ps.ExponentialMovingAverage(0.999, num_updates=opt.iterations)

        @ps.function
        def step(x, y):
            ...
            opt.apply_gradients(grads)
            ema.apply(model)

        with ema.swap(model):
            evaluate(model)
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> ExponentialMovingAverage:
        self = super().__new__(cls)
        decay = args[0] if args else kwargs.get("decay")
        _check_decay(decay)  # before a scope name is taken
        _check_num_updates(args[1] if len(args) > 1 else kwargs.get("num_updates"))
        name = args[3] if len(args) > 3 else kwargs.get("name", "ExponentialMovingAverage")
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"ps.ExponentialMovingAverage: name must be a non-empty str, got {name!r}."
            )
        Module.__init__(self, name="ExponentialMovingAverage" if not name.isidentifier() else name)
        return self

    def __init__(
        self,
        decay: float | Variable,
        num_updates: int | Variable | None = None,
        zero_debias: bool = False,
        name: str = "ExponentialMovingAverage",
    ) -> None:
        self._decay = decay
        self._num_updates = num_updates
        self._zero_debias = bool(zero_debias)
        self._name = name
        # id(variable) -> (a weak reference to it, its shadow), in the order first applied
        self._averaged = _Hidden(dict[int, tuple[weakref.ref[Variable], Variable]]())

    @property
    def name(self) -> str:
        """The name given (the suffix of the shadows' names)."""
        return self._name

    @property
    def decay(self) -> float | Variable:
        """The decay (a number or a Variable)."""
        return self._decay

    @property
    def num_updates(self) -> int | Variable | None:
        """The step count that caps the decay early in training, or None."""
        return self._num_updates

    @property
    def zero_debias(self) -> bool:
        """As given (it has no effect on variables' averages, as in TF)."""
        return self._zero_debias

    # ------------------------------------------------------------------ the shadows

    def _tracked(self) -> list[tuple[Variable, Variable]]:
        out = []
        for ref, shadow in self._averaged.value.values():
            var = ref()
            if var is not None:
                out.append((var, shadow))
        return out

    def _is_shadow(self, var: Variable) -> bool:
        return any(s is var for _, s in self._averaged.value.values())

    def _shadow(self, var: Variable) -> Variable | None:
        entry = self._averaged.value.get(id(var))
        return entry[1] if entry is not None and entry[0]() is var else None

    def _ps_children(self) -> list[tuple[Key, Any]]:
        """The shadows, each keyed by its variable's path (``Relative``), then any
        attribute a subclass added."""
        own: list[tuple[Key, Any]] = [
            (Relative(var, self._name, shadow.name), shadow) for var, shadow in self._tracked()
        ]
        extra = [
            (k, v)
            for k, v in super()._ps_children()
            if k not in ("_decay", "_num_updates", "_averaged")
        ]
        return [*own, *extra]

    def average_name(self, var: Variable) -> str:
        """The full name of ``var``'s shadow (what it is, or will be, called)."""
        shadow = self._shadow(var) if isinstance(var, Variable) else None
        if shadow is not None:
            return shadow.name
        plain = f"{_as_variable(var, 'average_name').name}/{self._name}"
        return default_store().unique_name(plain, reserve=False)  # as apply will name it

    def average(self, var: Variable) -> Variable:
        """``var``'s shadow Variable; ``KeyError`` if this average does not track ``var``."""
        shadow = self._shadow(_as_variable(var, "average"))
        if shadow is None:
            raise KeyError(
                f"ps.ExponentialMovingAverage '{self._name}' does not track variable "
                f"'{var.name}': call ema.apply([...]) with it first (it tracks "
                f"{len(self._tracked())} variables)."
            )
        return shadow

    def _targets(self, var_list: VariablesLike | None) -> list[Variable]:
        shadows = {id(s) for _, s in self._tracked()}
        if var_list is None:
            found = [v for v in default_store().trainable_variables() if isinstance(v, Variable)]
        else:
            found = variables_of(var_list)
        explicit = isinstance(var_list, Variable) or (
            isinstance(var_list, (list, tuple)) and all(isinstance(x, Variable) for x in var_list)
        )
        out = []
        for v in found:
            if id(v) in shadows:
                continue
            if v.dtype not in _FLOATS:
                if not explicit:
                    continue  # a Module's integer, key or string state is not averaged
                raise TypeError(
                    f"ps.ExponentialMovingAverage: variable '{v.name}' has dtype {v.dtype}; "
                    "only floating-point variables (float16, bfloat16, float32, float64) "
                    "can be averaged."
                )
            out.append(v)
        return out

    def apply(self, var_list: VariablesLike | None = None) -> None:
        """Create the missing shadows, then update the shadows of ``var_list`` (see the
        module docstring)."""
        targets = self._targets(var_list)
        for v in targets:
            if self._shadow(v) is None:
                self._create(v)
        decay = jnp.asarray(
            self._decay.value() if isinstance(self._decay, Variable) else self._decay,
            jnp.float32,
        )
        if self._num_updates is not None:
            n = self._num_updates
            steps = jnp.asarray(n.value() if isinstance(n, Variable) else n).astype(jnp.float32)
            decay = jnp.minimum(decay, (1.0 + steps) / (10.0 + steps))
        one_minus = 1.0 - decay
        for v in targets:
            shadow = self.average(v)
            avg = shadow.value()
            delta = (avg - v.value()) * one_minus.astype(avg.dtype)
            shadow.assign(avg - delta, read_value=False)

    def _create(self, v: Variable) -> None:
        """``v``'s shadow: ``v``'s value, or the saved average a restore left pending for it
        (deferred restoration, ``module.child_created``). Inside a ``ps.function``'s first
        trace it starts at ``v``'s value at this point of the program, computed from the
        first call's arguments where it depends on them (``initial_from_first_call``), as
        the same step run eagerly would start it. A failure (a saved value of another
        shape) leaves no shadow and takes no name."""
        full = default_store().unique_name(f"{v.name}/{self._name}", reserve=False)
        sharding = None if v._is_string else getattr(v, "sharding", None)
        with journal() as taken:
            if ctx.frames:  # in a ps.function's first trace: v's value at this point
                shadow = Variable(v, trainable=False, sharding=sharding, _full_name=full)
                initial_from_first_call(shadow)  # computed from the first call's arguments
            else:  # eager: a private copy of v's value
                start = ownership.copy(v)
                shadow = Variable(start, trainable=False, sharding=sharding, _full_name=full)
            self._averaged.value[id(v)] = (weakref.ref(v), shadow)
            try:
                child_created(self, Relative(v, self._name, shadow.name), shadow)
            except BaseException:
                del self._averaged.value[id(v)]
                give_back(taken, {shadow.name})
                raise

    # ------------------------------------------------------------------ evaluation

    def variables_to_restore(
        self, moving_avg_variables: VariablesLike | None = None
    ) -> dict[str, Variable]:
        """``{name: Variable}`` for ``ps.Saver``, as TF's (see the module docstring)."""
        store = default_store()
        if moving_avg_variables is None:
            chosen = [v for v, _ in self._tracked()]
            chosen += [
                v
                for v in store.trainable_variables()
                if isinstance(v, Variable)
                and v.dtype in _FLOATS
                and self._shadow(v) is None
                and not self._is_shadow(v)
            ]
        else:
            chosen = variables_of(moving_avg_variables)
        chosen = list({id(v): v for v in chosen}.values())
        names: dict[str, Variable] = {self.average_name(v): v for v in chosen}
        averaged = {v.name for v in chosen}
        for v in store.variables():
            if isinstance(v, Variable) and v.name not in averaged and v.name not in names:
                names[v.name] = v
        return names

    def swap(self, module_or_variables: VariablesLike | None = None) -> _Swap:
        """Inside the block the tracked variables of the collection (None: all tracked)
        hold their averages; their trained values come back on exit, also on an error.
        Interrupt-safe (docs/api.md, "Interrupts and faults"): entering changes all of them or
        none, and leaving puts all trained values back, or (an interrupt that lands as the
        block is left, before the restore starts) leaves all averages in place."""
        if module_or_variables is None:
            pairs = self._tracked()
        else:
            found = [(v, self._shadow(v)) for v in variables_of(module_or_variables)]
            pairs = [(v, s) for v, s in found if s is not None]
        return _Swap(pairs)

    def __repr__(self) -> str:
        return (
            f"<ps.ExponentialMovingAverage '{self._name}' decay={self._decay!r} "
            f"({len(self._tracked())} variables)>"
        )


class _Swap:
    """``ema.swap(...)``'s context manager: a class, not a generator, so that no bytecode
    runs between the averages being written and the block starting (an interrupt that
    lands in a generator's ``__enter__`` after its ``yield`` would skip ``__exit__`` and
    leave the averages in place)."""

    __slots__ = ("_variables", "_shadows", "_saved")

    def __init__(self, pairs: list[tuple[Variable, Variable]]) -> None:
        self._variables = [v for v, _ in pairs]
        self._shadows = [s for _, s in pairs]
        self._saved: list[Any] | None = None

    def __enter__(self) -> None:
        try:
            with deferred(), STATE_LOCK:  # all or none; a signal is raised at the end
                self._saved = [v.value() for v in self._variables]
                _write_all(self._variables, [s.value() for s in self._shadows])
        except BaseException:  # an interrupt delivered as the writes end: undo them all
            if self._saved is not None:
                with deferred(), STATE_LOCK:
                    _write_all(self._variables, self._saved)
            raise

    def __exit__(self, *exc: object) -> None:
        saved = self._saved
        if saved is None:
            return
        done = False
        try:
            with deferred(), STATE_LOCK:
                _write_all(self._variables, saved)
                done = True
        except BaseException:  # an interrupt before the writes began: write them anyway
            if not done:
                with deferred(), STATE_LOCK:
                    _write_all(self._variables, saved)
            raise


def _write_all(variables: list[Variable], values: list[Any]) -> None:
    """Write ``values`` (the variables' own shapes and dtypes) into ``variables``: call it
    under ``deferred()`` and ``STATE_LOCK``, so a step or a read sees all or none."""
    for v, x in zip(variables, values):
        v._swap(x, owned=False)


def _as_variable(var: Any, what: str) -> Variable:
    if not isinstance(var, Variable):
        raise TypeError(
            f"ps.ExponentialMovingAverage.{what} takes a ps.Variable, got {type(var).__name__}."
        )
    return var
