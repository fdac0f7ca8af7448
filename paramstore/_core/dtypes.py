"""The dtype policy: what dtype a new variable gets, and which assigned values convert.

* Python values follow TensorFlow's inference (``3.14`` -> float32, ``[1, 2]`` -> int32,
  ``[True]`` -> bool, ``5+4j`` -> complex64); NumPy and JAX arrays keep their dtype (64-bit
  types need ``jax_enable_x64``); the array a variable holds is never weakly typed.
* An assigned value converts only without loss: Python numbers and lists (and weakly typed
  JAX values) within their kind or upward, typed arrays only by a safe cast.
* Strings (``dtype=str``, ``['abc']``) become a NumPy ``StringDType`` array.
* Typed PRNG key arrays (``jax.random.key(0)``) keep their key dtype.
"""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

__all__ = [
    "STRING",
    "IntegerOverflow",
    "canonical_dtype",
    "tf_infer",
    "strong",
    "is_text",
    "to_strings",
    "lossless",
    "dtype_error",
    "shape_error",
    "is_key_dtype",
]

STRING = np.dtypes.StringDType()

A = TypeVar("A", jax.Array, np.ndarray)  # an array, JAX's or NumPy's


def is_key_dtype(dtype: DTypeLike) -> bool:
    """Whether ``dtype`` is a typed PRNG key dtype (``jax.random.key(0).dtype``)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def canonical_dtype(dtype: DTypeLike, what: str) -> np.dtype:
    if dtype is str or dtype is np.str_:
        return STRING
    try:
        dt = np.dtype(jnp.dtype(dtype))
    except TypeError as e:
        raise TypeError(f"Unknown dtype {dtype!r} for {what}: {e}.") from None
    if dt.kind == "O":
        raise TypeError(
            f"dtype object for {what} is not supported: a variable holds numbers, booleans, "
            "PRNG keys or strings (dtype=str)."
        )
    if dt.kind in "UST":
        return STRING
    canonical = np.dtype(jax.dtypes.canonicalize_dtype(dt))
    if canonical != dt:
        raise TypeError(
            f"dtype {dt.name} for {what} needs 64-bit JAX; enable it with "
            "jax.config.update('jax_enable_x64', True) or use a 32-bit dtype."
        )
    return dt


class IntegerOverflow(ValueError):
    """A Python integer that does not fit in int32 while 64-bit JAX is off (``tf_infer``)."""


def tf_infer(value: object) -> np.ndarray:
    """A NumPy array for a Python value, with TensorFlow's dtype inference."""
    arr = np.asarray(value)
    kind = arr.dtype.kind
    if kind == "f":
        return arr.astype(np.float32)
    if kind == "c":
        return arr.astype(np.complex64)
    if kind in "iu":
        if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
            if jax.config.read("jax_enable_x64"):
                return arr.astype(np.int64)
            raise IntegerOverflow(
                f"Integer value {value!r} does not fit in int32; enable 64-bit JAX "
                "(jax.config.update('jax_enable_x64', True)) for int64 variables."
            )
        return arr.astype(np.int32)
    if kind in "UST" or kind == "O" and is_text(arr):
        return to_strings(arr)
    return arr  # an object array: the caller refuses it


def strong(x: A) -> A:
    """``x`` without JAX's weak type: a variable's array always has a definite dtype."""
    return x.astype(x.dtype) if getattr(x, "weak_type", False) else x


def is_text(arr: np.ndarray) -> bool:
    kind = arr.dtype.kind
    if kind == "O":
        return all(isinstance(x, (str, bytes)) for x in arr.flat)
    return kind in "UST"


def to_strings(arr: np.ndarray) -> np.ndarray:
    try:
        out = np.asarray(arr, dtype=STRING)
    except (TypeError, ValueError) as e:
        raise TypeError(f"Cannot make a string variable from {arr!r}: {e}.") from None
    out.flags.writeable = False
    return out


def lossless(src: np.dtype, dst: np.dtype, weak: bool) -> bool:
    if src == dst:
        return True
    if dst.kind == "b":
        return False
    if weak:
        # Python ints go into any integer variable, signed or not (range checked separately).
        if src.kind in "iu" and dst.kind in "iu":
            return True
        return bool(np.can_cast(src, dst, "same_kind"))
    return bool(np.can_cast(src, dst, "safe"))


def dtype_error(
    var_name: str, src: DTypeLike, dst: np.dtype, op: str, python_value: object = None
) -> TypeError:
    what = f"dtype {np.dtype(src).name}"
    if python_value is not None:  # say what the user wrote, not NumPy's default width
        what = f"Python {type(python_value).__name__} {python_value!r:.40} ({what})"
    return TypeError(
        f"Cannot {op} a value of {what} to variable '{var_name}' of dtype "
        f"{dst.name}: the conversion would lose information. A variable's dtype never "
        f"changes; cast explicitly, e.g. value.astype({dst.name!r})."
    )


def shape_error(var_name: str, want: tuple, got: tuple, what: str = "variable") -> ValueError:
    return ValueError(
        f"Shapes {want} and {got} are incompatible: cannot assign a value of shape {got} to "
        f"{what} '{var_name}' of shape {want}. A variable's shape never changes."
    )
