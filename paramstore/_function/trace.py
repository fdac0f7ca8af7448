"""Tracing one new signature of a ``ps.function`` into its compiled ``Entry``.

``trace_signature`` runs the Python function once under ``jax.make_jaxpr`` inside a capture
frame (``_core.frames``); ``_lift`` turns the captured variables' constants (and the created
variables' initial values) into inputs, pairs donated inputs with their outputs, works out
which variables' arrays may be handed out (``_shared``) and has ``_function.runner`` build
the ``jax.jit`` runner with the shardings asked for (``leaf_shardings``);
``_function.initial`` computes the initial values of variables created from traced values
in that trace. See ``function``'s module docstring for the contract.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend as jex
from jax import ShapeDtypeStruct

from paramstore import sharding as _sharding
from paramstore._core import frames
from paramstore._core.context import TRACE_EPOCH
from paramstore._core.loops import pure
from paramstore._core.ownership import ownership
from paramstore._function.entry import Entry
from paramstore._function.failed import discard
from paramstore._function.initial import initialize
from paramstore._function.runner import runner
from paramstore._function.shardings import Shardings, leaf_shardings
from paramstore._function.static import merge
from paramstore.module import Module
from paramstore.variable import Variable, VariableSlice

__all__ = ["Shardings", "is_ref", "trace_signature"]


_HOST_CALLBACKS = ("callback",)  # debug_callback, io_callback, pure_callback

_CONCRETE_NOTE = (
    "In {owner}: array arguments and Variables are traced while the function compiles, so "
    "Python cannot see their values (float(v), int(x), `if v > 0`, `if training`). Use "
    "jnp.where or jax.lax.cond for a choice that depends on a value; pass a flag such as "
    'training as a Python bool marked static, ps.function(fn, static_argnames=("training",)); '
    'or read the value outside the function (docs/guides/keras.md, "training").'
)


def _explained(e: BaseException, owner: str) -> BaseException:
    """``e`` with a note saying what to do when it is JAX's concretization error."""
    if isinstance(e, jax.errors.ConcretizationTypeError):
        e.add_note(_CONCRETE_NOTE.format(owner=owner))
    return e


def is_ref(x: Any) -> bool:
    """Whether ``x`` is passed by reference (read, not passed): a Variable or a Module."""
    return isinstance(x, (Variable, Module))


def _is_var_or_slice(x: Any) -> bool:
    return isinstance(x, (Variable, VariableSlice))


def trace_signature(
    name: str,
    fn: Callable[..., Any],
    leaves: list[Any],
    treedef: Any,
    static: tuple[Any, ...],
    *,
    first: bool,
    donate: bool,
    in_shardings: Shardings,
    out_shardings: Shardings,
) -> Entry:
    """Trace ``fn`` (``name`` in messages) for the flat arguments ``leaves`` (``treedef``
    over ``(args, kwargs)`` less the ``static`` ones) and build its entry. ``first``: the
    function's first trace, the only one that may create variables."""
    owner = f"ps.function '{name}'"
    flags = TRACE_EPOCH.flags  # a trainable flag that changes during the trace: redone
    frame = frames.Frame(owner, frames.CAPTURE, allow_create=first)
    ref_pos = [i for i, x in enumerate(leaves) if is_ref(x)]
    refs = {i: leaves[i] for i in ref_pos}
    arrays = [x for i, x in enumerate(leaves) if i not in refs]
    result: dict[str, Any] = {"out_tree": None, "assigned": []}

    def flat(*arrays: Any) -> tuple[list[Any], list[Any], list[Any]]:
        it = iter(arrays)
        full = [refs[i] if i in refs else next(it) for i in range(len(leaves))]
        args, kwargs = merge(jax.tree_util.tree_unflatten(treedef, full), static)
        out_leaves: list[Any] = []
        new: list[Any] = []
        with frames.push(frame):
            try:
                out = fn(*args, **kwargs)
                out_leaves, result["out_tree"] = jax.tree_util.tree_flatten(
                    out, is_leaf=_is_var_or_slice
                )
                out_leaves = [x.value() if _is_var_or_slice(x) else x for x in out_leaves]
                result["assigned"] = list(frame.assigned.values())
                new = list(map(frame.final, result["assigned"]))
            except Exception as e:
                if not frame.created:
                    raise
                result["error"] = e  # finish the trace to give the created variables
                out_leaves, new, result["assigned"] = [], [], []  # their values
        return out_leaves, new, [x for _, x in frame.created]

    flat.__wrapped__ = fn  # type: ignore[attr-defined]  # JAX's messages name fn, not flat
    # No lock is held while the body is traced: a captured array is handed out
    # (_core.frames), so no step in another thread donates what this trace holds.
    try:
        closed = jax.make_jaxpr(flat)(*arrays)
        if frame.created:
            initialize(closed, frame.created, result.get("error"), arrays)
    except BaseException as e:
        # Variables the trace created and could not give a value: unusable, in no store
        discard([v for v, _ in frame.created if isinstance(ownership.peek(v), ShapeDtypeStruct)])
        _explained(e, owner)  # float(v), if x > 0, if training: what to do
        raise
    if "error" in result:
        raise _explained(result["error"], owner)
    _sharding.settle_unplaced(result["assigned"], arrays, [v for v, _ in frame.captured.values()])
    epoch = TRACE_EPOCH.epoch  # a placement that moves from here on: checked at the call
    entry = _lift(
        name,
        closed,
        frame,
        result,
        ref_pos,
        list(refs.values()),
        len(leaves),
        treedef,
        donate,
        in_shardings,
        out_shardings,
    )
    if TRACE_EPOCH.flags != flags:
        entry.flags = None  # it may have seen either value: stale, traced anew
        epoch = -1
    entry.epoch = entry.checked = epoch
    return entry


