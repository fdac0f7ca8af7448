"""ps.function: lifting, swapping, donation, traces, errors."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paramstore as ps
from paramstore._core.ownership import ownership


@pytest.fixture(autouse=True)
def _fresh_store():
    with ps.VariableStore() as store:
        yield store


class Dense(ps.Module):
    def __init__(self, n_in: int, n_out: int, name: str | None = None):
        self.w = ps.Variable(jnp.full((n_in, n_out), 0.1, jnp.float32), name="w")
        self.b = ps.Variable(jnp.zeros(n_out), name="b")

    def __call__(self, x):
        return x @ self.w + self.b


def snapshot(variables):
    return [(v.name, v.dtype, v.shape, np.array(v.numpy())) for v in variables]


def assert_unchanged(before, variables):
    after = snapshot(variables)
    assert len(before) == len(after)
    for (n0, d0, s0, a0), (n1, d1, s1, a1) in zip(before, after):
        assert (n0, d0, s0) == (n1, d1, s1)
        np.testing.assert_array_equal(a0, a1)


# ----------------------------------------------------------------------- reads & writes


def test_closed_over_variable_is_an_input_not_a_constant():
    v = ps.Variable(1.0)

    @ps.function
    def f(x):
        return x * v

    assert float(f(2.0)) == 2.0
    v.assign(5.0)  # an assign between calls is seen, without a retrace
    assert float(f(2.0)) == 10.0
    assert f.trace_count == 1


def test_assigns_are_swapped_in_and_seen_by_later_calls():
    v = ps.Variable(0)

    @ps.function
    def inc():
        v.assign_add(1)
        return v.value()

    assert [int(inc()) for _ in range(3)] == [1, 2, 3]
    assert int(v.numpy()) == 3
    assert inc.trace_count == 1


def test_variables_passed_as_args_in_lists_dicts_and_modules():
    a, b = ps.Variable(1.0), ps.Variable(2.0)
    m = Dense(2, 1)

    @ps.function
    def f(pair, mapping, module, x):
        pair[0].assign_add(1.0)
        mapping["b"].assign_sub(1.0)
        return module(x).sum() + pair[1] + mapping["b"]

    x = jnp.ones((1, 2))
    out = f([a, b], {"b": b}, m, x)
    assert float(a.numpy()) == 2.0
    assert float(b.numpy()) == 1.0
    np.testing.assert_allclose(float(out), 0.2 + 1.0 + 1.0, rtol=1e-6)  # b read after its assign
    m.w.assign(jnp.ones((2, 1)))
    out = f([a, b], {"b": b}, m, x)
    np.testing.assert_allclose(float(out), 2.0 + 0.0 + 0.0, rtol=1e-6)
    assert f.trace_count == 1


def test_other_variable_objects_get_their_own_trace():
    a, b = ps.Variable(1.0), ps.Variable(10.0)

    @ps.function
    def f(v):
        v.assign_add(1.0)
        return v.value()

    assert float(f(a)) == 2.0
    assert float(f(b)) == 11.0
    assert float(a.numpy()) == 2.0 and float(b.numpy()) == 11.0


def test_same_array_shared_by_two_variables_stays_two_inputs():
    arr = jnp.arange(3.0)
    a, b = ps.Variable(arr), ps.Variable(arr)

    @ps.function
    def f():
        a.assign_add(1.0)
        return b.value()

    np.testing.assert_array_equal(f(), [0.0, 1.0, 2.0])
    b.assign([5.0, 5.0, 5.0])
    np.testing.assert_array_equal(f(), [5.0, 5.0, 5.0])
    np.testing.assert_array_equal(a.numpy(), [2.0, 3.0, 4.0])
    np.testing.assert_array_equal(arr, [0.0, 1.0, 2.0])  # the user's array survives donation


def test_returning_a_variable_returns_its_value():
    v = ps.Variable([1.0, 2.0])

    @ps.function
    def f():
        v.assign(v * 2)
        return v, {"half": v[0]}

    out, extra = f()
    assert isinstance(out, jax.Array)
    np.testing.assert_array_equal(out, [2.0, 4.0])
    assert float(extra["half"]) == 2.0


# ------------------------------------------------------------------------------ traces


def test_one_trace_per_signature_and_static_args():
    calls = []

    @ps.function(static_argnums=(1,))
    def f(x, power):
        calls.append(power)
        return x**power

    f(jnp.ones(2), 2)
    f(jnp.ones(2) * 3, 2)
    assert f.trace_count == 1 and len(calls) == 1
    f(jnp.ones(3), 2)  # new shape
    f(jnp.ones(3), 3)  # new static arg
    f(jnp.ones(3, jnp.int32), 3)  # new dtype
    assert f.trace_count == 4 and len(calls) == 4


def test_static_argnames_and_kwargs():
    @ps.function(static_argnames="mode")
    def f(x, mode="double"):
        return x * (2 if mode == "double" else 3)

    assert float(f(1.0)) == 2.0
    assert float(f(1.0, mode="triple")) == 3.0
    assert float(f(x=1.0, mode="triple")) == 3.0


def test_unhashable_static_argument_is_a_clear_error():
    v = ps.Variable(1.0)

    @ps.function(static_argnums=1)
    def f(x, cfg):
        v.assign_add(1.0)
        return x

    with pytest.raises(
        TypeError, match=r"Static argument at position 1 .* unhashable \(type list\)"
    ):
        f(1.0, [1, 2])
    assert float(v.numpy()) == 1.0
    assert f.trace_count == 0


def test_non_array_argument_must_be_static():
    @ps.function
    def f(x, label):
        return x

    with pytest.raises(TypeError, match="type str .*static_argnums"):
        f(1.0, "hello")


def test_variables_created_on_first_trace_live_on():
    holder = {}

    @ps.function
    def f(x):
        if "v" not in holder:
            holder["v"] = ps.Variable(lambda: jnp.zeros(x.shape), name="acc")
        holder["v"].assign_add(x)
        return holder["v"].value()

    f(jnp.ones(2))
    f(jnp.ones(2))
    v = holder["v"]
    assert v.name == "acc"
    np.testing.assert_array_equal(v.numpy(), [2.0, 2.0])
    assert not isinstance(v.value(), jax.core.Tracer)


def test_creating_variables_on_a_non_first_trace_raises_and_changes_nothing(_fresh_store):
    counter = ps.Variable(0, name="counter")

    @ps.function
    def f(x):
        counter.assign_add(1)
        ps.Variable(1.0, name="fresh")
        return x

    f(1.0)
    assert int(counter.numpy()) == 1
    n_vars = len(_fresh_store.variables())
    with pytest.raises(
        ValueError,
        match=r"^ps\.function-decorated function tried to create variables on non-first trace\.",
    ):
        f(jnp.ones(3))
    assert int(counter.numpy()) == 1
    assert len(_fresh_store.variables()) == n_vars
    assert f.trace_count == 1


def test_initial_value_depending_on_argument_values_is_a_clear_error(_fresh_store):
    @ps.function
    def f(x):
        return ps.Variable(x * 2, name="bad").value()

    with pytest.raises(ValueError, match=r"'bad'.*depends on the values of the function's"):
        f(1.0)
    assert _fresh_store.variables() == []
    assert f.trace_count == 0


def test_a_failed_trace_forgets_its_variable_in_its_own_store_only(_fresh_store):
    """The undo of a failed creation removes the variable the trace created, from the store
    it was created in: a same-named variable of the outer store survives."""
    outer = ps.Variable(1.0, name="v")
    inner: list[ps.VariableStore] = []

    @ps.function
    def f(x):
        with ps.VariableStore() as store:
            inner.append(store)
            v = ps.Variable(x * 2, name="v")  # depends on the argument: the trace fails
        return v.value()

    with pytest.raises(ValueError, match=r"'v'.*depends on the values of the function's"):
        f(1.0)
    assert _fresh_store.get("v") is outer
    assert _fresh_store.variables() == [outer]
    assert inner[0].variables() == []
    np.testing.assert_allclose(outer.numpy(), 1.0)


def test_forgetting_a_variable_leaves_another_of_the_same_name(_fresh_store):
    kept = ps.Variable(1.0, name="w")
    with ps.VariableStore():
        other = ps.Variable(2.0, name="w")  # the same full name, in another store
    _fresh_store._forget(other)
    assert _fresh_store.get("w") is kept


def test_initial_value_computed_in_the_trace_from_shapes(_fresh_store):
    @ps.function
    def g(x):
        v = ps.Variable(jnp.full((x.shape[0],), 2.0), name="twos")
        v.assign_add(x)
        return v.value()

    out = g(jnp.arange(3.0))
    np.testing.assert_allclose(out, [2.0, 3.0, 4.0])
    (v,) = _fresh_store.variables()
    np.testing.assert_allclose(v.numpy(), [2.0, 3.0, 4.0])
    # later calls use the variable's state, not the initial value
    np.testing.assert_allclose(g(jnp.arange(3.0)), [2.0, 4.0, 6.0])
    assert g.trace_count == 1 and len(_fresh_store.variables()) == 1


def test_initializer_variable_inside_first_trace_is_concrete():
    holder = []

    @ps.function
    def f(x):
        if not holder:
            holder.append(ps.Variable(lambda: ps.initializers.ones()((2,)), name="w"))
        return x * holder[0]

    np.testing.assert_array_equal(f(jnp.ones(2)), [1.0, 1.0])
    np.testing.assert_array_equal(holder[0].numpy(), [1.0, 1.0])


def test_exceptions_leave_every_variable_as_it_was():
    a, b = ps.Variable(1.0), ps.Variable(2.0)

    @ps.function
    def f(x, fail):
        a.assign(x)
        if fail:
            raise RuntimeError("boom")
        b.assign(x)
        return x

    f = ps.function(f.__wrapped__, static_argnums=1)
    before = snapshot([a, b])
    with pytest.raises(RuntimeError, match="boom"):
        f(10.0, True)
    assert_unchanged(before, [a, b])
    f(10.0, False)
    assert float(a.numpy()) == 10.0 and float(b.numpy()) == 10.0


def test_string_variable_inside_function_is_a_type_error():
    s = ps.Variable(["abc"], name="label")
    v = ps.Variable(1.0)

    @ps.function
    def f():
        v.assign_add(1.0)
        return s.value()

    with pytest.raises(TypeError, match="'label' holds strings"):
        f()
    assert float(v.numpy()) == 1.0
    assert s.numpy().tolist() == ["abc"]


# ------------------------------------------------------------------------------ methods


def test_methods_trace_per_instance():
    class Counter(ps.Module):
        def __init__(self):
            self.n = None

        @ps.function
        def step(self, x):
            if self.n is None:
                self.n = ps.Variable(0, name="n")
            self.n.assign_add(x)
            return self.n.value()

    c1, c2 = Counter(), Counter()
    assert int(c1.step(1)) == 1
    assert int(c2.step(5)) == 5  # c2 creates its variable on its own first trace
    assert int(c1.step(1)) == 2
    assert c1.step.trace_count == 1 and c2.step.trace_count == 1
    assert c1.n.name != c2.n.name


# -------------------------------------------------------------------- transformations


def test_nested_functions_and_jax_transforms_inside():
    v = ps.Variable(jnp.arange(3.0))

    @ps.function
    def inner(x):
        v.assign(v * x)
        return v.sum()

    @ps.function
    def outer(x):
        s = inner(x)
        g = jax.grad(lambda y: jnp.sum(jnp.sin(y) * v))(x)
        batched = jax.vmap(lambda row: row * 2)(jnp.stack([v.value(), v.value()]))
        scanned, _ = jax.lax.scan(lambda c, r: (c + r, None), 0.0, v.value())
        return s, g, batched, scanned

    s, g, batched, scanned = outer(jnp.float32(2.0))
    np.testing.assert_allclose(v.numpy(), [0.0, 2.0, 4.0])
    assert float(s) == 6.0
    np.testing.assert_allclose(g, np.cos(2.0) * 6.0, rtol=1e-6)
    np.testing.assert_allclose(batched, [[0, 4, 8], [0, 4, 8]])
    assert float(scanned) == 6.0
    assert outer.trace_count == 1


def test_grad_inside_function_trains():
    m = Dense(3, 1)
    x = jnp.ones((4, 3))
    y = jnp.full((4, 1), 2.0)

    @ps.function
    def step():
        loss, grads = ps.value_and_grad(lambda: jnp.mean((m(x) - y) ** 2), m)()
        for var, g in zip(m.trainable_variables, grads):
            var.assign_sub(0.05 * g)
        return loss

    losses = [float(step()) for _ in range(30)]
    assert losses[-1] < losses[0] * 0.01
    assert step.trace_count == 1


def test_leaked_tracer_assign_from_plain_jit_is_a_clear_error():
    v = ps.Variable(1.0)

    with pytest.raises(TypeError, match="plain JAX transformation.*ps.function.*ps.pure"):
        jax.jit(lambda x: v.assign(x))(2.0)
    assert float(v.numpy()) == 1.0
    with pytest.raises(TypeError, match="leaked tracer"):
        jax.grad(lambda x: (v.assign(x), x)[1])(2.0)
    assert float(v.numpy()) == 1.0


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_function_that_assigns_inside_plain_vmap_is_a_clear_error():
    v = ps.Variable(0.0)

    @ps.function
    def f(x):
        v.assign_add(x)
        return x

    with pytest.raises(TypeError, match="called inside a plain JAX transformation"):
        jax.vmap(f)(jnp.ones(3))
    assert float(v.numpy()) == 0.0


def test_tracer_used_outside_its_trace_raises():
    v = ps.Variable(1.0)
    leaked = []

    @ps.function
    def f(x):
        leaked.append(v.value() * x)
        return x

    f(1.0)
    with pytest.raises(jax.errors.UnexpectedTracerError):
        _ = leaked[0] + 1


# --------------------------------------------------------------------------- donation


def test_assigned_buffers_are_donated_and_updated_in_place():
    v = ps.Variable(jnp.zeros(1024))

    @ps.function
    def step():
        v.assign_add(1.0)

    step()
    ptr = ownership.peek(v).unsafe_buffer_pointer()  # looked at, not handed out
    for _ in range(3):
        step()
    assert ownership.peek(v).unsafe_buffer_pointer() == ptr
    assert float(v.numpy()[0]) == 4.0


def test_an_array_the_user_holds_stays_valid():
    v = ps.Variable(jnp.zeros(8))

    @ps.function
    def step():
        v.assign_add(1.0)

    step()
    old = v.value()
    step()
    gc.collect()
    np.testing.assert_array_equal(old, np.ones(8))  # not deleted, not overwritten
    np.testing.assert_array_equal(v.numpy(), np.full(8, 2.0))


def test_only_the_held_array_is_copied_before_donation():
    a, b = ps.Variable(jnp.zeros(64)), ps.Variable(jnp.zeros(64))

    @ps.function
    def step():
        a.assign_add(1.0)
        b.assign_add(1.0)

    step()
    held = a.value()
    ptr_b = ownership.peek(b).unsafe_buffer_pointer()
    step()
    assert ownership.peek(b).unsafe_buffer_pointer() == ptr_b  # b still updated in place
    np.testing.assert_array_equal(held, np.ones(64))  # a's old array survived
    np.testing.assert_array_equal(a.numpy(), np.full(64, 2.0))


def test_donate_false_never_donates():
    v = ps.Variable(jnp.zeros(16))

    def inc():
        v.assign_add(1.0)

    f = ps.function(inc, donate=False)
    f()
    old = v.value()
    f()
    assert float(v.numpy()[0]) == 2.0
    assert float(old[0]) == 1.0 and not old.is_deleted()


def test_memory_analysis_shows_aliasing():
    """The compiled step's outputs alias the donated variable buffers (no extra copy)."""
    v = ps.Variable(jnp.zeros((256, 256)))

    @ps.function
    def step():
        v.assign(v * 2.0 + 1.0)

    step()
    entry = next(iter(step._cache.values()))
    compiled = entry.runner.lower([v.value()], [], []).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        pytest.skip("this backend reports no memory analysis")
    assert stats.alias_size_in_bytes >= 256 * 256 * 4


