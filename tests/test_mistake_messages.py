"""Common mistakes of a Keras user (issue 27's C/D-graded messages): each error's type and
words (what went wrong and the fix), and that nothing changed; a traced `training` flag
works in Dropout and BatchNormalization."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paramstore as ps

X = np.ones((4, 3), np.float32)


def _built_dense():
    model = ps.nn.Dense(2)
    model(X)
    return model


def test_jax_jit_of_a_module_says_ps_function_or_ps_state():
    model = _built_dense()
    before = model.kernel.numpy()
    with pytest.raises(
        ValueError,
        match=r"Dense 'dense' was passed as an argument .*ps\.function.*ps\.state\(model\)",
    ):
        jax.jit(lambda m, x: m(x))(model, X)
    np.testing.assert_array_equal(model.kernel.numpy(), before)
    # what the message says works
    np.testing.assert_allclose(ps.function(lambda m, x: m(x))(model, X), model(X))
    pure = ps.pure(lambda x: model(x), model)
    out, _ = jax.jit(pure)(ps.state(model), X)
    np.testing.assert_allclose(out, model(X))


def test_traced_training_flag_in_dropout_and_batch_norm():
    model = ps.nn.Sequential([ps.nn.Dense(3), ps.nn.BatchNormalization(), ps.nn.Dropout(0.5)])
    step = ps.function(lambda x, training: model(x, training=training))
    x = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    bn = model.layers[1]
    eval_out = step(x, False)
    np.testing.assert_array_equal(bn.moving_mean.numpy(), np.zeros(3))
    np.testing.assert_allclose(eval_out, model(x, training=False), rtol=1e-6)
    train_out = step(x, True)
    assert step.trace_count == 1  # one program for both values
    assert not np.allclose(bn.moving_mean.numpy(), 0)
    assert np.mean(np.asarray(train_out) == 0) > 0.2  # dropout applied


def test_traced_training_in_a_custom_module_says_static_argnames():
    class Net(ps.Module):
        def __call__(self, x, training=None):
            return x * 2 if training else x

    net = Net()
    step = ps.function(lambda x, training: net(x, training=training))
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        step(X, True)
    note = "\n".join(info.value.__notes__)
    assert 'static_argnames=("training",)' in note and "jnp.where" in note
    static = ps.function(
        lambda x, training: net(x, training=training), static_argnames=("training",)
    )
    np.testing.assert_array_equal(static(X, training=True), X * 2)


def test_float_of_a_variable_in_a_function_names_the_users_function():
    v = ps.Variable(1.0)

    @ps.function
    def positive():
        if float(v) > 0:
            return 1
        return 0

    with pytest.raises(jax.errors.ConcretizationTypeError) as info:
        positive()
    assert "function positive at" in str(info.value)
    assert "function flat" not in str(info.value)
    assert "jnp.where or jax.lax.cond" in "\n".join(info.value.__notes__)
    assert float(v) == 1.0


@pytest.mark.parametrize("fn,words", [(ps.value_and_grad, "loss, grads"), (ps.grad, "grads")])
def test_gradient_function_unpacked_without_calling_it(fn, words):
    model = _built_dense()
    with pytest.raises(
        TypeError, match=rf"returns a function, which cannot be unpacked.*{words} = "
    ):
        loss, grads = fn(lambda: jnp.sum(model(X)), model)
    loss, grads = ps.value_and_grad(lambda: jnp.sum(model(X)), model)()
    assert len(grads) == 2 and float(loss) == float(jnp.sum(model(X)))


def test_checkpoint_with_a_positional_object_says_keywords():
    model = _built_dense()
    with pytest.raises(
        TypeError, match=r"ps.Checkpoint takes its objects as keywords.*Checkpoint\(model=model\)"
    ):
        ps.Checkpoint(model)


def test_restoring_a_saver_file_with_checkpoint_says_use_saver(tmp_path):
    model = _built_dense()
    path = ps.Saver(model).save(str(tmp_path / "saver"))
    model.kernel.assign(np.zeros((3, 2), np.float32))
    status = ps.Checkpoint(model=model).restore(path)
    for check in (status.assert_consumed, status.expect_partial().assert_existing_objects_matched):
        with pytest.raises(
            ps.checkpoint.CheckpointError,
            match=r"expect_partial\(\) would not help.*ps.Saver\(model\).restore\(path\)",
        ):
            check()
    np.testing.assert_array_equal(model.kernel.numpy(), np.zeros((3, 2)))
    ps.Saver(model).restore(path)  # what the message says works
    assert np.any(model.kernel.numpy() != 0)
