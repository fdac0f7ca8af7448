"""How a new variable gets its first value and placement (what ``Variable.__init__`` calls).

Contract (docs/api.md, "Models larger than one device"; ``paramstore._core.layout`` decides the
sharding, ``paramstore._variable.abstract`` runs or defers the initializer):

* ``shaped(init, shape, dtype)``: ``Variable(init, shape=..., dtype=...)`` calls
  ``init(shape, dtype)`` (float32 by default); a concrete value with ``shape=`` must have it.
* ``created(...) -> (value, owned, sharding)``: an initializer (a zero-argument callable)
  whose variable gets a sharding over several devices is traced for its shape, then run by
  one program compiled with that output sharding, so no device ever holds more than its own
  shards; it runs under the variable's name, so it draws the same key (and values) as an
  eager creation would. Anything else is computed as before and placed afterwards (the
  returned sharding), inside a ``ps.function`` trace by the program ``ps.function`` runs
  after the trace.
* ``check_arguments(...)``: the checks of ``ps.Variable``'s arguments that come before
  anything else (a missing ``initial_value``, a name or ``trainable`` of the wrong type,
  constraints and regularizers resolved by name); ``check_hooks(...)``: a constraint keeps
  the value's shape and dtype, a regularizer gives a scalar, checked abstractly before the
  variable exists (so a bad one creates nothing).
* ``abstract_value(...) -> (ShapeDtypeStruct with sharding, initializer or None)``: for a
  variable created inside ``ps.abstract()`` (or from a ``jax.ShapeDtypeStruct``, only
  allowed there): its initializer is traced, never run. One that cannot be traced on its
  own is a ``TypeError`` naming the variable.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from paramstore import constraints as _constraints
from paramstore import regularizers as _regularizers
from paramstore._core import frames
from paramstore._core.dtypes import STRING, canonical_dtype, is_key_dtype, shape_error
from paramstore._core.jax_api import current_trace
from paramstore._core.layout import Partition, check_partition, may_shard, target
from paramstore._core.placement import check_fits
from paramstore._variable import abstract as _abstract
from paramstore._variable.initial import flag, parse_initial
from paramstore._variable.ops import ArrayOps
from paramstore.typing import ConstraintLike, RegularizerLike

__all__ = ["MISSING", "check_arguments", "check_hooks", "shaped", "created", "abstract_value"]

MISSING: Any = object()  # ps.Variable's initial_value default: not given (a clear TypeError)


def _lazy(initial_value: Any) -> bool:
    return callable(initial_value) and not isinstance(initial_value, (ArrayOps, jax.Array))


Hook = Callable[[jax.Array], jax.Array]  # a resolved constraint or regularizer


def check_arguments(
    initial_value: Any,
    trainable: bool | None,
    name: str | None,
    constraint: ConstraintLike | None,
    regularizer: RegularizerLike | None,
) -> tuple[Hook | None, Hook | None]:
    """``ps.Variable``'s arguments checked before anything is made (TypeError, ValueError);
    the constraint and regularizer resolved (a Keras name or dict, a callable, or None)."""
    if initial_value is MISSING or initial_value is None:
        raise TypeError(
            "ps.Variable() missing required argument 'initial_value': an array-like, a "
            "jax.Array, another Variable, or a zero-argument callable (e.g. lambda: "
            "init((3, 4)))."
        )
    if name is not None and not isinstance(name, str):
        raise TypeError(f"A variable's name must be a str, got {type(name).__name__}.")
    if trainable is not None:
        flag(trainable, "trainable", f"ps.Variable({name!r})" if name else "ps.Variable")
    who = f"ps.Variable({name!r})"
    constraint = _constraints.get(constraint, f"{who}: constraint")
    regularizer = _regularizers.get(regularizer, f"{who}: regularizer")
    frames.check_create()
    return constraint, regularizer


def check_hooks(constraint: Hook | None, regularizer: Hook | None, value: Any, name: str) -> None:
    """A constraint must keep the value's shape and dtype, a regularizer give a scalar:
    checked abstractly before the variable exists (so a bad one creates nothing)."""
    if constraint is None and regularizer is None:
        return
    shape, dtype = tuple(value.shape), value.dtype
    if is_key_dtype(dtype) or np.dtype(dtype) == STRING:
        raise TypeError(
            f"Variable '{name}' holds {'PRNG keys' if is_key_dtype(dtype) else 'strings'}: it "
            "cannot have a constraint or a regularizer (they apply to numbers)."
        )
    if constraint is not None:
        _constraints.check(constraint, shape, dtype, name)
    if regularizer is not None:
        _regularizers.check(regularizer, shape, dtype, name)


def shaped(initial_value: Any, shape: Any, dtype: Any, full_name: str) -> Any:
    """``Variable(init, shape=..., dtype=...)``: the zero-argument callable
    ``init(shape, dtype)``, or a concrete value checked to have ``shape``."""
    try:
        dims = (
            (operator.index(shape),)
            if isinstance(shape, (int, np.integer))
            else tuple(map(operator.index, shape))
        )
    except TypeError:
        raise TypeError(
            f"Variable '{full_name}': shape= must be an int or a sequence of ints, got {shape!r}."
        ) from None
    if not _lazy(initial_value):
        if tuple(np.shape(initial_value)) != dims:
            raise shape_error(full_name, dims, tuple(np.shape(initial_value)))
        return initial_value
    want = jnp.float32 if dtype is None else dtype
    return lambda: initial_value(dims, want)


def created(
    initial_value: Any,
    dtype: Any,
    full_name: str,
    partition: Partition | None,
    device: Any,
    sharding: Any,
) -> tuple[Any, bool, Sharding | None]:
    """``(value, owned, sharding to place it on)`` of a new concrete variable (see the
    module docstring); the sharding is None when the value is already where it belongs."""
    current_trace()  # mends a trace an interrupt inside JAX left unset (jax_api)
    if (
        _lazy(initial_value)
        and frames.creation_trace() is None
        and may_shard(device, sharding, partition)
    ):

        def make() -> Any:
            return parse_initial(initial_value, dtype, full_name)[0]

        struct = _abstract.shape_of(make)
        if struct is not None:
            placed = target(full_name, struct.shape, partition, device, sharding)
            check_partition(partition, full_name, struct.shape)
            if placed is not None and _abstract.spread(placed):
                check_fits(placed, struct.shape, f"variable '{full_name}'")
                (value,) = _abstract.run_sharded([make], [placed])
                return value, True, None
    value, owned = parse_initial(initial_value, dtype, full_name)
    if isinstance(value, np.ndarray):  # strings live on the host
        check_partition(partition, full_name, value.shape)
        return value, owned, None
    placed = target(full_name, tuple(value.shape), partition, device, sharding)
    check_partition(partition, full_name, tuple(value.shape))
    return value, owned, placed


def abstract_value(
    initial_value: Any,
    dtype: Any,
    full_name: str,
    partition: Partition | None,
    device: Any,
    sharding: Any,
) -> tuple[jax.ShapeDtypeStruct, Any]:
    """The shape, dtype and sharding of a new abstract variable, and its initializer (None
    when it was given as a ``jax.ShapeDtypeStruct``)."""
    make: Any = None
    if isinstance(initial_value, jax.ShapeDtypeStruct):
        if not _abstract.creating():
            raise TypeError(
                f"Cannot make variable '{full_name}' from a jax.ShapeDtypeStruct outside "
                "ps.abstract(): it has no value. Create it inside `with ps.abstract():` (then "
                "restore a checkpoint into it), or pass an initializer."
            )
        struct = initial_value
        if dtype is not None:
            struct = jax.ShapeDtypeStruct(struct.shape, canonical_dtype(dtype, full_name))
        given = initial_value.sharding
        if sharding is None and device is None and isinstance(given, Sharding):
            sharding = given
    else:

        def make() -> Any:
            with frames.no_frames():  # the initializer's own values, never a trace's
                return parse_initial(initial_value, dtype, full_name)[0]

        found, error = _abstract.trace_shape(make)
        if found is None:
            why = f" ({type(error).__name__}: {error})" if error is not None else ""
            raise _abstract.AbstractTraceError(
                f"The initial value of variable '{full_name}' cannot be traced for its shape "
                "inside ps.abstract() (it reads another variable, draws from a "
                "ps.random.Generator, or makes strings). Pass an initializer of shapes only "
                "(ps.Variable(init, shape=...)), or create this variable outside "
                f"ps.abstract(){why}."
            ) from error
        struct = found
    shape = tuple(struct.shape)
    placed = target(full_name, shape, partition, device, sharding)
    if placed is not None:
        check_fits(placed, shape, f"variable '{full_name}'")
    check_partition(partition, full_name, shape)
    return jax.ShapeDtypeStruct(shape, struct.dtype, sharding=placed), make
