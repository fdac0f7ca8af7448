"""The JAX internals paramstore relies on, in one place, each checked at import by what it
does (not by JAX's version number).

paramstore runs on every JAX from 0.10.0 on (``jax>=0.10``, no upper bound). It uses
public APIs (``jax.extend``, ``jax.ref``) wherever JAX has one; what remains private is
here, one feature a name, each found by a small function that raises when this JAX lacks
it (``_find``). At import, ``check()`` also runs a tiny traced program that exercises the
trace machinery paramstore reads; any missing or changed feature makes ``import
paramstore`` raise ``ImportError`` naming it, the installed JAX and the newest JAX known to
work (``NEWEST_KNOWN``), rather than an ``AttributeError`` from inside the package later.

* ``current_trace()``: the trace that new operations go to; ``EVAL`` is the eager one.
  Reading it costs ~150 ns, so hot paths compare identity.
* ``staging(trace)``: whether ``trace`` records a program to run later (``jax.jit``,
  ``make_jaxpr``, a control-flow body), looking through ``grad``/``vmap`` traces on top of
  it. A value read there and not passed in as an input would be baked in as a constant.
* ``ref_in(trace, value)``: a ``jax.new_ref`` created in ``trace`` (an enclosing one), so
  that nested bodies close over it and their writes are ordinary ref effects.
* ``tracer_in(trace, const)``: ``const`` as a tracer of a ``make_jaxpr`` trace, recorded as
  a constant of the jaxpr (which ``ps.function`` then lifts to an input).
* ``retrace``, ``discharge``, ``eval_eqn``: what ``_core.loops`` needs to rewrite a jaxpr
  (JAX's ``while_loop`` state-discharge bug is worked around there, in paramstore's own
  programs; no JAX rule is ever replaced).
* ``repair_trace(saved)``: from jax 0.11 a ``KeyboardInterrupt`` that lands inside JAX's
  ``Primitive.bind`` can leave the thread's current trace at ``None`` (every later JAX
  operation in that thread then fails); ``_core.interrupts`` puts the saved one back.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar, cast

import jax
import jax.extend as jex
import jax.extend.core  # noqa: F401  (jex.core, jex.linear_util, jex.source_info_util)
import jax.extend.linear_util  # noqa: F401
import jax.extend.source_info_util  # noqa: F401
import jaxlib
import numpy as np

if TYPE_CHECKING:  # annotations only: JAX's public names of its trace, aval and ref classes
    from jax.core import ShapedArray, Trace
    from jax.extend.core import DebugInfo, JaxprEqn
    from jax.ref import Ref

T = TypeVar("T")


class _TraceState(Protocol):
    """JAX's holder of the thread's current trace (``core.trace_state_strong_ref``)."""

    value: Trace | None


class _StagingTrace(Protocol):
    """What paramstore uses of a staging trace (``DynamicJaxprTrace``)."""

    def to_jaxpr_tracer(self, x: jax.Array, source_info: object) -> jax.Array: ...


class _Cache(Protocol):
    """One of JAX's caches of traced Python functions."""

    def cache_clear(self) -> None: ...


# The newest JAX this paramstore was run on (its suite passed there). Only a message: no
# version number is ever compared.
NEWEST_KNOWN = "0.12.0.1"

__all__ = [
    "ARRAY_TYPE",
    "EVAL",
    "ClosedJaxpr",
    "DropVar",
    "Jaxpr",
    "Literal",
    "jaxprs_in_params",
    "NEWEST_KNOWN",
    "AbstractRef",
    "Tracer",
    "check",
    "current_trace",
    "device_assignment",
    "discharge",
    "eval_eqn",
    "forget_traced_bodies",
    "in_shard_map",
    "in_trace",
    "in_while_body",
    "in_while_cond",
    "init_program",
    "put_on_device",
    "ref_in",
    "refuse_as_array",
    "repair_trace",
    "retrace",
    "staging",
    "trace_of",
    "tracer_in",
    "vmap_home",
    "while_p",
]

_missing: list[str] = []


def _find(feature: str, get: Callable[[], T]) -> T:
    """``get()``, or None with ``feature`` recorded as missing (``check`` raises at import,
    so no code after it sees the None)."""
    try:
        return get()
    except Exception as e:  # AttributeError, ImportError...: this JAX lacks the feature
        _missing.append(f"{feature} ({type(e).__name__}: {e})")
        return cast(T, None)


def _src(module: str) -> types.ModuleType:
    return __import__(f"jax._src.{module}", fromlist=["_"])


# Public names first (jax.extend, jax.ref, jax.core.Tracer).
Tracer = jax.core.Tracer
AbstractRef = jax.ref.AbstractRef
ClosedJaxpr = jex.core.ClosedJaxpr  # from jax 0.12 the same class as Jaxpr
Jaxpr = jex.core.Jaxpr
Literal = jex.core.Literal
DropVar = jex.core.DropVar
jaxprs_in_params = jex.core.jaxprs_in_params
while_p = jex.core.primitives.while_p
_set_trace = jex.core.set_current_trace

