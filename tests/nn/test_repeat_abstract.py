"""``ps.nn.Repeat`` inside ``with ps.abstract():``: an abstract build (the template block only
traced, the stacked variables abstract), ``ps.initialize`` and checkpoint restores making them
concrete with a concrete build's values, training afterwards, and the errors.

In-process tests use one device; the checks with a mesh of 8 forced CPU devices (layouts,
axis rules, sharded initialization and restore) run in this file's subprocess
(``python tests/nn/test_repeat_abstract.py OUT.json``, as ``tests/sharding/test_layout.py``)."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the multi-device subprocess: before jax is imported
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _backends import ROUNDING, assert_same_numbers, float32_matmuls
from _multidevice import init_programs, multi_device_tests, run_checks
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import paramstore as ps
from paramstore._core.jax_api import Tracer

D = 8
ABSTRACT = r"Variable '{}' is abstract .* restore a checkpoint .* ps\.initialize"


class Block(ps.Module):
    """A pre-norm residual MLP block: lazy layers, one input shape kept."""

    def __init__(self, name=None, up_partition=None, down_partition=None):
        self.ln = ps.nn.LayerNormalization()
        self.up = ps.nn.Dense(2 * D, kernel_partition=up_partition)
        self.down = ps.nn.Dense(D, kernel_partition=down_partition)

    def __call__(self, x, training=None):
        return x + self.down(jax.nn.gelu(self.up(self.ln(x))))


class Transformer(Block):
    """A pre-norm transformer block (attention, then the MLP)."""

    def __init__(self, name=None):
        super().__init__(name=name)
        self.attn = ps.nn.MultiHeadAttention(2, 4)

    def __call__(self, x, training=None):
        h = self.ln(x)
        return super().__call__(x + self.attn(h, h))


class Stateful(ps.Module):
    """Every kind of template variable: initializers, moving statistics (assigned in the
    scan), a concrete initial value, a generator drawn from even with training=False."""

    def __init__(self, name=None):
        self.bn = ps.nn.BatchNormalization()
        self.gen = ps.random.Generator(3)
        self.scale = ps.Variable(np.linspace(0.5, 1.5, D, dtype=np.float32), name="scale")

    def __call__(self, x, training=None):
        noise = 1e-3 * jax.random.normal(self.gen.key(), x.shape)
        return self.bn(x, training=training) * self.scale + noise


def _model(make_block=Block, n=3):
    return ps.nn.Sequential([ps.nn.Dense(D), ps.nn.Repeat(make_block, n), ps.nn.Dense(4)])


def _x(shape=(2, 5, 6), seed=1):
    return jax.random.normal(jax.random.key(seed), shape)


def _concrete(make=_model, shape=(None, 5, 6)):
    """A concrete build in a fresh store (seed 0): the model, its values, shapes, dtypes."""
    ps.random.set_seed(0)
    with ps.VariableStore():
        model = make()
        model.build(shape)
    return model, {v.name: (v.numpy(), v.shape, v.dtype, v.trainable) for v in model.variables}


def _abstract_model(make=_model, shape=(None, 5, 6)):
    with ps.abstract():
        model = make()
        model.build(shape)
    return model


def _step(model, opt):
    @ps.function
    def step(x, y):
        loss, grads = ps.value_and_grad(
            lambda: jnp.mean((model(x, training=True) - y) ** 2), model
        )()
        opt.apply_gradients(grads)
        return loss

    return step


def _values(*objects):
    return {v.name: v.numpy() for o in objects for v in o.variables}


# =============================================================== building abstractly


@pytest.mark.slow  # the concrete transformer build runs its initializers eagerly (~10 s)
def test_abstract_build_gives_the_concrete_builds_names_shapes_dtypes_and_allocates_nothing(
    fresh_store,
):
    def make():
        return _model(Transformer)

    _, want = _concrete(make)
    before = jax.live_arrays()  # held, so none is collected and its id reused meanwhile
    held = {id(a) for a in before}
    model = _abstract_model(make)
    assert [a.shape for a in jax.live_arrays() if id(a) not in held] == []
    got = {v.name: (v.shape, v.dtype, v.trainable) for v in model.variables}
    assert got == {k: w[1:] for k, w in want.items()}
    assert all(v.is_abstract for v in model.variables)
    repeat = model.layers[1]
    assert repeat.built and repeat.stacked["up/kernel"].shape == (3, D, 2 * D)
    assert repeat.stacked["attn/weights/query/kernel"].is_abstract
    # the template block is abstract too: nothing of it was ever computed
    assert repeat._template.tvars and all(v.is_abstract for v in repeat._template.tvars)
    assert sorted(v.name for v in fresh_store.variables()) == sorted(want)


def test_repeat_build_alone_and_a_first_block_made_outside_abstract():
    ps.random.set_seed(0)
    with ps.VariableStore():
        concrete = ps.nn.Repeat(Block, 2)
        concrete.build((None, 5, D))
        want = _values(concrete)
    ps.random.set_seed(0)
    with ps.VariableStore():
        made_outside = ps.nn.Repeat(Block, 2)  # its template's lazy layers are built abstract
        with ps.abstract():
            made_outside.build((None, 5, D))
        assert all(v.is_abstract for v in made_outside.variables)
        ps.initialize(made_outside)
        assert _values(made_outside).keys() == want.keys()
        for name, value in _values(made_outside).items():
            np.testing.assert_array_equal(value, want[name])
    ps.random.set_seed(0)
    with ps.VariableStore():
        with ps.abstract():
            made_inside = ps.nn.Repeat(Block, 2)
        made_inside.build((None, 5, D))  # built concretely: its initializers run for real
        assert not any(v.is_abstract for v in made_inside.variables)
        for name, value in _values(made_inside).items():
            np.testing.assert_array_equal(value, want[name])


def test_a_huge_repeat_builds_abstractly_without_running_an_initializer_on_values():
    """48 blocks of a 4096x4096 float32 kernel: 3 GiB stacked, 64 MiB per block; the
    initializer is only traced (each call sees tracers), nothing is allocated."""
    calls = []

    def init(shape, dtype=jnp.float32):
        out = jax.random.normal(ps.random.next_key(), shape, dtype)
        calls.append(isinstance(out, Tracer))
        return out

    class Big(ps.Module):
        def __init__(self, name=None):
            self.mlp = ps.nn.Dense(4096, use_bias=False, kernel_initializer=init)

        def __call__(self, x):
            return x + self.mlp(x)

    before = jax.live_arrays()  # held, so none is collected and its id reused meanwhile
    held = {id(a) for a in before}
    with ps.abstract():
        r = ps.nn.Repeat(Big, 48)
        r.build((None, 4096))
    kernel = r.stacked["mlp/kernel"]
    assert kernel.is_abstract and kernel.shape == (48, 4096, 4096) and kernel.dtype == np.float32
    assert calls and all(calls)  # traced for shapes only, never run on values
    assert [a.shape for a in jax.live_arrays() if id(a) not in held] == []


def test_nested_repeats_build_abstractly_and_initialize_to_the_concrete_values():
    def make():
        return ps.nn.Repeat(lambda: ps.nn.Repeat(lambda: ps.nn.Dense(D), 2), 3)

    _, want = _concrete(make, (None, 5, D))
    got = _abstract_model(make, (None, 5, D))
    assert {v.name: v.shape for v in got.variables} == {k: w[1] for k, w in want.items()}
    assert got.variables[0].shape[:2] == (3, 2)
    ps.initialize(got)
    for name, value in _values(got).items():  # bit-equal on CPU (_backends)
        assert_same_numbers(value, want[name][0], **ROUNDING, err_msg=name)


# ======================================================= initialize, restore, train


def _two_repeats():
    """Both kinds of block: initializers only, and every other kind of variable."""
    return ps.nn.Sequential(
        [ps.nn.Dense(D), ps.nn.Repeat(Block, 2), ps.nn.Repeat(Stateful, 2), ps.nn.Dense(4)]
    )


@pytest.mark.slow
def test_initialize_gives_the_concrete_builds_values_and_a_call_matches():
    concrete, want = _concrete(_two_repeats)
    ps.random.set_seed(0)
    with ps.VariableStore(), float32_matmuls():
        model = _abstract_model(_two_repeats)
        done = ps.initialize(model)
        assert {v.name for v in done} == set(want)
        for v in model.variables:  # one compiled program against eager builds
            assert not v.is_abstract
            assert_same_numbers(v.numpy(), want[v.name][0], **ROUNDING, err_msg=v.name)
        x = _x()
        # moving statistics and generator states assigned per layer, as the concrete model's
        y_model = model(x, training=True)
        np.testing.assert_allclose(y_model, concrete(x, training=True), rtol=1e-6, atol=1e-6)
        for name, value in _values(model).items():
            np.testing.assert_allclose(
                value, _values(concrete)[name], rtol=1e-6, atol=1e-6, err_msg=name
            )


def _abstract_trained(tmp_path, how):
    ps.random.set_seed(0)
    with ps.abstract():
        model = _model(n=2)
        model.build((None, 5, 6))
        opt = ps.Optimizer(optax.adam(1e-2), model, name="adam")
    assert all(v.is_abstract for v in [*model.variables, *opt.variables])
    mu = [v for v in opt.variables if v.name.endswith("repeat/block/dense/kernel/mu")]
    assert len(mu) == 1 and mu[0].shape == (2, D, 2 * D)  # slots stacked like their params
    if how == "initialize":
        ps.initialize([model, opt])
    elif how == "checkpoint":
        ps.Checkpoint(model=model, optimizer=opt).restore(str(tmp_path / "ckpt")).assert_consumed()
    else:
        ps.Saver([*model.variables, *opt.variables]).restore(tmp_path / "sharded")
    assert not any(v.is_abstract for v in [*model.variables, *opt.variables])
    return model, opt


@pytest.mark.slow  # three compiled training steps (~15 s)
def test_initialize_or_restore_then_a_training_step_equals_the_concrete_models(tmp_path):
    """An optimizer made over the abstract model: ``ps.initialize([model, opt])`` gives a new
    concrete model's state, a restore the saved one; a step then matches the concrete one."""
    x, y = _x(), _x((2, 5, 4), seed=2)
    ps.random.set_seed(0)
    with ps.VariableStore(), float32_matmuls():
        model = _model(n=2)
        model.build((None, 5, 6))
        opt = ps.Optimizer(optax.adam(1e-2), model, name="adam")
        step = _step(model, opt)
        first = _values(model, opt)
        losses = [step(x, y)]  # moments and count not zero
        after = [_values(model, opt)]
        ps.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
        ps.Saver([*model.variables, *opt.variables], sharded=True).save(tmp_path / "sharded")
        losses.append(step(x, y))
        after.append(_values(model, opt))
    for how, start in (("initialize", 0), ("checkpoint", 1), ("sharded_saver", 1)):
        with ps.VariableStore(), float32_matmuls():
            model2, opt2 = _abstract_trained(tmp_path, how)
            got = _values(model2, opt2)
            assert got.keys() == first.keys(), how
            for name, value in got.items():
                want = [first, *after][start][name]
                if how == "initialize":  # compiled against eager: bit-equal on CPU (_backends)
                    assert_same_numbers(value, want, **ROUNDING, err_msg=name)
                else:  # restored: bit-equal everywhere
                    np.testing.assert_array_equal(value, want, err_msg=name)
            if how == "sharded_saver":
                continue  # the same values as the checkpoint's: the same step
            np.testing.assert_allclose(_step(model2, opt2)(x, y), losses[start], rtol=1e-5)
            for name, value in _values(model2, opt2).items():
                np.testing.assert_allclose(
                    value, after[start][name], rtol=1e-5, atol=1e-6, err_msg=f"{how}: {name}"
                )


