"""The global seed, and keys derived from it and a variable's name.

* ``set_seed(seed)`` makes initialization reproducible run to run. Without it, the global
  seed is drawn from the OS at import, as TensorFlow does.
* Better than TensorFlow: while a variable's initializer runs (inside ``naming(full
  name)``), ``named_key()`` derives keys from the global seed **and the variable's full
  name** (``fold_in(key(seed), crc32(name))``), not from a global op counter, so adding a
  layer to a model leaves every other layer's initial values unchanged. Outside such a
  block there is no named key, and ``paramstore.random.next_key`` draws from the global
  ``Generator`` instead.
"""

from __future__ import annotations

import contextlib
import os
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.typing import ArrayLike

from paramstore._core.context import ctx

__all__ = ["set_seed", "get_seed", "naming", "named_key", "recording"]

_lock = threading.Lock()
_seed: int = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def set_seed(seed: int) -> None:
    """Set the global seed (the named keys derived from it change with it)."""
    global _seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"set_seed expects an int, got {type(seed).__name__}: {seed!r}.")
    with _lock:
        _seed = int(seed) & 0xFFFFFFFF


def get_seed() -> int:
    """The current global seed."""
    return _seed


def _name_to_int(name: str) -> int:
    return zlib.crc32(name.encode("utf-8")) & 0x7FFFFFFF


@contextlib.contextmanager
def naming(
    full_name: str, initializer: Callable[[], Any] | None = None, *, index: ArrayLike | None = None
) -> Iterator[None]:
    """Within this block, ``named_key()`` derives keys from ``full_name`` (and ``index``).

    Used by ``Variable`` around the call of an initializer (``initializer``, which the
    innermost ``recording()`` block, if any, records under ``full_name``).
    """
    if initializer is not None and ctx.recorders:
        ctx.recorders[-1][full_name] = initializer
    outer = ctx.names[-1][2] if ctx.names else ()
    entry = [full_name, 0, outer if index is None else (*outer, index)]
    ctx.names += (entry,)  # no call, so no signal check, before the try
    try:
        yield
    finally:
        ctx.names.pop()


@contextlib.contextmanager
def recording() -> Iterator[dict[str, Callable[[], Any]]]:
    """Collect ``{full name: initializer}`` for the variables created inside."""
    found: dict[str, Callable[[], Any]] = {}
    ctx.recorders += (found,)  # no call, so no signal check, before the try
    try:
        yield found
    finally:
        ctx.recorders.pop()


def named_key() -> jax.Array | None:
    """The next key of the innermost ``naming`` block, or None outside every block.

    A variable re-created under the same name (in a fresh store, say) gets the same
    values; repeated draws inside one block differ."""
    if not ctx.names:
        return None
    entry = ctx.names[-1]
    draw = entry[1]
    entry[1] = draw + 1
    key = jax.random.fold_in(jax.random.key(_seed), _name_to_int(entry[0]))
    for index in entry[2]:  # the copy's index in each enclosing stack, outermost first
        key = jax.random.fold_in(key, index)
    return jax.random.fold_in(key, draw) if draw else key
