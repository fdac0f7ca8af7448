"""ps.ExponentialMovingAverage against tf.train.ExponentialMovingAverage (the oracle), in
eager code, ps.function and lax.scan; swap, variables_to_restore, checkpoints, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import paramstore as ps

RNG = np.random.default_rng(0)
W0 = RNG.standard_normal((3, 4)).astype(np.float32)
DELTAS = RNG.standard_normal((6, 3, 4)).astype(np.float32)


def tf_averages(tf, decay, num_updates, zero_debias=False):
    """TF's shadow values after the same sequence: apply, then (add delta, step, apply)."""
    v = tf.Variable(W0)
    step = tf.Variable(0) if num_updates else None
    ema = tf.train.ExponentialMovingAverage(decay, num_updates=step, zero_debias=zero_debias)
    ema.apply([v])
    out = []
    for d in DELTAS:
        v.assign_add(d)
        if step is not None:
            step.assign_add(1)
        ema.apply([v])
        out.append(ema.average(v).numpy())
    return out


@pytest.mark.parametrize("how", ["eager", "function", "scan"])
@pytest.mark.parametrize(
    ("decay", "num_updates", "zero_debias"),
    [(0.9, False, False), (0.99, True, False), (0.5, True, True), (1.0, False, False)],
)
def test_shadows_equal_tensorflow(tf, how, decay, num_updates, zero_debias):
    expected = tf_averages(tf, decay, num_updates, zero_debias)
    v = ps.Variable(W0, name="w")
    step = ps.Variable(0, name="step", trainable=False) if num_updates else None
    ema = ps.ExponentialMovingAverage(decay, num_updates=step, zero_debias=zero_debias)
    ema.apply([v])

    def one(d):
        v.assign_add(d)
        if step is not None:
            step.assign_add(1)
        ema.apply([v])

    got = []
    if how == "scan":

        @ps.function
        def run(ds):
            def body(c, d):
                one(d)
                return c, ema.average(v).value()

            return jax.lax.scan(body, 0, ds)[1]

        got = list(np.asarray(run(DELTAS)))
    else:
        run = ps.function(one) if how == "function" else one
        for d in DELTAS:
            run(d)
            got.append(ema.average(v).numpy())
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)


def test_shadows_are_named_placed_and_made_like_tensorflows():
    model = ps.nn.Dense(4)
    model(jnp.ones((2, 3)))
    ema = ps.ExponentialMovingAverage(0.9)
    assert ema.average_name(model.kernel) == "dense/kernel/ExponentialMovingAverage"
    ema.apply(model)
    shadow = ema.average(model.kernel)
    assert shadow.name == "dense/kernel/ExponentialMovingAverage"
    assert not shadow.trainable and shadow.dtype == model.kernel.dtype
    assert shadow.sharding == model.kernel.sharding
    np.testing.assert_array_equal(shadow.numpy(), model.kernel.numpy())
    assert [v.name for v in ema.variables] == [
        "dense/bias/ExponentialMovingAverage",
        "dense/kernel/ExponentialMovingAverage",
    ]


def test_shadows_are_created_in_a_first_trace_and_updated_in_an_optimizer_step():
    model = ps.nn.Dense(2)
    x = jnp.ones((4, 3))
    model(x)
    opt = ps.Optimizer(optax.sgd(0.1), model)
    ema = ps.ExponentialMovingAverage(0.5, num_updates=opt.iterations)

    @ps.function
    def step():
        opt.apply_gradients(ps.grad(lambda: jnp.sum(model(x) ** 2), model)())
        ema.apply(model)

    step()  # the shadow is made from the value apply sees (the updated one), as in TF
    np.testing.assert_array_equal(ema.average(model.kernel).numpy(), model.kernel.numpy())
    k1, avg1 = model.kernel.numpy(), ema.average(model.kernel).numpy()
    step()
    d = min(0.5, 3 / 12)  # iterations is 2 when the second apply reads it
    expected = avg1 - (avg1 - model.kernel.numpy()) * np.float32(1 - d)
    np.testing.assert_allclose(ema.average(model.kernel).numpy(), expected, rtol=1e-6)
    assert not np.array_equal(k1, model.kernel.numpy())
    assert step.trace_count == 1


