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
