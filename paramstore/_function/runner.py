"""A traced signature's programs: the ``jax.jit`` runner of the lifted jaxpr (the variables'
new values pinned to their shardings, returned values that alias a variable copied) and its
masked twins, which donate every input but the handed-out ones (docs/architecture.md,
"Reads between steps copy nothing")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from paramstore._core.ownership import ownership
from paramstore._core.placement import in_host_memory
from paramstore.variable import Variable

__all__ = ["Masked", "masked_twin", "runner"]

Masked = tuple[Callable[..., Any], list[int]]
"""A masked twin and the order its new values come in (indices into the assigned)."""


def runner(
    fun: Callable[..., Any],
    n_out: int,
    order: list[int],
    to_copy: frozenset[int],
    assigned: list[Variable],
    donating: bool,
    arg_sh: list[Any] | None,
    out_sh: list[Any] | None,
) -> tuple[Callable[..., Any], tuple[Any, ...], Callable[[tuple[bool, ...]], Masked]]:
    """The ``jax.jit`` of ``fun`` (the lifted program) called as ``runner(donated,
    readonly, arrays) -> (new values in the order of assigned, outputs)``, the shardings
    of the assigned variables it was built for (which it pins), and the maker of its
    masked twins (``masked``)."""

    def run(don: list[Any], ro: list[Any], arrays: list[Any]) -> tuple[Any, Any]:
        res = fun(*don, *ro, *arrays)
        new = res[n_out:]
        out = [jnp.copy(x) if i in to_copy else x for i, x in enumerate(res[:n_out])]
        return [new[i] for i in order], out

    # Assigned variables come back with the very sharding they went in with (jit's
    # out_shardings; a with_sharding_constraint would hand back an equivalent but
    # unequal spec, P() -> P(None, None), and fails on Explicit mesh axes), so the
    # next call sees the same input shardings (no recompilation) and placement is kept.
    # (A variable in host memory, e.g. an optimizer slot with slot_memory_kind=, keeps
    # its memory kind the same way, even on one device.)
    layout = tuple(getattr(ownership.peek(v), "sharding", None) for v in assigned)
    keep = [
        sh if len(sh.device_set) > 1 or in_host_memory(sh) else None
        for sh in (ownership.peek(v).sharding for v in assigned)
    ]
    has_keep = any(sh is not None for sh in keep)
    in_sh = (None, None, arg_sh) if arg_sh is not None else None
    out_shs = (keep if has_keep else None, out_sh) if has_keep or out_sh is not None else None

    jitted = jax.jit(
        run,
        donate_argnums=(0,) if donating else (),
        in_shardings=in_sh,
        out_shardings=out_shs,
    )

    def masked(given: tuple[bool, ...]) -> Masked:
        return masked_twin(run, given, len(assigned), keep if has_keep else None, out_sh, arg_sh)

    return jitted, layout, masked


def masked_twin(
    run: Callable[..., Any],
    given: tuple[bool, ...],
    n_assigned: int,
    keep: list[Any] | None,
    out_sh: list[Any] | None,
    arg_sh: list[Any] | None,
) -> Masked:
    """A twin of the runner that donates the donated inputs except those ``given`` (handed
    out: passed, not donated, not copied), called as ``twin(kept, (given arrays,
    read-only), arrays)``, and the order of the assigned variables its new values come in:
    the kept ones first, so jit pairs each donated buffer with its own variable's new
    value (it pairs by shape and dtype, in order)."""
    kept_i = [i for i, g in enumerate(given) if not g]
    given_i = [i for i, g in enumerate(given) if g]
    perm = kept_i + given_i + list(range(len(given), n_assigned))

    def twin(kept: list[Any], rest: tuple[list[Any], list[Any]], arrays: list[Any]) -> Any:
        held, ro = rest
        don: list[Any] = [None] * len(given)
        for i, x in zip(kept_i, kept):
            don[i] = x
        for i, x in zip(given_i, held):
            don[i] = x
        new, out = run(don, ro, arrays)
        return [new[i] for i in perm], out

    in_sh = (None, None, arg_sh) if arg_sh is not None else None
    new_sh = [keep[i] for i in perm] if keep is not None else None
    out_shs = (new_sh, out_sh) if new_sh is not None or out_sh is not None else None
    jitted = jax.jit(twin, donate_argnums=(0,), in_shardings=in_sh, out_shardings=out_shs)
    return jitted, perm
