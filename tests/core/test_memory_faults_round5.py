"""Issue 36 (items 3, 7, 9, 11, 13) and issue 38 (item 5): in-memory state that a resume,
a compiled step or a failure used to drop, refuse or leave behind. Each case is compared
with the run that has no fault (an uninterrupted run, the same step eagerly, a first try
that succeeds); each error path checks the error's type and message and that nothing
changed (no variable, no name, no value)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import paramstore as ps
from paramstore.checkpoint import CheckpointError, CheckpointManager


def _names(store: ps.VariableStore) -> list[str]:
    return sorted(v.name for v in store.variables())


# ------------------------------------------------- issue 36, item 3: resuming keeps the EMA


def _train_step(model, opt, ema):
    """The documented recipe (docs/guides/recipes.md, "Weight averaging")."""

    def train_step(x, y):
        def loss():
            return jnp.mean((model(x) - y) ** 2)

        opt.apply_gradients(zip(ps.grad(loss, model)(), model.trainable_variables))
        ema.apply(model)

    return train_step


def _run(steps: int, model, opt, ema, data) -> None:
    step = _train_step(model, opt, ema)
    for x, y in data[:steps]:
        step(x, y)


def _setup():
    model = ps.nn.Dense(2)
    model.build((None, 3))
    opt = ps.Optimizer(optax.sgd(0.1), model.trainable_variables)
    ema = ps.ExponentialMovingAverage(0.5, num_updates=opt.iterations)
    return model, opt, ema


DATA = [
    (
        np.random.default_rng(i).normal(size=(4, 3)).astype(np.float32),
        np.full((4, 2), i, np.float32),
    )
    for i in range(4)
]


@pytest.mark.parametrize("how", ["checkpoint", "manager"])
@pytest.mark.parametrize("compiled", [False, True])
def test_a_resumed_run_keeps_its_averages(tmp_path, how: str, compiled: bool) -> None:
    with ps.VariableStore():  # the run that was not stopped
        model, opt, ema = _setup()
        _run(4, model, opt, ema, DATA)
        want = {v.name: ema.average(v).numpy() for v in model.variables}
    with ps.VariableStore():  # the run stopped after 2 steps
        model, opt, ema = _setup()
        _run(2, model, opt, ema, DATA)
        ckpt = ps.Checkpoint(model=model, optimizer=opt, ema=ema)
        manager = CheckpointManager(tmp_path / "run", ckpt)
        manager.save(2)
    with ps.VariableStore() as store:  # the resumed run: restore before the first apply
        model, opt, ema = _setup()
        ckpt = ps.Checkpoint(model=model, optimizer=opt, ema=ema)
        if how == "checkpoint":
            status = ckpt.restore(CheckpointManager(tmp_path / "run", ckpt).latest_checkpoint)
        else:
            assert CheckpointManager(tmp_path / "run", ckpt).restore_latest() is not None
        if compiled:
            step = ps.function(_train_step(model, opt, ema))
            for x, y in DATA[2:]:
                step(jnp.asarray(x), jnp.asarray(y))
        else:
            _run(2, model, opt, ema, DATA[2:])
        got = {v.name: ema.average(v).numpy() for v in model.variables}
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
        assert _names(store) == sorted(
            [v.name for v in model.variables]
            + [ema.average(v).name for v in model.variables]
            + [v.name for v in opt.variables]
        )
        if how == "checkpoint":
            status.assert_consumed()  # the shadows' values count as restored


def test_a_saved_average_of_another_shape_stays_pending_and_creates_nothing(tmp_path) -> None:
    with ps.VariableStore():
        w = ps.Variable(jnp.ones(3), name="w")
        ema = ps.ExponentialMovingAverage(0.5)
        ema.apply([w])
        path = ps.Checkpoint(ema=ema).save(tmp_path / "c")  # keyed by the shadow's name
    with ps.VariableStore() as store:
        w = ps.Variable(jnp.ones(4), name="w")  # another shape
        ema = ps.ExponentialMovingAverage(0.5)
        ps.Checkpoint(ema=ema).restore(path)
        before = _names(store)
        with pytest.raises(CheckpointError, match=r"shape.*stays pending"):
            ema.apply([w])
        assert _names(store) == before
        assert ema.variables == ()
        with pytest.raises(KeyError, match="does not track variable 'w'"):
            ema.average(w)
        np.testing.assert_array_equal(w.numpy(), np.ones(4))
        assert ema.average_name(w) == "w/ExponentialMovingAverage"  # the name is still free


# ------------------------------------- issue 36, item 7: the documented recipe, compiled


def test_the_documented_ema_recipe_runs_in_a_ps_function_as_eagerly() -> None:
    results = {}
    for compiled in (False, True):
        with ps.VariableStore():
            model, opt, ema = _setup()
            train_step = _train_step(model, opt, ema)
            step = ps.function(train_step) if compiled else train_step
            for x, y in DATA:
                step(jnp.asarray(x), jnp.asarray(y))
            results[compiled] = {
                v.name: (v.numpy(), ema.average(v).numpy()) for v in model.variables
            }
            if compiled:
                assert step.trace_count == 1
    for name, (value, average) in results[False].items():
        np.testing.assert_allclose(results[True][name][0], value, rtol=1e-5)
        np.testing.assert_allclose(results[True][name][1], average, rtol=1e-5)


def test_a_variable_whose_initial_value_depends_on_the_arguments_is_still_refused() -> None:
    holder: dict[str, ps.Variable] = {}

    @ps.function
    def f(x):
        holder["v"] = ps.Variable(x * 2.0, name="v")

    with pytest.raises(ValueError, match="depends on the values of the function's arguments"):
        f(jnp.ones(3))


# ---------------------------------- issue 36, item 9: loss scaling over host-memory slots


@pytest.mark.parametrize("jit_compile", [True, False])
def test_loss_scaling_over_pinned_host_slots_steps_on_one_device(jit_compile: bool) -> None:
    runs = {}
    for kind in (None, "pinned_host"):
        with ps.VariableStore():
            w = ps.Variable(jnp.arange(3.0), name="w")
            inner = ps.Optimizer(
                optax.adam(0.1), [w], slot_memory_kind=kind, jit_compile=jit_compile
            )
            opt = ps.LossScaleOptimizer(inner, initial_scale=4.0, dynamic_growth_steps=2)
            seen = []
            for g in ([1.0, 2.0, 3.0], [1.0, np.inf, 1.0], [0.5, 0.5, 0.5], [2.0, 1.0, 0.0]):
                opt.apply_gradients([(jnp.asarray(g, jnp.float32), w)])
                seen.append(
                    (w.numpy(), float(opt.scale.numpy()), [s.numpy() for s in inner.variables])
                )
            if kind:
                kinds = [v.sharding.memory_kind for v in inner.variables if v.shape == (3,)]
                assert kinds == ["pinned_host", "pinned_host"]
            runs[kind] = seen
    for (w0, s0, slots0), (w1, s1, slots1) in zip(runs[None], runs["pinned_host"]):
        np.testing.assert_array_equal(w1, w0)
        assert s1 == s0
        for a, b in zip(slots0, slots1):
            np.testing.assert_array_equal(a, b)


# ------------------------ issue 36, item 11 and issue 38, item 5: failures take no names


def test_a_build_that_fails_on_a_deferred_restore_leaves_nothing(tmp_path) -> None:
    with ps.VariableStore():
        saved = ps.nn.Dense(2)
        saved.build((None, 3))
        path = ps.Checkpoint(model=saved).save(tmp_path / "c")
    with ps.VariableStore() as store:
        layer = ps.nn.Dense(2)
        status = ps.Checkpoint(model=layer).restore(path)
        with pytest.raises(CheckpointError, match=r"'model/kernel' with shape \(3, 2\)"):
            layer.build((None, 5))
        assert _names(store) == [] and not layer.built and layer.variables == ()
        with pytest.raises(AttributeError, match="not built yet"):
            layer.kernel  # noqa: B018
        layer.build((None, 3))  # the retry: the same names, and the saved values
        assert _names(store) == ["dense/bias", "dense/kernel"]
        np.testing.assert_array_equal(layer.kernel.numpy(), saved.kernel.numpy())
        status.assert_consumed()


@pytest.mark.parametrize("compiled", [False, True])
def test_a_build_whose_initializer_raises_leaves_nothing(compiled: bool) -> None:
    calls = []

    def flaky(shape, dtype):
        calls.append(shape)
        if len(calls) == 1:
            raise RuntimeError("initializer failed")
        return jnp.zeros(shape, dtype)

    store = ps.VariableStore()
    with store:
        layer = ps.nn.Dense(2, bias_initializer=flaky)

        def call(x):
            return layer(x)

        with pytest.raises(RuntimeError, match="initializer failed"):
            (ps.function(call) if compiled else call)(jnp.ones((1, 3)))  # kernel, then bias
        assert _names(store) == [] and not layer.built
        out = (ps.function(call) if compiled else call)(jnp.ones((1, 3)))
        assert _names(store) == ["dense/bias", "dense/kernel"]
        np.testing.assert_array_equal(out, jnp.ones((1, 3)) @ layer.kernel.numpy())


def test_enable_lora_over_saved_values_of_another_rank_leaves_nothing(tmp_path) -> None:
    with ps.VariableStore():
        saved = ps.nn.Dense(4)
        saved.build((None, 3))
        saved.enable_lora(2)
        path = ps.Checkpoint(model=saved).save(tmp_path / "c")
    with ps.VariableStore() as store:
        layer = ps.nn.Dense(4)
        layer.build((None, 3))
        ps.Checkpoint(model=layer).restore(path)
        kernel = layer.kernel.numpy()
        with pytest.raises(CheckpointError, match=r"lora_kernel_a"):
            layer.enable_lora(3)
        assert _names(store) == ["dense/bias", "dense/kernel"]
        assert not layer.lora_enabled and layer.kernel.trainable
        np.testing.assert_array_equal(layer.kernel.numpy(), kernel)
        layer.enable_lora(2)
        assert _names(store) == [
            "dense/bias",
            "dense/kernel",
            "dense/lora_kernel_a",
            "dense/lora_kernel_b",
        ]
        np.testing.assert_array_equal(layer.lora_kernel_a.numpy(), saved.lora_kernel_a.numpy())


def test_a_constructor_that_raises_takes_no_name(fresh_store) -> None:
    with pytest.raises(ValueError, match="lora_alpha"):
        ps.nn.Dense(3, lora_rank=2, lora_alpha=float("nan"))
    assert ps.nn.Dense(3).scope_name == "dense"

    class Block(ps.Module):
        def __init__(self, fail: bool) -> None:
            self.inner = ps.nn.Dense(2, name="inner")
            self.w = ps.Variable(jnp.ones(2), name="w")
            if fail:
                raise RuntimeError("bad block")

    with pytest.raises(RuntimeError, match="bad block"):
        Block(True)
    assert _names(fresh_store) == []
    block = Block(False)
    assert (block.scope_name, block.inner.scope_name, block.w.name) == (
        "block",
        "block/inner",
        "block/w",
    )
    with pytest.raises(TypeError, match="num_updates"):
        ps.ExponentialMovingAverage(0.5, num_updates="often")
    assert ps.ExponentialMovingAverage(0.5).scope_name == "ExponentialMovingAverage"


# ------------------------------------- issue 36, item 13: set_weights is all or nothing


def test_set_weights_with_an_abstract_later_layer_assigns_nothing() -> None:
    first = ps.nn.Dense(3)
    first.build((None, 2))
    second = ps.nn.Dense(2)
    with ps.abstract(), second.name_scope:
        second.build((None, 3))
    model = ps.nn.Sequential([first, second])
    model.built = True
    before = [first.kernel.numpy(), first.bias.numpy()]
    new = [np.ones((2, 3)), np.ones(3), np.ones((3, 2)), np.ones(2)]
    with pytest.raises(ValueError, match=r"abstract.*'dense_1/kernel'.*Nothing was assigned"):
        model.set_weights(new)
    np.testing.assert_array_equal(first.kernel.numpy(), before[0])
    np.testing.assert_array_equal(first.bias.numpy(), before[1])


def test_module_enable_lora_over_saved_values_of_another_rank_leaves_nothing(tmp_path) -> None:
    with ps.VariableStore():
        saved = ps.nn.Dense(4)
        saved.build((None, 3))
        saved.enable_lora(2)
        path = ps.Checkpoint(model=saved).save(tmp_path / "c")
    with ps.VariableStore() as store:
        layer = ps.nn.Dense(4)
        layer.build((None, 3))
        ps.Checkpoint(model=layer).restore(path)
        with pytest.raises(CheckpointError, match=r"lora_kernel_a"):
            ps.nn.enable_lora(layer, 3)
        assert _names(store) == ["dense/bias", "dense/kernel"] and not layer.lora_enabled
        assert ps.nn.enable_lora(layer, 2) == [layer]
        assert _names(store)[2:] == ["dense/lora_kernel_a", "dense/lora_kernel_b"]


def test_a_resumed_model_built_in_the_first_trace_gets_its_weights_and_averages(tmp_path):
    """The model itself is built in the step's first trace, after the restore: its
    variables and their shadows all take their saved values there."""
    x, y = jnp.ones((2, 3)), jnp.zeros((2, 2))

    def make():
        model = ps.nn.Dense(2)
        ema = ps.ExponentialMovingAverage(0.5)

        @ps.function
        def step(x, y):
            out = model(x)  # builds the model in the first trace
            model.kernel.assign_sub(0.1 * x.T @ (out - y))
            ema.apply(model)

        return model, ema, step

    with ps.VariableStore():
        model, ema, step = make()
        step(x, y)
        step(x, y)
        path = ps.Checkpoint(model=model, ema=ema).save(tmp_path / "c")
        step(x, y)
        want = [ema.average(model.kernel).numpy(), model.kernel.numpy()]
    with ps.VariableStore():
        model, ema, step = make()
        status = ps.Checkpoint(model=model, ema=ema).restore(path)
        step(x, y)
        np.testing.assert_allclose(ema.average(model.kernel).numpy(), want[0], rtol=1e-6)
        np.testing.assert_allclose(model.kernel.numpy(), want[1], rtol=1e-6)
        status.assert_consumed()
