"""How a variable's value changes: ``assign``, ``assign_add`` / ``assign_sub``, the checks
and conversion of the new value (``_coerce``: lossless dtype conversions only, exact or
broadcast shape) and the one write path (``_swap`` / ``_write``, through ``_core.ownership``).

``Writes`` is the base class of ``ps.Variable`` (``Variable`` -> ``Writes`` -> ``Reads``); it
holds no state of its own (``__slots__ = ()``) and uses the fields ``Reads`` declares. Its
methods are ``Variable``'s own: a base class adds no call to an assign (attribute lookup goes
through the type's method cache). A failed assign leaves the variable exactly as it was.
"""

from __future__ import annotations

from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np

from paramstore._core import frames as _trace
from paramstore._core.dtypes import (
    dtype_error,
    is_key_dtype,
    is_text,
    lossless,
    shape_error,
    strong,
    to_strings,
)
from paramstore._core.jax_api import ARRAY_TYPE, EVAL, Tracer, current_trace, staging
from paramstore._core.ownership import ownership
from paramstore._variable.initial import broadcasts, fresh, utf8
from paramstore._variable.ops import unwrap
from paramstore._variable.read import Reads
from paramstore.typing import ValueLike

__all__ = ["Writes"]

# Eager updates call these directly: jit's C++ dispatch skips jnp's Python argument checks.
# An owned buffer that nobody else holds is donated into the update (issue figures: a
# donated add runs at 0.65-0.73x of `x = x + d`, a fresh one at 1.10-1.34x).
_EAGER = {
    "add": (jax.jit(jnp.add), jax.jit(jnp.add, donate_argnums=0)),
    "subtract": (jax.jit(jnp.subtract), jax.jit(jnp.subtract, donate_argnums=0)),
}


def _traced_context_error(name: str) -> TypeError:
    return TypeError(
        f"Cannot assign to variable '{name}' from inside a plain JAX transformation "
        "(jax.jit, jax.grad, jax.vmap, lax control flow ...): the variable would hold a "
        "leaked tracer, or the assign would run once at trace time only. Decorate the "
        "function with @ps.function, or make it pure with ps.pure(fn, variables)."
    )