# The private features, each found by what it is.
_core = _find("jax._src.core", lambda: _src("core"))
_pe = _find("jax._src.interpreters.partial_eval", lambda: _src("interpreters.partial_eval"))
_batching = _find("jax._src.interpreters.batching", lambda: _src("interpreters.batching"))
EVAL: Trace = _find("the eager trace (core.eval_trace)", lambda: _core.eval_trace)
_STRONG: _TraceState = _find(
    "the current-trace state (core.trace_state_strong_ref)", lambda: _core.trace_state_strong_ref
)
_TRACE_CTX: Callable[[Trace], None] = _find(
    "the tracing context (core.trace_ctx)", lambda: _core.trace_ctx.set_trace
)
_STAGING: type[Any] = _find("the staging trace (DynamicJaxprTrace)", lambda: _pe.DynamicJaxprTrace)
_BATCH_TRACE: type[Any] = _find("vmap's trace (BatchTrace)", lambda: _batching.BatchTrace)
_BATCH_TRACER: type[Any] = _find("vmap's tracer (BatchTracer)", lambda: _batching.BatchTracer)
ARRAY_TYPE: type[Any] = _find("jax.Array's class (ArrayImpl)", lambda: _src("array").ArrayImpl)
_SHAPED: type[ShapedArray] = _find("core.ShapedArray", lambda: _core.ShapedArray)
_device_put: Callable[..., jax.Array] = _find(
    "xla_client.batched_device_put", lambda: _src("lib").xla_client.batched_device_put
)
_discharge_state: Callable[..., ClosedJaxpr] = _find(
    "state discharge (discharge_state)", lambda: _src("state.discharge").discharge_state
)
_trace_to_jaxpr: Callable[..., tuple[Any, ...]] = _find(
    "pe.trace_to_jaxpr_dynamic", lambda: _pe.trace_to_jaxpr_dynamic
)
_convert_constvars: Callable[[Jaxpr], Jaxpr] = _find(
    "pe.convert_constvars_jaxpr", lambda: _pe.convert_constvars_jaxpr
)
_dce: Callable[[Jaxpr, list[bool]], tuple[Jaxpr, list[bool]]] = _find(
    "pe.dce_jaxpr", lambda: _pe.dce_jaxpr
)
_canonicalize: Callable[[type, Callable[[Any], Any]], None] = _find(
    "dtypes.register_canonicalize_value_handler",
    lambda: _src("dtypes").register_canonicalize_value_handler,
)
_aval_mappings: dict[type, Callable[[Any], Any]] = _find(
    "core.pytype_aval_mappings", lambda: _core.pytype_aval_mappings
)
# JAX's caches of traced Python functions, keyed by the function object (a module-level
# loop body, an inner jax.jit): a jaxpr traced inside a paramstore frame closes over that
# frame's refs, so it must not outlive the frame (forget_traced_bodies). Optional: a JAX
# without one of them has nothing there to forget.
_BODY_CACHES: list[_Cache] = [
    cache
    for module, name in (
        ("interpreters.partial_eval", "trace_to_jaxpr"),
        ("interpreters.partial_eval", "_cached_trace_to_jaxpr"),
        ("ad_checkpoint", "_trace_to_jaxpr"),
        ("ad_checkpoint", "_dyn_args_fun_cached"),
        ("pjit", "_infer_params_cached"),
    )
    for cache in [getattr(_src(module), name, None)]
    if cache is not None and callable(getattr(cache, "cache_clear", None))
]
if not _BODY_CACHES:
    _missing.append("the cache of traced loop bodies (partial_eval.trace_to_jaxpr)")
# discharge_state(strip_memory_space=) (jax 0.11.1+): its default changed between releases;
# paramstore keeps memory spaces (pinned_host slots), so it always passes False.
_STRIP = _discharge_state is not None and (
    "strip_memory_space" in inspect.signature(_discharge_state).parameters
)


def current_trace() -> Trace:
    """The trace new operations go to (``EVAL`` when nothing is being traced). ``None``,
    the damage an interrupt inside JAX's ``bind`` leaves (``repair_trace``), is mended here:
    every read, assign and compiled call asks this first."""
    trace = _STRONG.value
    if trace is None:
        _TRACE_CTX(EVAL)
        return EVAL
    return trace


def repair_trace(saved: Trace | None = None) -> None:
    """Put ``saved`` (default: the eager trace) back as the current trace when an interrupt
    inside JAX's ``bind`` left none (see the module docstring). paramstore's code never
    runs inside the window where JAX itself sets none, so ``None`` here is that damage."""
    if _STRONG.value is None:
        _TRACE_CTX(EVAL if saved is None else saved)


