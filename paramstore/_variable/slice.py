"""``v[index]``: a view of part of a variable that reads like an array and assigns that part."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from paramstore._core.context import STATE_LOCK
from paramstore._core.dtypes import shape_error
from paramstore._variable.initial import broadcasts
from paramstore._variable.ops import ArrayOps, unwrap
from paramstore.typing import Index, ValueLike

if TYPE_CHECKING:
    from paramstore.variable import Variable

__all__ = ["VariableSlice"]


class VariableSlice(ArrayOps):
    """``v[index]``: reads like an array; ``assign``/``assign_add``/``assign_sub`` update
    that part of ``v`` (a value that does not fit the slice raises ValueError)."""

    __slots__ = ("_var", "_index")

    def __init__(self, var: Variable, index: Index) -> None:
        self._var = var
        self._index = unwrap(index)

    def value(self) -> jax.Array:
        """The slice's current value (a ``jax.Array``)."""
        return self._var.value()[self._index]

    read_value = value

    def numpy(self) -> np.ndarray:
        """The slice's current value as a NumPy copy."""
        return np.array(self.value(), copy=True)

    @property
    def shape(self) -> tuple[int, ...]:
        """The slice's shape; IndexError for an index out of range (JAX would clamp it)."""
        probe = np.broadcast_to(np.empty((), dtype=bool), self._var.shape)  # no memory
        try:
            return tuple(probe[self._index].shape)
        except IndexError as e:
            raise IndexError(
                f"Index {self._index!r} is out of range for variable '{self._var.name}' of "
                f"shape {self._var.shape}: {e}."
            ) from None
        except Exception:  # e.g. a traced index: only JAX knows
            return tuple(self.value().shape)

    def __getitem__(self, index: Index) -> jax.Array:
        return self.value()[unwrap(index)]

    def __repr__(self) -> str:
        return f"<ps.Variable '{self._var.name}'[{self._index!r}] value={self.value()!r}>"

    def assign(self, value: ValueLike, read_value: bool = True) -> Variable | None:
        """Write ``value`` into the slice of the variable (shape and dtype checked, nothing
        changed on error); returns the variable when ``read_value``."""
        return self._scatter(value, "set", exact=True, read_value=read_value)

    def assign_add(self, delta: ValueLike, read_value: bool = True) -> Variable | None:
        """Add ``delta`` to the slice of the variable; returns the variable when
        ``read_value``."""
        return self._scatter(delta, "add", exact=False, read_value=read_value)

    def assign_sub(self, delta: ValueLike, read_value: bool = True) -> Variable | None:
        """Subtract ``delta`` from the slice of the variable; returns the variable when
        ``read_value``."""
        return self._scatter(delta, "subtract", exact=False, read_value=read_value)

    def _scatter(self, value: Any, how: str, exact: bool, read_value: bool) -> Variable | None:
        var = self._var
        if var._is_string:
            raise TypeError(f"Sliced assigns are not supported on string variable '{var.name}'.")
        if how != "set":
            var._check_arithmetic(how)
        x = var._coerce(value, "assign" if how == "set" else how, host=True)
        want = self.shape
        fits = x.shape == want if exact else broadcasts(tuple(x.shape), want)
        if not fits:
            raise shape_error(f"{var.name}[{self._index!r}]", want, tuple(x.shape), "slice")
        with STATE_LOCK:
            x = var._colocated(x)
            ref = var.value().at[self._index]
            new = ref.set(x) if how == "set" else (ref.add(x) if how == "add" else ref.add(-x))
            var._swap(new)
        return var if read_value else None


def _flatten_slice(s: VariableSlice) -> tuple[tuple[Any], None]:
    return (s.value(),), None


jax.tree_util.register_pytree_node(VariableSlice, _flatten_slice, lambda _, c: c[0])
