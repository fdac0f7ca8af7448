"""``ps.Reference``: a hashable key for a Variable (``v.ref()``), as TensorFlow's: a Variable
compares elementwise like an array, so it cannot be a dict key or a set member itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the class sits above this module: a name for annotations only
    from paramstore.variable import Variable

__all__ = ["Reference"]


class Reference:
    """A hashable key for a Variable (``v.ref()``); ``ref.deref()`` gives it back."""

    __slots__ = ("_var",)

    def __init__(self, var: Variable) -> None:
        self._var = var

    def deref(self) -> Variable:
        """The Variable this reference points to."""
        return self._var

    def __hash__(self) -> int:
        return id(self._var)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Reference) and other._var is self._var

    def __repr__(self) -> str:
        return f"<Reference to {self._var!r}>"