def test_a_restore_before_the_abstract_build_gives_the_stacked_variables_their_values(tmp_path):
    """Deferred restoration: the stacked variables, created abstract by the build, receive
    their saved values as they are created."""
    with ps.VariableStore():
        model = _model(n=2)
        model.build((None, 5, 6))
        for v in model.variables:
            v.assign(v.value() + 1.0)
        saved = _values(model)
        path = ps.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    with ps.VariableStore():
        with ps.abstract():
            model2 = _model(n=2)
        status = ps.Checkpoint(model=model2).restore(path)
        with ps.abstract():
            model2.build((None, 5, 6))
        status.assert_consumed()
        assert not any(v.is_abstract for v in model2.variables)
        assert _values(model2).keys() == saved.keys()
        for name, value in _values(model2).items():
            np.testing.assert_array_equal(value, saved[name], err_msg=name)


# ================================================================== errors


def test_calling_an_abstract_repeat_before_initialize_raises_naming_a_stacked_variable(
    fresh_store,
):
    repeat = ps.nn.Repeat(Block, 2)
    with ps.abstract():
        repeat.build((None, 5, D))
    names = [v.name for v in fresh_store.variables()]
    stacked = {v.name for v in repeat.stacked.values()}
    f = ps.function(lambda x: repeat(x))
    for call in (lambda: repeat(_x((2, 5, D))), lambda: f(_x((2, 5, D)))):
        with pytest.raises(ValueError, match=ABSTRACT.format(".*")) as info:
            call()
        assert any(f"Variable '{name}' is abstract" in str(info.value) for name in stacked)
        assert [v.name for v in fresh_store.variables()] == names
        assert all(v.is_abstract for v in repeat.variables)
    # a template variable is abstract and unbound outside the scan: the same error
    template = repeat._template.tvars[0]
    with pytest.raises(ValueError, match=ABSTRACT.format(template.name)):
        template.value()
    with pytest.raises(ValueError, match=ABSTRACT.format(template.name)):
        template.assign(jnp.zeros(template.shape))
    ps.initialize(repeat)
    assert not any(v.is_abstract for v in repeat.variables)