def test_numpy_array_operand_does_not_bake_the_variable_in():
    v = ps.Variable(jnp.ones((2, 2)))
    x = np.ones((3, 2), np.float32)
    f = ps.function(lambda: x @ v + np.float32(1) * v[0])
    np.testing.assert_array_equal(f(), np.full((3, 2), 3.0))
    v.assign(jnp.zeros((2, 2)))
    np.testing.assert_array_equal(f(), np.zeros((3, 2)))  # not a stale constant
    out = jax.vmap(lambda row: row @ v)(x)  # a NumPy operand under vmap: no conversion error
    np.testing.assert_array_equal(out, np.zeros((3, 2)))


def test_importing_paramstore_does_not_start_the_xla_backend():
    """jax.distributed.initialize() must run before the backend starts: import stays lazy."""
    import subprocess
    import sys

    code = (
        "import paramstore\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge.backends_are_initialized(), 'import started the backend'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# ------------------------------------------------------------------------ the trace cache


def test_the_trace_cache_is_bounded_least_recently_used_first(monkeypatch):
    monkeypatch.setattr(ps.Function, "max_traces", 3)
    v = ps.Variable(jnp.zeros(()))

    @ps.function
    def f(x):
        v.assign_add(x.sum())
        return x

    for n in (1, 2, 3):
        f(jnp.ones(n))
    assert f.trace_count == 3
    f(jnp.ones(1))  # now 2 is the least recently used
    f(jnp.ones(4))  # evicts 2
    assert f.trace_count == 4 and len(f._cache) == 3
    f(jnp.ones(1))
    f(jnp.ones(3))
    assert f.trace_count == 4  # still kept
    f(jnp.ones(2))
    assert f.trace_count == 5  # traced again
    assert float(v.numpy()) == 1 + 2 + 3 + 1 + 4 + 1 + 3 + 2


def test_clear_cache_drops_every_trace_and_keeps_the_variables():
    v = ps.Variable(jnp.zeros(3))

    @ps.function
    def step(x):
        v.assign_add(x)

    step(jnp.ones(3))
    step(jnp.ones(3))
    step.clear_cache()
    assert step._cache == {} and step._fast == {}
    np.testing.assert_array_equal(v.numpy(), np.full(3, 2.0))
    step(jnp.ones(3))  # traces again
    assert step.trace_count == 2
    np.testing.assert_array_equal(v.numpy(), np.full(3, 3.0))

    @ps.function
    def make(x):
        return ps.Variable(jnp.zeros(2)).value() + x

    make(1.0)
    make.clear_cache()
    with pytest.raises(ValueError, match="non-first trace"):
        make(1.0)


def test_clear_cache_on_a_method_clears_every_instance():
    class Counter(ps.Module):
        def __init__(self):
            self.n = ps.Variable(0.0)

        @ps.function
        def bump(self):
            self.n.assign_add(1.0)

    a, b = Counter(), Counter()
    a.bump()
    b.bump()
    Counter.bump.clear_cache()
    assert a.bump.trace_count == 1 and a.bump._cache == {}
    a.bump()
    assert float(a.n) == 2.0 and a.bump.trace_count == 2


# ------------------------------------------------- shardings, lower, shard_map, typing


def test_in_and_out_shardings_go_to_jit_for_arrays():
    dev = jax.devices()[0]
    one = jax.sharding.SingleDeviceSharding(dev)
    v = ps.Variable(jnp.zeros(3))

    @ps.function(in_shardings=(one, None), out_shardings={"y": one})
    def f(x, z):
        v.assign_add(x)
        return {"y": x * 2 + z}

    out = f(np.ones(3, np.float32), jnp.ones(3))
    assert out["y"].sharding == one
    np.testing.assert_array_equal(out["y"], np.full(3, 3.0))
    np.testing.assert_array_equal(v.numpy(), np.ones(3))
    g = ps.function(lambda x: x + v, in_shardings=one, out_shardings=one)
    assert g(jnp.ones(3)).sharding == one


def test_bad_shardings_are_clear_errors():
    v = ps.Variable(jnp.zeros(3))
    f = ps.function(lambda x: v.assign_add(x, read_value=False), in_shardings=("not",))
    with pytest.raises(TypeError, match=r"in_shardings of ps.function '<lambda>'.*got str"):
        f(jnp.ones(3))
    np.testing.assert_array_equal(v.numpy(), np.zeros(3))


def test_lower_returns_the_lowered_program_without_running_it():
    v = ps.Variable(jnp.zeros(4))

    @ps.function
    def step(x):
        v.assign_add(x)
        return x.sum()

    step(jnp.ones(4))
    before = ownership.peek(v)
    lowered = step.lower(jnp.ones(4))
    assert isinstance(lowered, jax.stages.Lowered)
    assert "add" in lowered.as_text()
    assert ownership.peek(v) is before and not before.is_deleted()
    np.testing.assert_array_equal(v.numpy(), np.ones(4))
    compiled = lowered.compile()
    assert compiled is not None and step.trace_count == 1


def test_a_variable_inside_a_shard_map_body_is_a_clear_error():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    spec = jax.sharding.PartitionSpec()
    v = ps.Variable(jnp.ones(2), name="w")

    @ps.function
    def read(x):
        return jax.shard_map(lambda a: a * v.value(), mesh=mesh, in_specs=spec, out_specs=spec)(x)

    @ps.function
    def write(x):
        def body(a):
            v.assign(a)
            return a

        return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(x)

    for f, what in ((read, "read"), (write, "assigned")):
        with pytest.raises(TypeError, match=rf"'w' was {what} inside a jax.shard_map body.*value"):
            f(jnp.full(2, 3.0))
        np.testing.assert_array_equal(v.numpy(), np.ones(2))
    ok = ps.function(
        lambda x: jax.shard_map(lambda a, w: a * w, mesh=mesh, in_specs=spec, out_specs=spec)(
            x, v.value()
        )
    )
    np.testing.assert_array_equal(ok(jnp.full(2, 3.0)), np.full(2, 3.0))
