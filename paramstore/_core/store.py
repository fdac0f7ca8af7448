"""``VariableStore``: a namespace of variables, and the ``State`` mapping of their values.

Contract (docs/api.md, "Names, scopes and sharing"):

* A store owns a namespace of full names. Every Variable created while a store is the
  default is tracked there weakly and gets a unique full name: a second ``"v"`` becomes
  ``"v_1"``, then ``"v_2"``; unnamed variables are ``"Variable"``, ``"Variable_1"``...
  Names are never reused within a store, even after a variable dies, so names can key
  state dicts and checkpoints. ``with ps.VariableStore() as store:`` makes a fresh
  namespace the default inside the block (re-running a notebook cell does not collide).
* ``get_variable`` variables are held strongly by their store (they are shared state);
  plain Variables only weakly.
* A construction or build that fails gives its names back (``journal``, ``give_back``):
  they never reached the user, and a retry must get the same names.
* ``State`` is an immutable ``{name: array}`` mapping registered as a pytree keyed by name:
  what ``store.state()`` and ``ps.state`` return.

The store sits below ``variable``: it uses a variable's ``name`` (and ``trainable``,
``value()``), and names the class in annotations only (a ``TYPE_CHECKING`` import).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from paramstore._core.context import ctx

if TYPE_CHECKING:  # the class sits above this module: a name for annotations only
    from paramstore.variable import Variable

__all__ = ["VariableStore", "State", "default_store", "preview_names", "journal", "give_back"]


class State(Mapping[str, Any]):
    """An immutable ``{name: array}`` mapping, registered as a pytree keyed by name."""

    __slots__ = ("_dict",)
    _dict: dict[str, Any]

    def __init__(self, items: Mapping[str, Any] | Any = ()) -> None:
        object.__setattr__(self, "_dict", dict(items))

    def __getitem__(self, key: str) -> Any:
        return self._dict[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict)

    def __len__(self) -> int:
        return len(self._dict)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("ps.State is immutable; build a new one, e.g. State({**s, k: v}).")

    def __repr__(self) -> str:
        body = ", ".join(
            f"'{k}': {getattr(v, 'dtype', type(v).__name__)}{list(np.shape(v))}"
            for k, v in self._dict.items()
        )
        return f"State({{{body}}})"


jax.tree_util.register_pytree_with_keys(
    State,
    lambda s: (tuple((jax.tree_util.DictKey(k), v) for k, v in s._dict.items()), tuple(s._dict)),
    lambda keys, values: State(zip(keys, values)),
    flatten_func=lambda s: (tuple(s._dict.values()), tuple(s._dict)),
)


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
        # No call after the push: an interrupt cannot land between it and the block (the
        # with statement would then never call __exit__ and the store stay the default).
        ctx.stores += (self,)
        return self

    def __exit__(self, *exc: object) -> None:
        stack = ctx.stores
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
                _journaled(self, candidate)
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
                _journaled(self, full)
            elif name not in self._taken:
                full = self.unique_name(name)
            else:
                full = self.unique_name(base or name)
            self._live[full] = var
            self._order[full] = len(self._order)
            return full

    def get_or_create(self, name: str, make: Callable[[Variable | None], Variable]) -> Variable:
        """``make(existing)`` with the live variable of full name ``name`` (None if there is
        none), under this store's lock: one step, so threads racing on one name get one
        variable. A variable ``make`` returns other than ``existing`` is then held strongly
        by the store (``get_variable``'s variables are shared state)."""
        with self._lock:
            existing = self._live.get(name)
            var = make(existing)
            if var is not existing:
                self._shared[var.name] = var
            return var

    def _forget(self, var: Variable) -> None:
        """Stop tracking ``var`` (the undo of a creation whose trace failed): only ``var``
        itself, never another variable that has its name. Its name stays taken."""
        with self._lock:
            name = var.name
            if self._shared.get(name) is var:
                del self._shared[name]
            if self._live.get(name) is var:
                del self._live[name]

    def _release(self, name: str, keep: Container[int]) -> None:
        """Give ``name`` back, untracking the variable that holds it unless its id is in
        ``keep`` (then nothing changes): the undo of a construction or build that failed,
        whose names never reached the user. ``_counts`` stays exact: ``base_k`` freed means
        ``base_1 .. base_(k-1)`` at most are known taken."""
        with self._lock:
            var = self._live.get(name)
            if var is not None:
                if id(var) in keep:
                    return
                del self._live[name]
                if self._shared.get(name) is var:
                    del self._shared[name]
            self._order.pop(name, None)
            self._taken.discard(name)
            base, sep, number = name.rpartition("_")
            if sep and number.isdigit() and number[0] != "0":
                k = int(number)
                if self._counts.get(base, 0) >= k:
                    self._counts[base] = k - 1

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
        """The live variables that are trainable, in creation order."""
        return [v for v in self.variables() if v.trainable]

    def state(self) -> State:
        """An immutable ``{full_name: jax.Array}`` mapping (a pytree) of the live variables.
        String variables are host data and are left out (as ``ps.state`` does)."""
        return State((v.name, v.value()) for v in self.variables() if not v._is_string)

    def __repr__(self) -> str:
        return f"<ps.VariableStore with {len(self._live)} live variables>"


_DEFAULT_STORE = VariableStore()


def _journaled(store: VariableStore, name: str) -> None:
    for entries in ctx.journals:
        entries.append((store, name))


@contextlib.contextmanager
def journal() -> Iterator[list[tuple[VariableStore, str]]]:
    """Record ``(store, name)`` for every name this thread takes inside the block (module
    scopes and variables, in any store), for ``give_back`` when what the block built
    fails. Nested blocks each see the names taken inside them."""
    entries: list[tuple[VariableStore, str]] = []
    ctx.journals += (entries,)  # no call, so no signal check, before the try
    try:
        yield entries
    finally:
        stack = ctx.journals
        if stack and stack[-1] is entries:  # the usual case, with no call (no signal check)
            del stack[-1]
        else:  # by identity (two empty journals compare equal)
            del stack[max(i for i, e in enumerate(stack) if e is entries)]


def give_back(
    entries: Sequence[tuple[VariableStore, str]], prefixes: Iterable[str], keep: Container[int] = ()
) -> None:
    """Undo the names of ``entries`` (a ``journal``) that are one of ``prefixes`` or under
    ``<prefix>/``: each is free again and its variable, if any, untracked (unless its id is
    in ``keep``: a variable that stays reachable), so a retry creates the same names
    (``dense/kernel``, never ``dense/kernel_1``), which name-based checkpoints rely on."""
    heads = tuple(prefixes)
    under = tuple(p + "/" for p in heads)
    for store, name in reversed(entries):
        if name in heads or name.startswith(under):
            store._release(name, keep)


def default_store() -> VariableStore:
    """The store new variables go to: the innermost ``with VariableStore()``, else the global."""
    stack = ctx.stores
    return stack[-1] if stack else _DEFAULT_STORE


def preview_names(names: Sequence[str], limit: int = 10) -> str:
    """``'a', 'b' and 3 more`` for error messages (``none`` for no names)."""
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "") or "none"
