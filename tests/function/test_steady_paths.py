"""The steady path per compiled program, and reads between steps that copy nothing (issue 33).

Each traced signature (``_function.entry.Entry``) keeps its own steady path, so a training
step alternating with an evaluation step stays on it; a read between steps (``v.value()``)
makes the next step pass that buffer undonated rather than copy it; ``float(v)`` and
``v.numpy()`` hand nothing out at all."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paramstore as ps
from paramstore._core.ownership import Ownership, ownership


@pytest.fixture(autouse=True)
def _fresh_store():
    with ps.VariableStore() as store:
        yield store


@pytest.fixture
def device_puts(monkeypatch):
    """Counts ``jax.device_put`` calls (a private copy of a buffer is one)."""
    calls: list[object] = []
    real = jax.device_put

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(jax, "device_put", counting)
    return calls


def _model():
    w = ps.Variable(jnp.ones((16, 16)), name="w")
    b = ps.Variable(jnp.zeros(16), name="b")
    count = ps.Variable(jnp.zeros((), jnp.int32), name="count")

    @ps.function
    def train(x):
        w.assign(w.value() * 0.5 + x.sum())
        b.assign_add(1.0)
        count.assign_add(1)

    @ps.function
    def evaluate(x):
        return (x @ w.value() + b.value()).sum()

    return w, b, count, train, evaluate


def _entry(fn):
    (entry,) = fn._cache.values()
    return entry


def test_a_train_step_alternating_with_an_eval_step_stays_on_its_steady_path(monkeypatch):
    w, b, count, train, evaluate = _model()
    x = jnp.ones((2, 16))
    for _ in range(3):  # (the eval step's trace handed out the parameters: gathered again)
        train(x)
        evaluate(x)
    gathers: list[object] = []
    real = Ownership.gather
    monkeypatch.setattr(Ownership, "gather", lambda self, *a: gathers.append(a) or real(self, *a))
    for _ in range(3):
        train(x)
        evaluate(x)
    # The eval step re-reads the parameters the train step wrote (one gather each); the
    # train step's inputs are its own last outputs: never gathered. Old code had one
    # global slot, so each of the two gathered on every call.
    assert len(gathers) == 3
    assert all(not donated for donated, _ in gathers)  # the eval step's, donating nothing
    assert int(count.numpy()) == 6
    np.testing.assert_allclose(float(evaluate(x)), float((x @ w.value() + b.value()).sum()))


def test_a_read_between_steps_copies_no_buffer_and_the_others_stay_in_place(device_puts):
    w, b, count, train, _ = _model()
    x = jnp.ones((2, 16))
    train(x)
    for _ in range(2):  # a read that recurs: its twin is compiled, in the background
        held = w.value()
        train(x)
    entry = _entry(train)
    deadline = time.monotonic() + 60
    while not any(entry.twins.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(3):
        held = w.value()  # a logged weight
        ptr_b = ownership.peek(b).unsafe_buffer_pointer()
        device_puts.clear()
        train(x)
        # Old code copied the handed-out buffer (a device_put) before every step.
        assert device_puts == []
        assert ownership.peek(b).unsafe_buffer_pointer() == ptr_b  # b: donated, in place
        np.testing.assert_array_equal(w.numpy(), np.asarray(held) * 0.5 + 32.0)
    assert int(count.numpy()) == 6


def test_float_and_numpy_between_steps_hand_nothing_out(device_puts):
    w, b, count, train, _ = _model()
    x = jnp.ones((2, 16))
    train(x)
    train(x)
    for i in range(3, 6):
        ptr = ownership.peek(b).unsafe_buffer_pointer()
        seen = (int(count), b.numpy(), w.numpy(), bool(count), float(count))
        device_puts.clear()
        train(x)
        # Old code: each read handed the buffer out, and the next step copied it.
        assert device_puts == []
        assert ownership.peek(b).unsafe_buffer_pointer() == ptr  # donated in place
        assert seen[0] == i - 1 and seen[3] and seen[4] == i - 1
        np.testing.assert_array_equal(seen[1], np.full(16, i - 1.0))
        np.testing.assert_array_equal(w.numpy(), seen[2] * 0.5 + 32.0)
        assert int(count.numpy()) == i


def _gathers(monkeypatch) -> list[object]:
    calls: list[object] = []
    real = Ownership.gather
    monkeypatch.setattr(Ownership, "gather", lambda self, *a: calls.append(a) or real(self, *a))
    return calls


def test_a_read_between_steps_keeps_the_steady_path_and_the_read_array(monkeypatch):
    w, b, count, train, _ = _model()
    x = jnp.ones((2, 16))
    train(x)
    entry = _entry(train)
    for _ in range(2):  # the twin for "w handed out", compiled in the background
        w.value()
        train(x)
    deadline = time.monotonic() + 60
    while not any(entry.twins.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    train(x)
    gathers = _gathers(monkeypatch)
    held = []
    for _ in range(4):
        held.append(w.value())
        train(x)
    # The hand-out marks only w on the entry's cache (old code: every hand-out emptied
    # every cache, and each of these calls gathered all its inputs again).
    assert gathers == []
    assert entry.mask is None and entry.last is not None
    # Each handed-out array is alive and holds the value it had when read.
    for older, newer in zip(held, held[1:]):
        np.testing.assert_array_equal(np.asarray(newer), np.asarray(older) * 0.5 + 32.0)
    np.testing.assert_array_equal(w.numpy(), np.asarray(held[-1]) * 0.5 + 32.0)
    assert int(count.numpy()) == 8


def test_a_read_of_a_variable_the_step_only_reads_leaves_its_cache_alone(monkeypatch):
    w = ps.Variable(jnp.ones(4), name="w")
    scale = ps.Variable(2.0, name="scale")
    step = ps.function(lambda: w.assign(w * scale))
    step()
    step()
    entry = _entry(step)
    gathers = _gathers(monkeypatch)
    for _ in range(3):
        s = scale.value()  # read-only in the step: never donated, nothing to mark
        step()
    assert gathers == [] and entry.mask is None
    assert float(s) == 2.0
    np.testing.assert_array_equal(w.numpy(), np.full(4, 32.0))


def test_a_read_then_a_write_drops_the_mark_with_the_cache(monkeypatch):
    w, b, count, train, _ = _model()
    x = jnp.ones((2, 16))
    train(x)
    train(x)
    entry = _entry(train)
    held = w.value()
    assert entry.mask is not None and entry.mask[entry.index[id(w)]]
    b.assign(jnp.full(16, 7.0))  # a write empties every cache, the mark with it
    assert entry.last is None
    gathers = _gathers(monkeypatch)
    before = np.asarray(held).copy()
    train(x)
    assert len(gathers) == 1  # gathered once, and saw the hand-out itself
    np.testing.assert_array_equal(np.asarray(held), before)  # not donated
    np.testing.assert_array_equal(b.numpy(), np.full(16, 8.0))
    assert entry.mask is None and entry.last is not None


def test_an_entry_that_is_dropped_is_no_longer_told_of_hand_outs():
    w, b, count, train, _ = _model()
    x = jnp.ones((2, 16))
    train(x)
    entry = _entry(train)
    assert any(r() is entry for r in w._donors)  # (a test may look at the field)
    train.clear_cache()
    assert not any(r() is entry for r in w._donors or ())
    w.value()  # nothing to tell
    train(x)
    assert int(count.numpy()) == 2
