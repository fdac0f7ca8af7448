"""Randomness as state: ``ps.random.Generator``, ``next_key`` and ``set_seed``.

Contract (docs/api.md, "Initializers and randomness"):

* ``Generator(seed)`` (also ``Generator.from_seed(seed)``) is a stateful key stream, as
  ``tf.random.Generator``: its state is a non-trainable ``uint32`` Variable (``g.state``,
  the key data of a ``jax.random`` key), so it is checkpointed with the model and threaded
  through ``ps.function`` like any variable. ``g.key()`` splits the state, keeps one half
  and returns the other; ``normal``/``uniform`` draw with a new key; ``split(n)`` makes
  ``n`` independent generators. The same seed gives the same sequence; eagerly and inside
  a ``ps.function``, every call draws new numbers (a compiled function reads and writes
  the state like any variable, so it never repeats the numbers of its trace).
* ``next_key()``: inside a variable's initializer, a key derived from the global seed and
  the variable's full name (``paramstore._core.seed``: adding a layer leaves the other layers'
  initial values unchanged); elsewhere a key from the *global generator*, which advances
  inside ``ps.function`` calls too. The global generator is created on first use and lives
  in no user store (``ps.Saver()`` does not save it; ``get_global_generator()`` returns it
  for a ``ps.Checkpoint``).
* ``set_seed(seed)`` sets the global seed and restarts the global generator from it.
"""

from __future__ import annotations

import math
import operator
import os
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from paramstore._core import frames
from paramstore._core import seed as _seed
from paramstore._core.context import STATE_LOCK
from paramstore._core.seed import get_seed, naming
from paramstore._core.store import VariableStore
from paramstore.variable import Variable

__all__ = [
    "Generator",
    "get_global_generator",
    "next_key",
    "set_seed",
    "get_seed",
    "naming",
]


def _check_seed(seed: Any, what: str) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{what} expects an int seed, got {type(seed).__name__}: {seed!r}.")
    return int(seed)


def _sample_shape(shape: Sequence[int], what: str) -> tuple[int, ...]:
    """``shape`` checked before any key is drawn (so a bad one advances no state)."""
    try:
        dims = tuple(shape)
        if any(isinstance(d, bool | np.bool_) for d in dims):
            raise TypeError
        dims = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise TypeError(f"{what}: shape must be a sequence of ints, got {shape!r}.") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"{what}: shape {dims} has a negative dimension.")
    if math.prod(dims) >= 2**62:
        raise ValueError(f"{what}: shape {dims} has more elements than an array can hold.")
    return dims


def _key_data(seed: int) -> jax.Array:
    with jax.ensure_compile_time_eval():  # concrete even while a function is traced
        return jax.random.key_data(jax.random.key(seed & 0xFFFFFFFF))


class Generator:
    """A stateful PRNG key stream whose state is a Variable (see the module docstring)."""

    def __init__(
        self, seed: int | None = None, *, name: str = "generator", state: ArrayLike | None = None
    ) -> None:
        if state is None:
            if seed is None:
                seed = int.from_bytes(os.urandom(4), "little")
            state = _key_data(_check_seed(seed, "ps.random.Generator"))
        self.state = Variable(state, trainable=False, name=name)

    @classmethod
    def from_seed(cls, seed: int, name: str = "generator") -> Generator:
        """A generator starting from ``seed`` (same as ``Generator(seed)``)."""
        return cls(_check_seed(seed, "Generator.from_seed"), name=name)

    def key(self) -> jax.Array:
        """A new ``jax.random`` key; advances the state."""
        with STATE_LOCK:  # eagerly: read and write as one step
            new, out = jax.random.split(jax.random.wrap_key_data(self.state.value()))
            self.state.assign(jax.random.key_data(new))
        return out  # type: ignore[no-any-return]

    def normal(
        self,
        shape: Sequence[int],
        mean: float = 0.0,
        stddev: float = 1.0,
        dtype: DTypeLike = jnp.float32,
    ) -> jax.Array:
        """Normal samples of ``shape`` (``mean + stddev * N(0, 1)``)."""
        dims = _sample_shape(shape, "Generator.normal")
        return jax.random.normal(self.key(), dims, dtype) * stddev + mean

    def uniform(
        self,
        shape: Sequence[int],
        minval: float = 0.0,
        maxval: float = 1.0,
        dtype: DTypeLike = jnp.float32,
    ) -> jax.Array:
        """Uniform samples of ``shape`` in ``[minval, maxval)``."""
        dims = _sample_shape(shape, "Generator.uniform")
        return jax.random.uniform(self.key(), dims, dtype, minval, maxval)

    def split(self, count: int) -> list[Generator]:
        """``count`` new, independent generators (advances this one's state once)."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"Generator.split expects a positive int count, got {count!r}.")
        keys = jax.random.split(self.key(), count)
        return [Generator(state=jax.random.key_data(k), name=self.state.name) for k in keys]

    def __repr__(self) -> str:
        return f"<ps.random.Generator state={self.state.name!r}>"


_global: Generator | None = None
_global_lock = threading.Lock()


def get_global_generator() -> Generator:
    """The generator behind ``next_key()`` (created on first use, in no user store)."""
    global _global
    if _global is None:
        with _global_lock:
            if _global is None:
                with VariableStore(), frames.no_frames():
                    _global = Generator(get_seed(), name="global_generator")
    return _global


def next_key() -> jax.Array:
    """A new PRNG key (see the module docstring for where it comes from)."""
    key = _seed.named_key()
    return key if key is not None else get_global_generator().key()


def set_seed(seed: int) -> None:
    """Set the global seed (reproducible initialization) and restart the global generator."""
    _seed.set_seed(seed)
    if _global is not None:
        _global.state.assign(_key_data(get_seed()))
