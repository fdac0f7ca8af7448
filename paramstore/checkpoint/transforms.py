"""Reversible transforms between a checkpoint value and a variable value, for
``ps.checkpoint.NameMap`` rules.

Contract (docs/api.md "Pretrained weights"; docs/guides/pretrained.md, "One name map"):

* ``Transform(forward, inverse)``: forward maps a checkpoint value to the variable value (a
  tuple of values for a tuple target), inverse back (given the tuple for a tuple target).
* Ready-made: ``transpose(axes=None)`` (its inverse permutation back), ``split(axis)`` (a
  fused tensor into as many equal parts as its rule's tuple target has names; back: their
  concatenation), ``chain(*transforms)`` (in order, after a ``split`` applied to each part;
  the inverses in reverse order back).
* The ready-made ones work on NumPy arrays (a memory-mapped view stays a view) and on JAX
  arrays and tracers (``jax.eval_shape`` finds an exported tensor's shape without
  computing it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

__all__ = ["Transform", "Values", "transpose", "split", "chain", "bind"]

Values = ArrayLike | tuple[ArrayLike, ...]
"""A checkpoint or variable value: an array, or a tuple of arrays for a tuple target."""
Fn = Callable[[Any], Any]


def _xp(*xs: Any) -> Any:
    """``jax.numpy`` for traced or JAX values (shape inference), else NumPy (views of a
    memory-mapped file stay views)."""
    return jnp if any(isinstance(x, jax.Array) for x in xs) else np


class Transform:
    """A reversible map between a checkpoint value and a variable value: ``forward``
    (checkpoint -> variable; a tuple of values for a tuple target) and ``inverse`` (back;
    given the tuple for a tuple target)."""

    fans_out = False  # forward returns a tuple (a split): transforms after it in a chain
    # apply to each part

    def __init__(self, forward: Fn, inverse: Fn) -> None:
        if not callable(forward) or not callable(inverse):
            raise TypeError(
                "ps.checkpoint.Transform(forward, inverse) takes two functions array -> "
                f"array, got {type(forward).__name__} and {type(inverse).__name__}."
            )
        self._forward, self._inverse = forward, inverse

    def forward(self, value: Values) -> Values:
        """The variable value(s) for checkpoint value ``value``."""
        out: Values = self._forward(value)
        return out

    def inverse(self, value: Values) -> Values:
        """The checkpoint value for variable value(s) ``value``."""
        out: Values = self._inverse(value)
        return out

    def __repr__(self) -> str:
        return f"Transform({self._forward!r}, {self._inverse!r})"


class _Transpose(Transform):
    def __init__(self, axes: Sequence[int] | None) -> None:
        self.axes = None if axes is None else tuple(int(a) for a in axes)

    def forward(self, value: Any) -> Any:
        return _xp(value).transpose(value, self.axes)

    def inverse(self, value: Any) -> Any:
        back = None if self.axes is None else tuple(np.argsort(self.axes))
        return _xp(value).transpose(value, back)

    def __repr__(self) -> str:
        return f"transpose(axes={self.axes})"


class _Split(Transform):
    fans_out = True

    def __init__(self, axis: int, parts: int | None = None) -> None:
        self.axis, self.parts = int(axis), parts

    def forward(self, value: Any) -> Any:
        if self.parts is None:
            raise ValueError(
                "ps.checkpoint.split(axis) splits a fused tensor for a tuple target: use it "
                "in a NameMap rule whose target is a tuple of names."
            )
        n = value.shape[self.axis]
        if n % self.parts:
            raise ValueError(
                f"ps.checkpoint.split({self.axis}): axis {self.axis} of a value of shape "
                f"{tuple(value.shape)} does not split into {self.parts} equal parts."
            )
        return tuple(_xp(value).split(value, self.parts, axis=self.axis))

    def inverse(self, value: Any) -> Any:
        return _xp(*value).concatenate(list(value), axis=self.axis)

    def __repr__(self) -> str:
        return f"split({self.axis})"


class _Chain(Transform):
    def __init__(self, transforms: Sequence[Transform]) -> None:
        for t in transforms:
            if not isinstance(t, Transform):
                raise TypeError(
                    "ps.checkpoint.chain(*transforms) takes ps.checkpoint.Transform objects "
                    f"(transpose, split, Transform(forward, inverse)), got {type(t).__name__}."
                )
        self.transforms = tuple(transforms)
        self.fans_out = any(t.fans_out for t in self.transforms)

    def forward(self, value: Any) -> Any:
        spread = False
        for t in self.transforms:
            value = tuple(t.forward(v) for v in value) if spread else t.forward(value)
            spread = spread or t.fans_out
        return value

    def inverse(self, value: Any) -> Any:
        spread = [False]
        for t in self.transforms:
            spread.append(spread[-1] or t.fans_out)
        for t, each in zip(reversed(self.transforms), reversed(spread[:-1])):
            value = tuple(t.inverse(v) for v in value) if each else t.inverse(value)
        return value

    def __repr__(self) -> str:
        return "chain(" + ", ".join(map(repr, self.transforms)) + ")"


def transpose(axes: Sequence[int] | None = None) -> Transform:
    """``np.transpose(x, axes)`` one way and its inverse permutation back (``None``: all
    axes reversed, e.g. a ``(out, in)`` torch ``Linear`` weight <-> a ``(in, out)`` kernel)."""
    return _Transpose(axes)


def split(axis: int) -> Transform:
    """A fused tensor into equal parts along ``axis`` for a tuple target (as many parts as
    the tuple has names); back: their concatenation."""
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"ps.checkpoint.split: axis must be an int, got {axis!r}.")
    return _Split(axis)


def chain(*transforms: Transform) -> Transform:
    """``transforms`` applied in order (after a ``split``, to each part), and their inverses
    in reverse order back."""
    return _Chain(transforms)


def bind(t: Transform | None, parts: int) -> Transform | None:
    """A ``split`` told how many parts its rule's tuple target has."""
    if isinstance(t, _Split):
        return _Split(t.axis, parts)
    if isinstance(t, _Chain):
        return _Chain([bind(x, parts) or x for x in t.transforms])
    return t
