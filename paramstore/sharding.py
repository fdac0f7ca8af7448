"""Device placement and sharding of variables.

Contract:

* ``with ps.device("cpu:0"):`` (also ``"gpu:1"``, ``"cpu"`` for device 0, or a
  ``jax.Device``) places every Variable created inside on that device. An unknown name
  raises ``ValueError`` listing the devices that exist.
* ``Variable(..., device=...)`` or ``Variable(..., sharding=jax.sharding.Sharding)`` places
  one variable; an explicit argument wins over the context.
* A variable keeps its placement: every assign puts the new value where the old one was.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import Sharding, SingleDeviceSharding

__all__ = ["device", "resolve_device", "placement", "current_placement"]

_local = threading.local()


def resolve_device(spec: str | jax.Device) -> jax.Device:
    """A ``jax.Device`` from ``"cpu:0"``, ``"gpu:1"``, ``"cpu"`` or a ``jax.Device``."""
    if isinstance(spec, jax.Device):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"A device is a string like 'cpu:0' or a jax.Device, got {type(spec).__name__}."
        )
    text = spec.strip().lower().removeprefix("/device:")
    kind, _, index = text.partition(":")
    try:
        devices = jax.devices(kind)
    except RuntimeError:
        devices = []
    if not index:
        index = "0"
    if devices and index.isdigit() and int(index) < len(devices):
        return devices[int(index)]
    available = ", ".join(f"{d.platform}:{d.id}" for d in jax.devices())
    raise ValueError(f"No device '{spec}' exists here; the devices are: {available}.")


@contextlib.contextmanager
def device(spec: str | jax.Device) -> Iterator[jax.Device]:
    """Place the Variables created inside this block on ``spec``."""
    dev = resolve_device(spec)
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(SingleDeviceSharding(dev))
    try:
        yield dev
    finally:
        stack.pop()


def current_placement() -> Sharding | None:
    """The sharding set by the innermost ``ps.device`` block, if any."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def placement(device: Any = None, sharding: Sharding | None = None) -> Sharding | None:
    """The sharding a new variable asks for: explicit sharding, device, context, or None."""
    if sharding is not None and device is not None:
        raise ValueError("Give a Variable either device= or sharding=, not both.")
    if sharding is not None:
        if not isinstance(sharding, Sharding):
            raise TypeError(
                f"sharding= must be a jax.sharding.Sharding, got {type(sharding).__name__}."
            )
        return sharding
    if device is not None:
        return SingleDeviceSharding(resolve_device(device))
    return current_placement()
