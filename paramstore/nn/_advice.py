"""What a custom layer that reads its variables before building itself is told.

Contract (docs/api.md, "Blocks of today's language models"; docs/layers.md, "A layer of your
own"): a ``ps.nn.Layer`` subclass whose ``__call__`` reads a variable attribute before the
layer is built (it never called ``self.ensure_built(x.shape)``) gets an ``AttributeError``
that names the line to add (and ``build(input_shape)`` to define, when the class has none),
never "call the layer on an input", which the user has just done. Read from outside the
layer's ``__call__`` (before any call), the usual advice applies (``paramstore.nn._base``).
The frames are looked at only on this error path.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

__all__ = ["read_in_own_call"]


def _in_own_call(layer: Any) -> bool:
    """Whether ``layer``'s own ``__call__`` is running below the caller (a few frames up)."""
    call = getattr(type(layer).__call__, "__wrapped__", type(layer).__call__)
    code = getattr(call, "__code__", None)
    frame: FrameType | None = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code is code and frame.f_locals.get("self") is layer:
            return True
        frame = frame.f_back
    return False


def read_in_own_call(layer: Any, name: str, has_build: bool) -> str | None:
    """The message for ``layer`` reading ``name`` unbuilt inside its own ``__call__``, or
    None when the read does not come from there."""
    if not _in_own_call(layer):
        return None
    cls = type(layer).__name__
    define = (
        ""
        if has_build
        else f" and define {cls}.build(input_shape) creating them with self.add_weight"
    )
    return (
        f"{layer.describe()} reads {name!r} in its __call__, but it is not built: a layer's "
        "variables are created by build(input_shape), which runs when __call__ first calls "
        "self.ensure_built(x.shape) (every ps.nn layer does; Keras calls build for you). Add "
        f"self.ensure_built(x.shape) at the top of {cls}.__call__{define}."
    )