def test_a_block_variable_made_from_a_value_computed_in_its_first_call_is_refused(fresh_store):
    class Computed(ps.Module):
        def __init__(self, name=None):
            self.w = None

        def __call__(self, x):
            if self.w is None:
                self.w = ps.Variable(jnp.ones(x.shape[-1]), name="w")
            return x * self.w

    with ps.abstract():
        r = ps.nn.Repeat(Computed, 3)
        with pytest.raises(ValueError, match=r"created variable '.*w' on its first call from a"):
            r.build((None, D))
    assert not r.built and fresh_store.variables() == []
    r2 = ps.nn.Repeat(Computed, 3)  # outside ps.abstract(): the block runs, as ever
    r2.build((None, D))
    np.testing.assert_array_equal(r2.stacked["w"].numpy(), np.ones((3, D)))


def test_abstract_build_keeps_the_repeats_checks(fresh_store):
    with ps.abstract():
        r = ps.nn.Repeat(lambda: ps.nn.Dense(3), 2)
        with pytest.raises(ValueError, match=r"shape \(2, 8\).*\(2, 3\).*carry"):
            r.build((2, D))
        r2 = ps.nn.Repeat(lambda: ps.nn.Activation("relu"), 2)
        with pytest.raises(ValueError, match="created no variables"):
            r2.build((2, D))
    assert fresh_store.variables() == [] and not r.built and not r2.built