def forget_traced_bodies() -> None:
    """Drop JAX's cached jaxprs of traced Python functions (loop and branch bodies, inner
    ``jax.jit``, ``jax.checkpoint``). JAX caches them by the function object: a module-level
    body traced inside a paramstore frame closes over that frame's refs, and a later trace
    with the very same body would reuse them (a leaked tracer, or reads and writes of a dead
    frame's state). A frame that made refs calls this when it ends; JAX then traces such
    bodies again (about what a new ``ps.function`` signature costs anyway)."""
    for cache in _BODY_CACHES:
        cache.cache_clear()


def staging(trace: Trace | None) -> bool:
    """Whether ``trace`` (or the trace it forwards to) records a program for later."""
    while trace is not None and trace is not EVAL:
        if isinstance(trace, _STAGING):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def trace_of(x: object) -> Trace | None:
    """The trace a tracer belongs to (None for a concrete value)."""
    return getattr(x, "_trace", None) if isinstance(x, Tracer) else None


def in_trace(trace: Trace) -> AbstractContextManager[None]:
    """A context manager making ``trace`` the current trace (an enclosing one)."""
    return _set_trace(trace)


def ref_in(trace: Trace, value: jax.typing.ArrayLike) -> Ref:
    """``jax.new_ref(value)`` created in ``trace`` rather than the current trace."""
    with _set_trace(trace):
        return jax.new_ref(value)


def tracer_in(trace: Trace, const: jax.Array) -> jax.Array:
    """``const`` as a tracer of the staging ``trace``: a constant of its jaxpr."""
    staged = cast("_StagingTrace", trace)  # a capture frame's base: make_jaxpr's trace
    return staged.to_jaxpr_tracer(const, jex.source_info_util.current())


def vmap_home(value: object, stop: Trace | None) -> tuple[Trace | None, bool]:
    """Where ``value`` can be written to a ref created outside the enclosing ``jax.vmap``
    bodies: ``(trace, batched)``. ``trace`` is the innermost enclosing trace that is not a
    vmap's (None when the current trace is not a vmap's: write where you are); ``batched``
    says that ``value`` varies along one of those vmaps' batch axes (no single value to
    write). JAX refuses any write to an unbatched ref from a vmap trace, even of a value
    that does not depend on the batch. The walk stops at ``stop`` (the ref's own trace)."""
    trace = current_trace()
    home = None
    while trace is not stop and isinstance(trace, _BATCH_TRACE):
        if isinstance(value, _BATCH_TRACER) and value._trace is trace:
            if value.batch_dim is not None:
                return None, True
            value = value.val
        trace = trace.parent_trace
        home = trace
    return home, False


def init_program(jaxpr: Jaxpr, used_out: list[bool]) -> tuple[Jaxpr, list[bool]]:
    """``jaxpr`` (an open jaxpr) with its constants turned into leading inputs, cut down
    to the computation of the outputs marked in ``used_out``; and which inputs (constants
    first) that computation uses."""
    with_consts = _convert_constvars(jaxpr)
    return _dce(with_consts, used_out)  # type: ignore[no-any-return]


def device_assignment(sharding: jax.sharding.Sharding) -> list[jax.Device]:
    """The devices of ``sharding`` in its own order (``Sharding._device_assignment``)."""
    return list(sharding._device_assignment)


def _traced_for(stop: Trace | None, what: str) -> bool:
    trace: Trace | None = current_trace()
    while trace is not None and trace is not stop and trace is not EVAL:
        if isinstance(trace, _STAGING):
            info = trace.frame.debug_info
            if info is not None and info.traced_for == what:
                return True
        trace = getattr(trace, "parent_trace", None)
    return False


def in_while_cond(stop: Trace | None) -> bool:
    """Whether the current trace, below ``stop``, is a ``lax.while_loop`` condition's."""
    return _traced_for(stop, "while_cond")


def in_while_body(stop: Trace | None) -> bool:
    """Whether the current trace, below ``stop``, is a ``lax.while_loop`` body's."""
    return _traced_for(stop, "while_body")


def in_shard_map(stop: Trace | None) -> bool:
    """Whether the current trace, below ``stop``, is a ``jax.shard_map`` body's."""
    return _traced_for(stop, "shard_map")


@functools.lru_cache(maxsize=256)
def _aval(shape: tuple[int, ...], dtype: np.dtype[Any]) -> ShapedArray:
    return _SHAPED(shape, dtype)


