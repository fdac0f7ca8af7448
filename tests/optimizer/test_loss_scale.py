"""ps.LossScaleOptimizer: Keras 3's sequence of scales and applied steps (inf/nan steps
included), eagerly, in ps.function and in a lax.scan; checkpoints; bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import paramstore as ps

INF, NAN = np.inf, np.nan
# per-step gradients for a (2,) variable: finite, inf, nan, then a run of finite ones
GRADS = [
    [1.0, 2.0],
    [INF, 1.0],
    [0.5, -1.0],
    [0.25, NAN],
    [1.0, 1.0],
    [2.0, -2.0],
    [-1.0, 0.5],
    [3.0, 1.0],
    [-INF, 0.0],
    [1.0, 1.0],
]


def keras_sequence(keras, inner, grads, initial_scale, growth):
    var = keras.Variable(np.array([1.0, -1.0], np.float32))
    opt = keras.optimizers.LossScaleOptimizer(
        inner, initial_scale=initial_scale, dynamic_growth_steps=growth
    )
    out = []
    for g in grads:
        opt.apply([np.asarray(g, np.float32)], [var])
        out.append(
            (float(opt.dynamic_scale.numpy()), int(opt.iterations.numpy()), np.array(var.numpy()))
        )
    return out


def ours(make_tx, grads, initial_scale, growth, *, compiled=False):
    var = ps.Variable(np.array([1.0, -1.0], np.float32))
    opt = ps.LossScaleOptimizer(
        ps.Optimizer(make_tx(), [var]), initial_scale=initial_scale, dynamic_growth_steps=growth
    )
    apply = ps.function(lambda g: opt.apply_gradients([g])) if compiled else None
    out = []
    for g in grads:
        g = np.asarray(g, np.float32)
        if apply is not None:
            apply(g)
        else:
            opt.apply_gradients([g])
        out.append((float(opt.scale.numpy()), int(opt.iterations.numpy()), var.numpy()))
    return out, opt


def assert_same(theirs, mine):
    for i, ((s1, n1, v1), (s2, n2, v2)) in enumerate(zip(theirs, mine, strict=True)):
        assert (s1, n1) == (s2, n2), f"step {i}"
        np.testing.assert_allclose(v2, v1, rtol=1e-5, atol=1e-6, err_msg=f"step {i}")


@pytest.mark.tf
@pytest.mark.parametrize("compiled", [False, True])
def test_sgd_sequence_matches_keras(keras, compiled):
    scale = 4.0
    theirs = keras_sequence(keras, keras.optimizers.SGD(0.1), GRADS, scale, 2)
    mine, _ = ours(lambda: optax.sgd(0.1), GRADS, scale, 2, compiled=compiled)
    assert_same(theirs, mine)
    scales = [s for s, _, _ in mine]
    assert scales[:3] == [4.0, 2.0, 2.0]  # finite, halved on inf, one finite step


@pytest.mark.tf
def test_adam_sequence_matches_keras_slots_untouched_on_skips(keras):
    theirs = keras_sequence(keras, keras.optimizers.Adam(0.01), GRADS, 2.0**3, 3)
    mine, opt = ours(lambda: optax.adam(0.01), GRADS, 2.0**3, 3)
    # Keras' Adam and optax's differ in where epsilon goes only at 1e-7: same to 1e-5
    assert_same(theirs, mine)
    assert int(opt.step_counter.numpy()) == 1


def test_skipped_step_changes_no_variable_slot_or_iteration():
    var = ps.Variable(np.array([1.0, 2.0], np.float32))
    opt = ps.LossScaleOptimizer(ps.Optimizer(optax.adam(0.1), [var]), initial_scale=8.0)
    opt.apply_gradients([np.array([1.0, 1.0], np.float32)])
    inner = [v.numpy() for v in opt.inner_optimizer.variables]
    before = var.numpy()
    opt.apply_gradients([np.array([NAN, 1.0], np.float32)])
    assert all(
        np.array_equal(a, b.numpy(), equal_nan=True)
        for a, b in zip(inner, opt.inner_optimizer.variables, strict=True)
    )
    np.testing.assert_array_equal(var.numpy(), before)
    assert float(opt.scale.numpy()) == 4.0 and int(opt.step_counter.numpy()) == 0


def test_unscales_and_scale_loss():
    var = ps.Variable(np.array([3.0], np.float32))
    opt = ps.LossScaleOptimizer(ps.Optimizer(optax.sgd(1.0), [var]), initial_scale=1024.0)

    def loss():
        return opt.scale_loss(jnp.sum(var.value() ** 2))

    assert float(loss()) == 9.0 * 1024
    grads = ps.grad(loss, [var])()
    opt.apply_gradients(grads)
    np.testing.assert_allclose(var.numpy(), [3.0 - 6.0])  # the unscaled gradient


def test_in_a_lax_scan_of_steps_equals_step_by_step():
    stack = np.asarray(GRADS, np.float32)
    step_by_step, _ = ours(lambda: optax.adam(0.05), GRADS, 16.0, 2)

    var = ps.Variable(np.array([1.0, -1.0], np.float32))
    opt = ps.LossScaleOptimizer(
        ps.Optimizer(optax.adam(0.05), [var]), initial_scale=16.0, dynamic_growth_steps=2
    )

    @ps.function
    def run(gs):
        def body(carry, g):
            opt.apply_gradients([g])
            return carry, opt.scale.value()

        return jax.lax.scan(body, 0, gs)[1]

    scales = run(stack)
    assert [float(s) for s in scales] == [s for s, _, _ in step_by_step]
    np.testing.assert_allclose(var.numpy(), step_by_step[-1][2], rtol=1e-6)
    assert int(opt.iterations.numpy()) == step_by_step[-1][1]


def test_mixed_precision_training_step():
    ps.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = ps.nn.Sequential([ps.nn.Dense(8, activation="relu"), ps.nn.Dense(1)])
    finally:
        ps.mixed_precision.set_global_policy("float32")
    x = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    model(x)
    opt = ps.LossScaleOptimizer(ps.Optimizer(optax.adam(1e-2), model))

    @ps.function
    def step():
        def scaled():
            return opt.scale_loss(jnp.mean(model(x).astype(jnp.float32) ** 2))

        grads = ps.grad(scaled, model)()
        opt.apply_gradients(grads)

    first = float(jnp.mean(model(x).astype(jnp.float32) ** 2))
    for _ in range(20):
        step()
    assert float(jnp.mean(model(x).astype(jnp.float32) ** 2)) < first
    # float16 overflows at 2**15 * big gradients: some early steps were skipped
    assert int(opt.iterations.numpy()) <= 20
    assert float(opt.scale.numpy()) <= 2.0**15


def test_checkpoint_saves_scale_and_inner_state(tmp_path):
    var = ps.Variable(np.array([1.0, 2.0], np.float32), name="w")
    opt = ps.LossScaleOptimizer(ps.Optimizer(optax.adam(0.1), [var]), initial_scale=8.0)
    opt.apply_gradients([np.array([INF, 1.0], np.float32)])
    opt.apply_gradients([np.array([1.0, 1.0], np.float32)])
    ckpt = ps.Checkpoint(optimizer=opt, w=var)
    path = ckpt.save(str(tmp_path / "ckpt"))
    keys = {name for name, _, _ in ps.checkpoint.list_variables(path)}
    assert {"optimizer/scale", "optimizer/step_counter"} <= keys
    assert any(k.startswith("optimizer/inner_optimizer/") for k in keys)
    saved = (opt.scale.numpy(), opt.step_counter.numpy(), opt.iterations.numpy())
    opt.apply_gradients([np.array([NAN, 1.0], np.float32)])
    ckpt.restore(path).assert_consumed()
    assert (opt.scale.numpy(), opt.step_counter.numpy(), opt.iterations.numpy()) == saved


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((optax.adam(1e-3),), TypeError, r"wraps a ps.Optimizer, got GradientTransformation.*Wrap"),
        (("adam",), TypeError, r"wraps a ps.Optimizer, got str"),
        (("OPT", 0.0), ValueError, r"initial_scale must be a finite number > 0.*got 0.0"),
        (("OPT", -2.0), ValueError, r"initial_scale must be .*-2.0"),
        (("OPT", float("inf")), ValueError, r"initial_scale"),
        (("OPT", 8.0, 0), ValueError, r"dynamic_growth_steps must be an int in \[1, 2\*\*31\]"),
    ],
)
def test_bad_input_creates_nothing(fresh_store, args, exc, match):
    var = ps.Variable(np.ones(2, np.float32), name="w")
    inner = ps.Optimizer(optax.sgd(0.1), [var])
    before = sorted(v.name for v in fresh_store.variables())
    args = tuple(inner if a == "OPT" else a for a in args)
    with pytest.raises(exc, match=match):
        ps.LossScaleOptimizer(*args)
    assert sorted(v.name for v in fresh_store.variables()) == before
    # the default name was not consumed either
    assert ps.LossScaleOptimizer(inner).scale.name == "loss_scale_optimizer/scale"


def test_bad_gradients_change_nothing():
    var = ps.Variable(np.ones(2, np.float32))
    opt = ps.LossScaleOptimizer(ps.Optimizer(optax.sgd(0.1), [var]), initial_scale=4.0)
    with pytest.raises(ValueError):
        opt.apply_gradients([np.ones(3, np.float32)])
    assert float(opt.scale.numpy()) == 4.0 and int(opt.iterations.numpy()) == 0


def test_created_in_the_first_trace_of_a_step():
    var = ps.Variable(np.ones(2, np.float32))
    holder = {}

    @ps.function
    def step():
        if "opt" not in holder:
            holder["opt"] = ps.LossScaleOptimizer(ps.Optimizer(optax.sgd(0.1), [var]))
        opt = holder["opt"]
        grads = ps.grad(lambda: opt.scale_loss(jnp.sum(var.value() ** 2)), [var])()
        opt.apply_gradients(grads)

    step()
    step()
    np.testing.assert_allclose(var.numpy(), [0.64, 0.64], rtol=1e-5)
    assert float(holder["opt"].scale.numpy()) == 2.0**15
    assert int(holder["opt"].step_counter.numpy()) == 2
