"""Names of an optimizer's state variables: pure functions of optax's state paths.

Contract (used by ``ps.Optimizer``; see its docstring for the naming rule):

* ``slot_names(paths, shapes, params)`` -> ``(names, owners)``: for each optax state leaf
  (its key path and shape), a readable name relative to the optimizer, and the variable
  it belongs to if it is a per-parameter slot. ``params`` maps the key under which optax
  sees each optimized variable (``DictKey(name)`` or ``SequenceKey(i)``) to that
  variable. A slot is ``"<variable name>/<slot path>"`` (``"dense/w/mu"``), anything
  else its path (``"count"``, ``"hyperparams/learning_rate"``); list indices of
  ``optax.chain`` are left out unless two names would collide.
* ``hyperparam_leaves(paths)`` -> ``[(leaf index, name)]`` of the hyperparameters that
  ``optax.inject_hyperparams`` keeps in the state.
* ``state_sharding(owner, leaf, replicated)``: where a state leaf's Variable goes. A slot
  goes exactly where its parameter is (the parameter's sharding, or, for a parameter with
  no placement of its own, nowhere in particular, like it), whatever ``ps.device`` block
  or ``LayoutMap`` the optimizer is built in: create the state inside
  ``paramstore._core.placement.unplaced()``. Other state (counters, hyperparameters) is
  replicated over the first parameter's devices.
* ``replicated_like(sharding)``: that replicated sharding (None: leave on the default).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, Sharding
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from paramstore._core.ownership import ownership

if TYPE_CHECKING:
    from paramstore.variable import Variable

__all__ = [
    "slot_names",
    "hyperparam_leaves",
    "state_sharding",
    "replicated_like",
    "as_state_array",
    "zero_int32",
    "constrained",
]

Path = tuple[Any, ...]


def _segment(key: Any, keep_index: bool) -> str | None:
    if isinstance(key, SequenceKey):
        return str(key.idx) if keep_index else None
    if isinstance(key, GetAttrKey):
        name: str = key.name
        return name
    if isinstance(key, (DictKey, FlattenedIndexKey)):
        return str(key.key)
    return str(key)


def path_name(path: Path, keep_index: bool) -> str:
    """``"0/mu"`` (``keep_index``) or ``"mu"`` for the path of ``chain(...)[0].mu``."""
    return "/".join(s for s in (_segment(k, keep_index) for k in path) if s)


def _owners(
    paths: Sequence[Path], shapes: Sequence[tuple[int, ...]], params: Mapping[Any, Any]
) -> list[Any]:
    """The variable each per-parameter leaf belongs to (None for shared state): a leaf
    whose last key is a parameter's, in a group of siblings that are all parameters' and
    either have their shapes or sit under a named field."""
    siblings: dict[Path, list[int]] = {}
    for j, path in enumerate(paths):
        if path:
            siblings.setdefault(tuple(path[:-1]), []).append(j)
    owners: list[Any] = []
    for path in paths:
        if not path or path[-1] not in params:
            owners.append(None)
            continue
        group = siblings[tuple(path[:-1])]
        if not all(paths[s][-1] in params for s in group):
            owners.append(None)
            continue
        shapes_match = all(tuple(shapes[s]) == params[paths[s][-1]].shape for s in group)
        named_field = len(path) > 1 and not isinstance(path[-2], SequenceKey)
        owners.append(params[path[-1]] if shapes_match or named_field else None)
    return owners


def slot_names(
    paths: Sequence[Path], shapes: Sequence[tuple[int, ...]], params: Mapping[Any, Any]
) -> tuple[list[str], list[Any]]:
    """Unique names for the state leaves, and their owning variables (see the docstring)."""
    owners = _owners(paths, shapes, params)

    def name(j: int, keep_index: bool) -> str:
        if owners[j] is None:
            return path_name(paths[j], keep_index) or "state"
        slot = path_name(paths[j][:-1], keep_index)
        return f"{owners[j].name}/{slot}" if slot else owners[j].name

    short = [name(j, False) for j in range(len(paths))]
    return [name(j, True) if short.count(n) > 1 else n for j, n in enumerate(short)], owners


def hyperparam_leaves(paths: Sequence[Path]) -> list[tuple[int, str]]:
    """``(leaf index, hyperparameter name)`` for ``...hyperparams[name]`` leaves."""
    return [
        (j, str(path[-1].key))
        for j, path in enumerate(paths)
        if len(path) >= 2
        and isinstance(path[-1], DictKey)
        and isinstance(path[-2], GetAttrKey)
        and path[-2].name == "hyperparams"
    ]


def replicated_like(sharding: Sharding | None) -> Sharding | None:
    """A replicated sharding over the devices of ``sharding`` (None: leave on the default)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
    if sharding is not None and len(sharding.device_set) == 1:
        return sharding
    return None


def state_sharding(owner: Any, leaf: Any, replicated: Sharding | None) -> Sharding | None:
    """The ``sharding=`` for the Variable of state ``leaf`` owned by parameter ``owner``
    (None for shared state); see the module docstring. Create it inside ``unplaced()``."""
    if owner is None or tuple(owner.shape) != tuple(leaf.shape):
        want = replicated
    elif getattr(ownership.peek(owner), "committed", True):  # metadata only: peek
        want = owner.sharding
    else:  # the parameter has no placement: neither has its slot
        return None
    if want is not None and getattr(leaf, "sharding", None) == want:
        return None  # already there (optax made it from the parameter): no copy
    return want


def zero_int32() -> jax.Array:
    """A scalar int32 zero (an optimizer's ``iterations`` initializer)."""
    return jnp.zeros((), jnp.int32)


def as_state_array(path: Any, leaf: Any) -> jax.Array:
    """An optax state leaf as a strongly typed array (one signature), or a TypeError."""
    try:
        arr = jnp.asarray(leaf)
        return jnp.asarray(arr, dtype=arr.dtype)  # drop weak types
    except TypeError:
        raise TypeError(
            f"ps.Optimizer: the optax state has a leaf at {jax.tree_util.keystr(path)} "
            f"that is not an array ({type(leaf).__name__}); it cannot be a Variable."
        ) from None


def constrained(var: Variable, x: jax.Array) -> jax.Array:
    """``var.constraint(x)``, checked to keep the shape and dtype (before anything is
    assigned: a step is all or nothing)."""
    x = jnp.asarray(x).astype(var.dtype)
    constraint = var.constraint
    assert constraint is not None
    out: jax.Array = constraint(x)
    if tuple(jnp.shape(out)) != var.shape or jnp.result_type(out) != var.dtype:
        raise ValueError(
            f"ps.Optimizer: the constraint of variable '{var.name}' ({var.constraint!r:.60}) "
            f"returned shape {tuple(jnp.shape(out))} dtype {jnp.result_type(out)} for its "
            f"{var.shape} {var.dtype} value; a constraint must keep both. Nothing was changed."
        )
    return out
