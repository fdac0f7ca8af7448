"""The JAX internals paramstore relies on, in one place (written against jax 0.10).

* ``current_trace()``: the trace that new operations go to (``core.trace_ctx.trace``);
  ``EVAL`` is the eager one. Reading it costs ~150 ns, so hot paths compare identity.
* ``staging(trace)``: whether ``trace`` records a program to run later (``jax.jit``,
  ``make_jaxpr``, a control-flow body), looking through ``grad``/``vmap`` traces on top of
  it. A value read there and not passed in as an input would be baked in as a constant.
* ``ref_in(trace, value)``: a ``jax.new_ref`` created in ``trace`` (an enclosing one), so
  that nested bodies close over it and their writes are ordinary ref effects.
* ``tracer_in(trace, const)``: ``const`` as a tracer of a ``make_jaxpr`` trace, recorded as
  a constant of the jaxpr (which ``ps.function`` then lifts to an input).

It also works around one bug of jax 0.10's state discharge: a ref that a ``while_loop``'s
``cond_fun`` reads and its ``body_fun`` writes got two separate loop carries, so the
condition saw the initial value forever (``while c < n: c += 1`` never ended). The rule
here gives each distinct ref one carry that both functions use; loops whose condition
reads no ref (or writes one) go to JAX's own rule. It is not registered for the process:
``while_fix()`` installs it only while paramstore discharges its own programs (a
``ps.function``'s jaxpr, before ``jax.jit`` sees it) or runs a binding frame (an eager
``ps.pure``/gradient, whose loops run, and so are discharged, inside it); JAX's own rule is
back as soon as the last user leaves, so code that never enters paramstore runs exactly
as without it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import jax

# The tested range (pyproject's `jax>=0.10,<0.11`): the internals below and the while_loop
# discharge rule are written against it.
SUPPORTED = ((0, 10), (0, 11))


def check_version(version: str) -> None:
    """ImportError unless ``version`` (``jax.__version__``) is in the tested range."""
    try:
        found = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        found = (-1, -1)
    if not SUPPORTED[0] <= found < SUPPORTED[1]:
        lo, hi = (".".join(map(str, v)) for v in SUPPORTED)
        raise ImportError(
            f"paramstore needs jax >= {lo}, < {hi} (the versions it is tested with: it uses "
            f"JAX internals that change between releases); found jax {version}. Install a "
            f"supported one: pip install 'jax>={lo},<{hi}'."
        )


check_version(jax.__version__)

from jax._src import core as _core  # noqa: E402
from jax._src import dtypes as _jax_dtypes  # noqa: E402
from jax._src import source_info_util as _source_info  # noqa: E402
from jax._src.array import ArrayImpl as _ArrayImpl  # noqa: E402
from jax._src.interpreters import batching as _batching  # noqa: E402
from jax._src.interpreters import partial_eval as _pe  # noqa: E402
from jax._src.lax.control_flow import loops as _loops  # noqa: E402
from jax._src.lib import xla_client as _xc  # noqa: E402
from jax._src.state import discharge as _discharge  # noqa: E402
from jax._src.state.types import AbstractRef, WriteEffect  # noqa: E402

__all__ = [
    "ARRAY_TYPE",
    "EVAL",
    "Tracer",
    "current_trace",
    "staging",
    "ref_in",
    "tracer_in",
    "trace_of",
    "in_trace",
    "pure_jaxpr",
    "put_on_device",
    "vmap_home",
    "in_while_cond",
    "in_while_body",
    "while_fix",
    "enter_while_fix",
    "exit_while_fix",
    "init_program",
    "in_shard_map",
    "device_assignment",
    "refuse_as_array",
]

Tracer = jax.core.Tracer
ARRAY_TYPE: Any = _ArrayImpl  # jax.Array's concrete class, without creating an array
EVAL = _core.eval_trace
_STRONG = _core.trace_state_strong_ref
_STAGING = _pe.DynamicJaxprTrace


def current_trace() -> Any:
    """The trace new operations go to (``EVAL`` when nothing is being traced)."""
    return _STRONG.value


def staging(trace: Any) -> bool:
    """Whether ``trace`` (or the trace it forwards to) records a program for later."""
    while trace is not None and trace is not EVAL:
        if isinstance(trace, _STAGING):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def trace_of(x: Any) -> Any:
    """The trace a tracer belongs to (None for a concrete value)."""
    return getattr(x, "_trace", None) if isinstance(x, Tracer) else None


def in_trace(trace: Any) -> Any:
    """A context manager making ``trace`` the current trace (an enclosing one)."""
    return _core.set_current_trace(trace)


def ref_in(trace: Any, value: Any) -> Any:
    """``jax.new_ref(value)`` created in ``trace`` rather than the current trace."""
    with _core.set_current_trace(trace):
        return jax.new_ref(value)


def tracer_in(trace: Any, const: Any) -> Any:
    """``const`` as a tracer of the staging ``trace``: a constant of its jaxpr."""
    return trace.to_jaxpr_tracer(const, _source_info.current())


def vmap_home(value: Any, stop: Any) -> tuple[Any, bool]:
    """Where ``value`` can be written to a ref created outside the enclosing ``jax.vmap``
    bodies: ``(trace, batched)``. ``trace`` is the innermost enclosing trace that is not a
    vmap's (None when the current trace is not a vmap's: write where you are); ``batched``
    says that ``value`` varies along one of those vmaps' batch axes (no single value to
    write). JAX refuses any write to an unbatched ref from a vmap trace, even of a value
    that does not depend on the batch. The walk stops at ``stop`` (the ref's own trace)."""
    trace = current_trace()
    home = None
    while trace is not stop and isinstance(trace, _batching.BatchTrace):
        if isinstance(value, _batching.BatchTracer) and value._trace is trace:
            if value.batch_dim is not None:
                return None, True
            value = value.val
        trace = trace.parent_trace
        home = trace
    return home, False


def init_program(jaxpr: Any, used_out: list[bool]) -> tuple[Any, list[bool]]:
    """``jaxpr`` (an open jaxpr) with its constants turned into leading inputs, cut down
    to the computation of the outputs marked in ``used_out``; and which inputs (constants
    first) that computation uses."""
    with_consts = _pe.convert_constvars_jaxpr(jaxpr)
    return _pe.dce_jaxpr(with_consts, used_out)  # type: ignore[no-any-return]


def device_assignment(sharding: Any) -> list[Any]:
    """The devices of ``sharding`` in its own order (``Sharding._device_assignment``)."""
    return list(sharding._device_assignment)


def _traced_for(stop: Any, what: str) -> bool:
    trace = current_trace()
    while trace is not None and trace is not stop and trace is not EVAL:
        if isinstance(trace, _STAGING):
            info = trace.frame.debug_info
            if info is not None and info.traced_for == what:
                return True
        trace = getattr(trace, "parent_trace", None)
    return False


def in_while_cond(stop: Any) -> bool:
    """Whether the current trace, below ``stop``, is a ``lax.while_loop`` condition's."""
    return _traced_for(stop, "while_cond")


def in_while_body(stop: Any) -> bool:
    """Whether the current trace, below ``stop``, is a ``lax.while_loop`` body's."""
    return _traced_for(stop, "while_body")


def in_shard_map(stop: Any) -> bool:
    """Whether the current trace, below ``stop``, is a ``jax.shard_map`` body's."""
    return _traced_for(stop, "shard_map")


@functools.lru_cache(maxsize=256)
def _aval(shape: tuple[int, ...], dtype: Any) -> Any:
    return _core.ShapedArray(shape, dtype)


def put_on_device(arr: Any, sharding: Any, device: Any) -> jax.Array:
    """``jax.device_put(arr, sharding, may_alias=True)`` for a NumPy array bound for one
    device (``sharding`` a ``SingleDeviceSharding`` of ``device``, default memory): the XLA
    call ``device_put`` ends in, without its per-array Python. Restoring 4,096 arrays of
    16 KiB took 136-157 ms through ``jax.device_put`` and 26 ms this way (2026-11-22)."""
    return _xc.batched_device_put(_aval(arr.shape, arr.dtype), sharding, [arr], [device], True)


def pure_jaxpr(closed: Any) -> Any:
    """``closed`` with its refs discharged (a pure jaxpr with the same outputs), so that
    dead-code elimination sees true data dependence rather than keeping every effect; a
    ``while_loop`` whose condition reads a ref its body writes gets one carry for it
    (``while_fix``). The debug info (argument names) is kept."""
    with while_fix():
        pure = _discharge.discharge_state(closed, should_discharge=False)
    info = closed.jaxpr.debug_info
    return _core.ClosedJaxpr(pure.jaxpr.replace(debug_info=info), pure.consts)


# ------------------------------------------------------- while_loop state discharge fix

_RULES = _discharge._partial_discharge_rules
_jax_while_rule = _RULES[_loops.while_p]
_fix_lock = threading.Lock()
_fix_users = 0  # enter_while_fix calls not yet matched by exit_while_fix, all threads


def enter_while_fix() -> None:
    """Install paramstore's ``while`` discharge rule (counted: the first user installs it)."""
    global _fix_users
    with _fix_lock:
        _fix_users += 1
        if _fix_users == 1:
            _RULES[_loops.while_p] = _while_rule


def exit_while_fix() -> None:
    """Undo one ``enter_while_fix``; the last one puts JAX's own rule back."""
    global _fix_users
    with _fix_lock:
        _fix_users -= 1
        if _fix_users == 0:
            _RULES[_loops.while_p] = _jax_while_rule


@contextlib.contextmanager
def while_fix() -> Iterator[None]:
    """The fixed ``while`` discharge rule in force inside the block (see the module
    docstring); JAX's own rule before and after."""
    enter_while_fix()
    try:
        yield
    finally:
        exit_while_fix()


def _while_rule(
    should_discharge: Any,
    in_avals: Any,
    out_avals: Any,
    *args: Any,
    cond_jaxpr: Any,
    body_jaxpr: Any,
    cond_nconsts: int,
    body_nconsts: int,
) -> tuple[list[Any], list[Any]]:
    n_consts = cond_nconsts + body_nconsts
    is_ref = [isinstance(a, AbstractRef) and s for a, s in zip(in_avals, should_discharge)]
    cond_writes = any(isinstance(e, WriteEffect) for e in _core.positional_effects(cond_jaxpr))
    if not any(is_ref[:cond_nconsts]) or any(is_ref[n_consts:]) or cond_writes:
        return _jax_while_rule(  # type: ignore[no-any-return,return-value]
            should_discharge,
            in_avals,
            out_avals,
            *args,
            cond_jaxpr=cond_jaxpr,
            body_jaxpr=body_jaxpr,
            cond_nconsts=cond_nconsts,
            body_nconsts=body_nconsts,
        )
    # One carry slot per distinct ref: the same jaxpr variable has the same aval object
    # (JAX's own rule identifies refs this way) and the same value.
    slot: list[int] = []
    firsts: list[int] = []
    for i in range(n_consts):
        if not is_ref[i]:
            slot.append(-1)
            continue
        same = [
            k for k, j in enumerate(firsts) if in_avals[j] is in_avals[i] and args[j] is args[i]
        ]
        slot.append(same[0] if same else len(firsts))
        if not same:
            firsts.append(i)
    n_carry = len(args) - n_consts
    carry_flags = [False] * n_carry
    cond = _discharge.discharge_state(
        cond_jaxpr, should_discharge=[*is_ref[:cond_nconsts], *carry_flags]
    )
    body = _discharge.discharge_state(
        body_jaxpr, should_discharge=[*is_ref[cond_nconsts:n_consts], *carry_flags]
    )
    body_refs = [i for i in range(cond_nconsts, n_consts) if is_ref[i]]

    def consts(lo: int, hi: int, refs: list[Any]) -> list[Any]:
        return [refs[slot[i]] if is_ref[i] else args[i] for i in range(lo, hi)]

    def cond_fun(state: tuple[list[Any], list[Any]]) -> Any:
        refs, carry = state
        return _core.eval_jaxpr(cond.jaxpr, cond.consts, *consts(0, cond_nconsts, refs), *carry)[0]

    def body_fun(state: tuple[list[Any], list[Any]]) -> tuple[list[Any], list[Any]]:
        refs, carry = state
        outs = _core.eval_jaxpr(
            body.jaxpr, body.consts, *consts(cond_nconsts, n_consts, refs), *carry
        )
        refs = list(refs)
        for i, x in zip(body_refs, outs[n_carry:]):
            refs[slot[i]] = x
        return refs, list(outs[:n_carry])

    init = ([args[j] for j in firsts], list(args[n_consts:]))
    refs, carry = jax.lax.while_loop(cond_fun, body_fun, init)
    new = [refs[slot[i]] if is_ref[i] else None for i in range(n_consts)]
    return [*new, *[None] * n_carry], carry


def refuse_as_array(cls: type, message: Any) -> None:
    """Make JAX's abstractification of a ``cls`` instance (a ``lax`` function or another
    primitive given one directly) raise ``ValueError(message(x))`` instead of JAX's own
    "Triggering __jax_array__() during abstractification is no longer supported"
    ValueError, which names neither the object nor the fix. (A ValueError, as JAX's: JAX
    turns a TypeError from here into its own message, losing ours.) JAX looks types up in its
    value-canonicalization handlers and ``pytype_aval_mappings`` (subclasses through the
    MRO) before that check, so ``jnp`` functions, which convert through ``__jax_array__``
    first, are unaffected."""

    def refuse(x: Any) -> Any:
        raise ValueError(message(x))

    _jax_dtypes.register_canonicalize_value_handler(cls, refuse)
    _core.pytype_aval_mappings[cls] = refuse
