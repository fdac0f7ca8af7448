"""Names, scopes, sharing: ``name_scope``, ``variable_scope``, ``get_variable``, ``VariableStore``.

Contract (API.md, "Names, scopes and sharing"), following TensorFlow 1 graphs:

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
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from paramstore.functional import State
    from paramstore.variable import Variable

__all__ = [
    "AUTO_REUSE",
    "VariableStore",
    "VariableScope",
    "name_scope",
    "variable_scope",
    "get_variable",
    "default_store",
]


class _AutoReuse:
    def __repr__(self) -> str:
        return "ps.AUTO_REUSE"


AUTO_REUSE: Any = _AutoReuse()
"""``variable_scope(..., reuse=AUTO_REUSE)``: ``get_variable`` gets or creates."""

_local = threading.local()


@dataclass(frozen=True)
class _Scope:
    name: str
    is_variable_scope: bool
    reuse: Any  # None, True, or AUTO_REUSE (already combined with the enclosing scopes)


def _scopes() -> list[_Scope]:
    stack: list[_Scope] | None = getattr(_local, "scopes", None)
    if stack is None:
        stack = _local.scopes = []
    return stack


def prefixed(name: str, *, variable_scopes_only: bool = False) -> str:
    """``name`` under the current scopes (all of them, or only the variable scopes)."""
    parts = [
        s.name for s in _scopes() if s.name and (s.is_variable_scope or not variable_scopes_only)
    ]
    return "/".join([*parts, name]) if parts else name


def _current_reuse() -> Any:
    stack = _scopes()
    return stack[-1].reuse if stack else None


class VariableStore:
    """A namespace of variables: what ``get_variable`` shares and ``Saver()`` saves."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._taken: set[str] = set()
        self._counts: dict[str, int] = {}
        self._live: weakref.WeakValueDictionary[str, Variable] = weakref.WeakValueDictionary()
        self._order: dict[str, int] = {}
        self._shared: dict[str, Variable] = {}

    # -- being the default
    def __enter__(self) -> VariableStore:
        _store_stack().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        stack = _store_stack()
        if stack and stack[-1] is self:
            stack.pop()

    # -- names
    def unique_name(self, name: str, *, reserve: bool = True) -> str:
        """``name``, or ``name_1``, ``name_2``... the first not yet taken in this store."""
        with self._lock:
            candidate = name
            if name in self._taken:
                # _counts[name] = k: name_1 ... name_k are all taken (names are never freed),
                # so n variables of one name cost O(n), not O(n^2).
                i = self._counts.get(name, 0) + 1
                while f"{name}_{i}" in self._taken:
                    i += 1
                self._counts[name] = i - 1
                candidate = f"{name}_{i}"
            if reserve:
                self._taken.add(candidate)
            return candidate

    def register(
        self, var: Variable, name: str, *, exact: bool = False, base: str | None = None
    ) -> str:
        """Track ``var`` under ``name`` (from ``unique_name(base, reserve=False)``). If another
        thread took it meanwhile, the next free name for ``base`` (``v_3``, not ``v_2_1``).
        With ``exact``, ``name`` as given if no live variable has it."""
        with self._lock:
            if exact and name not in self._live:
                full = name
                self._taken.add(full)
            elif name not in self._taken:
                full = self.unique_name(name)
            else:
                full = self.unique_name(base or name)
            self._live[full] = var
            self._order[full] = len(self._order)
            return full

    def _share(self, var: Variable) -> None:
        with self._lock:
            self._shared[var.name] = var

    def _forget(self, var: Variable) -> None:
        with self._lock:
            self._shared.pop(var.name, None)
            self._live.pop(var.name, None)

    def get(self, name: str) -> Variable | None:
        """The live variable of this full name, or None."""
        return self._live.get(name)

    # -- contents
    def variables(self) -> list[Variable]:
        """The live variables, in creation order."""
        with self._lock:
            items = list(self._live.items())
        items.sort(key=lambda kv: self._order[kv[0]])
        return [v for _, v in items]

    def trainable_variables(self) -> list[Variable]:
        return [v for v in self.variables() if v.trainable]

    def state(self) -> State:
        """An immutable ``{full_name: jax.Array}`` mapping (a pytree) of the live variables."""
        from paramstore.functional import state

        return state(self)  # string variables are host data: ps.state leaves them out

    def __repr__(self) -> str:
        return f"<ps.VariableStore with {len(self._live)} live variables>"


def _store_stack() -> list[VariableStore]:
    stack: list[VariableStore] | None = getattr(_local, "stores", None)
    if stack is None:
        stack = _local.stores = []
    return stack


_DEFAULT_STORE = VariableStore()


