"""Names, scopes, sharing: ``name_scope``, ``variable_scope``, ``get_variable``, ``VariableStore``.

Contract (docs/api.md, "Names, scopes and sharing"), following TensorFlow 1 graphs:

* A ``VariableStore`` owns a namespace of full names. Every Variable created while a store
  is the default is tracked there weakly and gets a unique full name: a second ``"v"``
  becomes ``"v_1"``, then ``"v_2"``; unnamed variables are ``"Variable"``, ``"Variable_1"``...
  Names are never reused within a store, even after a variable dies, so names can key
  state dicts and checkpoints. ``with ps.VariableStore() as store:`` starts a fresh
  namespace for the block (re-running a notebook cell does not collide).
* ``name_scope(name)`` prefixes the names of Variables created inside (``"outer/inner/v"``);
  entering the same scope twice gives the same prefix (TensorFlow 2 behaviour).
* ``variable_scope(name, reuse=None | True | AUTO_REUSE)`` also prefixes names, and sets
  how ``get_variable`` shares. As in TensorFlow 1, ``get_variable`` names come from the
  variable scopes only (``name_scope`` does not prefix them), and reuse is inherited by
  nested scopes: it cannot be switched off inside a reusing scope.
* ``get_variable`` variables are held strongly by their store (they are shared state);
  plain Variables only weakly.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Iterator
from typing import Any, Final, TypeAlias

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from paramstore import constraints as _constraints
from paramstore import initializers as _init
from paramstore import regularizers as _regularizers
from paramstore._core.context import Scope, ctx, prefixed
from paramstore._core.dtypes import canonical_dtype
from paramstore._core.store import VariableStore, default_store, preview_names
from paramstore._variable.initial import flag
from paramstore.typing import ConstraintLike, InitializerLike, RegularizerLike, ShapeLike
from paramstore.variable import Variable

__all__ = [
    "AUTO_REUSE",
    "VariableStore",
    "VariableScope",
    "name_scope",
    "variable_scope",
    "get_variable",
    "default_store",
    "preview_names",
    "prefixed",
]


class _AutoReuse:
    def __repr__(self) -> str:
        return "ps.AUTO_REUSE"


AUTO_REUSE: Final[_AutoReuse] = _AutoReuse()
"""``variable_scope(..., reuse=AUTO_REUSE)``: ``get_variable`` gets or creates."""

Reuse: TypeAlias = bool | _AutoReuse | None
"""A variable scope's ``reuse``: None (inherit), False, True, or ``AUTO_REUSE``."""


def _current_reuse() -> Reuse:
    stack = ctx.scopes
    return stack[-1].reuse if stack else None


@contextlib.contextmanager
def name_scope(name: str) -> Iterator[str]:
    """Prefix the names of Variables created inside with ``name/``. Yields the full prefix."""
    if not isinstance(name, str):
        raise TypeError(f"name_scope expects a str, got {type(name).__name__}.")
    name = name.strip("/")
    stack = ctx.scopes
    entry = Scope(name, False, _current_reuse())
    stack += (entry,)  # in place, no call: no signal check before the try
    try:
        yield prefixed("")
    finally:
        stack.pop()


@contextlib.contextmanager
def _absolute_scope(full: str) -> Iterator[None]:
    """Enter ``full`` as the whole prefix (used by ``Module.name_scope``)."""
    # Restore the very list that was current: enclosing name_scope/variable_scope blocks
    # pop from that list object when they exit.
    saved = ctx.scopes
    ctx.scopes = [Scope(full, True, None)] if full else []
    try:
        yield
    finally:
        ctx.scopes = saved


class VariableScope:
    """What ``with variable_scope(...) as scope`` gives: its full ``name`` and ``reuse``;
    ``scope.reuse_variables()`` turns reuse on for the rest of the block (TF1)."""

    __slots__ = ("name", "reuse", "_entry")

    def __init__(self, name: str, reuse: Reuse, entry: Scope) -> None:
        self.name = name
        self.reuse = reuse
        self._entry = entry

    def reuse_variables(self) -> None:
        """From now on in this block, ``get_variable`` returns existing variables (a
        missing one is an error), as ``reuse=True``; scopes entered later inherit it."""
        stack = ctx.scopes
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is self._entry:
                self._entry = stack[i] = Scope(self._entry.name, True, True)
                self.reuse = True
                return
        raise RuntimeError(
            f"reuse_variables() on variable scope '{self.name}' outside its with-block (or "
            "from another thread): call it inside the block that entered the scope."
        )

    def __repr__(self) -> str:
        return f"VariableScope(name={self.name!r}, reuse={self.reuse!r})"


@contextlib.contextmanager
def variable_scope(name: str, reuse: Reuse = None) -> Iterator[VariableScope]:
    """Prefix names with ``name/`` and set how ``get_variable`` shares inside the block.

    ``reuse=None`` inherits; ``True`` returns existing variables (a missing one is an
    error); ``AUTO_REUSE`` gets or creates. Reuse is inherited by nested scopes.
    """
    if not isinstance(name, str):
        raise TypeError(f"variable_scope expects a str name, got {type(name).__name__}.")
    if reuse not in (None, False, True) and reuse is not AUTO_REUSE:
        raise ValueError(f"reuse must be None, True or ps.AUTO_REUSE, got {reuse!r}.")
    outer = _current_reuse()
    effective = outer if outer in (True, AUTO_REUSE) else (reuse or None)
    if outer is AUTO_REUSE and reuse is True:
        effective = True
    stack = ctx.scopes
    entry = Scope(name.strip("/"), True, effective)
    stack += (entry,)  # in place, no call: no signal check before the try
    try:
        yield VariableScope(prefixed("", variable_scopes_only=True).rstrip("/"), effective, entry)
    finally:
        stack.pop()