def put_on_device(
    arr: np.ndarray, sharding: jax.sharding.Sharding, device: jax.Device
) -> jax.Array:
    """``jax.device_put(arr, sharding, may_alias=True)`` for a NumPy array bound for one
    device (``sharding`` a ``SingleDeviceSharding`` of ``device``, default memory): the XLA
    call ``device_put`` ends in, without its per-array Python. Restoring 4,096 arrays of
    16 KiB took 136-157 ms through ``jax.device_put`` and 26 ms this way (2026-11-22)."""
    return _device_put(_aval(arr.shape, arr.dtype), sharding, [arr], [device], True)  # type: ignore[no-any-return]


def discharge(closed: ClosedJaxpr, should_discharge: bool | Sequence[bool]) -> ClosedJaxpr:
    """``closed`` (a closed jaxpr) with its refs (those marked) turned into values: JAX's
    own ``discharge_state``, memory spaces kept."""
    if _STRIP:
        return _discharge_state(closed, should_discharge=should_discharge, strip_memory_space=False)
    return _discharge_state(closed, should_discharge=should_discharge)


def retrace(
    fun: Callable[..., list[Any]], in_avals: list[Any], debug_info: DebugInfo | None
) -> ClosedJaxpr:
    """The closed jaxpr of ``fun`` traced over ``in_avals`` (refs included)."""
    wrapped = jex.linear_util.wrap_init(fun, debug_info=debug_info)
    jaxpr, _, consts = _trace_to_jaxpr(wrapped, in_avals)[:3]
    return ClosedJaxpr(jaxpr, consts)


def eval_eqn(eqn: JaxprEqn, invals: list[Any], params: dict[str, Any]) -> list[Any]:
    """Bind ``eqn``'s primitive to ``invals`` with ``params`` in its own context, as
    ``core.eval_jaxpr`` does; always a list of outputs."""
    bind_params = eqn.primitive.get_bind_params(params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def refuse_as_array(cls: type, message: Callable[[Any], str]) -> None:
    """Make JAX's abstractification of a ``cls`` instance (a ``lax`` function or another
    primitive given one directly) raise ``ValueError(message(x))`` instead of JAX's own
    "Triggering __jax_array__() during abstractification is no longer supported"
    ValueError, which names neither the object nor the fix. (A ValueError, as JAX's: JAX
    turns a TypeError from here into its own message, losing ours.) JAX looks types up in its
    value-canonicalization handlers and ``pytype_aval_mappings`` (subclasses through the
    MRO) before that check, so ``jnp`` functions, which convert through ``__jax_array__``
    first, are unaffected."""

    def refuse(x: object) -> NoReturn:
        raise ValueError(message(x))

    _canonicalize(cls, refuse)
    _aval_mappings[cls] = refuse


def _probe() -> Iterator[str]:
    """Run a tiny program through the trace machinery paramstore reads; yield what fails."""
    if current_trace() is not EVAL:
        yield "the eager trace is the current trace outside any transformation"
    seen: dict[str, bool] = {}

    def cond(c: jax.Array) -> jax.Array:
        seen["cond"] = in_while_cond(None) and staging(current_trace())
        return c < 2

    def body(c: jax.Array) -> jax.Array:
        seen["body"] = in_while_body(None)
        r = ref_in(current_trace(), c)
        r[...] = r[...] + 1
        return r[...]

    def program(x: jax.Array) -> jax.Array:
        seen["jit"] = staging(current_trace())
        y = jax.lax.while_loop(cond, body, x)
        jax.vmap(per_row)(jax.numpy.ones(2) * y)
        return y

    def per_row(z: jax.Array) -> jax.Array:
        seen["vmap"] = vmap_home(z, None)[1]
        return z

    closed = jax.make_jaxpr(program)(0)
    for what in ("cond", "body", "jit", "vmap"):
        if seen.get(what) is not True:
            yield f"recognizing a {what} trace (DynamicJaxprTrace.frame.debug_info.traced_for)"
    sub = [j for e in closed.jaxpr.eqns for j in jaxprs_in_params(e.params)]
    body_jaxpr = [j for j in sub if any(e.primitive.name == "new_ref" for e in j.eqns)]
    if not body_jaxpr:
        yield "refs created in a loop body (jax.new_ref as a new_ref equation)"
    else:
        discharge(ClosedJaxpr(body_jaxpr[0], []), False)


def check() -> None:
    """ImportError naming every internal this JAX lacks (see the module docstring)."""
    problems = list(_missing)
    if not problems:
        try:
            problems += list(_probe())
        except Exception as e:
            problems.append(f"tracing a small program ({type(e).__name__}: {e})")
    if problems:
        raise ImportError(
            f"paramstore cannot run on the installed jax {jax.__version__} (jaxlib "
            f"{jaxlib.__version__}): it relies on JAX features this version lacks or changed: "
            + "; ".join(problems)
            + f". The newest JAX known to work is {NEWEST_KNOWN}: pip install "
            f"'jax=={NEWEST_KNOWN}' 'jaxlib=={NEWEST_KNOWN}' (or a newer paramstore)."
        )


check()