def test_swap_puts_the_averages_in_and_the_trained_values_back_even_on_error():
    v = ps.Variable(W0)
    ema = ps.ExponentialMovingAverage(0.9)
    ema.apply([v])
    v.assign(W0 + 1)
    ema.apply([v])
    avg = ema.average(v).numpy()
    with ema.swap([v]):
        np.testing.assert_array_equal(v.numpy(), avg)
    np.testing.assert_array_equal(v.numpy(), W0 + 1)
    with pytest.raises(RuntimeError, match="boom"), ema.swap():
        raise RuntimeError("boom")
    np.testing.assert_array_equal(v.numpy(), W0 + 1)
    np.testing.assert_array_equal(ema.average(v).numpy(), avg)


def test_variables_to_restore_lets_an_evaluation_model_restore_the_averages(tmp_path, tf):
    with ps.VariableStore():
        w = ps.Variable(W0, name="w")
        counter = ps.Variable(3, name="counter", trainable=False)
        ema = ps.ExponentialMovingAverage(0.9)
        ema.apply([w])
        w.assign(W0 * 3)
        ema.apply([w])
        avg = ema.average(w).numpy()
        path = ps.Saver().save(str(tmp_path / "ckpt"))
        names = ema.variables_to_restore()
        assert names == {"w/ExponentialMovingAverage": w, "counter": counter}
    with ps.VariableStore():  # the evaluation program: the same model, no shadows
        w2 = ps.Variable(np.zeros_like(W0), name="w")
        counter2 = ps.Variable(0, name="counter", trainable=False)
        names = ps.ExponentialMovingAverage(0.9).variables_to_restore()
        assert set(names) == {"w/ExponentialMovingAverage", "counter"}
        ps.Saver(names).restore(path)
        np.testing.assert_array_equal(w2.numpy(), avg)
        assert int(counter2.numpy()) == 3
    # TF's own mapping has the same shape
    tv = tf.Variable(W0, name="w")
    assert set(tf.train.ExponentialMovingAverage(0.9).variables_to_restore([tv])) == {
        "w/ExponentialMovingAverage"
    }


def test_shadows_are_saved_by_checkpoint_under_the_variables_paths(tmp_path):
    model = ps.nn.Dense(2)
    model(jnp.ones((1, 3)))
    ema = ps.ExponentialMovingAverage(0.9)
    ema.apply(model)
    model.kernel.assign(model.kernel + 1)
    ema.apply(model)
    avg = ema.average(model.kernel).numpy()
    path = ps.Checkpoint(model=model, ema=ema).save(str(tmp_path / "c"))
    names = [n for n, _, _ in ps.checkpoint.list_variables(path)]
    assert "ema/model/kernel/ExponentialMovingAverage" in names
    ema.average(model.kernel).assign(jnp.zeros_like(avg))
    ps.Checkpoint(model=model, ema=ema).restore(path).assert_consumed()
    np.testing.assert_array_equal(ema.average(model.kernel).numpy(), avg)


@pytest.mark.parametrize("decay", [-0.1, 1.5, float("nan")])
def test_decay_outside_0_1_is_a_value_error_and_creates_nothing(decay):
    with ps.VariableStore() as store:
        with pytest.raises(ValueError, match=r"decay must be in \[0, 1\]"):
            ps.ExponentialMovingAverage(decay)
        assert store.variables() == []
    with pytest.raises(TypeError, match="decay must be a number"):
        ps.ExponentialMovingAverage("0.9")


def test_average_of_an_untracked_variable_names_it():
    v, other = ps.Variable(1.0, name="tracked"), ps.Variable(2.0, name="other")
    ema = ps.ExponentialMovingAverage(0.9)
    ema.apply([v])
    with pytest.raises(KeyError, match=r"does not track variable 'other'.*apply"):
        ema.average(other)


def test_a_non_floating_variable_in_a_list_is_a_type_error_naming_it():
    v, n = ps.Variable(1.0, name="f"), ps.Variable(1, name="n")
    ema = ps.ExponentialMovingAverage(0.9)
    with pytest.raises(TypeError, match=r"variable 'n' has dtype int32"):
        ema.apply([v, n])
    assert ema.variables == ()
