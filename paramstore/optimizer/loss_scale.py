"""``ps.LossScaleOptimizer``: Keras 3's dynamic loss scaling around a ``ps.Optimizer``.

Contract (docs/api.md, "Mixed precision"; docs/guides/recipes.md, "Loss scaling"):

* ``LossScaleOptimizer(optimizer, initial_scale=2.0**15, dynamic_growth_steps=2000, *,
  name=None)``: ``optimizer`` must be a ``ps.Optimizer`` (else ``TypeError``),
  ``initial_scale`` a number > 0 that is finite in float32 (1e39 is not: the scale is a
  float32 variable) and ``dynamic_growth_steps`` an int in [1, 2**31] (the counter is an
  int32) (else ``ValueError``); nothing is created before these checks pass.
* ``opt.scale`` is a non-trainable float32 Variable (starts at ``initial_scale``),
  ``opt.step_counter`` an int32 Variable (finite steps in a row, as Keras'
  ``step_counter``); both are this Module's, so a ``ps.Checkpoint`` saves them
  (``<key>/scale``, ``<key>/step_counter``) beside the inner optimizer's state
  (``<key>/inner_optimizer/...``), and ``ps.function`` / ``lax.scan`` thread them.
* ``opt.scale_loss(loss)`` is ``loss * scale``. ``opt.apply_gradients(grads)`` (the inner
  optimizer's forms and checks) takes the gradients of the scaled loss. If every gradient
  is finite, it applies ``grads / scale`` with the inner optimizer, then doubles the scale
  and resets the counter when the counter had reached ``dynamic_growth_steps - 1``, else
  increments the counter. Otherwise it applies nothing (variables, slots and
  ``iterations`` keep their values), halves the scale and resets the counter. This is
  Keras 3's ``LossScaleOptimizer`` step for step. The choice is made with ``jnp.where`` on
  the computed values (never a Python branch on a value), so the same code runs eagerly,
  inside ``ps.function`` and in a ``lax.scan`` body. Eagerly it runs compiled (the inner
  optimizer's ``jit_compile``).
* ``iterations``, ``learning_rate``, ``var_list`` are the inner optimizer's.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from paramstore._core.placement import device_memory_kind, in_host_memory
from paramstore.function import function
from paramstore.module import Module
from paramstore.optimizer import Optimizer
from paramstore.optimizer.grads import Targets
from paramstore.typing import ValueLike
from paramstore.variable import Variable

__all__ = ["LossScaleOptimizer"]


def _check(optimizer: Any, initial_scale: Any, dynamic_growth_steps: Any) -> None:
    me = "ps.LossScaleOptimizer"
    if not isinstance(optimizer, Optimizer):
        hint = (
            " Wrap it first: ps.LossScaleOptimizer(ps.Optimizer(tx, model))."
            if callable(getattr(optimizer, "update", None))
            else ""
        )
        raise TypeError(f"{me} wraps a ps.Optimizer, got {type(optimizer).__name__}.{hint}")
    if (
        isinstance(initial_scale, bool)
        or not isinstance(initial_scale, numbers.Real)
        or not _finite_float32(initial_scale)
    ):
        raise ValueError(
            f"{me}: initial_scale must be a finite number > 0 that float32 holds (the first "
            f"loss scale, e.g. 2.0**15; the scale is a float32 variable, so above "
            f"{float(np.finfo(np.float32).max):.4g} it would be inf), got {initial_scale!r}."
        )
    if (
        isinstance(dynamic_growth_steps, bool)
        or not isinstance(dynamic_growth_steps, (int, np.integer))
        or not 1 <= dynamic_growth_steps <= _MAX_GROWTH_STEPS
    ):
        raise ValueError(
            f"{me}: dynamic_growth_steps must be an int in [1, 2**31] (finite steps before "
            f"the scale doubles, counted by an int32 variable), got {dynamic_growth_steps!r}."
        )


_MAX_GROWTH_STEPS = 2**31  # the counter (int32) reaches dynamic_growth_steps - 1


def _finite_float32(x: numbers.Real) -> bool:
    """Whether ``x`` is > 0 and finite as float32 (neither inf nor rounded to 0)."""
    try:
        f = float(x)
    except OverflowError:  # an int beyond float64
        return False
    if not math.isfinite(f) or f <= 0:
        return False
    with np.errstate(over="ignore", under="ignore"):
        f32 = np.float32(f)
    return bool(np.isfinite(f32) and f32 > 0)


def _select(finite: jax.Array, new: jax.Array, var: Variable) -> jax.Array:
    """``new`` where ``finite``, else ``var``'s value. A slot kept in host memory
    (``slot_memory_kind="pinned_host"``) is selected in its devices' memory and moved back
    home: XLA's select takes operands of one memory space only."""
    home = var.sharding
    if home is None or not in_host_memory(home):
        return jnp.where(finite, new, var.value())
    compute = home.with_memory_kind(device_memory_kind(home))
    picked = jnp.where(finite, jax.device_put(new, compute), jax.device_put(var.value(), compute))
    home_again: jax.Array = jax.device_put(picked, home)
    return home_again


