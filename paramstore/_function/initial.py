"""The initial values of variables created inside a ``ps.function``'s first trace from
traced values: the part of the trace they depend on, cut out, compiled (with each placed
variable's sharding) and run once; an initial value may depend on the arguments' shapes,
not their values, except for variables marked ``initial_from_first_call`` (an average's
shadow)."""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.extend as jex

from paramstore._core.jax_api import Tracer, init_program
from paramstore._core.loops import pure
from paramstore._core.ownership import ownership
from paramstore.variable import Variable

__all__ = ["initial_from_first_call", "initialize"]

_FROM_FIRST_CALL: weakref.WeakValueDictionary[int, Variable] = weakref.WeakValueDictionary()


def initial_from_first_call(var: Variable) -> None:
    """Let ``var``, created in this first trace, start at the value its initial value has
    in the function's first call even where that depends on the arguments (computed from
    the first call's arguments): an average's shadow starts at its variable's value at
    that point of the step (docs/api.md, "Weight averaging"). Other variables may not."""
    _FROM_FIRST_CALL[id(var)] = var  # (by id: a Variable compares elementwise)


def initialize(
    closed: Any, created: list[tuple[Variable, Any]], error: Any, arrays: list[Any]
) -> None:
    """Compute the initial values of the variables created (with traced values) during the
    trace ``closed``: run the part of the jaxpr they depend on, once, and write them.
    ``arrays``: the first call's arguments (only ``initial_from_first_call`` variables may
    depend on them)."""
    closed = pure(closed)
    jaxpr = closed.jaxpr
    n_out, n_created = len(jaxpr.outvars), len(created)
    names = ", ".join(f"'{v.name}'" for v, _ in created)
    used_out = [False] * (n_out - n_created) + [True] * n_created
    init, used_in = init_program(jaxpr, used_out)
    n_consts = len(jaxpr.constvars)
    if any(used_in[n_consts:]) and _arguments_refused(jaxpr, created, n_consts, arrays):
        # no value for any of them: made unusable by the caller
        raise ValueError(
            f"The initial value of variable(s) {names}, created inside a ps.function, "
            "depends on the values of the function's arguments. An initial value may depend "
            "on their shapes and dtypes only (as Keras' build(input_shape)): compute it from "
            "x.shape, or create the variable outside and assign it."
        ) from error
    consts = [c for c, used in zip(closed.consts, used_in[:n_consts]) if used]
    consts += [a for a, used in zip(arrays, used_in[n_consts:]) if used]  # (allowed above)
    init = init.replace(debug_info=init.debug_info.with_unknown_names())
    # A variable created with a sharding (sharding=, a LayoutMap, axis rules) gets its value
    # from a program compiled with that output sharding: no device holds more than its
    # shards. The others come from a program with no output shardings, as before.
    shardings = [ownership.peek(v).sharding for v, _ in created]
    run = jex.core.jaxpr_as_fun(jex.core.ClosedJaxpr(init, []))
    values: list[Any] = [None] * n_created
    placed = [i for i, sh in enumerate(shardings) if sh is not None]
    for group in (placed, [i for i, sh in enumerate(shardings) if sh is None]):
        if group:
            outs = [shardings[i] for i in group] if group is placed else None
            program = jax.jit(lambda *c, g=group: [run(*c)[i] for i in g], out_shardings=outs)
            for i, value in zip(group, program(*consts)):
                values[i] = value
    for (var, _), value in zip(created, values):
        override = ownership.take_initial(var, None)
        sharding = ownership.peek(var).sharding
        if override is not None and sharding is not None:
            override = jax.device_put(override, sharding)
        var._write(value if override is None else override, owned=True)


def _arguments_refused(
    jaxpr: Any, created: list[tuple[Variable, Any]], n_consts: int, arrays: list[Any]
) -> bool:
    """Whether an initial value that depends on the arguments is refused: arguments that
    are traced (a ps.function inside another trace), or a variable that depends on them
    and is not ``initial_from_first_call``'s."""
    if any(isinstance(a, Tracer) for a in arrays):
        return True
    n_out, n_created = len(jaxpr.outvars), len(created)
    for i, (var, _) in enumerate(created):
        if _FROM_FIRST_CALL.get(id(var)) is var:
            continue
        one = [False] * n_out
        one[n_out - n_created + i] = True
        if any(init_program(jaxpr, one)[1][n_consts:]):
            return True
    return False