# ===================================================== 8 devices (in a subprocess)

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def _mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _layout(mesh):
    layout = ps.sharding.LayoutMap(mesh)
    layout[r"block/dense/kernel"] = ("data", "model")  # one block's shapes: up (8, 16)
    layout[r"block/dense_1/kernel"] = ("model", "data")  # down (16, 8)
    layout[r"multi_head_attention/(query|key|value)/kernel"] = ("data", "model", None)
    return layout


def _sharded_model(mesh, how):
    if how == "layout":
        context = ps.device(_layout(mesh))
        block = Block
    else:
        context = ps.sharding.axis_rules(mesh, {"embed": "data", "mlp": "model"})

        def block():
            return Block(up_partition=("embed", "mlp"), down_partition=("mlp", "embed"))

    with context:
        model = _model(block, n=4)
        model.build((None, 5, 6))
    return model


@check
def check_abstract_builds_with_layouts_and_axis_rules_initialize_sharded_as_concrete():
    mesh = _mesh()
    for how in ("layout", "rules"):
        ps.random.set_seed(0)
        with ps.VariableStore():
            concrete = _sharded_model(mesh, how)
            want = {v.name: (v.numpy(), v.sharding, v.shape, v.dtype) for v in concrete.variables}
        spec = ps.sharding.specs(concrete)
        assert spec["repeat/block/dense/kernel"] == P(None, "data", "model"), spec
        assert spec["repeat/block/dense_1/kernel"] == P(None, "model", "data"), spec
        ps.random.set_seed(0)
        with ps.VariableStore():
            before = jax.live_arrays()  # held: no id reused meanwhile
            held = {id(a) for a in before}
            with ps.abstract():
                model = _sharded_model(mesh, how)
            assert [a.shape for a in jax.live_arrays() if id(a) not in held] == [], how
            assert ps.sharding.specs(model) == spec, how
            got = {v.name: (v.shape, v.dtype) for v in model.variables}
            assert got == {k: w[2:] for k, w in want.items()}, how
            for v in model.variables:  # unplaced ones (None) go to the default device
                assert v.sharding in (None, want[v.name][1]), v.name
            if how == "rules":
                up = model.layers[1].stacked["up/kernel"]
                assert up.partition == (None, "embed", "mlp")
                continue  # initialized as the layout's: the same program
            programs = init_programs(lambda model=model: ps.initialize(model))
            assert len(programs) == 1, programs  # one sharded program for the sharded ones
            for v in model.variables:
                assert not v.is_abstract and v.sharding == want[v.name][1], v.name
                np.testing.assert_array_equal(v.numpy(), want[v.name][0], err_msg=v.name)
            kernel = model.layers[1].stacked["up/kernel"].value()
            assert kernel.sharding == NamedSharding(mesh, P(None, "data", "model"))
            assert {s.data.shape for s in kernel.addressable_shards} == {(4, 2, 8)}


