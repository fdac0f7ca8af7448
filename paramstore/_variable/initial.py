"""A variable's initial value: what ``ps.Variable(initial_value, dtype=...)`` accepts and how
it becomes the variable's first array (see ``variable``'s contract)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paramstore._core import frames
from paramstore._core.dtypes import (
    STRING,
    IntegerOverflow,
    canonical_dtype,
    dtype_error,
    is_key_dtype,
    is_text,
    lossless,
    strong,
    tf_infer,
    to_strings,
)
from paramstore._core.jax_api import Tracer, in_trace
from paramstore._core.seed import naming
from paramstore._variable.ops import ArrayOps, unwrap

__all__ = ["parse_initial", "fresh", "broadcasts", "flag", "utf8"]


def fresh(given: Any, new: Any) -> bool:
    """Whether ``new`` (what ``_coerce`` made of ``given``) is a buffer nobody else holds."""
    given = unwrap(given)
    if isinstance(given, jax.Array):
        return bool(new.dtype != given.dtype)  # a cast makes a new buffer; else it is theirs
    return True


def broadcasts(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    try:
        return np.broadcast_shapes(src, dst) == tuple(dst)
    except ValueError:
        return False


def parse_initial(initial_value: Any, dtype: Any, full_name: str) -> tuple[Any, bool]:
    """The first value of a variable named ``full_name`` and whether we own its buffer: a
    concrete array, or (in a ``ps.function`` trace) a tracer."""
    want = None if dtype is None else canonical_dtype(dtype, f"variable '{full_name}'")
    if callable(initial_value) and not isinstance(initial_value, (ArrayOps, jax.Array)):
        base = frames.creation_trace()
        with (
            naming(full_name, initial_value),
            in_trace(base) if base is not None else nullcontext(),
        ):
            initial_value = initial_value()
    if isinstance(initial_value, ArrayOps):
        source = initial_value.value()
        if isinstance(source, np.ndarray):  # strings: host data
            return _strings(np.array(source, copy=True), full_name), True
        _check_explicit(source, want, full_name)
        copied = jnp.array(source, copy=True)  # never share state
        return _cast(copied, want, full_name), True
    value = initial_value
    if want is not None and want == STRING:
        return to_strings(utf8(np.asarray(value), full_name)), True
    if isinstance(value, jax.Array):  # also tracers
        if is_key_dtype(value.dtype):
            if want is not None:
                raise TypeError(f"Variable '{full_name}': a PRNG key array takes no dtype=.")
            return value, False
        _check_explicit(value, want, full_name)
        return _cast(value, want, full_name), False
    if isinstance(value, (np.ndarray, np.generic)):
        if value.dtype.kind in "USOT":
            return _strings(np.asarray(value), full_name), True
        if not value.dtype.isnative:  # big-endian data: JAX takes the native byte order only
            value = value.astype(value.dtype.newbyteorder("="))
        _check_explicit(value, want, full_name)
        return strong(jnp.asarray(np.array(value, copy=True), dtype=want)), True
    if want is not None and want.kind in "iub":  # as assign checks a Python value
        try:
            host = np.asarray(value)
        except (TypeError, ValueError):
            host = None
        if host is not None and host.dtype.kind in "biuf":
            _check_explicit(host, want, full_name, python_value=value)
    try:
        arr = tf_infer(value)
    except IntegerOverflow:
        raise
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.dtype.kind == "O" and not is_text(arr):
        raise TypeError(
            f"Cannot make variable '{full_name}' from a {type(value).__name__}: initial_value "
            "must be array-like (a number, a nested list of numbers, a NumPy or JAX array, "
            "strings), another Variable, or a zero-argument callable returning one."
        )
    if arr.dtype == STRING or arr.dtype.kind == "O":
        return _strings(arr, full_name), True
    if isinstance(arr, np.ndarray) and not arr.dtype.isnative:  # a list of big-endian arrays
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return strong(jnp.asarray(arr, dtype=want)), True


def utf8(arr: np.ndarray, name: str) -> np.ndarray:
    """``arr`` with its bytes decoded as UTF-8 (string variables hold text, which is what
    they save and print); bytes that are not valid UTF-8 are a TypeError."""
    kind = arr.dtype.kind
    if kind != "S" and not (kind == "O" and any(isinstance(x, bytes) for x in arr.flat)):
        return arr
    try:
        text = [x.decode("utf-8") if isinstance(x, bytes) else x for x in arr.flat]
    except UnicodeDecodeError as e:
        raise TypeError(
            f"String variable '{name}' holds UTF-8 text, and these bytes are not valid utf-8 "
            f"({e}). Decode them first (e.g. b.decode('latin-1')), or keep raw bytes in a "
            "uint8 variable (np.frombuffer(b, np.uint8))."
        ) from None
    return np.array(text, dtype=object).reshape(arr.shape)


def flag(value: Any, name: str, where: str) -> bool:
    """``value`` as a bool flag: a Python or NumPy bool only (``trainable="no"`` would be
    truthy), else TypeError naming the flag."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(
        f"{where}: {name} must be a bool (True or False), got {type(value).__name__} {value!r:.40}."
    )


def _check_explicit(value: Any, want: Any, full_name: str, python_value: Any = None) -> None:
    """Refuse an explicit ``dtype=`` that would change ``value``'s values, with the rules of
    ``assign`` for a Python value: same-kind or widening casts only (no float into an
    integer or bool variable, NaN and infinities included), integers within range."""
    if want is None or want == STRING or is_key_dtype(value.dtype):
        return
    src = np.dtype(value.dtype)
    if src.kind in "USOT":
        return  # strings: a string variable (or its own error)
    check = np.dtype(np.int64) if python_value is not None and src.kind in "iu" else src
    if not lossless(check, want, weak=True):
        raise dtype_error(full_name, src, want, "convert", python_value=python_value)
    if want.kind in "iu" and src.kind in "iu" and not isinstance(value, Tracer) and value.size:
        info = np.iinfo(want)
        lo, hi = int(value.min()), int(value.max())
        if lo < info.min or hi > info.max:
            shown = (
                f"{python_value!r:.40}" if python_value is not None else f"values in [{lo}, {hi}]"
            )
            raise TypeError(
                f"Cannot make variable '{full_name}' of dtype {want.name} from {shown}: out of "
                f"range [{info.min}, {info.max}]. Pass values that fit, or another dtype."
            )


def _strings(arr: np.ndarray, full_name: str) -> np.ndarray:
    if arr.dtype.kind == "O" and not is_text(arr):
        raise TypeError(
            f"Cannot make variable '{full_name}' from an object array: only strings make "
            "host-side string variables."
        )
    return to_strings(utf8(arr, full_name))


def _cast(value: Any, want: Any, full_name: str) -> Any:
    if np.dtype(value.dtype).kind in "USOT":
        return to_strings(utf8(np.asarray(value), full_name))
    return strong(jnp.asarray(value, dtype=want))