def default_store() -> VariableStore:
    """The store new variables go to: the innermost ``with VariableStore()``, else the global."""
    stack = getattr(_local, "stores", None)
    return stack[-1] if stack else _DEFAULT_STORE


@contextlib.contextmanager
def name_scope(name: str) -> Iterator[str]:
    """Prefix the names of Variables created inside with ``name/``. Yields the full prefix."""
    if not isinstance(name, str):
        raise TypeError(f"name_scope expects a str, got {type(name).__name__}.")
    name = name.strip("/")
    stack = _scopes()
    stack.append(_Scope(name, False, _current_reuse()))
    try:
        yield prefixed("")
    finally:
        stack.pop()


@contextlib.contextmanager
def _absolute_scope(full: str) -> Iterator[None]:
    """Enter ``full`` as the whole prefix (used by ``Module.name_scope``)."""
    # Restore the very list that was current: enclosing name_scope/variable_scope blocks
    # pop from that list object when they exit.
    saved = _scopes()
    _local.scopes = [_Scope(full, True, None)] if full else []
    try:
        yield
    finally:
        _local.scopes = saved


@dataclass(frozen=True)
class VariableScope:
    """What ``with variable_scope(...) as scope`` gives: its full ``name`` and ``reuse``."""

    name: str
    reuse: Any


@contextlib.contextmanager
def variable_scope(name: str, reuse: Any = None) -> Iterator[VariableScope]:
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
    stack = _scopes()
    stack.append(_Scope(name.strip("/"), True, effective))
    try:
        yield VariableScope(prefixed("", variable_scopes_only=True).rstrip("/"), effective)
    finally:
        stack.pop()


def get_variable(
    name: str,
    shape: Any = None,
    dtype: Any = jnp.float32,
    initializer: Any = None,
    trainable: bool = True,
) -> Variable:
    """Get or create the variable ``<variable scopes>/name`` of the default store.

    ``initializer`` is an initializer (``init(shape, dtype)``), a concrete value (then
    ``shape`` may be omitted), or None: glorot_uniform for floating dtypes, zeros otherwise.
    """
    from paramstore import initializers as _init
    from paramstore.variable import Variable, _canonical_dtype

    store = default_store()
    full = prefixed(name, variable_scopes_only=True)
    reuse = _current_reuse()
    dt = _canonical_dtype(dtype, f"variable '{full}'")
    existing = store.get(full)
    if reuse is True or (reuse is AUTO_REUSE and existing is not None):
        if existing is None:
            raise ValueError(
                f"Variable {full} does not exist, or was not created with get_variable(); "
                "reuse=True only returns existing variables. Create it first, or use "
                "reuse=ps.AUTO_REUSE to get or create."
            )
        _check_matches(existing, full, shape, dt, initializer)
        return existing
    if existing is not None:
        raise ValueError(
            f"Variable {full} already exists, disallowed. Did you mean to set reuse=True or "
            "reuse=ps.AUTO_REUSE in variable_scope?"
        )
    if initializer is None or isinstance(initializer, type):
        if shape is None:
            raise ValueError(f"get_variable('{full}') needs a shape (or a concrete initializer).")
        initializer = _init.glorot_uniform() if dt.kind in "fc" else _init.zeros()
    if callable(initializer):
        if shape is None:
            raise ValueError(f"get_variable('{full}') with an initializer function needs a shape.")
        shp = _as_shape(shape)
        init = initializer

        def initial() -> Any:
            return init(shp, dt)

        var = Variable(initial, trainable=trainable, name=None, dtype=dt, _full_name=full)
    else:
        value = np.asarray(initializer) if not hasattr(initializer, "dtype") else initializer
        if shape is not None and tuple(value.shape) != _as_shape(shape):
            raise ValueError(
                f"get_variable('{full}'): the initializer's shape {tuple(value.shape)} does "
                f"not match shape {_as_shape(shape)}."
            )
        var = Variable(value, trainable=trainable, dtype=dt, _full_name=full)
    store._share(var)
    return var


def preview_names(names: Sequence[str], limit: int = 10) -> str:
    """``'a', 'b' and 3 more`` for error messages (``none`` for no names)."""
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "") or "none"


def _as_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, int):
        return (shape,)
    return tuple(int(d) for d in shape)


def _check_matches(var: Variable, full: str, shape: Any, dt: np.dtype, init: Any) -> None:
    if shape is None and init is not None and not callable(init):
        shape = np.shape(init)
    if shape is not None and _as_shape(shape) != var.shape:
        raise ValueError(
            f"Trying to share variable {full}, but specified shape {_as_shape(shape)} and "
            f"found shape {var.shape}."
        )
    if dt != var.dtype:
        raise ValueError(
            f"Trying to share variable {full}, but specified dtype {dt.name} and found "
            f"dtype {var.dtype.name}."
        )
