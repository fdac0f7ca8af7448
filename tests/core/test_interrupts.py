"""Interrupt safety (issue 28): an interrupt (``_thread.interrupt_main``, what Ctrl-C and a
signal handler do) landing at every point of an operation that changes variables leaves
each of them readable, and all of them at their values from before or all from after."""

from __future__ import annotations

import _thread
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _interrupting import run_interrupted, sweep

import paramstore as ps
from paramstore._core.interrupts import deferred
from paramstore._function import entry as _entry


@pytest.fixture(autouse=True)
def default_sigint_handler():
    """Python's own SIGINT handler (what ``_thread.interrupt_main`` and Ctrl-C reach) during
    each test, whatever an earlier test in this worker process left installed (a fresh
    clone's first run met another handler here, and every sweep saw no interrupt)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _state(*shapes: tuple[int, ...]) -> list[ps.Variable]:
    return [ps.Variable(np.zeros(s, np.float32) + i) for i, s in enumerate(shapes)]


def _reset(variables: list[ps.Variable], values: list[np.ndarray]) -> None:
    for v, x in zip(variables, values):
        v.assign(np.array(x))  # a fresh, owned buffer: the next step donates it


@pytest.mark.parametrize("donate", [True, False])
def test_a_warm_step_interrupted_anywhere(donate: bool) -> None:
    w, b = _state((4,), (4,))
    start = [np.ones(4, np.float32), np.zeros(4, np.float32)]

    @ps.function(donate=donate)
    def step(x: jax.Array) -> jax.Array:
        w.assign_add(x)
        b.assign_sub(x)
        return w.value().sum()

    x = jnp.ones(4)

    def prepare():
        _reset([w, b], start)
        step(x)  # warm, and the steady cache holds this call's outputs
        return lambda: step(x)

    seen = sweep(prepare, lambda: [w, b])
    assert seen["before"] and seen["after"]


@pytest.mark.parametrize("twin", [False, True], ids=["copying", "masked-twin"])
def test_a_step_after_a_read_interrupted_anywhere(twin: bool, monkeypatch) -> None:
    """A step whose donated inputs include a handed-out buffer (issue 33): the handed-out
    one copied (before its masked twin is ready) or passed to the twin undonated."""
    if not twin:  # copying throughout: no twin compiled in the background mid-sweep (the
        monkeypatch.setattr(_entry, "MAX_TWINS", 0)  # read recurs in every run of the sweep)
    w, b = _state((4,), (4,))
    start = [np.ones(4, np.float32), np.zeros(4, np.float32)]

    @ps.function
    def step(x: jax.Array) -> None:
        w.assign_add(x)
        b.assign_sub(x)

    x = jnp.ones(4)
    held: list[jax.Array] = []
    if twin:
        for _ in range(3):  # a read that recurs: its twin is compiled in the background
            held.append(w.value())
            step(x)
        (entry,) = step._cache.values()
        deadline = time.monotonic() + 60
        while not any(entry.twins.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert any(entry.twins.values())

    def prepare():
        _reset([w, b], start)
        step(x)
        held[:] = [w.value()]  # handed out: never donated
        return lambda: step(x)

    seen = sweep(prepare, lambda: [w, b])
    assert seen["before"] and seen["after"]
    np.testing.assert_array_equal(held[0], start[0] + 1)  # the handed-out array is intact


def test_a_step_with_a_host_callback_holding_the_lock_interrupted_anywhere() -> None:
    w, b = _state((4,), (4,))
    start = [np.ones(4, np.float32), np.zeros(4, np.float32)]
    seen_in_callback: list[float] = []

    @ps.function
    def step(x: jax.Array) -> None:
        jax.debug.callback(lambda s: seen_in_callback.append(float(s)), w.value().sum())
        w.assign_add(x)
        b.assign_sub(x)

    x = jnp.ones(4)

    def prepare():
        _reset([w, b], start)
        step(x)
        return lambda: step(x)

    seen = sweep(prepare, lambda: [w, b])
    assert seen["before"] and seen["after"]
    w.assign(np.zeros(4, np.float32))  # no lock left held, nothing left open


def test_a_first_call_interrupted_anywhere() -> None:
    w, b = _state((4,), (4,))
    start = [np.ones(4, np.float32), np.zeros(4, np.float32)]
    x = jnp.ones(4)

    def prepare():
        _reset([w, b], start)

        @ps.function
        def step(x: jax.Array) -> jax.Array:  # a new program: its first call
            w.assign_add(x)
            b.assign_sub(x)
            return w.value().sum()

        return lambda: step(x)

    seen = sweep(prepare, lambda: [w, b], points=25)
    assert seen["before"] and seen["after"]


def test_a_step_with_a_host_callback_interrupted_anywhere() -> None:
    (w,) = _state((3,))
    x = jnp.ones(3)

    @ps.function
    def step(x: jax.Array) -> None:
        jax.debug.callback(lambda y: None, x)
        w.assign_add(x)

    def prepare():
        _reset([w], [np.zeros(3, np.float32)])
        step(x)
        return lambda: step(x)

    sweep(prepare, lambda: [w], points=60)


@pytest.mark.parametrize("jit_compile", [True, False])
def test_apply_gradients_interrupted_anywhere(jit_compile: bool) -> None:
    w = ps.Variable(np.ones(3, np.float32), name="w")
    opt = ps.Optimizer(optax.adam(0.1), [w], jit_compile=jit_compile)
    g = jnp.full(3, 0.5)
    start = [np.array(v.numpy()) for v in [w, *opt.variables]]
    everything = [w, *opt.variables]

    def prepare():
        _reset(everything, start)
        opt.apply_gradients([(g, w)])
        return lambda: opt.apply_gradients([(g, w)])

    seen = sweep(prepare, lambda: everything, points=None if jit_compile else 80)
    assert seen["before"] and seen["after"]


@pytest.mark.parametrize("op", ["assign", "assign_add", "assign_sub"])
def test_eager_writes_interrupted_anywhere(op: str) -> None:
    (v,) = _state((5,))
    d = jnp.full(5, 2.0, jnp.float32)  # strong: the steady path

    def prepare():
        _reset([v], [np.ones(5, np.float32)])
        getattr(v, op)(d)  # warm: the steady path of an eager update
        _reset([v], [np.ones(5, np.float32)])
        return lambda: getattr(v, op)(d)

    sweep(prepare, lambda: [v])


def test_a_first_eager_update_interrupted_anywhere() -> None:
    def prepare():
        v = ps.Variable(np.ones(5, np.float32))
        holder[:] = [v]
        return lambda: v.assign_add(jnp.full(5, 2.0))

    holder: list[ps.Variable] = []
    sweep(prepare, lambda: holder, points=40)


def test_update_interrupted_anywhere() -> None:
    a, b = (
        ps.Variable(np.zeros(2, np.float32), name="a"),
        ps.Variable(np.zeros(3, np.float32), name="b"),
    )
    new = {"a": np.ones(2, np.float32), "b": np.ones(3, np.float32)}

    def prepare():
        _reset([a, b], [np.zeros(2, np.float32), np.zeros(3, np.float32)])
        return lambda: ps.update([a, b], new)

    sweep(prepare, lambda: [a, b], points=80)


def test_a_metric_update_interrupted_anywhere() -> None:
    m = ps.metrics.Mean()
    values = jnp.arange(4.0)

    def prepare():
        _reset([m.total, m.count], [np.float32(0), np.float32(0)])
        m.update_state(values)
        return lambda: m.update_state(values)

    sweep(prepare, lambda: [m.total, m.count], points=80)


def test_a_repeat_call_interrupted_anywhere() -> None:
    class Block(ps.Module):
        def __init__(self) -> None:
            self.w = ps.Variable(np.ones(3, np.float32))
            self.n = ps.Variable(np.zeros((), np.float32), trainable=False)

        def __call__(self, x: jax.Array) -> jax.Array:
            self.n.assign_add(1.0)
            return x * self.w

    rep = ps.nn.Repeat(Block, 2)
    x = jnp.ones((1, 3))
    rep(x)
    variables = rep.variables
    start = [np.array(v.numpy()) for v in variables]

    def prepare():
        _reset(variables, start)
        rep(x)
        return lambda: rep(x)

    sweep(prepare, lambda: variables)


def test_restore_interrupted_anywhere(tmp_path) -> None:
    a, b = (
        ps.Variable(np.ones(3, np.float32), name="ra"),
        ps.Variable(np.ones(2, np.int32), name="rb"),
    )
    path = str(tmp_path / "ckpt")
    ps.Saver([a, b]).save(path)
    saver = ps.Saver([a, b])

    def prepare():
        _reset([a, b], [np.zeros(3, np.float32), np.zeros(2, np.int32)])
        return lambda: saver.restore(path)

    sweep(prepare, lambda: [a, b], points=60)


def test_checkpoint_restore_interrupted_anywhere(tmp_path) -> None:
    class M(ps.Module):
        def __init__(self) -> None:
            self.a = ps.Variable(np.ones(3, np.float32))
            self.b = ps.Variable(np.ones(2, np.float32))

    m = M()
    path = str(tmp_path / "obj")
    ps.Checkpoint(model=m).save(path)
    ckpt = ps.Checkpoint(model=m)

    def prepare():
        _reset([m.a, m.b], [np.zeros(3, np.float32), np.zeros(2, np.float32)])
        return lambda: ckpt.restore(path)

    sweep(prepare, lambda: [m.a, m.b], points=60)


def test_deferred_delivers_the_interrupt_right_after_the_region() -> None:
    order: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with deferred():
            _thread.interrupt_main()
            order.append("body ran to its end")
        order.append("not reached")
    assert order == ["body ran to its end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_deferred_delivers_a_user_handlers_exception() -> None:
    class Stop(Exception):
        pass

    def handler(signum, frame):
        raise Stop

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        with pytest.raises(Stop), deferred():
            signal.raise_signal(signal.SIGUSR1)
            for _ in range(3):
                pass
        assert signal.getsignal(signal.SIGUSR1) is handler
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_an_interrupt_still_stops_a_training_loop() -> None:
    (w,) = _state((2,))

    @ps.function
    def step() -> None:
        w.assign_add(jnp.ones(2))

    step()
    fired, raised = run_interrupted(lambda: [step() for _ in range(5)], 10)
    assert fired and raised
    np.testing.assert_array_equal(w.numpy(), np.full(2, float(round(w.numpy()[0]))))
