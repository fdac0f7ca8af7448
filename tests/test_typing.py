"""The public API is typed: no public parameter or return is ``Any`` or unannotated unless it is
listed in ``ALLOWED`` below with the reason ``Any`` is really right there (issue 15, "Types").

The walk starts at ``paramstore.__all__`` and goes into every public submodule's ``__all__``
(``ps.nn``, ``ps.metrics``, ``ps.initializers``, ``ps.random``, ``ps.sharding``,
``ps.checkpoint``, ``ps.typing``); for a class it takes ``__init__``, ``__call__`` and every
public method and property (inherited ones once, under the class that defines them). A
parameter counts when its annotation is missing or ``Any`` (``self``/``cls`` excepted); a
return when it is ``Any``.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import paramstore

# "qualified.name(parameter)" or "qualified.name -> return": why Any is right there.
ALLOWED: dict[str, str] = {}

# ``PyTree`` is ``Any`` under a name (paramstore.typing): it counts as Any here.
ANY = (inspect.Parameter.empty, Any, "Any", "typing.Any", "PyTree")


def _functions(obj: object, name: str, seen: set[int]) -> Iterator[tuple[str, Callable[..., Any]]]:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, types.ModuleType):
        for attr in getattr(obj, "__all__", ()):
            yield from _functions(getattr(obj, attr), f"{name}.{attr}", seen)
    elif inspect.isclass(obj):
        if not obj.__module__.startswith("paramstore"):
            return
        for attr, member in vars(obj).items():
            if attr.startswith("_") and attr not in ("__init__", "__call__"):
                continue
            if isinstance(member, staticmethod | classmethod):
                member = member.__func__
            if isinstance(member, property):
                member = member.fget
            if inspect.isfunction(member) and id(member) not in seen:
                seen.add(id(member))
                yield f"{obj.__module__}.{obj.__qualname__}.{attr}", member
        for base in obj.__mro__[1:]:
            if base.__module__.startswith("paramstore"):
                yield from _functions(base, base.__qualname__, seen)
    elif inspect.isfunction(obj) and obj.__module__.startswith("paramstore"):
        yield f"{obj.__module__}.{obj.__qualname__}", obj
    elif callable(obj) and getattr(obj, "__wrapped__", None) is not None:
        yield from _functions(obj.__wrapped__, name, seen)


def untyped() -> tuple[list[str], list[str], int, int]:
    """(untyped parameters, untyped returns, all parameters, all returns)."""
    params, returns, n_params, n_returns = [], [], 0, 0
    for name, fn in _functions(paramstore, "paramstore", set()):
        sig = inspect.signature(fn)
        for p in sig.parameters.values():
            if p.name in ("self", "cls"):
                continue
            n_params += 1
            if p.annotation in ANY:
                params.append(f"{name}({p.name})")
        n_returns += 1
        if sig.return_annotation in ANY[1:]:
            returns.append(f"{name} -> return")
    return params, returns, n_params, n_returns


def test_the_walk_sees_the_public_api():
    params, returns, n_params, n_returns = untyped()
    names = {n.split("(")[0].split(" ->")[0] for n in params + returns}
    assert n_params > 250 and n_returns > 150, (n_params, n_returns)
    walked = [name for name, _ in _functions(paramstore, "paramstore", set())]
    for expected in (
        "paramstore.variable.Variable.assign",
        "paramstore.nn.core.Dense.__call__",
        "paramstore.metrics.Metric.update_state",
        "paramstore.initializers.resolve",
    ):
        assert expected in walked
    assert names <= {n.rsplit("(", 1)[0] for n in walked}


def test_public_signatures_are_typed_beyond_any():
    params, returns, _, _ = untyped()
    found = params + returns
    extra = [n for n in found if n not in ALLOWED]
    assert not extra, (
        "public parameters/returns typed Any or unannotated; use paramstore.typing's aliases, "
        "jax.typing.ArrayLike/DTypeLike or jax.Array (or, where Any is genuinely right, add "
        "the name with a reason to ALLOWED in tests/test_typing.py):\n" + "\n".join(extra)
    )
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"ALLOWED entries that are typed now (remove them): {stale}"
