"""paramstore's own programs rewritten around JAX's ``while_loop`` state-discharge bug.

JAX's discharge of a ``while_loop`` whose condition reads a ref that its body writes gives
the condition and the body two separate loop carries for that ref, so the condition sees
the value from before the loop forever (``while c < n: c += 1`` never ends, or ends wrong).
Every JAX release from 0.10 through 0.12.0.1 has it; a variable read in a loop condition
and assigned in its body is exactly that program.

paramstore never replaces a JAX rule (other threads running plain JAX see JAX's own rules,
always). Instead ``fix_while`` rewrites paramstore's own jaxprs before it discharges them
(``pure``): each such loop becomes a loop whose carry holds the values of
the refs its condition reads (read before the loop and again after each body run), and
whose condition reads those carried values instead of the refs. The body is unchanged, so
JAX's own rule discharges the new loop correctly. Loops nested in other bodies (``scan``,
``cond``, ``jax.checkpoint``, an inner ``jax.jit``...) are rewritten inside them.

Costs: a program with no such loop is returned as it is after one walk over its equations
(the common case: nothing is retraced). ``jax_has_bug()`` checks, once and on first need,
with a tiny program, whether the installed JAX still has the bug; once JAX fixes it,
nothing is rewritten.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax

from paramstore._core.jax_api import (
    AbstractRef,
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    Literal,
    discharge,
    eval_eqn,
    jaxprs_in_params,
    retrace,
    while_p,
)

if TYPE_CHECKING:  # annotations only
    from jax.extend.core import JaxprEqn, Var

__all__ = ["fix_while", "jax_has_bug", "needs_fix", "pure"]


def pure(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` with its loops fixed (``fix_while``) and its refs discharged (a pure jaxpr
    with the same outputs, so that dead-code elimination sees true data dependence rather
    than keeping every effect): the program paramstore compiles or cuts down. The debug info
    (argument names) is kept."""
    pure = discharge(fix_while(closed), False)
    info = closed.jaxpr.debug_info
    return ClosedJaxpr(pure.jaxpr.replace(debug_info=info), pure.consts)


def _cond_refs(eqn: JaxprEqn) -> list[int]:
    """The positions of the refs among a ``while`` equation's condition constants."""
    avals = eqn.params["cond_jaxpr"].in_avals[: eqn.params["cond_nconsts"]]
    return [i for i, a in enumerate(avals) if isinstance(a, AbstractRef)]


def needs_fix(jaxpr: Jaxpr) -> bool:
    """Whether ``jaxpr`` (open) or a jaxpr inside it has a loop whose condition reads a ref."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is while_p and _cond_refs(eqn):
            return True
        if any(needs_fix(sub) for sub in jaxprs_in_params(eqn.params)):
            return True
    return False


def fix_while(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` with every loop whose condition reads a ref rewritten (module docstring);
    ``closed`` itself when there is none or JAX has no bug to work around."""
    if not needs_fix(closed.jaxpr) or not jax_has_bug():
        return closed
    return _rewrite(closed)


def _rewrite(closed: ClosedJaxpr) -> ClosedJaxpr:
    jaxpr, consts = closed.jaxpr, list(closed.consts)

    def run(*args: object) -> list[Any]:
        return _interpret(jaxpr, consts, list(args))

    return retrace(run, [v.aval for v in jaxpr.invars], jaxpr.debug_info)


def _interpret(jaxpr: Jaxpr, consts: list[Any], args: list[Any]) -> list[Any]:
    """Evaluate ``jaxpr`` in the current trace, as ``core.eval_jaxpr`` does, with the
    loops that need it rewritten."""
    env: dict[Var, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(atom: Var | Literal) -> object:
        return atom.val if isinstance(atom, Literal) else env[atom]

    for eqn in jaxpr.eqns:
        invals = [read(a) for a in eqn.invars]
        if eqn.primitive is while_p and _cond_refs(eqn):
            outs = _fixed_while(eqn, invals)
        elif any(needs_fix(sub) for sub in jaxprs_in_params(eqn.params)):
            outs = eval_eqn(eqn, invals, {k: _param(v) for k, v in eqn.params.items()})
        else:
            outs = eval_eqn(eqn, invals, eqn.params)
        for var, out in zip(eqn.outvars, outs):
            if not isinstance(var, DropVar):
                env[var] = out
    return [read(a) for a in jaxpr.outvars]


def _param(value: object) -> object:
    """An equation parameter with the jaxprs in it rewritten (a tuple of them too)."""
    if isinstance(value, tuple):
        return tuple(_param(v) for v in value)
    if isinstance(value, ClosedJaxpr):  # (from jax 0.12, every jaxpr: consts attached)
        return _rewrite(value) if needs_fix(value.jaxpr) else value
    if isinstance(value, Jaxpr) and needs_fix(value):  # an open jaxpr (jax.checkpoint's)
        new = _rewrite(ClosedJaxpr(value, []))
        if new.consts:
            raise NotImplementedError(
                "paramstore could not rewrite the while_loop inside this transformation's "
                "body (it would need constants); carry the variable's value through the loop"
            )
        return new.jaxpr
    return value


def _fixed_while(eqn: JaxprEqn, invals: list[Any]) -> list[Any]:
    """The loop of ``eqn`` with the refs its condition reads carried as values."""
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
    refs = _cond_refs(eqn)
    cond = discharge(p["cond_jaxpr"], [i in refs for i in range(cn)] + [False] * len(init))
    body = p["body_jaxpr"]

    def read_refs() -> list[Any]:
        return [cond_consts[i][...] for i in refs]

    def cond_fun(state: tuple[list[Any], list[Any]]) -> jax.Array:
        values, carry = state
        args = list(cond_consts)
        for i, value in zip(refs, values):
            args[i] = value
        go: jax.Array = _interpret(cond.jaxpr, list(cond.consts), [*args, *carry])[0]
        return go

    def body_fun(state: tuple[list[Any], list[Any]]) -> tuple[list[Any], list[Any]]:
        _, carry = state
        outs = _interpret(body.jaxpr, list(body.consts), [*body_consts, *carry])
        return read_refs(), outs

    _, carry = jax.lax.while_loop(cond_fun, body_fun, (read_refs(), list(init)))
    return list(carry)


@functools.cache
def jax_has_bug() -> bool:
    """Whether JAX's own discharge still gives a ``while_loop`` condition a stale copy of a
    ref its body writes: a tiny program, run eagerly once (bounded by a counter, so a
    buggy JAX ends too)."""

    def program() -> int:  # (jax.lax.while_loop's types: the carry is typed as its init)
        r = jax.new_ref(0)

        def cond(c: int) -> object:
            return (r[...] < 3) & (c < 10)

        def body(c: int) -> int:
            r[...] = r[...] + 1
            return c + 1

        return jax.lax.while_loop(cond, body, 0)

    closed = jax.make_jaxpr(program)()
    pure = discharge(closed, False)
    steps = jax.jit(jax.extend.core.jaxpr_as_fun(pure))()[0]
    return int(steps) != 3