def get_variable(
    name: str,
    shape: ShapeLike | None = None,
    dtype: DTypeLike = jnp.float32,
    initializer: InitializerLike = None,
    trainable: bool = True,
    regularizer: RegularizerLike | None = None,
    constraint: ConstraintLike | None = None,
) -> Variable:
    """Get or create the variable ``<variable scopes>/name`` of the default store.

    ``regularizer`` (TF1's argument: a callable ``(value) -> scalar`` or a Keras name such
    as ``"l2"``) is kept with a variable it creates, and counted by
    ``ps.regularization_loss()`` (TF1's ``tf.losses.get_regularization_loss()``);
    ``constraint`` (``(value) -> value``) is applied by optimizers after each update. A
    reused variable keeps those it was created with.

    ``initializer`` is an initializer (``init(shape, dtype)``), a concrete value (then
    ``shape`` may be omitted), or None: glorot_uniform for floating dtypes, zeros otherwise.
    Getting or creating is atomic: threads racing on one name under ``AUTO_REUSE`` get one
    variable. An initializer whose result has another shape than ``shape`` is a
    ``ValueError`` (and no variable is made).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"get_variable expects a non-empty str name, got {type(name).__name__} {name!r}."
        )
    store = default_store()
    full = prefixed(name, variable_scopes_only=True)
    trainable = flag(trainable, "trainable", f"get_variable('{full}')")
    initializer = _init.resolve(initializer)
    hooks = {
        "regularizer": _regularizers.get(regularizer, f"get_variable('{full}'): regularizer"),
        "constraint": _constraints.get(constraint, f"get_variable('{full}'): constraint"),
    }
    reuse = _current_reuse()
    dt = canonical_dtype(dtype, f"variable '{full}'")
    shp = None if shape is None else _as_shape(shape, full)

    def get_or_create(existing: Variable | None) -> Variable:  # under the store's lock
        if reuse is True or (reuse is AUTO_REUSE and existing is not None):
            if existing is None:
                raise ValueError(
                    f"Variable {full} does not exist, or was not created with get_variable(); "
                    "reuse=True only returns existing variables. Create it first, or use "
                    "reuse=ps.AUTO_REUSE to get or create."
                )
            _check_matches(existing, full, shp, dt, initializer)
            return existing
        if existing is not None:
            raise ValueError(
                f"Variable {full} already exists, disallowed. Did you mean to set reuse=True "
                "or reuse=ps.AUTO_REUSE in variable_scope?"
            )
        return _create(full, shp, dt, initializer, trainable, hooks)

    var: Variable = store.get_or_create(full, get_or_create)
    return var


def _create(
    full: str,
    shp: tuple[int, ...] | None,
    dt: Any,
    initializer: Any,
    trainable: bool,
    hooks: dict[str, Any],
) -> Variable:
    if initializer is None or isinstance(initializer, type):
        if shp is None:
            raise ValueError(f"get_variable('{full}') needs a shape (or a concrete initializer).")
        initializer = _init.glorot_uniform() if dt.kind in "fc" else _init.zeros()
    if callable(initializer):
        if shp is None:
            raise ValueError(f"get_variable('{full}') with an initializer function needs a shape.")
        init, want = initializer, shp

        def initial() -> Any:
            value = init(want, dt)
            if tuple(np.shape(value)) != want:
                raise ValueError(
                    f"get_variable('{full}'): the initializer returned shape "
                    f"{tuple(np.shape(value))}, but the variable's shape is {want}."
                )
            return value

        return Variable(initial, trainable=trainable, dtype=dt, _full_name=full, **hooks)
    value = np.asarray(initializer) if not hasattr(initializer, "dtype") else initializer
    if shp is not None and tuple(value.shape) != shp:
        raise ValueError(
            f"get_variable('{full}'): the initializer's shape {tuple(value.shape)} does "
            f"not match shape {shp}."
        )
    return Variable(value, trainable=trainable, dtype=dt, _full_name=full, **hooks)


def _as_shape(shape: Any, full: str) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int | np.integer) else shape
    try:
        if isinstance(shape, bool | np.bool_) or any(isinstance(d, bool | np.bool_) for d in dims):
            raise TypeError  # operator.index(True) is 1
        out = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise TypeError(
            f"get_variable('{full}'): shape must be an int or a sequence of ints, got {shape!r}."
        ) from None
    if any(d < 0 for d in out):
        raise ValueError(f"get_variable('{full}'): shape {out} has a negative dimension.")
    if math.prod(out) >= 2**62:
        raise ValueError(
            f"get_variable('{full}'): shape {out} has {math.prod(out):.3g} elements, more "
            "than an array can hold."
        )
    return out


def _check_matches(
    var: Variable, full: str, shape: tuple[int, ...] | None, dt: np.dtype, init: Any
) -> None:
    if shape is None and init is not None and not callable(init):
        shape = tuple(np.shape(init))
    if shape is not None and shape != var.shape:
        raise ValueError(
            f"Trying to share variable {full}, but specified shape {shape} and "
            f"found shape {var.shape}."
        )
    if dt != var.dtype:
        raise ValueError(
            f"Trying to share variable {full}, but specified dtype {dt.name} and found "
            f"dtype {var.dtype.name}."
        )
