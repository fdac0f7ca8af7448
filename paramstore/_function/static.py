"""Static arguments of a ``ps.function`` (``static_argnums`` / ``static_argnames``): their
validation against the function's signature, and the split of a call's arguments into the
dynamic part (traced) and the static part (part of the trace's key).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["static_args", "split", "merge", "unhashable_message"]


def static_args(
    fn: Callable[..., Any], nums: int | Iterable[int], names: str | Iterable[str]
) -> tuple[frozenset[int], frozenset[str]]:
    """Static positions and names, each completed from the other through the signature.
    Like ``jax.jit``: a position past the parameters or an unknown name is a ValueError
    (unless ``fn`` takes ``*args`` / ``**kwargs``); a wrong type is a TypeError."""
    nums = (nums,) if isinstance(nums, int) else nums
    names = (names,) if isinstance(names, str) else names
    try:
        nums = tuple(nums)
        names = tuple(names)
    except TypeError:
        raise TypeError(
            "static_argnums must be an int or a sequence of ints and static_argnames a str or "
            f"a sequence of str; got static_argnums={nums!r}, static_argnames={names!r}."
        ) from None
    bad: list[Any] = [i for i in nums if isinstance(i, bool) or not isinstance(i, int)]
    bad += [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(
            f"static_argnums takes ints and static_argnames takes str; got {bad[0]!r} "
            f"({type(bad[0]).__name__})."
        )
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return frozenset(nums), frozenset(names)
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    var_args = any(p.kind == p.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    label = getattr(fn, "__name__", "the function")
    for i in nums:
        if not var_args and not -len(positional) <= i < len(positional):
            raise ValueError(
                f"static_argnums {i} is out of range: {label}() takes {len(positional)} "
                f"positional argument(s) ({', '.join(positional) or 'none'})."
            )
    for n in names:
        if not var_kw and n not in keywords:
            raise ValueError(
                f"static_argnames {n!r} is not a parameter of {label}() (its parameters: "
                f"{', '.join(keywords) or 'none'})."
            )
    num_set = {i % len(positional) if i < 0 and positional else i for i in nums}
    name_set = set(names)
    for i in num_set:
        if 0 <= i < len(positional):
            name_set.add(positional[i])
    for n in names:
        if n in positional:
            num_set.add(positional.index(n))
    return frozenset(num_set), frozenset(name_set)


def split(
    args: tuple[Any, ...], kwargs: dict[str, Any], nums: frozenset[int], names: frozenset[str]
) -> tuple[Any, tuple[Any, ...]]:
    """``((dynamic args, dynamic kwargs), static)``: the static ones are None in the
    dynamic args and left out of the dynamic kwargs; ``static`` is hashable if they are."""
    dyn_args = tuple(None if i in nums else a for i, a in enumerate(args))
    dyn_kw = {k: v for k, v in kwargs.items() if k not in names}
    static = (
        tuple((i, args[i]) for i in nums if i < len(args)),
        tuple(sorted((k, v) for k, v in kwargs.items() if k in names)),
    )
    return (dyn_args, dyn_kw), static


def merge(dyn: Any, static: tuple[Any, ...]) -> tuple[list[Any], dict[str, Any]]:
    """The call's ``(args, kwargs)`` again, from what ``split`` made of them."""
    args, kwargs = list(dyn[0]), dict(dyn[1])
    if static:
        for i, v in static[0]:
            args[i] = v
        kwargs.update(static[1])
    return args, kwargs


def unhashable_message(name: str, static: tuple[Any, ...]) -> str:
    """The error for a call whose trace key cannot be hashed, naming the culprit."""
    for where, value in [*static[0], *static[1]]:
        try:
            hash(value)
        except TypeError:
            label = f"position {where}" if isinstance(where, int) else f"'{where}'"
            return (
                f"Static argument at {label} of {name}() is unhashable (type "
                f"{type(value).__name__}): ps.function keys its traces on static "
                "arguments. Pass a hashable value (a tuple instead of a list), or pass "
                "arrays as regular (traced) arguments."
            )
    return f"An argument of {name}() is unhashable."