def _lift(
    name: str,
    closed: Any,
    frame: frames.Frame,
    result: dict[str, Any],
    ref_pos: list[int],
    refs: list[Any],
    n_leaves: int,
    treedef: Any,
    donate: bool,
    in_shardings: Shardings,
    out_shardings: Shardings,
) -> Entry:
    """Turn the variables' constants (and created variables' initial values) into
    inputs; build the runner. The steps: ``_inputs`` (which jaxpr variables become the
    variables' inputs), ``_pair_donated`` (donated inputs in the order of their outputs),
    ``_lifted`` (the jaxpr over them), ``runner`` (``_function.runner``: the ``jax.jit``
    that runs it)."""
    lift = _inputs(closed, frame)
    donated, readonly, assigned, order = _pair_donated(lift.moved, result["assigned"])
    moved = donated + readonly
    lifted = _lifted(closed.jaxpr, lift, moved)
    n_out = len(lift.outvars) - len(assigned)
    program = jex.core.ClosedJaxpr(lifted, lift.consts)
    # Variables promoted to refs in control flow (by this frame or a ps.pure/gradient frame
    # inside it): discharged here (with _core.loops' while_loop fix), not by jax.jit.
    if frame.refs or any(e.primitive.name == "new_ref" for e in lifted.eqns):
        program = pure(program)

    # An output that is also a variable's new value or a donated input (`return
    # v.value()` after `v.assign_add(1)`) would be one buffer for both, which then
    # could never be donated again: the output gets a copy of its own instead (one
    # copy of the returned value, where sharing cost a copy of the variable per call).
    outvars = lift.outvars
    new_vars = [outvars[n_out + i] for i in order]
    own_ids = {id(v) for v in new_vars} | {id(c) for _, c in donated}
    to_copy = frozenset(i for i, v in enumerate(outvars[:n_out]) if id(v) in own_ids)
    wait = _has_host_callback(lifted)
    kept = [v for i, v in enumerate(outvars[:n_out]) if i not in to_copy]
    shared = _shared(moved, assigned, new_vars, kept)
    donating = donate and bool(donated) and not wait
    jitted, layout, twin = runner(
        jex.core.jaxpr_as_fun(program),
        n_out,
        order,
        to_copy,
        assigned,
        donating,
        leaf_shardings(name, in_shardings, treedef, n_leaves, ref_pos, True),
        leaf_shardings(name, out_shardings, result["out_tree"], n_out, [], False),
    )
    return Entry(
        f"ps.function '{name}'",
        jitted,
        [v for v, _ in donated],
        [v for v, _ in readonly],
        assigned,
        result["out_tree"],
        ref_pos,
        refs,
        n_leaves,
        donating,
        wait,
        shared,
        layout,
        twin,
    )


class _Inputs(NamedTuple):
    """What ``_inputs`` finds in a trace's jaxpr."""

    moved: list[tuple[Variable, Any]]  # (variable, the jaxpr variable that becomes its input)
    constvars: list[Any]  # the constants that stay constants
    consts: list[Any]
    eqns: list[Any]  # the equations, less the created variables' initial-value copies
    outvars: list[Any]  # the outputs, less the created variables' initial values


