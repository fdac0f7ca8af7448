"""Issue 36, item 2: Ctrl-C (``_thread.interrupt_main``) landing at every point of
``with ema.swap(...)`` entering or leaving, and of ``set_weights``, leaves the variables all
at their old values or all at their new ones (API.md, "Interrupts and faults"): leaving
the block puts every trained value back or, only when the interrupt lands as the block is
left, leaves every average in place; never a mix. Bounded in time (tests/_interrupting.py)."""

from __future__ import annotations

import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _interrupting import BOUND, _read, _same, count_events, run_interrupted, sweep
from jax.sharding import Mesh

import paramstore as ps
from paramstore._core.context import STATE_LOCK, ctx


@pytest.fixture(autouse=True)
def default_sigint_handler():
    """Python's own SIGINT handler during each test (as tests/core/test_interrupts.py)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _averaged_model():
    model = ps.nn.Sequential([ps.nn.Dense(4), ps.nn.Dense(3), ps.nn.Dense(2)])
    model.build((None, 3))
    ema = ps.ExponentialMovingAverage(0.5)
    ema.apply(model)
    for v in model.variables:  # the averages now differ from the trained values
        v.assign_add(jnp.ones(v.shape))
    ema.apply(model)
    trained = [np.array(v.numpy()) for v in model.variables]
    averages = [np.array(ema.average(v).numpy()) for v in model.variables]
    assert not any(np.array_equal(a, b) for a, b in zip(trained, averages))
    return model, ema, trained, averages


def _put(variables, values) -> None:
    for v, x in zip(variables, values):
        v.assign(np.array(x))


def test_entering_ema_swap_interrupted_anywhere() -> None:
    model, ema, trained, _ = _averaged_model()
    variables = list(model.variables)
    held = []  # keeps each context manager alive (an entered block, never left here)

    def prepare():
        _put(variables, trained)
        held.clear()

        def enter():
            held.append(ema.swap(model))
            held[-1].__enter__()

        return enter

    seen = sweep(prepare, lambda: variables)
    assert seen["before"] and seen["after"]


def test_leaving_ema_swap_interrupted_anywhere() -> None:
    model, ema, trained, _ = _averaged_model()
    variables = list(model.variables)

    def prepare():
        _put(variables, trained)
        swap = ema.swap(model)
        swap.__enter__()  # the block holds the averages
        return lambda: swap.__exit__(None, None, None)

    seen = sweep(prepare, lambda: variables)
    assert seen["before"] and seen["after"]


def test_a_whole_swap_block_interrupted_anywhere_never_mixes() -> None:
    """``with ema.swap(model): evaluate()`` interrupted at each point: afterwards the model
    holds all its trained values, or (the interrupt landed as the block was left) all its
    averages."""
    model, ema, trained, averages = _averaged_model()
    variables = list(model.variables)

    def block():
        with ema.swap(model):
            variables[0].assign_add(0.0)  # a use of the averages (an evaluation's place)

    _put(variables, trained)
    block()  # warm: the next runs take the same path
    _put(variables, trained)
    total = count_events(block)
    assert _same(_read(variables), trained)
    start = time.monotonic()
    outcomes = {"trained": 0, "averages": 0, "raised": 0}
    for k in sorted({*np.linspace(1, total, min(total, 300)).astype(int), total + 1}):
        _put(variables, trained)
        _, raised = run_interrupted(block, k)
        now = _read(variables)
        if _same(now, trained):
            outcomes["trained"] += 1
        elif _same(now, averages):
            outcomes["averages"] += 1
        else:
            raise AssertionError(f"interrupt at event {k}/{total}: a mix of both: {now}")
        outcomes["raised"] += raised
        assert not STATE_LOCK._is_owned()
        assert time.monotonic() - start < BOUND
    assert outcomes["raised"] and outcomes["trained"]
    # the averages stay only when the interrupt lands as the block is left: at the very
    # start of __exit__, before it runs a line (one point; a retry covers the rest)
    assert outcomes["averages"] <= 1, outcomes


def test_set_weights_interrupted_anywhere() -> None:
    model = ps.nn.Sequential([ps.nn.Dense(4), ps.nn.Dense(3), ps.nn.Dense(2)])
    model.build((None, 3))
    old = [np.array(w) for w in model.get_weights()]
    new = [w + 1.0 for w in old]
    variables = list(model.weights)

    def prepare():
        model.set_weights(old)
        return lambda: model.set_weights(new)

    seen = sweep(prepare, lambda: variables, points=120)
    assert seen["before"] and seen["after"]


def _stacks() -> tuple[int, ...]:
    return (
        len(ctx.scopes),
        len(ctx.stores),
        len(ctx.placements),
        ctx.abstract,
        len(ctx.names),
        len(ctx.recorders),
        len(ctx.axis_rules),
        len(ctx.journals),
    )


def _name_scope() -> None:
    with ps.name_scope("a"):
        pass


def _variable_scope() -> None:
    with ps.variable_scope("a"):
        pass


def _device() -> None:
    with ps.device("cpu:0"):
        pass


def _abstract() -> None:
    with ps.abstract():
        pass


def _axis_rules() -> None:
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    with ps.sharding.axis_rules(mesh, {"batch": "data"}):
        pass


def _store() -> None:
    with ps.VariableStore():
        pass


def _variable() -> None:
    ps.Variable(lambda: jnp.ones(2), name="v")


@pytest.mark.parametrize(
    ("block", "allowed"),
    [
        (_name_scope, 0),
        (_variable_scope, 0),
        (_device, 0),
        (_abstract, 0),
        (_axis_rules, 0),
        (_variable, 0),  # (the initializer's naming block)
        # __exit__'s own first instruction: the with statement has called it, and no code of
        # ours has run yet (a Python __exit__ always has this one point)
        (_store, 1),
    ],
)
def test_a_block_interrupted_anywhere_leaves_no_scope_or_context_behind(block, allowed) -> None:
    """Ctrl-C anywhere in a `with` block that pushes per-thread state (a name scope, a
    device, a store...) pops it: otherwise every later variable would get a wrong name,
    placement or store. (Issue 36: 'every with block that restores state on exit'.)"""
    base = _stacks()
    block()
    total = count_events(block)
    left = []
    start = time.monotonic()
    for k in range(1, total + 2):
        run_interrupted(block, k)
        if _stacks() != base:
            left.append(k)
            del ctx.scopes[base[0] :]
            del ctx.stores[base[1] :]
            del ctx.placements[base[2] :]
            ctx.abstract = base[3]
            del ctx.names[base[4] :]
            del ctx.recorders[base[5] :]
            del ctx.axis_rules[base[6] :]
            del ctx.journals[base[7] :]
        assert time.monotonic() - start < BOUND
    assert len(left) <= allowed, f"interrupts at {left} of {total} left per-thread state pushed"
