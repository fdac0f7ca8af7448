"""One compiled call and other threads (issue 33): compiles block nobody, calls with host
callbacks stay atomic, a trace or compile that overlaps a change is redone before it writes.

Every test is bounded in time (``tests/_bounded.py``): a deadlock fails it."""

from __future__ import annotations

import _thread
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _bounded import in_thread

import paramstore as ps
from paramstore._core.hostcalls import CallbackWriteError


@pytest.fixture(autouse=True)
def _fresh_store():
    with ps.VariableStore() as store:
        yield store


def _slow_to_compile(w: ps.Variable, n: int = 1500) -> ps.Function:
    """A step whose compile takes seconds: a long unrolled chain of elementwise ops."""

    @ps.function
    def big(x):
        y = x
        for i in range(n):
            y = jnp.sin(y) * 1.0001 + jnp.cos(y * (i + 1))
        w.assign(w + y.sum())
        return y

    return big


def test_a_compile_blocks_no_other_threads_reads_writes_or_calls():
    w = ps.Variable(0.0)
    other = ps.Variable(jnp.zeros(4))
    small = ps.function(lambda: other.assign_add(jnp.ones(4)))
    small()  # compiled before
    big = _slow_to_compile(w)
    done = threading.Event()
    took: list[float] = []

    def compile_big() -> None:
        t0 = time.perf_counter()
        big(jnp.ones(8))
        took.append(time.perf_counter() - t0)
        done.set()

    worker = threading.Thread(target=compile_big, daemon=True)
    worker.start()
    latencies: list[float] = []
    while big.trace_count == 0 and not done.is_set():  # traced: now it compiles
        time.sleep(0.005)
    while not done.wait(0.01):
        t0 = time.perf_counter()
        other.value()
        other.assign(other.value() + 1)
        small()
        np.asarray(other)
        latencies.append(time.perf_counter() - t0)
    worker.join(60)
    assert took and latencies, "the compiling thread did not finish"
    # Old code: the state lock was held through the compile, so one of these waited for
    # the whole compile (seconds). The bound on the slowest is relative to the compile (a
    # loaded machine starves this thread for a second at times: 1.1 s seen during a 4.5 s
    # compile with two suites on two cores); the typical one must be quick.
    assert max(latencies) < took[0] / 2, (max(latencies), took[0])
    assert statistics.median(latencies) < 0.1, (statistics.median(latencies), took[0])
    assert len(latencies) >= 3, f"the compile ({took[0]:.2f} s) was too quick to test"
    assert float(w.numpy()) != 0.0  # the big step ran and wrote


def _callback_step(v: ps.Variable, callback):
    @ps.function
    def step():
        jax.debug.callback(callback, v.value())
        v.assign(v + 1.0)

    return step


def test_a_call_with_a_host_callback_is_atomic_with_another_threads_assign():
    v = ps.Variable(1.0)
    entered, proceed = threading.Event(), threading.Event()
    proceed.set()

    def callback(x):
        entered.set()
        assert proceed.wait(10)

    step = _callback_step(v, callback)
    step()  # compiled
    v.assign(1.0)
    entered.clear()
    proceed.clear()
    caller = threading.Thread(target=step, daemon=True)
    caller.start()
    assert entered.wait(10)
    writer = threading.Thread(target=lambda: v.assign(100.0), daemon=True)
    writer.start()
    time.sleep(0.3)  # the writer reaches the assign while the callback runs
    proceed.set()
    caller.join(10)
    writer.join(10)
    assert not caller.is_alive() and not writer.is_alive()
    # Old code: the call ran without the lock, so the assign landed inside it and was
    # overwritten by the call's result, 2.0. Each call is atomic: 100 or 101.
    assert float(v.numpy()) in (100.0, 101.0)


def test_a_host_callback_reads_variables_with_their_values_from_before_the_call():
    v = ps.Variable(1.0)
    u = ps.Variable(jnp.arange(3.0))
    seen: list[object] = []

    def callback(x):
        seen.append((float(v), v.numpy().item(), u.value()))
        # another Python thread reads too while the call holds the state lock
        reader = threading.Thread(target=lambda: seen.append(float(v.numpy())))
        reader.start()
        reader.join(5)

    step = _callback_step(v, callback)
    assert in_thread(step) is None
    assert in_thread(step) is None
    assert float(v.numpy()) == 3.0
    assert [s[:2] for s in seen[0::2]] == [(1.0, 1.0), (2.0, 2.0)]
    assert seen[1::2] == [1.0, 2.0]
    np.testing.assert_array_equal(seen[0][2], np.arange(3.0))


@pytest.mark.parametrize("how", ["assign", "assign_add", "call"])
def test_a_write_from_a_host_callback_raises_and_changes_nothing(how):
    v = ps.Variable(1.0)
    other = ps.Variable(5.0)
    bump = ps.function(lambda: other.assign_add(1.0))
    bump()
    other.assign(5.0)
    writes = {
        "assign": lambda: other.assign(7.0),
        "assign_add": lambda: other.assign_add(1.0),
        "call": bump,
    }

    def callback(x):
        writes[how]()

    step = _callback_step(v, callback)
    error: list[BaseException] = []

    def run() -> None:
        try:
            step()
        except BaseException as e:
            error.append(e)

    assert in_thread(run) is None
    assert error and isinstance(error[0], CallbackWriteError), error
    assert "host callback" in str(error[0]) and "variable" in str(error[0])
    assert float(v.numpy()) == 1.0 and float(other.numpy()) == 5.0
    v.assign(2.0)  # nothing is left locked or open
    assert float(v.numpy()) == 2.0