def _inputs(closed: Any, frame: frames.Frame) -> _Inputs:
    """Which jaxpr variables become inputs: each captured variable's constant, and each
    created variable's initial value (the output of one ``copy``, see ``frames.create``:
    in the step, that jaxpr variable is an input instead, and the copy is cut)."""
    jaxpr = closed.jaxpr
    var_of = {id(alias): var for var, alias in frame.captured.values()}
    moved: list[tuple[Variable, Any]] = []
    keep_vars, keep_consts = [], []
    for cvar, const in zip(jaxpr.constvars, closed.consts):
        var = var_of.get(id(const))
        if var is None:
            keep_vars.append(cvar)
            keep_consts.append(const)
        else:
            moved.append((var, cvar))
    n_created = len(frame.created)
    outvars = list(jaxpr.outvars)
    init_vars = outvars[len(outvars) - n_created :]
    cut = {id(v) for v in init_vars}
    eqns = [e for e in jaxpr.eqns if not (len(e.outvars) == 1 and id(e.outvars[0]) in cut)]
    moved += [(var, jv) for (var, _), jv in zip(frame.created, init_vars)]
    return _Inputs(moved, keep_vars, keep_consts, eqns, outvars[: len(outvars) - n_created])


def _pair_donated(
    moved: list[tuple[Variable, Any]], assigned: list[Variable]
) -> tuple[list[tuple[Variable, Any]], list[tuple[Variable, Any]], list[Variable], list[int]]:
    """``(donated, readonly, assigned, order)``: the inputs of assigned variables (donated)
    and of the others, the assigned variables reordered, and that order (indices into the
    trace's ``assigned``).

    jit pairs each output with the first unused donated input of the same shape and
    dtype, in order. Donated inputs in the order of their outputs, and those outputs
    first, pair every variable's new value with its own old buffer: XLA updates it in
    place, with no copies (a mismatched pairing, e.g. Adam's mu with its parameter,
    makes XLA copy each buffer to resolve the aliasing)."""
    written = {id(v) for v in assigned}
    donated = [(v, c) for v, c in moved if id(v) in written]
    readonly = [(v, c) for v, c in moved if id(v) not in written]
    position = {id(v): i for i, v in enumerate(assigned)}
    donated.sort(key=lambda vc: position[id(vc[0])])
    donated_ids = {id(v) for v, _ in donated}
    order = [position[id(v)] for v, _ in donated]
    order += [i for i, v in enumerate(assigned) if id(v) not in donated_ids]
    return donated, readonly, [assigned[i] for i in order], order


def _lifted(jaxpr: Any, lift: _Inputs, moved: list[tuple[Variable, Any]]) -> Any:
    """``jaxpr`` over the variables' inputs (``moved``, first) and its own arguments, its
    debug info naming them."""
    info = jaxpr.debug_info
    if info is not None:
        arg_names = info.arg_names
        if arg_names is not None:
            arg_names = (*(v.name for v, _ in moved), *arg_names)
        paths = info.result_paths
        if paths is not None and not callable(paths):
            paths = tuple(paths)[: len(lift.outvars)]
        info = info._replace(arg_names=arg_names, result_paths=paths)
    return jaxpr.replace(
        constvars=lift.constvars,
        invars=[c for _, c in moved] + list(jaxpr.invars),
        eqns=lift.eqns,
        outvars=lift.outvars,
        debug_info=info,
    )


def _has_host_callback(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if any(word in eqn.primitive.name for word in _HOST_CALLBACKS):
            return True
        for sub in jex.core.jaxprs_in_params(eqn.params):
            if _has_host_callback(sub):
                return True
    return False


def _shared(
    moved: list[tuple[Variable, Any]], assigned: list[Variable], new: list[Any], outs: list[Any]
) -> list[Variable]:
    """The variables whose array an output of the lifted jaxpr is, or may be, after a call.

    jit forwards an input that is returned unchanged and may return one buffer for two
    equal outputs (or a cached constant for a literal): then the user, or a second
    variable, holds that variable's buffer, which must count as handed out. ``moved``:
    (variable, input var); ``new``: the assigned variables' output vars, in order;
    ``outs``: the function's own outputs."""
    counts: dict[int, int] = {}
    for v in [*new, *outs]:
        counts[id(v)] = counts.get(id(v), 0) + 1
    inputs = {id(c) for _, c in moved}
    shared = [
        var
        for var, v in zip(assigned, new)
        if not isinstance(v, jex.core.Var) or counts[id(v)] > 1 or id(v) in inputs
    ]
    returned = {id(v) for v in outs}
    written = {id(v) for v in assigned}
    shared += [var for var, c in moved if id(c) in returned and id(var) not in written]
    return shared
