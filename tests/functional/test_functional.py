"""The functional core: state, pure, update, grad, value_and_grad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import paramstore as ps


@pytest.fixture(autouse=True)
def _fresh_store():
    with ps.VariableStore() as store:
        yield store


class Linear(ps.Module):
    def __init__(self, n_in: int, n_out: int, name: str | None = None):
        self.w = ps.Variable(jnp.linspace(-1.0, 1.0, n_in * n_out).reshape(n_in, n_out), name="w")
        self.b = ps.Variable(jnp.zeros(n_out), name="b")
        self.calls = ps.Variable(0, trainable=False, name="calls")

    def __call__(self, x):
        self.calls.assign_add(1)
        return x @ self.w + self.b


def test_state_is_an_immutable_pytree_keyed_by_name():
    m = Linear(2, 3)
    s = ps.state(m)
    assert list(s) == ["linear/b", "linear/calls", "linear/w"]
    assert isinstance(s, ps.State)
    with pytest.raises(AttributeError, match="immutable"):
        s.x = 1
    with pytest.raises(TypeError):
        s["linear/b"] = 0  # type: ignore[index]
    doubled = jax.tree_util.tree_map(lambda a: a * 2, s)
    assert isinstance(doubled, ps.State) and list(doubled) == list(s)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(s)]
    assert paths == ["['linear/b']", "['linear/calls']", "['linear/w']"]
    assert list(ps.state({"alias": m.w})) == ["alias"]


def test_pure_binds_values_and_never_touches_the_variables():
    m = Linear(2, 1)
    before = ps.state(m)
    f = ps.pure(lambda x: m(x), m)
    values = dict(before)
    values["linear/w"] = jnp.ones((2, 1))
    out, new = f(values, jnp.ones((1, 2)))
    np.testing.assert_allclose(out, [[2.0]])
    assert int(new["linear/calls"]) == 1
    np.testing.assert_array_equal(new["linear/w"], np.ones((2, 1)))
    # the real variables are untouched
    for k, v in ps.state(m).items():
        np.testing.assert_array_equal(v, before[k])
    assert int(m.calls.numpy()) == 0


def test_pure_under_jit_grad_and_scan():
    m = Linear(3, 1)
    f = ps.pure(lambda x, y: jnp.mean((m(x) - y) ** 2), m)
    x, y = jnp.ones((4, 3)), jnp.ones((4, 1))
    s = ps.state(m)
    out, _ = jax.jit(f)(s, x, y)
    assert float(out) > 0

    def loss(params, state):
        out, new = f({**state, **params}, x, y)
        return out, new

    params = {k: s[k] for k in ("linear/w", "linear/b")}
    grads, new = jax.grad(loss, has_aux=True)(params, dict(s))
    assert set(grads) == {"linear/w", "linear/b"}
    assert int(new["linear/calls"]) == 1

    def body(state, _):
        _, new = f(state, x, y)
        return new, None

    final, _ = jax.lax.scan(body, s, None, length=5)
    assert int(final["linear/calls"]) == 5


def test_vmap_pure_trains_an_ensemble_of_8_models():
    m = Linear(2, 1)
    k = jax.random.split(jax.random.key(0), 8)
    stacked = {
        "linear/w": jax.vmap(lambda kk: jax.random.normal(kk, (2, 1)))(k),
        "linear/b": jnp.zeros((8, 1)),
        "linear/calls": jnp.zeros((8,), jnp.int32),
    }
    x = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]])  # well conditioned
    y = x @ jnp.array([[0.5], [-1.0]]) + 0.25
    f = ps.pure(lambda: jnp.mean((m(x) - y) ** 2), m)

    @jax.jit
    def train_step(state):
        def loss(params):
            out, new = f({**state, **params})
            return out, new

        params = {k: state[k] for k in ("linear/w", "linear/b")}
        (val, new), grads = jax.value_and_grad(loss, has_aux=True)(params)
        new = dict(new)
        for k in params:
            new[k] = params[k] - 0.2 * grads[k]
        return new, val

    batched = jax.vmap(train_step)
    state = stacked
    first = None
    for _ in range(500):
        state, losses = batched(state)
        first = losses if first is None else first
    assert losses.shape == (8,)
    assert np.all(np.asarray(losses) < 1e-6) and np.all(np.asarray(first) > 1e-2)
    # different inits, all converged to the same solution; calls counted per member
    np.testing.assert_allclose(state["linear/w"][:, :, 0], np.tile([0.5, -1.0], (8, 1)), atol=0.05)
    np.testing.assert_array_equal(state["linear/calls"], np.full(8, 500))
    assert int(m.calls.numpy()) == 0


def test_pure_rejects_bad_values_and_assigns_outside_its_set():
    m = Linear(2, 1)
    other = ps.Variable(0.0, name="other")
    f = ps.pure(lambda: m.w.sum(), m)
    with pytest.raises(KeyError, match=r"missing \['linear/w'\]"):
        f({"linear/b": jnp.zeros(1), "linear/calls": 0})
    s = dict(ps.state(m))
    s["linear/w"] = jnp.zeros((3, 3))
    with pytest.raises(ValueError, match=r"Shapes \(2, 1\) and \(3, 3\) are incompatible"):
        f(s)
    g = ps.pure(lambda: other.assign(1.0), m)
    with pytest.raises(ValueError, match="assigned variable 'other', which is not among"):
        g(ps.state(m))
    assert float(other.numpy()) == 0.0


def test_update_assigns_all_or_nothing():
    m = Linear(2, 1)
    s = dict(ps.state(m))
    s["linear/w"] = jnp.full((2, 1), 7.0)
    s["linear/b"] = jnp.full((1,), 3.0)
    ps.update(m, s)
    np.testing.assert_array_equal(m.w.numpy(), np.full((2, 1), 7.0))
    before = ps.state(m)
    bad = dict(s)
    bad["linear/w"] = jnp.zeros((2, 1))
    bad["linear/calls"] = 1.5  # lossy: fails after w would have been assigned
    with pytest.raises(
        TypeError,
        match=r"Python float 1.5 \(dtype float64\) to variable 'linear/calls' of dtype int32",
    ):
        ps.update(m, bad)
    for k, v in ps.state(m).items():
        np.testing.assert_array_equal(v, before[k])


def test_grad_structures():
    a, b = ps.Variable(2.0, name="a"), ps.Variable(3.0, name="b")

    def fn():
        return a * a * b

    g_list = ps.grad(fn, [a, b])()
    assert isinstance(g_list, list)
    np.testing.assert_allclose(g_list, [12.0, 4.0])
    g_tuple = ps.grad(fn, (a, b))()
    assert isinstance(g_tuple, tuple)
    g_dict = ps.grad(fn, {"x": a, "y": b})()
    assert set(g_dict) == {"x", "y"} and float(g_dict["y"]) == 4.0
    g_one = ps.grad(fn, a)()
    assert float(g_one) == 12.0
    val, g = ps.value_and_grad(fn, [a])()
    assert float(val) == 12.0 and float(g[0]) == 12.0
    (val, aux), g = ps.value_and_grad(lambda: (fn(), "aux"), [b], has_aux=True)()
    assert aux == "aux" and float(g[0]) == 4.0
    m = Linear(2, 1)
    gm = ps.grad(lambda x: m(x).sum(), m)(jnp.ones((1, 2)))
    assert isinstance(gm, tuple) and len(gm) == len(m.trainable_variables)


def test_grad_matches_jax_and_applies_assigns():
    m = Linear(3, 2)
    x = jnp.arange(6.0).reshape(2, 3)
    grads = ps.grad(lambda: jnp.sum(m(x) ** 2), [m.w, m.b])()
    w, b = m.w.value(), m.b.value()
    ref = jax.grad(lambda w, b: jnp.sum((x @ w + b) ** 2), argnums=(0, 1))(w, b)
    np.testing.assert_allclose(grads[0], ref[0], rtol=1e-6)
    np.testing.assert_allclose(grads[1], ref[1], rtol=1e-6)
    counter = ps.Variable(0.0, name="seen")

    def loss():
        counter.assign_add(1.0)
        return jnp.sum(m.w.value())

    ps.grad(loss, [m.w, counter])()
    assert float(counter.numpy()) == 1.0  # assigns inside fn take effect, as in eager TF


def test_grad_with_bad_has_aux_output():
    a = ps.Variable(1.0)
    with pytest.raises(TypeError, match=r"has_aux=True needs fn to return \(value, aux\)"):
        ps.value_and_grad(lambda: a * 2, [a], has_aux=True)()


def test_manual_optax_step_through_pure_matches_handwritten():
    m = Linear(3, 1)
    x = jnp.arange(12.0).reshape(4, 3) / 10
    y = jnp.ones((4, 1))
    tx = optax.adam(1e-2)
    params = {"w": m.w.value(), "b": m.b.value()}
    opt_state = tx.init(params)

    def ref_loss(p):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    ps_opt_state = tx.init({"w": m.w.value(), "b": m.b.value()})

    @ps.function
    def step(opt_state):
        loss, g = ps.value_and_grad(lambda: jnp.mean((m(x) - y) ** 2), {"w": m.w, "b": m.b})()
        updates, opt_state = tx.update(g, opt_state)
        m.w.assign_add(updates["w"])
        m.b.assign_add(updates["b"])
        return loss, opt_state

    for _ in range(20):
        g = jax.grad(ref_loss)(params)
        upd, opt_state = tx.update(g, opt_state)
        params = optax.apply_updates(params, upd)
        _, ps_opt_state = step(ps_opt_state)
    np.testing.assert_allclose(m.w.numpy(), params["w"], atol=1e-6)
    np.testing.assert_allclose(m.b.numpy(), params["b"], atol=1e-6)
    assert step.trace_count == 1
