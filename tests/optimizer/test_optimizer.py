"""ps.Optimizer: optax state in Variables, exactness against pure optax, errors."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import paramstore as ps

RNG = np.random.default_rng(0)
W0 = RNG.standard_normal((4, 3)).astype(np.float32)
B0 = RNG.standard_normal(3).astype(np.float32)
X = jnp.asarray(RNG.standard_normal((8, 4)).astype(np.float32))
Y = jnp.asarray(RNG.standard_normal((8, 3)).astype(np.float32))


def loss_fn(w, b):
    return jnp.mean((jnp.tanh(X @ w + b) - Y) ** 2)


class Dense(ps.Module):
    def __init__(self, name: str | None = None):
        self.w = ps.Variable(W0, name="w")
        self.b = ps.Variable(B0, name="b")

    def __call__(self, x):
        return jnp.tanh(x @ self.w + self.b)


def pure_optax(tx, steps: int, jit: bool = False):
    """The reference: a hand-written optax loop from the same initial values."""
    params = [jnp.asarray(W0), jnp.asarray(B0)]
    state = tx.init(params)

    def step(params, state):
        grads = jax.grad(lambda p: loss_fn(*p))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    if jit:
        step = jax.jit(step)
    for _ in range(steps):
        params, state = step(params, state)
    return params, state


def snapshot(*groups):
    return [np.array(v.numpy()) for g in groups for v in g]


def assert_unchanged(before, *groups):
    for a, b in zip(before, snapshot(*groups), strict=True):
        np.testing.assert_array_equal(a, b)


TXS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(0.01),
}


# ------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("mode", ["eager", "eager-uncompiled", "function"])
@pytest.mark.parametrize("tx_name", list(TXS))
def test_50_steps_match_pure_optax(tx_name, mode):
    want_params, want_state = pure_optax(TXS[tx_name](), 50)
    w, b = ps.Variable(W0, name="w"), ps.Variable(B0, name="b")
    opt = ps.Optimizer(TXS[tx_name](), [w, b], jit_compile=mode != "eager-uncompiled")
    grad_fn = ps.grad(lambda: loss_fn(w, b), [w, b])

    def step():
        opt.apply_gradients(grad_fn())

    if mode == "function":
        step = ps.function(step)
    for _ in range(50):
        step()
    np.testing.assert_allclose(w.numpy(), want_params[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(b.numpy(), want_params[1], rtol=1e-6, atol=1e-6)
    got_state = jax.tree_util.tree_leaves(opt.opt_state)
    for got, want in zip(got_state, jax.tree_util.tree_leaves(want_state), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert int(opt.iterations.numpy()) == 50
    if mode == "function":
        assert step.trace_count == 1


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.01)),
        lambda: optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 0.02, 5, 20), weight_decay=0.1),
        lambda: optax.chain(optax.clip(0.01), optax.sgd(optax.exponential_decay(0.1, 3, 0.5))),
        lambda: optax.multi_transform(
            {"fast": optax.adam(0.05), "slow": optax.sgd(0.01)}, ["fast", "slow"]
        ),
        lambda: optax.masked(optax.adam(0.05), [True, False]),
        lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=0.01, weight_decay=0.01),
        lambda: optax.MultiSteps(optax.adam(0.05), every_k_schedule=3),
        lambda: optax.lion(0.01),
    ],
    ids=[
        "clip+adam",
        "adamw+schedule",
        "clip+sgd+decay",
        "multi_transform",
        "masked",
        "inject",
        "multisteps",
        "lion",
    ],
)
def test_chains_schedules_and_masks_match_pure_optax(make_tx):
    want_params, _ = pure_optax(make_tx(), 12, jit=True)
    w, b = ps.Variable(W0, name="w"), ps.Variable(B0, name="b")
    opt = ps.Optimizer(make_tx(), [w, b])

    @ps.function
    def step():
        opt.apply_gradients(ps.grad(lambda: loss_fn(w, b), [w, b])())

    for _ in range(12):
        step()
    np.testing.assert_allclose(w.numpy(), want_params[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(b.numpy(), want_params[1], rtol=1e-6, atol=1e-6)
    assert step.trace_count == 1


# ---------------------------------------------------------------------- structures


def test_module_dict_tuple_and_zip_forms_agree():
    want, _ = pure_optax(optax.adam(0.01), 3)
    # a Module: grads come back as a tuple of its trainable variables
    m = Dense()
    opt = ps.Optimizer(optax.adam(0.01), m)
    for _ in range(3):
        grads = ps.grad(lambda: jnp.mean((m(X) - Y) ** 2), m)()
        assert isinstance(grads, tuple)
        opt.apply_gradients(grads)
    np.testing.assert_allclose(m.w.numpy(), want[0], rtol=1e-6, atol=1e-6)
    # a dict of variables: a dict of gradients
    with ps.VariableStore():
        d = {"kernel": ps.Variable(W0), "bias": ps.Variable(B0)}
        opt = ps.Optimizer(optax.adam(0.01), d)
        for _ in range(3):
            opt.apply_gradients(ps.grad(lambda: loss_fn(d["kernel"], d["bias"]), d)())
        np.testing.assert_allclose(d["kernel"].numpy(), want[0], rtol=1e-6, atol=1e-6)
    # a tuple, and TF's zip(grads, vars) in any order
    with ps.VariableStore():
        w, b = ps.Variable(W0), ps.Variable(B0)
        opt = ps.Optimizer(optax.adam(0.01), (w, b))
        for i in range(3):
            gw, gb = ps.grad(lambda: loss_fn(w, b), (w, b))()
            opt.apply_gradients(zip([gw, gb], [w, b]) if i % 2 else [(gb, b), (gw, w)])
        np.testing.assert_allclose(w.numpy(), want[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(b.numpy(), want[1], rtol=1e-6, atol=1e-6)


def test_zip_form_inside_function():
    w, b = ps.Variable(W0), ps.Variable(B0)
    opt = ps.Optimizer(optax.sgd(0.1), [w, b])

    @ps.function
    def step():
        grads = ps.grad(lambda: loss_fn(w, b), [w, b])()
        opt.apply_gradients(zip(grads, [w, b]))

    step()
    step()
    want, _ = pure_optax(optax.sgd(0.1), 2)
    np.testing.assert_allclose(w.numpy(), want[0], rtol=1e-6, atol=1e-6)


def test_state_variables_names_and_iterations():
    m = Dense()
    opt = ps.Optimizer(optax.adam(1e-3), m)
    names = [v.name for v in opt.variables]
    assert names == [
        "optimizer/iterations",
        "optimizer/count",
        "optimizer/dense/b/mu",
        "optimizer/dense/w/mu",
        "optimizer/dense/b/nu",
        "optimizer/dense/w/nu",
    ]
    assert opt.variables[0] is opt.iterations
    assert opt.iterations.dtype == np.int32
    assert all(not v.trainable for v in opt.variables)
    assert opt.trainable_variables == ()
    assert opt.var_list == m.trainable_variables
    # a second optimizer gets its own scope; name= picks one
    assert ps.Optimizer(optax.sgd(0.1, momentum=0.9), m).variables[1].name == (
        "optimizer_1/dense/b/trace"
    )
    assert ps.Optimizer(optax.sgd(0.1), m, name="plain").iterations.name == "plain/iterations"
    # colliding paths (two counts in a chain) keep their chain index
    chained = ps.Optimizer(optax.chain(optax.adam(1e-3), optax.scale_by_schedule(lambda c: 1.0)), m)
    assert {"0/0/count", "1/count"} <= {v.name.split("/", 1)[1] for v in chained.variables}


def test_optimizer_state_follows_a_module_that_holds_it():
    class Trainer(ps.Module):
        def __init__(self):
            self.model = Dense()
            self.opt = ps.Optimizer(optax.adam(1e-3), self.model)

    t = Trainer()
    assert len(t.variables) == 2 + 6
    assert len(t.trainable_variables) == 2
    assert all(any(v is u for u in t.variables) for v in t.opt.variables)
    names = {v.name for v in t.opt.variables}
    assert "trainer/optimizer/trainer/dense/w/mu" in names


def test_only_trainable_float_variables_are_optimized():
    w = ps.Variable(W0, name="w")
    steps = ps.Variable(0, name="steps")  # int, trainable by default as in TF
    frozen = ps.Variable(B0, trainable=False, name="frozen")
    opt = ps.Optimizer(optax.sgd(0.1), [w, steps, frozen])
    g = jnp.ones_like(w.value())
    opt.apply_gradients([g, None, jnp.ones(3)])
    np.testing.assert_allclose(w.numpy(), W0 - 0.1)
    assert int(steps.numpy()) == 0
    np.testing.assert_array_equal(frozen.numpy(), B0)
    opt.apply_gradients(zip([g], [w]))  # the zip form needs only the optimized ones
    np.testing.assert_allclose(w.numpy(), W0 - 0.2, rtol=1e-6)
    with pytest.raises(ValueError, match="nothing to optimize"):
        ps.Optimizer(optax.sgd(0.1), [steps, frozen])


def test_optimizer_built_during_the_first_trace():
    w = ps.Variable(np.ones(3, np.float32), name="w")
    built = []

    @ps.function
    def step():
        if not built:  # Keras-style: build the optimizer on the first call
            built.append(ps.Optimizer(optax.sgd(0.1, momentum=0.9), [w]))
        built[0].apply_gradients(ps.grad(lambda: jnp.sum(w**2), [w])())

    step()
    step()
    opt = built[0]
    assert [v.name for v in opt.variables] == ["optimizer/iterations", "optimizer/w/trace"]
    assert int(opt.iterations.numpy()) == 2 and step.trace_count == 1
    # 1 - 0.1 * 2, then 0.8 - 0.1 * (1.6 + 0.9 * 2)
    np.testing.assert_allclose(w.numpy(), 0.8 - 0.1 * (1.6 + 1.8), rtol=1e-6)


def test_donation_keeps_arrays_the_user_holds_valid():
    w = ps.Variable(W0)
    opt = ps.Optimizer(optax.adam(0.1), [w])
    old_w, old_mu = w.value(), opt.variables[2].value()
    for _ in range(2):
        opt.apply_gradients([jnp.ones((4, 3))])
    np.testing.assert_array_equal(old_w, W0)
    np.testing.assert_array_equal(old_mu, np.zeros((4, 3)))
    assert not np.allclose(w.numpy(), W0)


def test_pure_and_jit_over_the_optimizer_state():
    m = Dense()
    opt = ps.Optimizer(optax.adam(0.01), m)

    def step():
        loss, grads = ps.value_and_grad(lambda: jnp.mean((m(X) - Y) ** 2), m)()
        opt.apply_gradients(grads)
        return loss

    variables = [*m.variables, *opt.variables]
    f = jax.jit(ps.pure(step, variables))
    values = ps.state(variables)
    for _ in range(3):
        _, values = f(values)
    assert int(values["optimizer/iterations"]) == 3
    want, _ = pure_optax(optax.adam(0.01), 3)
    np.testing.assert_allclose(values["dense/w"], want[0], rtol=1e-6, atol=1e-6)
    assert int(opt.iterations.numpy()) == 0  # the real variables never moved


def test_extra_args_reach_tx_update():
    w = ps.Variable(W0)
    tx = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=1, factor=0.5))
    opt = ps.Optimizer(tx, [w])
    for loss in [1.0, 2.0, 3.0, 4.0]:
        opt.apply_gradients([jnp.ones((4, 3))], value=jnp.asarray(loss))
    scale = jax.tree_util.tree_leaves(opt.opt_state[1].scale)[0]
    assert float(scale) < 1.0  # the plateau was seen: the values arrived


# ----------------------------------------------------------------- hyperparameters


def test_learning_rate_changes_without_a_retrace():
    w = ps.Variable(np.ones(3, np.float32))
    opt = ps.Optimizer(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), [w])

    @ps.function
    def step():
        opt.apply_gradients([jnp.ones(3)])

    step()
    np.testing.assert_allclose(w.numpy(), 0.9, rtol=1e-6)
    assert isinstance(opt.learning_rate, ps.Variable)
    assert float(opt.learning_rate) == pytest.approx(0.1)
    opt.learning_rate = 0.5
    step()
    np.testing.assert_allclose(w.numpy(), 0.4, rtol=1e-6)
    opt.set_hyperparam("learning_rate", 0.0)
    step()
    np.testing.assert_allclose(w.numpy(), 0.4, rtol=1e-6)
    assert step.trace_count == 1
    assert set(opt.hyperparams) == {"learning_rate"}  # (momentum=None is not numeric)
    assert opt.get_hyperparam("learning_rate") is opt.learning_rate
    assert opt.learning_rate.name == "optimizer/hyperparams/learning_rate"


def test_hyperparameter_errors():
    w = ps.Variable(W0)
    plain = ps.Optimizer(optax.adam(0.1), [w])
    with pytest.raises(AttributeError, match="inject_hyperparams"):
        _ = plain.learning_rate
    with pytest.raises(KeyError, match="inject_hyperparams"):
        plain.set_hyperparam("learning_rate", 0.1)
    injected = ps.Optimizer(optax.inject_hyperparams(optax.adam)(learning_rate=0.1), [w])
    with pytest.raises(KeyError, match="no hyperparameter 'lr'.*learning_rate"):
        injected.get_hyperparam("lr")
    # two injected transformations with a learning_rate: ambiguous by short name
    b = ps.Variable(B0)
    tx = optax.multi_transform(
        {
            "a": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
            "b": optax.inject_hyperparams(optax.sgd)(learning_rate=0.2),
        },
        ["a", "b"],
    )
    multi = ps.Optimizer(tx, [w, b])
    with pytest.raises(ValueError, match="Several"):
        multi.set_hyperparam("learning_rate", 0.3)
    keys = [k for k in multi.hyperparams if k.endswith("learning_rate")]
    assert len(keys) == 2
    multi.set_hyperparam(keys[0], 0.0)
    assert float(multi.hyperparams[keys[0]]) == 0.0


# ----------------------------------------------------------------------- errors


@pytest.fixture
def trained():
    w, b = ps.Variable(W0, name="w"), ps.Variable(B0, name="b")
    opt = ps.Optimizer(optax.adam(0.01), [w, b])
    opt.apply_gradients(ps.grad(lambda: loss_fn(w, b), [w, b])())
    return w, b, opt


BAD_GRADS = {
    "too few": (lambda w, b: [jnp.ones((4, 3))], ValueError, "got 1 gradients for a list of 2"),
    "too many": (lambda w, b: [jnp.ones((4, 3)), jnp.ones(3), jnp.ones(3)], ValueError, "got 3"),
    "wrong shape": (
        lambda w, b: [jnp.ones((4, 3)), jnp.ones(4)],
        ValueError,
        r"gradient for variable 'b' has shape \(4,\), but the variable has shape \(3,\)",
    ),
    "a dict for a list": (lambda w, b: {"w": jnp.ones((4, 3))}, TypeError, "dict of gradients"),
    "None": (lambda w, b: [jnp.ones((4, 3)), None], ValueError, "no gradient.*'b'"),
    "one array": (lambda w, b: jnp.ones((4, 3)), TypeError, "structure"),
    "not owned (zip)": (
        lambda w, b: zip([jnp.ones((4, 3)), jnp.ones(3)], [w, ps.Variable(B0, name="other")]),
        ValueError,
        "variable 'other', which this optimizer does not update",
    ),
    "missing (zip)": (
        lambda w, b: zip([jnp.ones((4, 3))], [w]),
        ValueError,
        "no gradient for 1.*'b'",
    ),
    "twice (zip)": (
        lambda w, b: [(jnp.ones((4, 3)), w), (jnp.ones((4, 3)), w)],
        ValueError,
        "two gradients for variable 'w'",
    ),
    "wrong shape (zip)": (
        lambda w, b: zip([jnp.ones(3), jnp.ones((4, 3))], [w, b]),
        ValueError,
        "'w' has shape",
    ),
    "not an array": (lambda w, b: [jnp.ones((4, 3)), "abc"], TypeError, "'b'"),
}


@pytest.mark.parametrize("case", list(BAD_GRADS))
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_bad_gradients_raise_and_change_nothing(trained, case, mode):
    w, b, opt = trained
    make, exc, msg = BAD_GRADS[case]
    bad = make(w, b)
    before = snapshot([w, b], opt.variables)

    def apply():
        opt.apply_gradients(bad)

    with pytest.raises(exc, match=msg):
        (ps.function(apply) if mode == "function" else apply)()
    assert_unchanged(before, [w, b], opt.variables)
    assert int(opt.iterations.numpy()) == 1
    opt.apply_gradients([jnp.ones((4, 3)), jnp.ones(3)])  # still works afterwards
    assert int(opt.iterations.numpy()) == 2


def test_bad_dict_gradients():
    d = {"kernel": ps.Variable(W0), "bias": ps.Variable(B0)}
    opt = ps.Optimizer(optax.sgd(0.1), d)
    before = snapshot(d.values(), opt.variables)
    with pytest.raises(ValueError, match=r"missing \['bias'\], unexpected \['b'\]"):
        opt.apply_gradients({"kernel": jnp.ones((4, 3)), "b": jnp.ones(3)})
    with pytest.raises(TypeError, match="pass a dict with the same keys"):
        opt.apply_gradients([jnp.ones((4, 3)), jnp.ones(3)])
    assert_unchanged(before, d.values(), opt.variables)


def test_module_that_grew_after_the_optimizer():
    m = Dense()
    opt = ps.Optimizer(optax.sgd(0.1), m)
    m.extra = ps.Variable(1.0)
    grads = ps.grad(lambda: jnp.sum(m(X)) * m.extra, m)()
    with pytest.raises(ValueError, match="create it after the model's variables exist"):
        opt.apply_gradients(grads)


def test_bad_constructor_arguments():
    w = ps.Variable(W0)
    with pytest.raises(TypeError, match=r"Did you mean adam\(learning_rate\)"):
        ps.Optimizer(optax.adam, [w])
    with pytest.raises(TypeError, match="in that order"):
        ps.Optimizer([w], optax.adam(0.1))
    with pytest.raises(TypeError, match=r"wrap it in a list"):
        ps.Optimizer(optax.adam(0.1), w)
    with pytest.raises(TypeError, match=r"got a int \(3\) at \[1\]"):
        ps.Optimizer(optax.adam(0.1), [w, 3])
    with pytest.raises(ValueError, match="given twice"):
        ps.Optimizer(optax.adam(0.1), [w, w])
    with pytest.raises(ValueError, match="at least one"):
        ps.Optimizer(optax.adam(0.1), [])
    with pytest.raises(ValueError, match="no trainable variables"):
        ps.Optimizer(optax.adam(0.1), ps.Module())


# -------------------------------------------------------------------- checkpoints


@pytest.mark.skipif(
    importlib.util.find_spec("paramstore.checkpoint") is None, reason="needs paramstore.checkpoint"
)
def test_optimizer_state_checkpoints_and_training_resumes_exactly(tmp_path):
    from paramstore.checkpoint import Saver

    m = Dense()
    opt = ps.Optimizer(optax.adam(0.05), m)

    @ps.function
    def step():
        opt.apply_gradients(ps.grad(lambda: jnp.mean((m(X) - Y) ** 2), m)())

    for _ in range(3):
        step()
    path = Saver([*m.variables, *opt.variables]).save(tmp_path / "ckpt")
    for _ in range(3):
        step()
    want = snapshot(m.variables, opt.variables)
    with ps.VariableStore():  # a new process, in effect: same names, fresh values
        m2 = Dense()
        opt2 = ps.Optimizer(optax.adam(0.05), m2)
        Saver([*m2.variables, *opt2.variables]).restore(path)
        assert int(opt2.iterations.numpy()) == 3

        @ps.function
        def step2():
            opt2.apply_gradients(ps.grad(lambda: jnp.mean((m2(X) - Y) ** 2), m2)())

        for _ in range(3):
            step2()
        for a, b in zip(want, snapshot(m2.variables, opt2.variables), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------- masks and labels by name


class Net(ps.Module):
    def __init__(self, name: str | None = None):
        self.dense = ps.nn.Dense(3)
        self.dense(X)  # built: dense/kernel (4, 3), dense/bias (3,)


def test_module_params_reach_optax_keyed_by_name():
    m = Net()
    seen = []

    def mask(params):
        seen.append(sorted(params))
        return {k: not k.endswith("bias") for k in params}

    m.dense.bias.assign(B0)
    m.dense.kernel.assign(W0)
    opt = ps.Optimizer(optax.adamw(0.0, weight_decay=0.5, mask=mask), m)
    opt.apply_gradients([jnp.zeros(3), jnp.zeros((4, 3))])  # a tuple, in module order
    assert seen[0] == ["net/dense/bias", "net/dense/kernel"]
    # learning rate 0: only decay could move them, and the mask keeps it off the bias
    np.testing.assert_array_equal(m.dense.bias.numpy(), B0)
    np.testing.assert_allclose(m.dense.kernel.numpy(), W0, rtol=1e-6)
    # with a real learning rate the kernel decays, the bias does not
    opt2 = ps.Optimizer(
        optax.adamw(0.1, weight_decay=0.5, mask=ps.Optimizer.by_name(lambda n: "kernel" in n)), m
    )
    zeros = {"net/dense/bias": jnp.zeros(3), "net/dense/kernel": jnp.zeros((4, 3))}
    opt2.apply_gradients(zeros)  # a dict keyed by names works for a Module too
    np.testing.assert_array_equal(m.dense.bias.numpy(), B0)
    np.testing.assert_allclose(m.dense.kernel.numpy(), W0 * (1 - 0.1 * 0.5), rtol=1e-6)
    names = {v.name for v in opt2.variables}
    assert {"optimizer_1/net/dense/kernel/mu", "optimizer_1/net/dense/bias/nu"} <= names


def test_multi_transform_labels_by_name_inside_function():
    m = Net()
    labels = ps.Optimizer.by_name(lambda n: "frozen" if n.endswith("bias") else "train")
    opt = ps.Optimizer(
        optax.multi_transform({"train": optax.sgd(0.1), "frozen": optax.set_to_zero()}, labels), m
    )
    bias0 = m.dense.bias.numpy()

    @ps.function
    def step():
        opt.apply_gradients(ps.grad(lambda: jnp.mean((m.dense(X) - Y) ** 2), m)())

    kernel0 = m.dense.kernel.numpy()
    step()
    step()
    np.testing.assert_array_equal(m.dense.bias.numpy(), bias0)
    assert not np.allclose(m.dense.kernel.numpy(), kernel0)
    with pytest.raises(TypeError, match="keyed by name"):
        ps.Optimizer(optax.adamw(0.1, mask=labels), [m.dense.kernel])


# ------------------------------------------------------------------ more bad input


def test_name_that_is_not_a_string_creates_nothing():
    w = ps.Variable(W0, name="w")
    with pytest.raises(TypeError, match="name must be a str.*int 3"):
        ps.Optimizer(optax.adam(0.1), [w], name=3)  # type: ignore[arg-type]
    opt = ps.Optimizer(optax.adam(0.1), [w])
    assert opt.iterations.name == "optimizer/iterations"  # no scope was taken by the failure


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_complex_gradient_for_a_real_variable_raises_and_changes_nothing(trained, mode):
    w, b, opt = trained
    before = snapshot([w, b], opt.variables)
    bad = [jnp.ones((4, 3), jnp.complex64), jnp.ones(3)]

    def apply():
        opt.apply_gradients(bad)

    with pytest.raises(
        TypeError, match=r"gradient for variable 'w' is complex \(complex64\).*real \(float32\)"
    ):
        (ps.function(apply) if mode == "function" else apply)()
    assert_unchanged(before, [w, b], opt.variables)
    # a complex variable takes complex gradients
    z = ps.Variable(np.ones(2, np.complex64), name="z")
    zopt = ps.Optimizer(optax.sgd(0.5), [z])
    zopt.apply_gradients([jnp.asarray([1j, 2.0], jnp.complex64)])
    np.testing.assert_allclose(z.numpy(), [1 - 0.5j, 0.0])