class Writes(Reads):
    """The writing half of ``ps.Variable`` (see the module docstring)."""

    __slots__ = ()

    def assign(self, value: ValueLike, read_value: bool = True) -> Self | None:
        """Replace the value. Raises ValueError (shape) or TypeError (dtype); then no change."""
        new = self._coerce(value, "assign")
        if new.shape != self._shape:
            raise shape_error(self._name, self._shape, tuple(new.shape))
        self._swap(new, owned=fresh(value, new))
        return self if read_value else None

    def assign_add(self, delta: ValueLike, read_value: bool = True) -> Self | None:
        """``self += delta`` atomically (delta broadcasts to the variable's shape)."""
        self._update(delta, "add")
        return self if read_value else None

    def assign_sub(self, delta: ValueLike, read_value: bool = True) -> Self | None:
        """``self -= delta`` atomically (delta broadcasts to the variable's shape)."""
        self._update(delta, "subtract")
        return self if read_value else None

    def _update(self, delta: Any, how: str) -> None:
        if type(delta) is ARRAY_TYPE and delta.aval is self._delta_aval:
            # The steady eager case: an array with the very aval (an immutable object) of a
            # delta that passed every check of _delta and already ran an update, so of this
            # variable's dtype and exact shape and not weakly typed, and jit's C++ dispatch
            # knows the update: one identity test instead of five attribute reads (assign_add
            # on 1,000 float32: 0.95x -> 0.85x of `x = x + d`, 2026-11-23).
            d, steady = delta, True
        else:
            d, steady = self._delta(delta, how), False
        if _trace.depth and _trace.active():  # traced: plain jnp ops, no nested jit
            op = jnp.add if how == "add" else jnp.subtract
            self._swap(op(self.value(), d), update=f"assign_{how[:3]}")
            return
        if current_trace() is not EVAL:
            raise _traced_context_error(self._name)
        if type(d) is not np.ndarray and d.committed:
            d = self._colocated(d)
        # The result lands where the variable's array is: no placement check.
        fresh, donating = _EAGER[how]
        if steady:
            ownership.update(self, fresh, donating, d)
            return
        # jit's own signature of the delta: the first update of each kind runs jit's Python
        # dispatch, maybe after the donation, so its interrupts are deferred (issue 28).
        kind = (type(d), d.dtype, d.shape, getattr(d, "weak_type", 0), getattr(d, "committed", 0))
        warm = kind in self._warm
        (ownership.update if warm else ownership.update_cold)(self, fresh, donating, d)
        if not warm:
            if len(self._warm) > 16:  # deltas of ever new shapes: keep it small
                self._warm.clear()
            self._warm.add(kind)
        if d is delta and type(d) is ARRAY_TYPE and d.shape == self._shape and not d.weak_type:
            self._delta_aval = d.aval  # the next delta with this aval: the steady path

    def _delta(self, delta: Any, how: str) -> Any:
        """``delta`` checked and converted for ``_update`` (TypeError/ValueError: no change)."""
        if self._arith and type(delta) is ARRAY_TYPE and delta.dtype == self._dtype:
            # A strong jax.Array of the variable's dtype: the checks that apply are below
            # (its shape; weak types and other dtypes take _coerce). Measured: assign_add on
            # 1,000 float32 13.4 -> 11.x us (2026-11-22).
            if delta.weak_type:
                d = self._coerce(delta, how, host=True)
            elif delta.shape == self._shape:
                return delta  # once it ran, the next delta with its aval skips all this
            else:
                d = delta
        else:
            self._check_arithmetic(how)
            d = self._coerce(delta, how, host=True)
        if d.shape != self._shape and not broadcasts(d.shape, self._shape):
            raise shape_error(self._name, self._shape, tuple(d.shape))
        return d

    def _check_arithmetic(self, what: str) -> None:
        if self._is_string:
            raise TypeError(f"Cannot {what} on string variable '{self._name}'.")
        if self._is_key:
            raise TypeError(
                f"Cannot {what} on PRNG key variable '{self._name}': key variables only "
                "support assign (of a key of the same type)."
            )
        if self._dtype.kind == "b":
            raise TypeError(
                f"Cannot {what} on bool variable '{self._name}' (as in TensorFlow, bool "
                "variables only support assign)."
            )

    def _colocated(self, x: Any) -> Any:
        """``x`` usable with this variable's array in one eager op: an array committed to
        other devices goes through the host (jit would refuse to mix the two)."""
        if (
            isinstance(x, jax.Array)
            and not isinstance(x, Tracer)
            and x.committed  # an uncommitted array goes wherever the variable's is
            and x.sharding.device_set != ownership.peek(self).sharding.device_set
        ):
            return np.asarray(x)
        return x

    def _coerce(self, value: Any, op: str, *, host: bool = False) -> Any:
        """``value`` as an array of this variable's dtype, or TypeError (no change made).

        A jax.Array (or tracer) stays one, without a weak type. Python and NumPy values
        become a jax.Array or, with ``host``, a private NumPy copy (for an update op, which
        moves it to the device itself, and more cheaply)."""
        value = unwrap(value)
        dst = self._dtype
        if self._is_string:
            arr = value if isinstance(value, np.ndarray) else np.asarray(value)
            if not is_text(arr):
                raise TypeError(
                    f"Cannot {op} a value of dtype {arr.dtype.name} to string variable "
                    f"'{self._name}': a variable's dtype never changes; convert the values "
                    "to str explicitly."
                )
            return to_strings(utf8(arr, self._name))
        if self._is_key:
            if not (isinstance(value, jax.Array) and value.dtype == dst):
                got = getattr(value, "dtype", type(value).__name__)
                raise TypeError(
                    f"Cannot {op} a value of dtype {got} to PRNG key variable '{self._name}' "
                    f"of dtype {dst}: assign a key array of the same type (jax.random.key)."
                )
            return value
        if isinstance(value, jax.Array):  # also tracers
            if value.dtype != dst and is_key_dtype(value.dtype):
                raise TypeError(
                    f"Cannot {op} a PRNG key array (dtype {value.dtype}) to variable "
                    f"'{self._name}' of dtype {dst.name}: store its key data "
                    "(jax.random.key_data(key)), or hold keys in a key variable "
                    "(ps.Variable(jax.random.key(0)))."
                )
            if value.dtype != dst and not lossless(np.dtype(value.dtype), dst, value.weak_type):
                raise dtype_error(self._name, value.dtype, dst, op)
            return value.astype(dst) if value.dtype != dst else strong(value)
        if isinstance(value, (np.ndarray, np.generic)):
            if value.dtype != dst and not lossless(value.dtype, dst, weak=False):
                raise dtype_error(self._name, value.dtype, dst, op)
            arr = np.array(value, dtype=dst, copy=True)
            return arr if host else jnp.asarray(arr)
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"Cannot {op} {type(value).__name__} to variable '{self._name}': {e}."
            ) from None
        src = arr.dtype if arr.dtype.kind not in "iu" else np.dtype(np.int64)
        if arr.dtype.kind in "USOT" or not lossless(src, dst, weak=True):
            raise dtype_error(self._name, arr.dtype, dst, op, python_value=value)
        if dst.kind in "iu" and arr.size:
            info = np.iinfo(dst)
            if arr.min() < info.min or arr.max() > info.max:
                raise TypeError(
                    f"Cannot {op} {value!r} to variable '{self._name}' of dtype {dst.name}: "
                    f"out of range [{info.min}, {info.max}]."
                )
        arr = arr.astype(dst)  # a copy, converted by NumPy the same way on every path
        return arr if host else jnp.asarray(arr)

    def _swap(self, new: Any, placed: bool = False, owned: bool = True, update: str = "") -> None:
        """Make ``new`` (checked by the caller) the value: in the active frame, or for real
        (``update``: the op, e.g. ``assign_add``, when ``new`` is computed from the value)."""
        if _trace.depth and _trace.bind(self, new, update):  # type: ignore[arg-type]  # a Variable
            return
        trace = current_trace()
        if isinstance(new, Tracer) or trace is not EVAL and staging(trace):
            raise _traced_context_error(self._name)
        if not (placed or self._is_string):
            old = ownership.peek(self).sharding
            if new.sharding != old:
                new = jax.device_put(new, old)
        self._write(new, owned)

    def _write(self, new: Any, owned: bool = False) -> None:
        """The one write path of a variable's real array (callers checked dtype, shape and
        placement). ``owned``: nobody outside this variable holds ``new``'s buffer."""
        ownership.write(self, new, owned)
