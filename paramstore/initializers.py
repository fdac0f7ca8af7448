"""Initializers: Keras 3 defaults, built on ``jax.nn.initializers``.

Contract:

* Every name here is a *factory*: ``glorot_uniform()`` returns an initializer
  ``init(shape, dtype=jnp.float32) -> jax.Array``. ``shape`` may be an int or any
  sequence of ints and ``dtype`` anything ``jnp.dtype`` accepts; the result has exactly
  that shape and dtype (after JAX's usual canonicalization: 64-bit types become 32-bit
  unless ``jax_enable_x64`` is set). Called inside a ``ps.function`` trace they return
  traced values (a variable created from one gets its value computed after the trace).
* ``zeros``, ``ones`` and ``constant(value)`` work for every dtype (bool, integer,
  floating, complex). ``constant`` broadcasts ``value`` to ``shape`` with NumPy rules
  and raises ``ValueError`` naming both shapes when it cannot.
* The random initializers need a real floating dtype (complex is rejected too, as in
  Keras) and raise ``TypeError`` otherwise. Each takes keyword ``seed=`` (an int) or
  ``key=`` (a typed or raw ``uint32`` JAX PRNG key), at most one of them:

  - ``seed=`` / ``key=``: every call returns the same values (Keras 3 behaviour for an
    int seed).
  - neither: the key comes from :func:`paramstore.random.next_key` *at call time*: from
    the global seed and the name of the variable being created, or, outside a variable's
    initializer, from the global generator (see :mod:`paramstore.random`).

* Defaults and formulas are Keras 3's. Fans follow Keras' ``compute_fans``: 0-D shapes
  have ``fan_in = fan_out = 1``, 1-D shapes ``fan_in = fan_out = shape[0]``, and N-D
  shapes ``fan_in = shape[-2] * receptive``, ``fan_out = shape[-1] * receptive`` with
  ``receptive = prod(shape[:-2])``. (``jax.nn.initializers`` rejects shapes below 2-D;
  those are drawn as ``(size, 1)`` with ``mode="fan_in"``, which gives Keras' fans for
  every mode, then reshaped.) The ``*_normal`` variance-scaling initializers draw from
  a normal truncated at two standard deviations, rescaled so the variance is
  ``scale / n``, as in Keras.
* ``orthogonal`` needs rank >= 2 (``ValueError`` otherwise, as in Keras) and flattens
  the shape to ``(prod(shape[:-1]), shape[-1])``; 16-bit dtypes are computed in float32
  (LAPACK has no 16-bit QR) and cast.
* ``zeros``, ``ones`` and ``constant`` take no ``seed=``/``key=``. Shapes with a
  zero-sized dimension give an empty array without drawing a key.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from . import random as _psrandom
from .typing import Initializer, InitializerLike, ShapeLike

__all__ = [
    "resolve",
    "Initializer",
    "zeros",
    "ones",
    "constant",
    "random_normal",
    "random_uniform",
    "truncated_normal",
    "glorot_normal",
    "glorot_uniform",
    "xavier_normal",
    "xavier_uniform",
    "he_normal",
    "he_uniform",
    "lecun_normal",
    "orthogonal",
]

_Draw = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


def resolve(initializer: InitializerLike) -> InitializerLike:
    """An initializer given uncalled, as TF1 accepts it (``initializer=zeros`` rather than
    ``zeros()``), called with no arguments; anything else unchanged. A factory that needs
    arguments (``constant``) raises TypeError saying to call it."""
    if initializer is constant:
        raise TypeError(
            "initializer=ps.initializers.constant needs its value: pass "
            "ps.initializers.constant(value)."
        )
    if any(initializer is f for f in _FACTORIES):
        return cast(Callable[[], Initializer], initializer)()
    return initializer


def _shape(shape: ShapeLike) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
    out = tuple(operator.index(d) for d in dims)
    if any(d < 0 for d in out):
        raise ValueError(f"Initializer shape must be non-negative, got {out}.")
    return out


def _deterministic(name: str, fill: Callable[[tuple[int, ...], Any], jax.Array]) -> Initializer:
    def init(shape: ShapeLike, dtype: DTypeLike = jnp.float32) -> jax.Array:
        return fill(_shape(shape), jnp.dtype(dtype))

    init.__qualname__ = init.__name__ = name
    return init


def _random(
    name: str, draw: _Draw, seed: int | None, key: ArrayLike | None, min_rank: int = 0
) -> Initializer:
    """Wrap ``draw(key, shape, dtype)`` with the shape, dtype and key rules."""
    if seed is not None and key is not None:
        raise TypeError(f"{name}: pass at most one of seed= and key=.")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int | np.integer)):
        raise TypeError(f"{name}: seed must be an int, got {type(seed).__name__}.")

    def init(shape: ShapeLike, dtype: DTypeLike = jnp.float32) -> jax.Array:
        shape_, dtype_ = _shape(shape), jnp.dtype(dtype)
        if not jnp.issubdtype(dtype_, jnp.floating):
            raise TypeError(f"{name} initializer needs a floating dtype, got {dtype_}.")
        if len(shape_) < min_rank:
            raise ValueError(
                f"{name} initializer needs a shape of rank >= {min_rank}, got {shape_}."
            )
        if math.prod(shape_) == 0:
            return jnp.zeros(shape_, dtype_)
        if key is not None:
            k = jnp.asarray(key)
        elif seed is not None:
            k = jax.random.key(int(seed))
        else:
            k = _psrandom.next_key()
        return draw(k, shape_, dtype_)

    init.__qualname__ = init.__name__ = name
    return init


def _scaling(
    name: str,
    scale: float,
    mode: Literal["fan_in", "fan_out", "fan_avg"],
    distribution: Literal["truncated_normal", "uniform"],
    seed: int | None,
    key: ArrayLike | None,
) -> Initializer:
    def draw(k: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        if len(shape) >= 2:
            return jax.nn.initializers.variance_scaling(scale, mode, distribution)(k, shape, dtype)
        # Keras: fan_in = fan_out = size for 0-D/1-D; (size, 1) under "fan_in" gives that.
        vs = jax.nn.initializers.variance_scaling(scale, "fan_in", distribution)
        return vs(k, (math.prod(shape), 1), dtype).reshape(shape)

    return _random(name, draw, seed, key)


def zeros() -> Initializer:
    """All zeros, any dtype."""
    return _deterministic("zeros", jnp.zeros)


def ones() -> Initializer:
    """All ones, any dtype."""
    return _deterministic("ones", jnp.ones)


def constant(value: ArrayLike) -> Initializer:
    """``value`` cast to ``dtype`` and broadcast to ``shape`` (NumPy rules), any dtype."""

    def fill(shape: tuple[int, ...], dtype: Any) -> jax.Array:
        v = jnp.asarray(value, dtype)
        try:
            return jnp.broadcast_to(v, shape)
        except ValueError:
            raise ValueError(
                f"constant initializer: value of shape {v.shape} does not broadcast to "
                f"shape {shape}."
            ) from None

    return _deterministic("constant", fill)


def random_normal(
    mean: float = 0.0,
    stddev: float = 0.05,
    *,
    seed: int | None = None,
    key: ArrayLike | None = None,
) -> Initializer:
    """Normal ``N(mean, stddev**2)``; Keras default ``stddev=0.05``."""

    def draw(k: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        return jax.nn.initializers.normal(stddev)(k, shape, dtype) + jnp.asarray(mean, dtype)

    return _random("random_normal", draw, seed, key)


def random_uniform(
    minval: float = -0.05,
    maxval: float = 0.05,
    *,
    seed: int | None = None,
    key: ArrayLike | None = None,
) -> Initializer:
    """Uniform on ``[minval, maxval)``; Keras default ``(-0.05, 0.05)``."""

    def draw(k: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        return jax.random.uniform(k, shape, dtype, minval, maxval)

    return _random("random_uniform", draw, seed, key)


def truncated_normal(
    mean: float = 0.0,
    stddev: float = 0.05,
    *,
    seed: int | None = None,
    key: ArrayLike | None = None,
) -> Initializer:
    """``N(mean, stddev**2)`` truncated to ``mean ± 2 stddev`` (not rescaled, as in Keras)."""

    def draw(k: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        tn = jax.nn.initializers.truncated_normal(stddev)
        return tn(k, shape, dtype) + jnp.asarray(mean, dtype)

    return _random("truncated_normal", draw, seed, key)


def glorot_normal(*, seed: int | None = None, key: ArrayLike | None = None) -> Initializer:
    """Truncated normal, ``stddev = sqrt(2 / (fan_in + fan_out))``."""
    return _scaling("glorot_normal", 1.0, "fan_avg", "truncated_normal", seed, key)


def glorot_uniform(*, seed: int | None = None, key: ArrayLike | None = None) -> Initializer:
    """Uniform on ``±sqrt(6 / (fan_in + fan_out))``."""
    return _scaling("glorot_uniform", 1.0, "fan_avg", "uniform", seed, key)


xavier_normal = glorot_normal
xavier_uniform = glorot_uniform


def he_normal(*, seed: int | None = None, key: ArrayLike | None = None) -> Initializer:
    """Truncated normal, ``stddev = sqrt(2 / fan_in)``."""
    return _scaling("he_normal", 2.0, "fan_in", "truncated_normal", seed, key)


def he_uniform(*, seed: int | None = None, key: ArrayLike | None = None) -> Initializer:
    """Uniform on ``±sqrt(6 / fan_in)``."""
    return _scaling("he_uniform", 2.0, "fan_in", "uniform", seed, key)


def lecun_normal(*, seed: int | None = None, key: ArrayLike | None = None) -> Initializer:
    """Truncated normal, ``stddev = sqrt(1 / fan_in)``."""
    return _scaling("lecun_normal", 1.0, "fan_in", "truncated_normal", seed, key)


def orthogonal(
    gain: float = 1.0, *, seed: int | None = None, key: ArrayLike | None = None
) -> Initializer:
    """``gain`` times a (semi-)orthogonal matrix over ``(prod(shape[:-1]), shape[-1])``."""

    def draw(k: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        # LAPACK's QR has no 16-bit kernels: compute in float32 at least, then cast.
        wide = jnp.promote_types(dtype, jnp.float32)
        return jax.nn.initializers.orthogonal(gain)(k, shape, wide).astype(dtype)

    return _random("orthogonal", draw, seed, key, min_rank=2)


_FACTORIES = tuple(
    {
        zeros,
        ones,
        random_normal,
        random_uniform,
        truncated_normal,
        glorot_normal,
        glorot_uniform,
        xavier_normal,
        xavier_uniform,
        he_normal,
        he_uniform,
        lecun_normal,
        orthogonal,
    }
)