def test_a_flag_change_during_the_compile_traces_again_before_anything_is_written():
    w = ps.Variable(0.0)
    a = ps.Variable(0.0)
    b = ps.Variable(0.0)
    big = _slow_to_compile(w, n=1200)

    @ps.function
    def step(x):
        big.__wrapped__(x)  # the slow program, inlined
        for var in (a, b):
            if var.trainable:
                var.assign_add(1.0)

    worker = threading.Thread(target=lambda: step(jnp.ones(8)), daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    while step.trace_count == 0 and time.monotonic() < deadline:
        time.sleep(0.002)
    b.trainable = False  # while it compiles (the trace saw it trainable)
    worker.join(120)
    assert not worker.is_alive()
    # Old code: the compiled call checked only the placements, and wrote b.
    assert (float(a.numpy()), float(b.numpy())) == (1.0, 0.0)
    assert step.trace_count == 2


# ----------------------------------------------- a failed first trace (issue 36, item 8)


class _Builds(ps.Module):
    """A layer that builds itself on its first call, wrongly from the input's values."""

    def __init__(self) -> None:
        super().__init__()
        self.w: ps.Variable | None = None

    def __call__(self, x):
        if self.w is None:
            self.w = ps.Variable(x * 2.0, name="w")
        return self.w.value() * x


def test_a_variable_of_a_failed_first_trace_is_unusable_and_in_no_store(_fresh_store):
    layer = _Builds()
    step = ps.function(lambda x: layer(x))
    with pytest.raises(ValueError, match="depends on the values"):
        step(jnp.ones(3))
    zombie = layer.w
    assert zombie is not None
    assert _fresh_store.variables() == []
    # Old code: value() returned a ShapeDtypeStruct and numpy() an object array.
    for read in (zombie.value, zombie.numpy, lambda: float(zombie[0]), lambda: np.asarray(zombie)):
        with pytest.raises(ValueError, match=r"Variable 'w'.* trace that failed"):
            read()
    with pytest.raises(ValueError, match=r"Variable 'w'.*assigned"):
        zombie.assign(jnp.zeros(3))
    with pytest.raises(ValueError, match=r"Variable 'w'"):
        ps.state(layer)
    assert "unusable" in repr(zombie)
    assert zombie.shape == (3,)  # its metadata stays


def test_an_interrupt_in_a_first_trace_leaves_no_placeholder_behind(_fresh_store):
    made: list[ps.Variable] = []

    @ps.function
    def step(x):
        made.append(ps.Variable(jnp.zeros_like(x), name="v"))
        raise KeyboardInterrupt  # as Ctrl-C would, in the traced body

    with pytest.raises(KeyboardInterrupt):
        step(jnp.ones(2))
    assert _fresh_store.variables() == []
    with pytest.raises(ValueError, match=r"Variable 'v'"):
        made[0].value()


@pytest.mark.parametrize("where", ["calling thread", "runtime thread"])
def test_a_save_from_a_host_callback_writes_the_values_from_before_the_call(tmp_path, where):
    """XLA:CPU runs a host callback on the calling thread (which holds the state lock);
    XLA:GPU on a runtime thread, which Python knows only as a dummy thread: simulated here
    with a thread started by ``_thread`` (also a dummy to ``threading``). Old code took
    the state lock for the snapshot there and waited forever."""
    v = ps.Variable(1.0, name="v")
    u = ps.Variable(jnp.arange(3.0), name="u")
    saver = ps.Saver([v, u])
    saved: list[object] = []

    def save(path: str) -> None:
        try:
            saved.append(saver.save(path))
        except BaseException as e:  # noqa: BLE001
            saved.append(e)

    def callback(x):
        path = str(tmp_path / f"ck{len(saved)}")
        if where == "calling thread":
            save(path)
            return
        done = threading.Event()
        _thread.start_new_thread(lambda: (save(path), done.set()), ())
        assert done.wait(5), "the save from the runtime thread is still blocked"

    @ps.function
    def step():
        jax.debug.callback(callback, v.value())
        v.assign(v + 1.0)
        u.assign(u * 2.0)

    assert in_thread(step) is None
    assert in_thread(step) is None
    assert [type(s) for s in saved] == [str, str], saved
    for i, (value, array) in enumerate([(1.0, np.arange(3.0)), (2.0, np.arange(3.0) * 2)]):
        got_v, got_u = ps.Variable(0.0, name=f"gv{i}"), ps.Variable(jnp.zeros(3), name=f"gu{i}")
        ps.Saver({"v": got_v, "u": got_u}).restore(saved[i])
        assert float(got_v.numpy()) == value
        np.testing.assert_array_equal(got_u.numpy(), array)
    assert float(v.numpy()) == 3.0
