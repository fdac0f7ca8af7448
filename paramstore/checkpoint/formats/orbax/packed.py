"""Dtypes that Orbax (TensorStore) cannot store, kept as the bytes of a ``uint8`` array
(private; the format is ``paramstore.checkpoint.formats.orbax.format``).

The one-byte dtypes of ``ml_dtypes`` (int4, uint4, int2, uint2, float4_e2m1fn and every
float8) are stored as a ``uint8`` array of the same shape and sharding holding each
element's bits (a sub-byte value in the low bits, as JAX widens an unsigned integer); the
metadata keeps the real dtype and ``"stored": "uint8"``. The conversions run where the
shards live (one elementwise program), so a save copies no array to the host, and a
restore reads the bytes straight into the target sharding and converts them there. The
shard sums are those of the stored bytes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

STORED = "uint8"
_BITS = {"int4": 4, "uint4": 4, "float4_e2m1fn": 4, "int2": 2, "uint2": 2}
_UNSIGNED = {8: jnp.uint8, 4: jnp.uint4, 2: jnp.uint2}


def needs_packing(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is stored as bytes: a one-byte ``ml_dtypes`` type."""
    return dtype.itemsize == 1 and dtype.kind not in "biu" and hasattr(ml_dtypes, dtype.name)


def _bits(dtype: np.dtype) -> int:
    return _BITS.get(dtype.name, 8)


def _pack(x: jax.Array) -> jax.Array:
    unsigned = _UNSIGNED[_bits(np.dtype(x.dtype))]
    bits = jax.lax.bitcast_convert_type(x, unsigned)
    return bits if unsigned is jnp.uint8 else bits.astype(jnp.uint8)


def _unpack(x: jax.Array, dtype: Any) -> jax.Array:
    unsigned = _UNSIGNED[_bits(np.dtype(dtype))]
    return jax.lax.bitcast_convert_type(x.astype(unsigned), dtype)


_pack_jit = jax.jit(_pack)
_unpack_jit = jax.jit(_unpack, static_argnums=1)


def pack(x: Any) -> Any:
    """``x`` (a ``jax.Array`` or a NumPy array of a packed dtype) as its ``uint8`` bytes, a
    ``jax.Array`` on the same sharding or a NumPy array."""
    if isinstance(x, jax.Array):
        return _pack_jit(x)
    return np.asarray(_pack_jit(jax.device_put(np.asarray(x), jax.devices("cpu")[0])))


def unpack(x: Any, dtype: np.dtype) -> Any:
    """The stored bytes ``x`` back as ``dtype`` (bit for bit), where ``x`` lives."""
    if isinstance(x, jax.Array):
        return _unpack_jit(x, dtype)
    return np.asarray(_unpack_jit(jax.device_put(np.asarray(x), jax.devices("cpu")[0]), dtype))