class LossScaleOptimizer(Module):
    """Dynamic loss scaling around a ``ps.Optimizer``, as ``keras.optimizers.
    LossScaleOptimizer`` (see the module docstring).

    Example::

        opt = ps.LossScaleOptimizer(ps.Optimizer(optax.adam(1e-3), model))

        @ps.function
        def step(x, y):
            def scaled():
                return opt.scale_loss(loss_fn(model(x), y))
            grads = ps.grad(scaled, model)()
            opt.apply_gradients(grads)   # unscales; skips the step on inf/nan
    """

    inner_optimizer: Optimizer
    scale: Variable
    step_counter: Variable

    def __new__(
        cls,
        optimizer: Optimizer,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
        **kwargs: Any,
    ) -> LossScaleOptimizer:
        _check(optimizer, initial_scale, dynamic_growth_steps)  # before any name is taken
        return super().__new__(cls)

    def __init__(
        self,
        optimizer: Optimizer,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
        *,
        name: str | None = None,
    ) -> None:
        self.inner_optimizer = optimizer
        self.initial_scale = float(initial_scale)
        self.dynamic_growth_steps = int(dynamic_growth_steps)
        where = optimizer.iterations.sharding  # replicated like the step counter
        scale, zero = np.float32(self.initial_scale), np.int32(0)  # concrete in a trace too
        self.scale = Variable(scale, trainable=False, name="scale", sharding=where)
        self.step_counter = Variable(zero, trainable=False, name="step_counter", sharding=where)
        self._compiled = function(self._step)

    # ------------------------------------------------------------------ delegation
    @property
    def iterations(self) -> Variable:
        """The inner optimizer's step counter (a skipped step does not count)."""
        return self.inner_optimizer.iterations

    @property
    def var_list(self) -> tuple[Variable, ...]:
        """The variables the inner optimizer updates."""
        return self.inner_optimizer.var_list

    @property
    def learning_rate(self) -> Variable:
        """The inner optimizer's injected ``learning_rate`` (settable)."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value: ValueLike) -> None:
        self.inner_optimizer.learning_rate = value

    # ------------------------------------------------------------------ the step
    def scale_loss(self, loss: ValueLike) -> jax.Array:
        """``loss * scale``: differentiate this, then pass the gradients to
        ``apply_gradients``, which unscales them."""
        return jnp.asarray(loss) * self.scale.value()

    def apply_gradients(
        self,
        grads_and_vars: optax.Updates | Iterable[tuple[ValueLike | None, Variable]],
        **extra_args: Any,
    ) -> None:
        """Unscale and apply ``grads_and_vars`` (gradients of the scaled loss) if all are
        finite, else skip the step; then update the scale (see the module docstring).
        Bad gradients raise as the inner optimizer's do, and nothing changes."""
        inner = self.inner_optimizer
        targets: Targets = inner._targets.value
        entries = targets.gradients(grads_and_vars)
        arrays_only = all(
            isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float))
            for x in jax.tree_util.tree_leaves(extra_args)
        )
        if inner._jit_compile and arrays_only:
            self._compiled(entries, extra_args)
        else:
            self._step(entries, extra_args)

    def _step(self, entries: list[Any], extra_args: Mapping[str, Any]) -> None:
        inner = self.inner_optimizer
        targets: Targets = inner._targets.value
        grads = [None if g is None else jnp.asarray(g) for g in entries]
        present = [g for g in grads if g is not None]
        finite = jnp.asarray(True)
        for g in present:
            finite = jnp.logical_and(finite, jnp.all(jnp.isfinite(g)))
        scale = self.scale.value()
        unscaled = [None if g is None else (g / scale).astype(g.dtype) for g in grads]
        writes = inner._new_values(targets.tree(unscaled), extra_args)
        for var, new in writes:  # a skipped step keeps every old value
            var.assign(_select(finite, new, var), read_value=False)
        inner.iterations.assign_add(finite.astype(jnp.int32), read_value=False)
        counter = self.step_counter.value()
        grow = jnp.logical_and(finite, counter == self.dynamic_growth_steps - 1)
        factor = jnp.where(finite, jnp.where(grow, 2.0, 1.0), 0.5).astype(scale.dtype)
        self.scale.assign(scale * factor, read_value=False)
        self.step_counter.assign(
            jnp.where(jnp.logical_and(finite, ~grow), counter + 1, 0).astype(counter.dtype),
            read_value=False,
        )

    def __repr__(self) -> str:
        return (
            f"<ps.LossScaleOptimizer '{self.scope_name}' scale={self.scale.value()!s} "
            f"around {self.inner_optimizer!r}>"
        )
