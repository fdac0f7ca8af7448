"""Gradient accumulation with optax.MultiSteps through ps.Optimizer (docs/guides/recipes.md):
K micro-steps equal one step on the mean gradient, eagerly and inside ps.function."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import paramstore as ps

RNG = np.random.default_rng(0)
XS = jnp.asarray(RNG.standard_normal((4, 8, 3)).astype(np.float32))


@pytest.mark.parametrize("compiled", [False, True])
def test_multisteps_accumulates_k_micro_batches_into_one_update(compiled):
    model = ps.nn.Dense(2)
    model(XS[0])
    start = ps.state(model)
    opt = ps.Optimizer(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4), model)

    def micro(x):
        opt.apply_gradients(ps.grad(lambda: jnp.mean(model(x) ** 2), model)())

    step = ps.function(micro) if compiled else micro
    for i in range(3):
        step(XS[i])
        for name, value in ps.state(model).items():  # nothing applied before the 4th
            np.testing.assert_array_equal(value, start[name])
    step(XS[3])
    after = ps.state(model)

    ps.update(model, start)  # the reference: one sgd step on the mean of the 4 gradients
    grads = [ps.grad(lambda x=x: jnp.mean(model(x) ** 2), model)() for x in XS]
    mean = [sum(g[i] for g in grads) / 4 for i in range(len(grads[0]))]
    for v, g in zip(model.trainable_variables, mean):
        np.testing.assert_allclose(after[v.name], v.numpy() - 0.1 * np.asarray(g), rtol=1e-5)
    assert int(opt.iterations.numpy()) == 4
