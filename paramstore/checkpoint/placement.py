"""Device placement of loaded checkpoint values (private).

``put`` places a batch of host arrays on their shardings as one ``jax.device_put`` would,
with a fast path for single-device targets; ``place`` is the same for a ``{name: value}``
dict whose placement may be None (stays a NumPy array; strings always do). Every reader of
``paramstore.checkpoint.format`` ends its ``load`` here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from paramstore._core.jax_api import put_on_device
from paramstore.checkpoint.format import is_string

# dtypes that jax.device_put would place unchanged (no x64 canonicalisation), for put
_NATIVE = (
    np.bool_,
    np.uint8,
    np.int8,
    np.uint16,
    np.int16,
    np.uint32,
    np.int32,
    np.uint64,
    np.int64,
    np.float16,
    ml_dtypes.bfloat16,
    np.float32,
    np.float64,
    np.complex64,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
)
_DIRECT_DTYPES = frozenset(
    np.dtype(t) for t in _NATIVE if jax.dtypes.canonicalize_dtype(np.dtype(t)) == np.dtype(t)
)


def place(values: dict[str, Any], wanted: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with each array whose ``wanted`` placement is not None put there (strings
    stay NumPy arrays); one batched device_put."""
    batch = [
        (n, values[n], p)
        for n, p in wanted.items()
        if p is not None and isinstance(values[n], np.ndarray) and not is_string(values[n].dtype)
    ]
    if batch:
        values.update(put(batch))
    return values


def put(batch: list[tuple[str, np.ndarray, Any]]) -> dict[str, Any]:
    """The batch on its placements: what one ``jax.device_put(arrays, shardings,
    may_alias=True)`` returns. Values bound for one device (a ``SingleDeviceSharding`` in
    the device's default memory) skip device_put's per-array Python (~30 us an array):
    the same XLA call it ends in, with the same aval, committed like it."""
    out: dict[str, Any] = {}
    rest: list[tuple[str, np.ndarray, Any]] = []
    devices: dict[Any, Any] = {}
    for name, arr, sharding in batch:
        device: Any = devices.get(sharding)
        if device is None and type(sharding) is jax.sharding.SingleDeviceSharding:
            (device,) = sharding.device_set
            if sharding.memory_kind not in (None, device.default_memory().kind):
                device = None
            devices[sharding] = device
        if device is None or arr.dtype not in _DIRECT_DTYPES or type(arr) is not np.ndarray:
            rest.append((name, arr, sharding))
            continue
        out[name] = put_on_device(arr, sharding, device)
    if rest:
        names, arrays, shardings = zip(*rest)
        placed = jax.device_put(list(arrays), list(shardings), may_alias=True)
        out.update(zip(names, placed))
    return out
