"""``ps.nn.Repeat``'s layout helpers: attribute paths, stacked initial values and
shardings, and the conversion of checkpoint keys between ``n`` blocks and the stacked layout
(see ``paramstore/nn/repeat/__init__.py`` and docs/guides/repeat.md)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paramstore._core import seed as _seed
from paramstore._traverse import walk
from paramstore.random import Generator
from paramstore.variable import Variable

__all__ = [
    "STACKED",
    "attribute_paths",
    "generators",
    "all_variables",
    "stacked_initial",
    "stacked_shape",
    "stacked_sharding",
    "stacked_partition",
    "stack_state",
    "unstack_state",
]

STACKED = "stacked"  # the Repeat attribute holding the stacked variables


def attribute_paths(block: Any) -> dict[int, str]:
    """``{id(variable): its path inside block}``: ``ps.Checkpoint``'s paths (the one
    traversal, ``_traverse.walk``, with holders: a generator's ``state`` included), each
    variable under the path where the walk first meets it."""
    return {
        id(v): path
        for path, v in walk(block, "", holders=True)
        if isinstance(v, Variable) and path is not None
    }


def generators(block: Any) -> list[Generator]:
    """The ``ps.random.Generator`` objects the block holds, at any depth (the one traversal,
    which yields the holders it descends into)."""
    return [g for _, g in walk(block, holders=True) if isinstance(g, Generator)]


def all_variables(block: Any) -> list[Variable]:
    """Every variable the block holds: its modules' and its generators' states."""
    return [v for _, v in walk(block, holders=True) if isinstance(v, Variable)]


def stacked_initial(
    init: Callable[[], Any] | None, source: Any, n: int, name: str, stream: bool
) -> Callable[[], Any]:
    """The initial value of a stacked variable: ``init`` drawn for each layer with the
    layer index folded into its key; else ``source`` (an array, or a zero-argument callable
    computing it: an abstract template variable's initializer) in every layer (a generator
    state: split per layer). Computed only when called, so inside ``ps.abstract()`` it is
    only traced for its shape."""

    def stacked() -> Any:
        if stream or init is None:
            with _seed.recording():  # the template's initializer: not recorded as ours
                value = source() if callable(source) else source
        if stream:
            key = jax.random.wrap_key_data(value)
            keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n))
            return jax.random.key_data(keys)
        if init is None:
            if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):  # type: ignore[attr-defined]
                return jax.vmap(lambda i: jax.random.fold_in(value, i))(jnp.arange(n))
            return jnp.broadcast_to(value, (n, *value.shape))

        def one(i: Any) -> Any:
            with _seed.naming(name, index=i):
                return jnp.asarray(init())

        try:
            return jax.vmap(one)(jnp.arange(n))
        except TypeError:  # an initializer vmap cannot batch (NumPy on a tracer...)
            return jnp.stack([one(i) for i in range(n)])

    return stacked


def stacked_shape(template: Variable, n: int) -> jax.ShapeDtypeStruct:
    """A stacked variable's shape and dtype only: for a template variable made abstract from
    a shape (``ps.Variable(jax.ShapeDtypeStruct(...))``), whose stacked copy has no
    initializer either and must be restored (allowed inside ``ps.abstract()`` only)."""
    return jax.ShapeDtypeStruct((n, *template.shape), template.dtype)


def stacked_sharding(template: Variable) -> Any:
    """The stacked variable's sharding: the template's ``NamedSharding`` (from ``sharding=``,
    a ``ps.sharding.LayoutMap`` entry or a partition under ``axis_rules``, all resolved for
    the per-block shape when the template was created) with the stacked axis replicated in
    front; None where the template has no mesh layout."""
    sharding = template.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (template.ndim - len(sharding.spec))
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, *spec))
    return None


def stacked_partition(template: Variable) -> tuple[Any, ...] | None:
    """The template's logical partition with an unnamed stacked axis in front."""
    partition = template.partition
    return None if partition is None else (None, *partition)


def stack_state(state: Mapping[str, Any], prefix: str) -> dict[str, np.ndarray]:
    """Checkpoint keys of ``n`` separate blocks to the stacked layout.

    ``state`` maps keys to arrays (a ``ps.Checkpoint`` file read with
    ``ps.checkpoint.list_variables``/``load_variable``); the keys ``f"{prefix}/{i}/<path>"``
    (an unrolled list of blocks) become ``f"{prefix}/stacked/<path>"`` with the blocks'
    values stacked on a new leading axis; other keys are kept as they are."""
    pattern = re.compile(re.escape(prefix.rstrip("/")) + r"/(\d+)/(.+)")
    out: dict[str, np.ndarray] = {}
    layers: dict[int, dict[str, Any]] = {}
    for key, value in state.items():
        match = pattern.fullmatch(key)
        if match is None:
            out[key] = np.asarray(value)
        else:
            layers.setdefault(int(match[1]), {})[match[2]] = value
    if not layers:
        raise KeyError(f"Repeat.stack_state: no key looks like '{prefix}/<i>/...'.")
    n = len(layers)
    if sorted(layers) != list(range(n)):
        raise KeyError(
            f"Repeat.stack_state: the blocks under '{prefix}' are {sorted(layers)}, "
            f"expected 0 to {n - 1}."
        )
    paths = sorted(layers[0])
    for i in range(n):
        if sorted(layers[i]) != paths:
            raise KeyError(
                f"Repeat.stack_state: block {i} under '{prefix}' has keys "
                f"{sorted(layers[i])}, block 0 has {paths}."
            )
    for path in paths:
        out[f"{prefix.rstrip('/')}/{STACKED}/{path}"] = np.stack(
            [np.asarray(layers[i][path]) for i in range(n)]
        )
    return out


def unstack_state(state: Mapping[str, Any], prefix: str) -> dict[str, np.ndarray]:
    """The reverse of ``stack_state``: ``f"{prefix}/stacked/<path>"`` (leading axis
    ``n``) becomes ``f"{prefix}/{i}/<path>"`` for each block ``i``."""
    head = f"{prefix.rstrip('/')}/{STACKED}/"
    out: dict[str, np.ndarray] = {}
    found = False
    for key, value in state.items():
        if key.startswith(head):
            found = True
            arr = np.asarray(value)
            for i in range(arr.shape[0]):
                out[f"{prefix.rstrip('/')}/{i}/{key[len(head) :]}"] = arr[i]
        else:
            out[key] = np.asarray(value)
    if not found:
        raise KeyError(f"Repeat.unstack_state: no key starts with '{head}'.")
    return out
