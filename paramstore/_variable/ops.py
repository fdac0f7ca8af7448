"""The operator mixin of ``ps.Variable`` and ``VariableSlice``: operators, conversions and
array methods, all computed on ``self.value()`` (which is a traced value inside
``ps.function`` / ``ps.pure``, so the same code runs eagerly and compiled)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

__all__ = ["ArrayOps", "unwrap"]


def unwrap(x: Any) -> Any:
    """``x.value()`` for a Variable or a slice of one, else ``x``."""
    return x.value() if isinstance(x, ArrayOps) else x


_Op = Callable[[Any, Any], Any]


def _binary(op: _Op) -> tuple[_Op, _Op]:
    def forward(self: Any, other: Any) -> Any:
        return op(self.value(), unwrap(other))

    def reflected(self: Any, other: Any) -> Any:
        return op(unwrap(other), self.value())

    return forward, reflected


class ArrayOps:
    """Operators, conversions and array methods, all computed on ``self.value()``."""

    __slots__ = ()
    # Higher than NumPy's, as jax.Array's: `np_array @ v` defers to our reflected operator
    # (a JAX op that sees the traced value) instead of converting v through __array__.
    __array_priority__ = 100

    def value(self) -> jax.Array:  # pragma: no cover - overridden
        raise NotImplementedError

    __add__, __radd__ = _binary(operator.add)
    __sub__, __rsub__ = _binary(operator.sub)
    __mul__, __rmul__ = _binary(operator.mul)
    __truediv__, __rtruediv__ = _binary(operator.truediv)
    __floordiv__, __rfloordiv__ = _binary(operator.floordiv)
    __mod__, __rmod__ = _binary(operator.mod)
    __pow__, __rpow__ = _binary(operator.pow)
    __matmul__, __rmatmul__ = _binary(operator.matmul)
    __and__, __rand__ = _binary(operator.and_)
    __or__, __ror__ = _binary(operator.or_)
    __xor__, __rxor__ = _binary(operator.xor)
    __lshift__, __rlshift__ = _binary(operator.lshift)
    __rshift__, __rrshift__ = _binary(operator.rshift)
    __lt__, _ = _binary(operator.lt)
    __le__, _ = _binary(operator.le)
    __gt__, _ = _binary(operator.gt)
    __ge__, _ = _binary(operator.ge)
    __eq__, _ = _binary(operator.eq)
    __ne__, _ = _binary(operator.ne)
    del _

    def __neg__(self) -> Any:
        return -self.value()

    def __pos__(self) -> Any:
        return +self.value()

    def __abs__(self) -> Any:
        return abs(self.value())

    def __invert__(self) -> Any:
        return ~self.value()

    def __bool__(self) -> bool:
        return bool(self.value())

    def __float__(self) -> float:
        return float(self.value())

    def __int__(self) -> int:
        return int(self.value())

    def __index__(self) -> int:
        return operator.index(self.value())

    def __complex__(self) -> complex:
        return complex(self.value())

    def __len__(self) -> int:
        return len(self.value())

    def __iter__(self) -> Iterator[Any]:
        return iter(self.value())

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = np.asarray(self.value())
        if dtype is not None:
            arr = arr.astype(dtype)
        return arr.copy() if copy else arr

    def __jax_array__(self) -> jax.Array:
        return self.value()

    def __hash__(self) -> int:
        raise TypeError(
            f"{type(self).__name__} is unhashable: it compares elementwise like an array. "
            "Use variable.ref() as a dict key or set member."
        )

    def __getattr__(self, name: str) -> Any:
        # Array methods and properties: v.sum(), v.reshape(...), v.T, v.astype(...).
        missing = AttributeError(f"'ps.{type(self).__name__}' object has no attribute {name!r}")
        if name.startswith("_"):
            raise missing
        try:
            return getattr(self.value(), name)
        except AttributeError:
            raise missing from None
