"""Freezing (``trainable = False``), the ``training=`` flag, class filters and ps.grad over an
unbuilt model (docs/api.md, "Freezing and the ``training`` flag")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import paramstore as ps

X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32))


def two_layers():
    model = ps.nn.Sequential([ps.nn.Dense(5, name="body"), ps.nn.Dense(2, name="head")])
    model(X)
    return model


def loss(model):
    return jnp.sum(model(X) ** 2)


def snapshot(variables):
    return [np.array(v.numpy()) for v in variables]


def unchanged(before, variables):
    return [np.array_equal(b, v.numpy()) for b, v in zip(before, variables)]


def test_module_freeze_hides_its_variables_everywhere_and_unfreeze_restores():
    model = two_layers()
    body = model.layers[0]
    body.trainable = False
    assert not body.trainable and body.trainable_variables == ()
    assert [v.name for v in model.trainable_variables] == ["head/bias", "head/kernel"]
    assert sorted(ps.state(model, where=ps.trainable)) == ["head/bias", "head/kernel"]
    assert sorted(ps.state(model, where=ps.non_trainable)) == ["body/bias", "body/kernel"]
    grads = ps.grad(lambda: loss(model), model)()
    assert len(grads) == 2  # the frozen layer's variables get no gradient
    assert all(not v.trainable for v in body.variables)
    body.trainable = True
    assert len(model.trainable_variables) == 4
    assert all(v.trainable for v in body.variables)


def test_unfreeze_keeps_variables_that_were_created_non_trainable():
    bn = ps.nn.BatchNormalization()
    bn(X, training=True)
    bn.trainable = False
    assert bn.trainable_variables == ()
    bn.trainable = True
    assert [v.name.split("/")[-1] for v in bn.trainable_variables] == ["beta", "gamma"]
    assert not bn.moving_mean.trainable


def test_a_variable_frozen_by_itself_stays_frozen_when_its_module_is_unfrozen():
    model = two_layers()
    kernel = model.layers[0].kernel
    kernel.trainable = False
    model.trainable = False
    model.trainable = True
    assert not kernel.trainable
    kernel.trainable = True
    assert kernel.trainable


def test_a_layer_frozen_before_it_is_built_builds_frozen_variables():
    dense = ps.nn.Dense(3)
    dense.trainable = False
    dense(X)
    assert dense.variables and dense.trainable_variables == ()


@pytest.mark.parametrize("compiled", [False, True])
def test_an_optimizer_built_before_the_freeze_changes_neither_variables_nor_slots(compiled):
    model = two_layers()
    opt = ps.Optimizer(optax.adam(0.1), model)

    def step():
        g = ps.grad(lambda: loss(model), model)()
        opt.apply_gradients(g)

    run = ps.function(step) if compiled else step
    run()
    body = model.layers[0]
    body.trainable = False
    frozen_slots = [v for v in opt.variables if "/body/" in v.name]
    other_slots = [v for v in opt.variables if "/head/" in v.name]
    before, slots, others = snapshot(body.variables), snapshot(frozen_slots), snapshot(other_slots)
    head = snapshot(model.layers[1].variables)
    run()
    assert all(unchanged(before, body.variables))
    assert all(unchanged(slots, frozen_slots))
    assert not any(unchanged(others, other_slots))
    assert not any(unchanged(head, model.layers[1].variables))
    body.trainable = True  # unfreezing: trained again
    run()
    assert not any(unchanged(before, body.variables))
    if compiled:
        assert run.trace_count == 3  # a freeze and an unfreeze each retrace, once


def test_a_freeze_between_calls_of_a_function_takes_effect_and_only_retraces_when_seen():
    model = two_layers()
    opt = ps.Optimizer(optax.sgd(0.1), model)

    @ps.function
    def step(x):
        g = ps.grad(lambda: jnp.sum(model(x) ** 2), model)()
        opt.apply_gradients(g)

    step(X)
    other = ps.Variable(1.0)
    other.trainable = False  # a flag the trace never saw: no retrace
    step(X)
    assert step.trace_count == 1
    model.layers[0].kernel.trainable = False  # a flag it saw
    before = model.layers[0].kernel.numpy()
    step(X)
    assert step.trace_count == 2
    np.testing.assert_array_equal(before, model.layers[0].kernel.numpy())


def test_a_fused_scan_of_steps_leaves_frozen_variables_and_slots_alone():
    model = two_layers()
    opt = ps.Optimizer(optax.adam(0.1), model)
    model.layers[0].trainable = False
    frozen = [*model.layers[0].variables, *(v for v in opt.variables if "/body/" in v.name)]
    before = snapshot(frozen)

    @ps.function
    def steps(xs):
        def body(carry, x):
            g = ps.grad(lambda: jnp.sum(model(x) ** 2), model)()
            opt.apply_gradients(g)
            return carry, None

        jax.lax.scan(body, 0, xs)

    steps(jnp.stack([X, X, X]))
    assert all(unchanged(before, frozen))
    assert int(opt.iterations.numpy()) == 3


def test_the_compiled_step_does_no_slot_work_for_frozen_variables():
    model = two_layers()
    opt = ps.Optimizer(optax.adam(0.1), model)

    @ps.function
    def step(x):
        g = ps.grad(lambda: jnp.sum(model(x) ** 2), model)()
        opt.apply_gradients(g)

    def sqrt_ops():  # adam's per-parameter sqrt: one per optimized variable
        return step.lower(X).compile().as_text().count(" sqrt(")

    full = sqrt_ops()
    model.layers[0].trainable = False
    assert full == 4 and sqrt_ops() == 2


def test_trainable_must_be_a_bool_and_a_bad_one_changes_nothing():
    model = two_layers()
    with pytest.raises(TypeError, match=r"Dense 'body'.*trainable must be a bool.*str 'no'"):
        model.layers[0].trainable = "no"
    with pytest.raises(TypeError, match=r"Variable 'body/kernel'.*trainable must be a bool.*int 0"):
        model.layers[0].kernel.trainable = 0
    assert len(model.trainable_variables) == 4 and model.layers[0].trainable


@pytest.mark.parametrize("bad", ["false", "eval", 1, 0.0, jnp.ones(2, bool), jnp.int32(1)])
@pytest.mark.parametrize("make", [lambda: ps.nn.Dropout(0.5), ps.nn.BatchNormalization])
def test_training_must_be_a_bool(make, bad):
    layer = make()
    layer(X)
    before = snapshot(layer.variables)
    with pytest.raises(TypeError, match=r"(Dropout|BatchNormalization) '.*': training must be"):
        layer(X, training=bad)
    assert all(unchanged(before, layer.variables))


def test_training_is_refused_by_a_layer_that_does_not_support_a_traced_flag():
    block = ps.nn.Repeat(lambda: ps.nn.Dropout(0.5), 2)
    with pytest.raises(TypeError, match=r"Repeat '.*': training must be True, False or None, got"):
        block(X, training=jnp.bool_(True))


def test_a_traced_training_flag_switches_dropout_and_batch_normalization():
    model = ps.nn.Sequential([ps.nn.BatchNormalization(), ps.nn.Dropout(0.5)])
    model(X)

    @ps.function
    def run(x, training):
        return model(x, training=training)

    np.testing.assert_allclose(run(X, jnp.bool_(False)), model(X, training=False), rtol=1e-6)
    mean = model.layers[0].moving_mean.numpy()
    out = run(X, jnp.bool_(True))
    assert (np.asarray(out) == 0).any()  # dropped
    assert not np.array_equal(mean, model.layers[0].moving_mean.numpy())  # statistics moved
    assert run.trace_count == 1


def test_a_frozen_batch_normalization_runs_in_inference_mode_as_keras():
    bn = ps.nn.BatchNormalization()
    bn(X)
    bn.trainable = False
    mean = bn.moving_mean.numpy()
    np.testing.assert_allclose(bn(X, training=True), bn(X, training=False))
    np.testing.assert_array_equal(mean, bn.moving_mean.numpy())


def test_where_takes_module_and_variable_classes():
    class Special(ps.Variable):
        __slots__ = ()

    model = ps.nn.Sequential([ps.nn.Dense(5), ps.nn.LayerNormalization(), ps.nn.Dense(2)])
    model(X)
    dense = ps.state(model, where=ps.nn.Dense)
    assert sorted(dense) == ["dense/bias", "dense/kernel", "dense_1/bias", "dense_1/kernel"]
    grads = ps.grad(lambda: loss(model), model, where=ps.nn.LayerNormalization)()
    assert len(grads) == 2
    s = Special(1.0, name="s")
    assert list(ps.state([s, ps.Variable(2.0, name="p")], where=Special)) == ["s"]
    assert len(ps.state(model, where=ps.Variable)) == 6


@pytest.mark.parametrize("where", [int, 3.5, object()])
def test_where_of_another_kind_says_what_it_accepts(where):
    model = two_layers()
    with pytest.raises(TypeError, match=r"where must be a callable.*Module subclass.*Variable"):
        ps.state(model, where=where)


@pytest.mark.parametrize("grad", [ps.grad, ps.value_and_grad])
def test_grad_over_an_unbuilt_model_says_to_build_it(grad):
    model = ps.nn.Dense(3)
    f = grad(lambda: jnp.sum(model(X)), model)
    with pytest.raises(ValueError, match=r"Module 'dense' has no variables yet.*build"):
        f()
    assert model.variables == ()
    with pytest.raises(ValueError, match="no variables yet"):
        grad(lambda: jnp.sum(model(X)), [model])()
    model(X)
    assert len(f()) == 2 if grad is ps.grad else len(f()[1]) == 2


@pytest.mark.parametrize("form", ["list", "zip", "dict", "nested"])
def test_every_gradient_form_works_while_a_variable_is_frozen(form):
    a, b = ps.Variable([1.0, 2.0], name="a"), ps.Variable([3.0], name="b")
    model = two_layers()
    collection = {
        "list": [a, b],
        "zip": [a, b],
        "dict": {"a": a, "b": b},
        "nested": [[a, b], model],
    }[form]
    opt = ps.Optimizer(optax.sgd(1.0), collection)
    a.trainable = False
    model.layers[0].trainable = False
    grads = ps.grad(lambda: jnp.sum(a**2) + jnp.sum(b**2) + loss(model), collection)()
    if form == "zip":
        grads = zip(grads, [a, b])
    before_a, before_body = a.numpy(), snapshot(model.layers[0].variables)
    opt.apply_gradients(grads)
    np.testing.assert_array_equal(a.numpy(), before_a)  # frozen: its gradient ignored
    np.testing.assert_array_equal(b.numpy(), [-3.0])
    assert all(unchanged(before_body, model.layers[0].variables))
