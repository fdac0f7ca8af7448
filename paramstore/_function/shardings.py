"""``in_shardings`` / ``out_shardings`` of ``ps.function``: the spec a user gives, as one
``Sharding`` (or None) per flat array leaf of the arguments or the result."""

from __future__ import annotations

import itertools
from typing import Any

import jax
from jax.sharding import Sharding

__all__ = ["Shardings", "leaf_shardings"]

# in_shardings / out_shardings: one Sharding for every array, or a pytree prefix of the
# positional arguments (of the result) with a Sharding or None (unspecified) at its leaves.
Shardings = Sharding | None | tuple[Any, ...] | list[Any] | dict[str, Any]


def leaf_shardings(
    name: str, spec: Shardings, tree: Any, n: int, skip: list[int], args: bool
) -> list[Any] | None:
    """``spec`` (``in_shardings``: over the positional arguments; ``out_shardings``:
    over the result) as one Sharding or None per flat leaf, leaves in ``skip``
    (Variables/Modules passed as arguments) left out; None for no spec."""
    if spec is None or tree is None:
        return None
    which = "in_shardings" if args else "out_shardings"
    if isinstance(spec, Sharding):
        per_leaf: list[Any] = [spec] * n
    else:
        example = jax.tree_util.tree_unflatten(tree, list(range(n)))
        target = example[0] if args else example  # (args, kwargs) for arguments
        per_leaf = [None] * n
        is_spec = lambda x: x is None or isinstance(x, Sharding)  # noqa: E731
        try:
            pairs = jax.tree_util.tree_map(
                lambda sh, sub: [(i, sh) for i in jax.tree_util.tree_leaves(sub)],
                spec,
                target,
                is_leaf=is_spec,
            )
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"{which} of ps.function '{name}' must be a Sharding, or a pytree "
                "prefix of the "
                + ("positional arguments" if args else "result")
                + f" with a Sharding or None at each leaf: {e}"
            ) from None
        for i, sh in itertools.chain.from_iterable(
            jax.tree_util.tree_leaves(pairs, is_leaf=lambda x: isinstance(x, list))
        ):
            if sh is not None and not isinstance(sh, Sharding):
                raise TypeError(
                    f"{which} of ps.function '{name}': expected a "
                    f"jax.sharding.Sharding or None, got {type(sh).__name__}."
                )
            per_leaf[i] = sh
    skipped = set(skip)
    return [sh for i, sh in enumerate(per_leaf) if i not in skipped]