@check
def check_sharded_checkpoint_restores_into_an_abstract_repeat_that_then_trains():
    mesh = _mesh()
    x, y = _x(), _x((2, 5, 4), seed=2)
    path = tempfile.mkdtemp() + "/ckpt"
    ps.random.set_seed(0)
    with ps.VariableStore():
        model = _sharded_model(mesh, "layout")
        opt = ps.Optimizer(optax.adam(1e-2), model, name="adam")
        step = _step(model, opt)
        step(x, y)
        ps.Checkpoint(model=model, optimizer=opt).save(path)
        saved = {v.name: (v.numpy(), v.sharding) for v in [*model.variables, *opt.variables]}
        loss = step(x, y)
        after = _values(model, opt)
    with ps.VariableStore():
        with ps.abstract():
            model2 = _sharded_model(mesh, "layout")
            opt2 = ps.Optimizer(optax.adam(1e-2), model2, name="adam")
        ps.Checkpoint(model=model2, optimizer=opt2, sharded=True).restore(path).assert_consumed()
        for v in [*model2.variables, *opt2.variables]:
            assert not v.is_abstract and v.sharding == saved[v.name][1], v.name
            np.testing.assert_array_equal(v.numpy(), saved[v.name][0], err_msg=v.name)
        np.testing.assert_allclose(_step(model2, opt2)(x, y), loss, rtol=1e-5)
        for v in [*model2.variables, *opt2.variables]:
            np.testing.assert_allclose(v.numpy(), after[v.name], rtol=1e-5, atol=1e-6)
            assert v.sharding == saved[v.name][1], v.name  # the step keeps every placement


repeat_abstract_results, test_multi_device = multi_device_tests(
    CHECKS, __file__, "repeat_abstract_results"
)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        run_checks(CHECKS, sys.argv[1])
