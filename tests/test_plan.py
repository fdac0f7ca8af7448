"""ps.plan: bytes per device and in host memory for a step, before allocating anything.

One-device checks run here; the sharded ones (FSDP, ZeRO-1, host-memory slots, quantized
kernels, abstract models) in one 8-device subprocess (tests/_multidevice.py). Expected byte
counts are written out from the shapes, independently of the plan's own arithmetic, and the
argument bytes are checked against XLA's own analysis of the ps.function's program.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the multi-device subprocess: before jax is imported
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import contextlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _multidevice import multi_device_tests, run_checks
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import paramstore as ps

HOST = "pinned_host"


def make(units=(64, 32), stats=False):
    layers = [ps.nn.Dense(units[0], name="up")]
    if stats:
        layers.append(ps.nn.BatchNormalization(name="bn"))
    layers.append(ps.nn.Dense(units[1], name="down"))
    model = ps.nn.Sequential(layers, name="model")
    model.build((None, 16))
    return model


def train_step(model, opt):
    @ps.function
    def step(x):
        loss, grads = ps.value_and_grad(lambda: jnp.mean(model(x, training=True) ** 2), model)()
        opt.apply_gradients(grads)
        return loss

    return step


def nbytes(shape, dtype="float32"):
    return int(np.prod(shape)) * np.dtype(dtype).itemsize


# ------------------------------------------------------------------ one device


def test_one_device_rows_match_the_variables_and_xla():
    model = make(stats=True)
    opt = ps.Optimizer(optax.adam(1e-3), model.trainable_variables)
    step = train_step(model, opt)
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    plan = ps.plan(step, x)
    assert step.trace_count == 0  # planning traced nothing of the step itself, ran nothing
    (row,) = plan.devices.values()
    weights = nbytes((16, 64)) + nbytes((64,)) * 3 + nbytes((64, 32)) + nbytes((32,))
    assert row.parameters == weights  # kernels, biases, BN gamma and beta
    assert row.other_state == 2 * nbytes((64,))  # BN moving mean and variance
    counters = sum(v.dtype.itemsize * v.size for v in opt.variables if v.ndim == 0)
    assert row.optimizer_state == 2 * weights + counters  # Adam's mu and nu
    assert row.inputs == nbytes((8, 16)) and row.outputs == 4  # the loss
    stats = step.lower(np.zeros((8, 16), np.float32)).compile().memory_analysis()
    args = row.parameters + row.optimizer_state + row.other_state + row.inputs
    assert args == stats.argument_size_in_bytes  # the same arguments as ps.function's program
    assert row.temporaries == plan.memory_analysis.temp_size_in_bytes > 0
    assert row.peak == args + row.outputs + row.temporaries == plan.peak
    # The peak is the sum that matched the measured peak_bytes_in_use of a first step on an
    # H200 (to 1e-7 for steps of 9 and 19 GB; +133 MB of GPU library workspace on top of
    # small steps): arguments + outputs - aliased + temporaries of the program's analysis.
    # (XLA also counts the output tuple's table: 8 bytes a result, 23 here.)
    compiled = step.lower(np.zeros((8, 16), np.float32)).compile()
    table = 8 * len(jax.tree_util.tree_leaves(compiled.output_shardings))
    undonated = stats.output_size_in_bytes - stats.alias_size_in_bytes - table
    assert row.outputs == undonated
    assert row.peak == args + undonated + row.temporaries
    assert plan.host == ps.PlanRow()


def test_fits_and_the_table():
    model = make()
    plan = ps.plan(lambda x: model(x), jax.ShapeDtypeStruct((4, 16), jnp.float32))
    assert plan.fits(limit=plan.peak) and not plan.fits(limit=plan.peak - 1)
    device = next(iter(plan.devices))
    if (device.memory_stats() or {}).get("bytes_limit") is None:
        with pytest.raises(ValueError, match="does not report a memory limit.*pass limit="):
            plan.fits()
    with pytest.raises(ValueError, match="limit must be a number of bytes"):
        plan.fits(limit=-1)
    text = str(plan)
    for column in ("parameters", "optimizer_state", "other_state", "inputs", "outputs",
                   "temporaries", "peak", "host"):  # fmt: skip
        assert column in text
    assert f"{plan.devices[device].parameters / 1024:.2f} KiB" in text
    with pytest.raises(TypeError, match="ps.plan: fn must be"):
        ps.plan(3)


def test_abstract_model_is_not_allocated_and_quantized_sizes_are_exact():
    with ps.abstract():
        model = make(units=(64, 33))
        ps.nn.quantize(model, "int8", where="up")
        ps.nn.quantize(model, "int4", where="down")
        ps.nn.enable_lora(model, 4)
        opt = ps.Optimizer(optax.adam(1e-3), model.trainable_variables)
    before = {v.name for v in model.variables}
    plan = ps.plan(train_step(model, opt), jax.ShapeDtypeStruct((8, 16), jnp.float32))
    assert all(v.is_abstract for v in [*model.variables, *opt.variables])
    assert {v.name for v in model.variables} == before
    (row,) = plan.devices.values()
    quantized = 16 * 64 + nbytes((64,)) + 64 * 17 + nbytes((33,))  # int8; int4 half a byte
    adapters = nbytes((16, 4)) + nbytes((4, 64)) + nbytes((64, 4)) + nbytes((4, 33))
    assert row.parameters == quantized + adapters + nbytes((64,)) + nbytes((33,))


def test_variables_the_first_trace_creates_are_created_abstract():
    model = ps.nn.Sequential([ps.nn.Dense(32), ps.nn.Dense(4)])  # not built
    plan = ps.plan(lambda x: model(x), jax.ShapeDtypeStruct((8, 16), jnp.float32))
    assert [v.shape for v in model.variables] == [(32,), (16, 32), (4,), (32, 4)]
    assert all(v.is_abstract for v in model.variables)  # created, nothing allocated
    (row,) = plan.devices.values()
    assert row.parameters == nbytes((16, 32)) + nbytes((32,)) + nbytes((32, 4)) + nbytes((4,))
    assert row.outputs == nbytes((8, 4)) and row.inputs == nbytes((8, 16))
    ps.initialize(model)  # then the model runs as planned
    assert model(np.ones((8, 16), np.float32)).shape == (8, 4)


def test_ema_shadows_count_as_other_state_and_must_exist_first():
    model = make()
    opt = ps.Optimizer(optax.sgd(0.1), model.trainable_variables)
    ema = ps.ExponentialMovingAverage(0.9)

    @ps.function
    def step(x):
        loss, grads = ps.value_and_grad(lambda: jnp.mean(model(x) ** 2), model)()
        opt.apply_gradients(grads)
        ema.apply(model.trainable_variables)
        return loss

    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    with pytest.raises(TypeError, match="ExponentialMovingAverage") as info:
        ps.plan(step, x)
    assert any("ema.apply" in note for note in info.value.__notes__)
    ema.apply(model.trainable_variables)  # the shadows exist: then the step plans
    (row,) = ps.plan(step, x).devices.values()
    weights = nbytes((16, 64)) + nbytes((64,)) + nbytes((64, 32)) + nbytes((32,))
    assert row.parameters == weights and row.other_state == weights  # one shadow each


class Trainer(ps.Module):
    def __init__(self):
        super().__init__()
        self.model = make()
        inner = ps.Optimizer(optax.adam(1e-3), self.model.trainable_variables)
        self.opt = ps.LossScaleOptimizer(inner)

    @ps.function
    def step(self, x):
        scaled = lambda: self.opt.scale_loss(jnp.mean(self.model(x) ** 2))  # noqa: E731
        _, grads = ps.value_and_grad(scaled, self.model)()
        self.opt.apply_gradients(grads)
        return jnp.zeros(())


def test_a_method_and_modules_as_arguments_are_state_not_inputs():
    trainer = Trainer()
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    (row,) = ps.plan(trainer.step, x).devices.values()
    weights = nbytes((16, 64)) + nbytes((64,)) + nbytes((64, 32)) + nbytes((32,))
    assert row.parameters == weights and row.inputs == nbytes((8, 16))
    counters = sum(v.dtype.itemsize * v.size for v in trainer.opt.variables if v.ndim == 0)
    assert row.optimizer_state == 2 * weights + counters  # Adam's slots, counters, loss scale

    def forward(model, x):
        return model(x)

    (row,) = ps.plan(ps.function(forward), trainer.model, x).devices.values()
    assert row.parameters == weights and row.optimizer_state == 0
    assert row.inputs == nbytes((8, 16)) and row.outputs == nbytes((8, 32))


# ------------------------------------------------------------------ 8 devices

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def _mesh():
    return Mesh(np.array(jax.devices()), ("data",))


def _sharded(mesh, abstract=False):
    with (
        ps.abstract() if abstract else contextlib.nullcontext(),
        ps.device(mesh),
        ps.sharding.axis_rules(mesh, [("mlp", "data")]),
    ):
        model = ps.nn.Sequential(
            [
                ps.nn.Dense(64, kernel_partition=(None, "mlp"), bias_partition=("mlp",)),
                ps.nn.Dense(32, kernel_partition=("mlp", None), bias_partition=(None,)),
            ]
        )
        model.build((None, 16))
    return model


@check
def check_fsdp_counts_each_devices_shards():
    mesh = _mesh()
    for abstract in (False, True):
        with ps.VariableStore():
            model = _sharded(mesh, abstract)
            with ps.abstract() if abstract else contextlib.nullcontext():
                opt = ps.Optimizer(optax.adam(1e-3), model.trainable_variables)
            step = train_step(model, opt)
            x = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(mesh, P("data")))
            plan = ps.plan(step, x)
            assert len(plan.devices) == 8 and len({str(r) for r in plan.devices.values()}) == 1
            row = plan.devices[jax.devices()[3]]
            per = (nbytes((16, 64)) + nbytes((64,)) + nbytes((64, 32))) // 8 + nbytes((32,))
            assert row.parameters == per, abstract
            assert row.optimizer_state - 2 * per in (8, 12, 16), row  # + the counters
            assert row.inputs == nbytes((64, 16)) // 8
            if not abstract:
                real = jax.device_put(np.zeros((64, 16), np.float32), x.sharding)
                stats = step.lower(real).compile().memory_analysis()
                args = row.parameters + row.optimizer_state + row.inputs
                assert args == stats.argument_size_in_bytes, (args, stats)
            assert "cpu x8" in str(plan)


@check
def check_zero1_and_host_memory_slots():
    mesh = _mesh()
    rep = NamedSharding(mesh, P())
    zero1 = NamedSharding(mesh, P("data"))
    with ps.VariableStore(), ps.device(rep):
        model = make()
        opt = ps.Optimizer(optax.adam(1e-3), model.trainable_variables, slot_sharding=zero1)
        plan = ps.plan(train_step(model, opt), jax.ShapeDtypeStruct((8, 16), jnp.float32))
        weights = nbytes((16, 64)) + nbytes((64,)) + nbytes((64, 32)) + nbytes((32,))
        row = plan.devices[jax.devices()[0]]
        assert row.parameters == weights  # replicated: whole on every device
        assert row.optimizer_state - 2 * weights // 8 in (8, 12, 16)  # ZeRO-1: an eighth
    with ps.VariableStore(), ps.device(rep):
        model = make()
        opt = ps.Optimizer(optax.adam(1e-3), model.trainable_variables, slot_memory_kind=HOST)
        plan = ps.plan(train_step(model, opt), jax.ShapeDtypeStruct((8, 16), jnp.float32))
        row = plan.devices[jax.devices()[0]]
        assert row.optimizer_state in (8, 12, 16)  # the counters only
        assert plan.host.optimizer_state == 8 * 2 * weights  # every device's copy, in host memory
        assert plan.host.peak >= plan.host.optimizer_state


@check
def check_a_big_abstract_model_plans_without_allocating():
    mesh = _mesh()
    with ps.VariableStore():
        with ps.abstract(), ps.device(mesh), ps.sharding.axis_rules(mesh, [("mlp", "data")]):
            model = ps.nn.Sequential(
                [ps.nn.Dense(8192, kernel_partition=(None, "mlp")) for _ in range(4)]
            )  # 4 x 8192 x 8192 float32: 1 GiB of kernels
            model.build((None, 8192))
            opt = ps.Optimizer(optax.adam(1e-3), model.trainable_variables)
        x = jax.ShapeDtypeStruct((8, 8192), jnp.float32, sharding=NamedSharding(mesh, P()))
        plan = ps.plan(train_step(model, opt), x)
        row = plan.devices[jax.devices()[0]]
        assert row.parameters == 4 * nbytes((8192, 8192)) // 8 + 4 * nbytes((8192,))
        assert all(v.is_abstract for v in model.variables)


plan_results, test_multi_device = multi_device_tests(CHECKS, __file__, "plan_results")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        run_checks(CHECKS, sys.argv[1])
