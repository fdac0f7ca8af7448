"""Variables left behind by a failed first trace of a ``ps.function``.

A variable created during a trace gets its value only when the trace completes (until then
it holds a placeholder: shape, dtype and sharding). When the trace cannot give it one (its
initial value depends on the values of the function's arguments, or an interrupt or error
stopped the trace or the program computing it), the variable is taken out of its store and
becomes ``Unusable``: code that still holds it (a layer's attribute, a list) gets a
``ValueError`` naming it on every use, never the placeholder posing as a value.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from paramstore._core.ownership import ownership
from paramstore.variable import Variable

__all__ = ["Unusable", "discard"]


def _error(name: str, what: str = "used") -> ValueError:
    return ValueError(
        f"Variable '{name}' cannot be {what}: it was created by a ps.function trace that "
        "failed before it computed the variable's initial value (see the error that trace "
        "raised), so it has no value and is in no store. Create it again (call the function "
        "again after fixing the cause: a layer that builds itself then builds anew)."
    )


class Unusable(Variable):
    """A variable whose creating trace failed: every use raises ``ValueError`` naming it."""

    __slots__ = ()

    def value(self) -> Any:
        raise _error(self._name, "read")

    read_value = value

    def numpy(self) -> np.ndarray:
        raise _error(self._name, "read")

    def _update(self, delta: Any, how: str) -> None:
        raise _error(self._name, "assigned")

    def _coerce(self, value: Any, op: str, *, host: bool = False) -> Any:
        raise _error(self._name, "assigned")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or not hasattr(np.ndarray, name):
            raise AttributeError(f"'ps.Variable' object has no attribute {name!r}")
        raise _error(self._name, f"used (.{name})")

    def __deepcopy__(self, memo: dict[int, Any]) -> Variable:
        raise _error(self._name, "copied")

    __copy__ = __deepcopy__

    def __repr__(self) -> str:
        return f"<ps.Variable '{self._name}' (unusable: its creating trace failed)>"


def discard(variables: list[Variable]) -> None:
    """Take the variables a failed trace created out of their stores and make them
    ``Unusable`` (each still holds its placeholder, which no read returns)."""
    for var in variables:
        var._store._forget(var)  # the store it was created in, not the default now
        ownership.take_initial(var, None)
        var.__class__ = Unusable
