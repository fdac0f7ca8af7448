"""What a variable accepts as a new value: the checks and conversion of what ``assign``,
``assign_add`` / ``assign_sub`` and a sliced assign are given (free functions of the
variable, called by ``Variable``'s thin ``_coerce`` / ``_check_arithmetic`` /
``_colocated`` methods and, off the steady path, by ``Variable._update``).

Contract (see ``paramstore.variable``): lossless dtype conversions only (``TypeError``
naming both dtypes otherwise, from ``_core.dtypes``); a string variable takes strings
only, a key variable keys of its own type only; bool, string and key variables refuse
arithmetic; an update's delta broadcasts to the variable's shape (``ValueError``
otherwise). Every check runs before anything changes: a refused value leaves the variable
exactly as it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from paramstore._core.dtypes import (
    dtype_error,
    is_key_dtype,
    is_text,
    lossless,
    shape_error,
    strong,
    to_strings,
)
from paramstore._core.jax_api import ARRAY_TYPE, Tracer, current_trace
from paramstore._core.ownership import ownership
from paramstore._variable.initial import broadcasts, utf8
from paramstore._variable.ops import unwrap

if TYPE_CHECKING:  # the class sits above this module: a name for annotations only
    from paramstore.variable import Variable

__all__ = ["coerce", "checked_delta", "check_arithmetic", "colocated", "traced_context_error"]


def traced_context_error(name: str) -> TypeError:
    """An assign of variable ``name`` inside a plain JAX transformation (no frame of ours)."""
    return TypeError(
        f"Cannot assign to variable '{name}' from inside a plain JAX transformation "
        "(jax.jit, jax.grad, jax.vmap, lax control flow ...): the variable would hold a "
        "leaked tracer, or the assign would run once at trace time only. Decorate the "
        "function with @ps.function, or make it pure with ps.pure(fn, variables)."
    )


def checked_delta(var: Variable, delta: Any, how: str) -> Any:
    """``delta`` checked and converted for an update of ``var`` (``how``: ``"add"`` or
    ``"subtract"``); TypeError/ValueError with no change made."""
    if var._arith and type(delta) is ARRAY_TYPE and delta.dtype == var._dtype:
        # A strong jax.Array of the variable's dtype: the checks that apply are below
        # (its shape; weak types and other dtypes take coerce). Measured: assign_add on
        # 1,000 float32 13.4 -> 11.x us (2026-11-22).
        if delta.weak_type:
            d = var._coerce(delta, how, host=True)
        elif delta.shape == var._shape:
            return delta  # once it ran, the next delta with its aval skips all this
        else:
            d = delta
    else:
        check_arithmetic(var, how)
        d = var._coerce(delta, how, host=True)
    if d.shape != var._shape and not broadcasts(d.shape, var._shape):
        raise shape_error(var._name, var._shape, tuple(d.shape))
    return d


def check_arithmetic(var: Variable, what: str) -> None:
    """TypeError unless ``var`` supports ``what`` (an arithmetic update: not on strings,
    keys or bools)."""
    if var._is_string:
        raise TypeError(f"Cannot {what} on string variable '{var._name}'.")
    if var._is_key:
        raise TypeError(
            f"Cannot {what} on PRNG key variable '{var._name}': key variables only "
            "support assign (of a key of the same type)."
        )
    if var._dtype.kind == "b":
        raise TypeError(
            f"Cannot {what} on bool variable '{var._name}' (as in TensorFlow, bool "
            "variables only support assign)."
        )


def colocated(var: Variable, x: Any) -> Any:
    """``x`` usable with ``var``'s array in one eager op: an array committed to other
    devices goes through the host (jit would refuse to mix the two)."""
    if (
        isinstance(x, jax.Array)
        and not isinstance(x, Tracer)
        and x.committed  # an uncommitted array goes wherever the variable's is
        and x.sharding.device_set != ownership.peek(var).sharding.device_set
    ):
        return np.asarray(x)
    return x


def coerce(var: Variable, value: Any, op: str, *, host: bool = False) -> Any:
    """``value`` as an array of ``var``'s dtype, or TypeError (no change made).

    A jax.Array (or tracer) stays one, without a weak type. Python and NumPy values
    become a jax.Array or, with ``host``, a private NumPy copy (for an update op, which
    moves it to the device itself, and more cheaply)."""
    current_trace()  # mends a trace an interrupt inside JAX left unset (jax_api)
    value = unwrap(value)
    dst = var._dtype
    name = var._name
    if var._is_string:
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        if not is_text(arr):
            raise TypeError(
                f"Cannot {op} a value of dtype {arr.dtype.name} to string variable "
                f"'{name}': a variable's dtype never changes; convert the values "
                "to str explicitly."
            )
        return to_strings(utf8(arr, name))
    if var._is_key:
        if not (isinstance(value, jax.Array) and value.dtype == dst):
            got = getattr(value, "dtype", type(value).__name__)
            raise TypeError(
                f"Cannot {op} a value of dtype {got} to PRNG key variable '{name}' "
                f"of dtype {dst}: assign a key array of the same type (jax.random.key)."
            )
        return value
    if isinstance(value, jax.Array):  # also tracers
        if value.dtype != dst and is_key_dtype(value.dtype):
            raise TypeError(
                f"Cannot {op} a PRNG key array (dtype {value.dtype}) to variable "
                f"'{name}' of dtype {dst.name}: store its key data "
                "(jax.random.key_data(key)), or hold keys in a key variable "
                "(ps.Variable(jax.random.key(0)))."
            )
        if value.dtype != dst and not lossless(np.dtype(value.dtype), dst, value.weak_type):
            raise dtype_error(name, value.dtype, dst, op)
        return value.astype(dst) if value.dtype != dst else strong(value)
    if isinstance(value, (np.ndarray, np.generic)):
        if value.dtype != dst and not lossless(value.dtype, dst, weak=False):
            raise dtype_error(name, value.dtype, dst, op)
        arr = np.array(value, dtype=dst, copy=True)
        return arr if host else jnp.asarray(arr)
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"Cannot {op} {type(value).__name__} to variable '{name}': {e}.") from None
    src = arr.dtype if arr.dtype.kind not in "iu" else np.dtype(np.int64)
    if arr.dtype.kind in "USOT" or not lossless(src, dst, weak=True):
        raise dtype_error(name, arr.dtype, dst, op, python_value=value)
    if dst.kind in "iu" and arr.size:
        info = np.iinfo(dst)
        if arr.min() < info.min or arr.max() > info.max:
            raise TypeError(
                f"Cannot {op} {value!r} to variable '{name}' of dtype {dst.name}: "
                f"out of range [{info.min}, {info.max}]."
            )
    arr = arr.astype(dst)  # a copy, converted by NumPy the same way on every path
    return arr if host else jnp.asarray(arr)
