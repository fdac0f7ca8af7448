"""Seeds and PRNG keys for initialization.

Contract:

* ``set_seed(seed)`` makes initialization reproducible run to run. Without it, the
  global seed is drawn from the OS at import, as TensorFlow does.
* Better than TensorFlow: a variable's initial value is drawn from a key derived from
  the global seed **and the variable's full name** (``fold_in(key(seed), crc32(name))``),
  not from a global op counter. Adding a layer to a model therefore leaves the initial
  values of every other layer unchanged. This applies whenever the initializer runs
  while the variable's name is known: ``get_variable(..., initializer=...)`` and
  ``Variable(callable, name=...)`` (the callable is called after the name is resolved).
* An initializer called outside any variable (``glorot_normal()((3, 4))``) draws from a
  counter-based key sequence, reset by ``set_seed``, so such programs are reproducible
  too, but depend on the order of the calls.
* An initializer built with an explicit ``seed=`` or ``key=`` ignores both and always
  returns the same values.
"""

from __future__ import annotations

import contextlib
import os
import threading
import zlib
from collections.abc import Iterator

import jax

__all__ = ["set_seed", "get_seed", "next_key", "naming"]

_lock = threading.Lock()
_seed: int = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
_counter: int = 0
_local = threading.local()

# Separate streams: keys for named variables and keys for anonymous draws never collide.
_ANON_STREAM = 0x7FFF_FFFF


def set_seed(seed: int) -> None:
    """Set the global seed and restart the key sequences derived from it."""
    global _seed, _counter
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"set_seed expects an int, got {type(seed).__name__}: {seed!r}.")
    with _lock:
        _seed = int(seed) & 0xFFFFFFFF
        _counter = 0


def get_seed() -> int:
    """The current global seed."""
    return _seed


def _name_to_int(name: str) -> int:
    return zlib.crc32(name.encode("utf-8")) & 0x7FFFFFFF


@contextlib.contextmanager
def naming(full_name: str) -> Iterator[None]:
    """Within this block, ``next_key()`` derives keys from ``full_name``.

    Used by ``Variable`` and ``get_variable`` around the call of an initializer.
    """
    stack = getattr(_local, "names", None)
    if stack is None:
        stack = _local.names = []
    stack.append([full_name, 0])
    try:
        yield
    finally:
        stack.pop()


def next_key() -> jax.Array:
    """A fresh PRNG key from the global seed (see the module docstring for the rule)."""
    global _counter
    stack = getattr(_local, "names", None)
    with jax.ensure_compile_time_eval():
        base = jax.random.key(_seed)
        with _lock:
            if stack:
                # A variable re-created under the same name (in a fresh store, say) gets
                # the same values; repeated draws inside one naming block differ.
                entry = stack[-1]
                draw = entry[1]
                entry[1] = draw + 1
                key = jax.random.fold_in(base, _name_to_int(entry[0]))
                return jax.random.fold_in(key, draw) if draw else key
            n = _counter
            _counter += 1
        return jax.random.fold_in(jax.random.fold_in(base, _ANON_STREAM), n)
