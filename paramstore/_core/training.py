"""``training=`` travelling down the call stack, as in Keras 3.

Contract (docs/api.md, "Layers"): a Module or layer whose ``__call__`` takes a ``training``
parameter and is called with ``training=True``/``False`` makes that the value for every
such call made inside it (in the same thread) that is not given ``training`` itself (or
is given ``None``). The outermost explicit value wins only until an inner call passes its
own. Inside a ``ps.function`` the value is read while the body is traced, so pass
``training`` to the compiled function's body itself (``f(x, training=True)`` as a
``static_argnames`` argument, or two functions), not from an outer eager call.

``training=`` must be ``True``, ``False`` or ``None``: a Python (or NumPy) bool, or a
boolean scalar ``jax.Array`` (a traced flag, e.g. ``lax.cond``-free evaluation switched
inside one compiled step) for classes that support it (``traced_training``: Dropout,
BatchNormalization, Sequential and user Modules; not ``Repeat`` or layers without a
mode); anything else (``"false"``, ``1``, ``"eval"``) is a ``TypeError`` naming the layer.

``propagate(call)`` wraps a ``__call__``; ``ps.Module.__init_subclass__`` applies it to
every subclass that defines ``__call__`` with a ``training`` parameter.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from paramstore._core.context import ctx

__all__ = ["propagate", "current", "check"]

F = TypeVar("F", bound=Callable[..., Any])


def current() -> bool | None:
    """The ``training`` value set by an enclosing call, or None outside any."""
    return ctx.training


def check(module: Any, given: Any) -> None:
    """``training=`` that is not a Python bool or None: a boolean scalar ``jax.Array`` (a
    traced flag) where ``module``'s class says it supports one (``traced_training``, True
    unless a class says otherwise), else ``TypeError`` naming the module."""
    supports = bool(getattr(type(module), "traced_training", True))
    if isinstance(given, jax.Array) and given.shape == () and given.dtype == np.bool_ and supports:
        return
    describe = getattr(module, "describe", None)
    who = (
        describe()
        if callable(describe)
        else f"{type(module).__name__} '{getattr(module, 'scope_name', '?')}'"
    )
    extra = " or a boolean scalar array (a traced flag)" if supports else ""
    raise TypeError(
        f"{who}: training must be True, False or None{extra}, got {type(given).__name__} "
        f"{given!r:.40}. Pass a Python bool (training=True for training, False for "
        "evaluation)."
    )


def propagate(call: F) -> F:
    """``call`` (a ``__call__``) filling ``training`` from the enclosing call when it is not
    given, and setting it for the calls made inside; ``call`` unchanged if it takes no
    ``training``. Idempotent."""
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
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
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
        if not isinstance(given, (bool, np.bool_)):  # a traced flag: nothing to pass down
            check(self, given)
            return call(self, *args, **kwargs)
        saved, ctx.training = ctx.training, bool(given)
        try:
            return call(self, *args, **kwargs)
        finally:
            ctx.training = saved

    wrapped._ps_training = True  # type: ignore[attr-defined]
    return wrapped  # type: ignore[return-value]
