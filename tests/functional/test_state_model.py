"""The state model (issue 9): variables inside control flow and transformations, nothing
baked in, no tracer stored, traced initial values, randomness as state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _bounded import in_thread

import paramstore as ps


@pytest.fixture(autouse=True)
def _fresh_store():
    with ps.VariableStore() as store:
        yield store


def _inc(v, d=1.0):
    v.assign_add(d, read_value=False)


# --------------------------------------------------------------------------- control flow


def test_fori_loop_body_assigns_like_eager_code():
    c = ps.Variable(0.0)

    @ps.function
    def f(n):
        jax.lax.fori_loop(0, n, lambda i, _: _inc(c, i), None)
        return c.value()

    assert float(f(5)) == 10.0  # 0 + 1 + 2 + 3 + 4
    assert float(f(5)) == 20.0  # state carried across calls
    assert c.numpy() == 20.0 and f.trace_count == 1


def test_while_loop_condition_reads_the_body_writes():
    c = ps.Variable(0)

    @ps.function
    def count_to(n):
        jax.lax.while_loop(lambda _: c < n, lambda _: _inc(c, 1), None)
        return c.value()

    assert int(count_to(7)) == 7
    assert int(count_to(10)) == 10
    assert int(count_to(3)) == 10  # condition false at once: unchanged


def test_scan_cond_switch_checkpoint_and_vmap_bodies_match_eager():
    def program(w, xs, lax_control):
        total = 0.0
        if lax_control:

            def body(carry, x):
                w.assign_add(x)
                return carry + w.sum(), None

            total, _ = jax.lax.scan(body, 0.0, xs)
            jax.lax.cond(total > 0, lambda: _inc(w, -1.0), lambda: None)
            jax.lax.switch(1, [lambda: None, lambda: _inc(w, 10.0)])
            y = jax.checkpoint(lambda z: (w * z).sum())(2.0)
            v = jax.vmap(lambda x: w.value() * x)(jnp.arange(2.0))
        else:
            for x in xs:
                w.assign_add(x)
                total = total + w.sum()
            if total > 0:
                w.assign_add(-1.0)
            w.assign_add(10.0)
            y = (w * 2.0).sum()
            v = jnp.stack([w.value() * x for x in jnp.arange(2.0)])
        return total, y, v

    xs = jnp.arange(12.0).reshape(4, 3)
    w1, w2 = ps.Variable(jnp.ones(3)), ps.Variable(jnp.ones(3))
    compiled = ps.function(lambda xs: program(w1, xs, True))(xs)
    eager = program(w2, xs, False)
    for a, b in zip(compiled, eager):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(w1.numpy(), w2.numpy())


def test_pure_composes_with_control_flow_vmap_and_grad():
    c = ps.Variable(jnp.zeros(()))
    f = ps.pure(lambda n: jax.lax.fori_loop(0, n, lambda i, _: _inc(c, 2.0), None), [c])
    _, new = f(ps.state([c]), 3)
    assert float(new[c.name]) == 6.0
    assert float(c.numpy()) == 0.0  # the real variable is untouched
    batched = jax.vmap(lambda s: f({c.name: s}, 2)[1][c.name])(jnp.arange(3.0))
    np.testing.assert_allclose(batched, [4.0, 5.0, 6.0])
    g = jax.grad(lambda s: f({c.name: s}, 2)[1][c.name] * s)(3.0)
    assert float(g) == pytest.approx(2 * 3.0 + 4.0)


def test_k_optimizer_steps_in_one_scan_equal_a_python_loop():
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((3, 2)).astype(np.float32)
    xs = jnp.asarray(rng.standard_normal((20, 4, 3)).astype(np.float32))

    def make():
        w = ps.Variable(w0, name="w")
        return w, ps.Optimizer(optax.adam(0.1), [w])

    def loss(w, x):
        return jnp.mean((x @ w) ** 2)

    w1, opt1 = make()

    @ps.function
    def fused(xs):
        def body(_, x):
            value, grads = ps.value_and_grad(lambda: loss(w1, x), [w1])()
            opt1.apply_gradients(zip(grads, [w1]))
            return None, value

        return jax.lax.scan(body, None, xs)[1]

    losses = fused(xs)
    w2, opt2 = make()
    eager = []
    for x in xs:
        value, grads = ps.value_and_grad(lambda x=x: loss(w2, x), [w2])()
        opt2.apply_gradients(zip(grads, [w2]))
        eager.append(float(value))
    np.testing.assert_allclose(losses, eager, rtol=2e-5)
    np.testing.assert_allclose(w1.numpy(), w2.numpy(), rtol=2e-5, atol=1e-6)
    assert int(opt1.iterations.numpy()) == 20 == int(opt2.iterations.numpy())


# -------------------------------------------------------------------- nothing baked in


@pytest.mark.parametrize(
    "read",
    [float, int, bool, lambda v: v.item(), lambda v: v.numpy(), np.asarray],
    ids=["float", "int", "bool", "item", "numpy", "np.asarray"],
)
def test_concrete_reads_during_a_trace_raise(read):
    v = ps.Variable(3.0)

    @ps.function
    def f():
        return read(v)

    with pytest.raises(TypeError) as info:  # ConcretizationTypeError / TracerArrayConversion
        f()
    assert "Tracer" in type(info.value).__name__ or "tracer" in str(info.value).lower()
    assert float(v.numpy()) == 3.0


def test_plain_jit_closure_is_refused_not_stale():
    v = ps.Variable(3.0, name="weight")
    with pytest.raises(TypeError, match=r"'weight'.*ps\.function"):
        jax.jit(lambda x: x * v)(1.0)
    assert float(v.numpy()) == 3.0
    # the same program as a ps.function sees every assign
    f = ps.function(lambda x: x * v)
    assert float(f(1.0)) == 3.0
    v.assign(5.0)
    assert float(f(1.0)) == 5.0


def test_assigning_function_under_vmap_or_grad_raises_and_changes_nothing():
    a, b = ps.Variable(1.0, name="a"), ps.Variable(2.0, name="b")

    @ps.function
    def step(x):
        a.assign_add(x)
        b.assign_add(x * 2)
        return a.value()

    for transform in (lambda: jax.vmap(step)(jnp.ones(3)), lambda: jax.grad(step)(1.0)):
        with pytest.raises(TypeError, match=r"assigns variables \(a, b\)"):
            transform()
    assert (float(a.numpy()), float(b.numpy())) == (1.0, 2.0)
    assert not isinstance(a._value, jax.core.Tracer) and not isinstance(b._value, jax.core.Tracer)


def test_assigning_inside_plain_jit_is_an_error():
    v = ps.Variable(1.0, name="v")
    with pytest.raises(TypeError, match="Cannot assign to variable 'v'"):
        jax.jit(lambda: v.assign(2.0))()
    assert float(v.numpy()) == 1.0


# ----------------------------------------------------------- initial values in a trace


class FlexibleDense(ps.Module):
    """The TensorFlow guide's layer: built on its first call from the input's shape."""

    def __init__(self, units, name=None):
        self.units = units
        self.w = None

    def __call__(self, x):
        if self.w is None:
            with self.name_scope:
                self.w = ps.Variable(jnp.ones((x.shape[-1], self.units)), name="w")
                self.b = ps.Variable(jnp.zeros_like(x[0, : self.units]), name="b")
                self.k = ps.Variable(jax.random.normal(ps.random.next_key(), (self.units,)))
        return x @ self.w + self.b + 0 * self.k


def test_layer_built_in_the_first_trace_one_trace_per_signature(_fresh_store):
    layer = FlexibleDense(2)
    step = ps.function(lambda x: layer(x))
    out = step(jnp.ones((1, 3)))
    np.testing.assert_allclose(out, [[3.0, 3.0]])
    assert step.trace_count == 1
    np.testing.assert_allclose(layer.w.numpy(), np.ones((3, 2)))
    assert {v.name for v in _fresh_store.variables()} >= {"flexible_dense/w", "flexible_dense/b"}
    layer.w.assign(2 * np.ones((3, 2), np.float32))
    np.testing.assert_allclose(step(jnp.ones((1, 3))), [[6.0, 6.0]])  # state, not the init
    assert step.trace_count == 1


def test_a_failed_first_trace_keeps_the_variables_it_created(_fresh_store):
    layer = FlexibleDense(2)
    calls = []

    @ps.function
    def step(x):
        out = layer(x)
        if not calls:
            calls.append(1)
            raise RuntimeError("boom")
        return out

    with pytest.raises(RuntimeError, match="boom"):
        step(jnp.ones((1, 3)))
    assert {v.name for v in layer.variables} <= {v.name for v in _fresh_store.variables()}
    np.testing.assert_allclose(layer.w.numpy(), np.ones((3, 2)))
    np.testing.assert_allclose(step(jnp.ones((1, 3))), [[3.0, 3.0]])
    assert ps.state(_fresh_store)  # a saver would find them


# ---------------------------------------------------------------- randomness as state


def test_next_key_advances_inside_a_compiled_function():
    f = ps.function(lambda: jax.random.uniform(ps.random.next_key(), (4,)))
    draws = [np.asarray(f()) for _ in range(3)]
    assert not np.array_equal(draws[0], draws[1]) and not np.array_equal(draws[1], draws[2])
    assert f.trace_count == 1


def test_generator_is_reproducible_fresh_and_checkpointable(tmp_path):
    def draws(g, n):
        f = ps.function(lambda: g.normal((3,)))
        return [np.asarray(f()) for _ in range(n)]

    g1, g2 = ps.random.Generator(7), ps.random.Generator.from_seed(7)
    a, b = draws(g1, 3), draws(g2, 3)
    np.testing.assert_array_equal(np.stack(a), np.stack(b))  # same seed, same sequence
    assert not np.array_equal(a[0], a[1])
    assert not g1.state.trainable and g1.state.dtype == np.uint32
    path = ps.Saver({"rng": g1.state}).save(str(tmp_path / "rng"))
    expected = draws(g1, 2)
    ps.Saver({"rng": g1.state}).restore(path)  # the stream resumes from the checkpoint
    np.testing.assert_array_equal(np.stack(draws(g1, 2)), np.stack(expected))
    parts = g1.split(2)
    assert not np.array_equal(
        np.asarray(parts[0].uniform((2,))), np.asarray(parts[1].uniform((2,)))
    )


def test_typed_key_arrays_can_be_held():
    k = ps.Variable(jax.random.key(0))
    assert not k.trainable and jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key)

    @ps.function
    def advance():
        new, out = jax.random.split(k.value())
        k.assign(new)
        return jax.random.uniform(out)

    assert float(advance()) != float(advance())
    with pytest.raises(TypeError, match="PRNG key variable"):
        k.assign_add(1)
    with pytest.raises(TypeError, match="PRNG key variable"):
        k.assign(np.zeros(2, np.uint32))


@pytest.mark.parametrize("bad", [object(), {"a": 1}, (i for i in range(3))])
def test_non_array_initial_values_are_type_errors(bad, _fresh_store):
    with pytest.raises(TypeError, match="must be array-like"):
        ps.Variable(bad)
    with pytest.raises(TypeError, match="dtype object"):
        ps.Variable([1, 2], dtype=object)
    assert _fresh_store.variables() == []


def test_duplicate_variables_in_grad_get_the_full_gradient():
    v = ps.Variable([1.0, 2.0])
    grads = ps.grad(lambda: jnp.sum(v * v), [v, v])()
    np.testing.assert_allclose(grads[0], [2.0, 4.0])
    np.testing.assert_allclose(grads[1], [2.0, 4.0])


# ------------------------------------------------- one parser for a collection of variables


def test_grad_optimizer_saver_and_reshard_accept_the_same_forms(tmp_path):
    class Net(ps.Module):
        def __init__(self):
            self.w = ps.Variable(jnp.ones(2), name="w")

    a, b = Net(), Net()
    extra = ps.Variable(jnp.zeros(2), name="extra")
    nested = [[a, extra], (b,)]  # Modules and Variables, nested
    expected = [a.w, extra, b.w]
    names = [v.name for v in expected]

    assert list(ps.state(nested)) == names
    opt = ps.Optimizer(optax.sgd(1.0), nested)
    opt.apply_gradients([jnp.ones(2)] * 3)
    np.testing.assert_allclose(a.w.numpy(), [0.0, 0.0])
    # ps.grad reads the same forms: a list of Modules gives, per Module, what it alone gives
    grads = ps.grad(lambda: jnp.sum(a.w * 2.0 + extra + b.w * 3.0), nested)()
    assert isinstance(grads[0][0], tuple) and isinstance(grads[1][0], tuple)
    np.testing.assert_allclose(grads[0][0][0], [2.0, 2.0])
    np.testing.assert_allclose(grads[0][1], [1.0, 1.0])
    np.testing.assert_allclose(grads[1][0][0], [3.0, 3.0])
    loss_ab = lambda: jnp.sum(a.w * 2.0 + b.w * 3.0)  # noqa: E731
    for m, g in zip((a, b), ps.grad(loss_ab, [a, b])(), strict=True):
        alone = ps.grad(loss_ab, m)()
        assert isinstance(g, tuple) and len(g) == len(alone) == 1
        np.testing.assert_allclose(g[0], alone[0])
    opt.apply_gradients(grads)  # the optimizer takes ps.grad's structure for the same form
    np.testing.assert_allclose(a.w.numpy(), [-2.0, -2.0])
    path = ps.Saver(nested).save(str(tmp_path / "c"))
    assert [n for n, _, _ in ps.checkpoint.list_variables(path)] == sorted(names)
    ps.sharding.reshard(nested, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert all(v.device == jax.devices()[0] for v in expected)
    with pytest.raises(TypeError, match=r"Expected Variables, Modules.*got a int"):
        ps.state([a, 3])
    with pytest.raises(TypeError, match=r"Saver: Expected Variables, Modules.*got a str"):
        ps.Saver([a, "w"])


# ---------------------------------------------------------------- error paths, no change


def test_a_variable_from_a_value_traced_in_a_nested_body_is_refused(_fresh_store):
    @ps.function
    def f(n):
        def body(i, carry):
            ps.Variable(carry * 2.0, name="inner")  # depends on the loop's carry
            return carry + 1.0

        return jax.lax.fori_loop(0, n, body, 0.0)

    with pytest.raises(ValueError, match=r"'inner' is a traced value computed inside"):
        f(3)
    assert _fresh_store.variables() == [] and f.trace_count == 0

    pure = ps.pure(lambda x: ps.Variable(x * 2.0, name="in_pure").value(), [])
    with pytest.raises(ValueError, match=r"'in_pure' is a traced value"):
        jax.jit(lambda x: pure({}, x))(1.0)
    assert _fresh_store.variables() == []


def test_placement_of_a_traced_initial_value_is_kept(_fresh_store):
    # Created in the first trace with device=: its initial value is computed after the trace
    # by a program whose output sharding is that device (issue 17: once "not supported").
    @ps.function
    def f(x):
        return ps.Variable(jnp.ones(x.shape), name="placed", device="cpu:0").value() + x

    np.testing.assert_array_equal(f(jnp.ones(2)), [2.0, 2.0])
    (v,) = _fresh_store.variables()
    assert v.name == "placed" and v.device == jax.devices("cpu")[0]
    assert v.value().committed
    np.testing.assert_array_equal(v.numpy(), [1.0, 1.0])


def test_key_variable_errors_change_nothing(_fresh_store):
    with pytest.raises(TypeError, match="a PRNG key array takes no dtype="):
        ps.Variable(jax.random.key(0), dtype=jnp.uint32, name="k0")
    assert _fresh_store.variables() == []
    k = ps.Variable(jax.random.key(1), name="k")
    before = np.asarray(jax.random.key_data(k.value()))
    for bad in (lambda: k.assign_add(1), lambda: k.assign(np.zeros(2, np.uint32))):
        with pytest.raises(TypeError, match="PRNG key variable 'k'"):
            bad()
    u = ps.Variable(jnp.zeros(2, jnp.uint32), name="u")
    with pytest.raises(TypeError, match=r"a PRNG key array \(dtype key<fry>\) to variable 'u'"):
        u.assign(jax.random.key(2))
    np.testing.assert_array_equal(u.numpy(), [0, 0])
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(k.value())), before)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: ps.random.Generator("7"), TypeError, "expects an int seed, got str"),
        (lambda: ps.random.Generator.from_seed(True), TypeError, "expects an int seed"),
        (lambda: ps.random.Generator(1).split(0), ValueError, "positive int count, got 0"),
    ],
)
def test_bad_generator_arguments(make, error, message, _fresh_store):
    with pytest.raises(error, match=message):
        make()
    # a refused split leaves the generator's state as it was
    g = ps.random.Generator(3)
    state = g.state.numpy()
    with pytest.raises(ValueError):
        g.split(-1)
    np.testing.assert_array_equal(g.state.numpy(), state)


# ------------------------------------------------------------------------ vmap bodies


def test_an_unbatched_assign_inside_a_vmap_body_matches_eager():
    def per_row(w, r):
        w.assign(jnp.maximum(w.value(), 2.0))
        return r * w.value()

    def run(w, x):
        return jax.vmap(lambda r: per_row(w, r))(x)

    x = jnp.arange(6.0).reshape(2, 3)
    eager_w = ps.Variable(jnp.array([1.0, 3.0, 0.5]))
    eager = jnp.stack([per_row(eager_w, r) for r in x])  # row by row
    w = ps.Variable(jnp.array([1.0, 3.0, 0.5]))
    out = ps.function(lambda x: run(w, x))(x)
    np.testing.assert_array_equal(out, eager)
    np.testing.assert_array_equal(w.numpy(), eager_w.numpy())
    # nested in a scan body too
    w2 = ps.Variable(jnp.array([1.0, 3.0, 0.5]))
    out2 = ps.function(lambda x: jax.lax.scan(lambda c, r: (c, run(w2, r[None])[0]), 0, x)[1])(x)
    np.testing.assert_array_equal(out2, eager)
    np.testing.assert_array_equal(w2.numpy(), eager_w.numpy())


@pytest.mark.parametrize("op", ["assign", "assign_add"])
def test_assigning_a_batched_value_inside_vmap_is_a_clear_error(op):
    w = ps.Variable(jnp.zeros(3), name="acc")

    @ps.function
    def f(x):
        return jax.vmap(lambda r: getattr(w, op)(r) and r)(x)

    with pytest.raises(TypeError, match=r"'acc'.*varies over the batch.*outside"):
        f(jnp.ones((4, 3)))
    np.testing.assert_array_equal(w.numpy(), np.zeros(3))


def test_assign_add_inside_a_vmap_body_is_a_clear_error():
    n = ps.Variable(0.0, name="count")

    @ps.function
    def f(x):
        def row(r):
            n.assign_add(1.0)
            return r

        return jax.vmap(row)(x)

    with pytest.raises(TypeError, match=r"assign_add variable 'count' inside a jax.vmap.*sum"):
        f(jnp.ones((4, 3)))
    assert float(n) == 0.0


def test_an_assign_in_a_while_loop_condition_is_a_clear_error():
    n = ps.Variable(0.0, name="evaluations")
    i = ps.Variable(0.0, name="i")

    def cond(_):
        n.assign_add(1.0)
        return i.value() < 3

    def body(c):
        i.assign_add(1.0)
        return c

    f = ps.function(lambda: jax.lax.while_loop(cond, body, 0))
    with pytest.raises(TypeError, match=r"'evaluations' was assigned in a jax.lax.while_loop cond"):
        f()
    assert float(n) == 0.0 and float(i) == 0.0
    with pytest.raises(TypeError):  # eagerly too: an assign inside a JAX trace
        jax.lax.while_loop(cond, body, 0)
    assert float(n) == 0.0 and float(i) == 0.0


# ------------------------------------------------- while_loop conditions under plain jax.jit


def test_pure_under_jit_refuses_a_condition_reading_what_the_body_assigns():
    """ps.pure under a plain jax.jit: JAX discharges the loop with its own rule, whose
    condition would never see the body's assigns (a loop that does not end): refused."""
    c = ps.Variable(0, name="counter")

    def count_to(n):
        jax.lax.while_loop(lambda _: c < n, lambda _: _inc(c, 1), None)
        return c.value()

    step = jax.jit(ps.pure(count_to, [c]))
    with pytest.raises(TypeError) as e:
        step(ps.state([c]), 5)
    message = str(e.value)
    assert "'counter' is read in a jax.lax.while_loop condition and assigned" in message
    assert "Run the loop in a ps.function" in message
    assert int(c.numpy()) == 0
    # the same loop in a ps.function runs, also inside a ps.pure there; a condition that
    # only reads runs under jit too
    # (bounded: a condition that never sees the body's assigns loops forever)
    outs = []
    pure = ps.pure(count_to, [c])
    assert in_thread(lambda: outs.append(int(ps.function(count_to)(5)))) is None
    assert (
        in_thread(lambda: outs.append(int(ps.function(lambda: pure(ps.state([c]), 8)[0])())))
        is None
    )
    assert outs == [5, 8]
    assert int(c.numpy()) == 5  # ps.pure returned its new state; the variable is unchanged
    limit = ps.Variable(3, name="limit")
    bounded = jax.jit(
        ps.pure(lambda: jax.lax.while_loop(lambda i: i < limit, lambda i: i + 1, 0), [limit])
    )
    assert int(bounded(ps.state([limit]))[0]) == 3
