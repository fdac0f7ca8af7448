"""``training=`` travelling down the call stack (Keras 3's rule).

Contract (docs/api.md, "Layers"): an object whose ``__call__`` takes a ``training``
parameter (wrapped by ``propagate``) and is called with ``training=True``/``False`` makes
that the value for every such call made inside it (in the same thread) that is not given
``training`` itself (or is given ``None``). The outermost explicit value wins only until an
inner call passes its own. Inside a ``ps.function`` the value is read while the body is
traced, so pass ``training`` to the compiled function's body itself (``f(x, training=True)``
as a ``static_argnames`` argument, or two functions), not from an outer eager call.

A Python (or NumPy) bool or ``None`` travels; any other value is given to the ``check`` that
``propagate`` was given with the call, which accepts it or raises: the module layer's
accepts a traced flag (``is_flag``: a boolean scalar ``jax.Array``, for ``jnp.where``
switching the mode inside one program) where the object's class allows one, and raises a
``TypeError`` naming the object otherwise. Nothing here knows what the objects are.

``propagate(call, check)`` wraps a ``__call__``; the module layer (``ps.Module``'s
``__init_subclass__``) applies it to every subclass that defines ``__call__`` with a
``training`` parameter.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from paramstore._core.context import ctx

__all__ = ["propagate", "current", "is_flag", "Check"]

F = TypeVar("F", bound=Callable[..., Any])

Check = Callable[[Any, object], None]
"""``check(obj, given)``: accepts a ``training=`` value that is not a bool or None, or raises
(``obj`` is the object whose ``__call__`` was given it)."""


def current() -> bool | None:
    """The ``training`` value set by an enclosing call, or None outside any."""
    return ctx.training


def is_flag(given: object) -> bool:
    """Whether ``given`` is a traced flag: a boolean scalar ``jax.Array``."""
    return isinstance(given, jax.Array) and given.shape == () and given.dtype == np.bool_


def propagate(call: F, check: Check) -> F:
    """``call`` (a ``__call__``) filling ``training`` from the enclosing call when it is not
    given, and setting it for the calls made inside; a value that is not a bool or None
    goes to ``check`` first. ``call`` unchanged if it takes no ``training``. Idempotent."""
    if getattr(call, "_ps_training", False):
        return call
    try:
        params = list(inspect.signature(call).parameters.values())
    except (TypeError, ValueError):
        return call
    names = [p.name for p in params]
    if "training" not in names:
        return call
    param = params[names.index("training")]
    # Index among the positional arguments after ``self`` (None: keyword-only).
    position = (
        names.index("training") - 1
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD)
        else None
    )

    @functools.wraps(call)
    def wrapped(self: object, *args: object, **kwargs: object) -> object:
        if position is not None and len(args) > position:
            given = args[position]
        else:
            given = kwargs.get("training")
        if given is None:
            outer = ctx.training
            if outer is None:
                return call(self, *args, **kwargs)
            if position is not None and len(args) > position:
                args = (*args[:position], outer, *args[position + 1 :])
            else:
                kwargs["training"] = outer
            return call(self, *args, **kwargs)
        if not isinstance(given, (bool, np.bool_)):
            check(self, given)  # a traced flag, accepted, passes nothing down
            return call(self, *args, **kwargs)
        saved, ctx.training = ctx.training, bool(given)
        try:
            return call(self, *args, **kwargs)
        finally:
            ctx.training = saved

    wrapped._ps_training = True  # type: ignore[attr-defined]
    return wrapped  # type: ignore[return-value]
