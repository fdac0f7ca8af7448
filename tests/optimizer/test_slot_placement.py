"""Optimizer state placement: ``slot_sharding=`` (ZeRO-1) and ``slot_memory_kind=`` (host
offload) on ``ps.Optimizer``. Values against the default placement, eagerly, in a
``ps.function`` and in a fused ``lax.scan``; the compiled step's memory kinds; checkpoints;
abstract optimizers; bad input.

One-device tests run in process (JAX's CPU backend has ``pinned_host`` memory); the
sharded checks run in one 8-device subprocess (``python tests/optimizer/test_slot_placement.py
OUT.json``, see ``_multidevice``).
"""

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
from _multidevice import multi_device_tests, run_checks
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import paramstore as ps
from paramstore.optimizer import placement as _placement

HOST = "pinned_host"
RNG = np.random.default_rng(0)
W0 = RNG.standard_normal((16, 12)).astype(np.float32)
B0 = RNG.standard_normal(12).astype(np.float32)  # 12: not split 8 ways
XS = RNG.standard_normal((3, 8, 16)).astype(np.float32)  # 3 steps' batches
STEPS = len(XS)


class Dense(ps.Module):
    def __init__(self, sharding=None):
        self.w = ps.Variable(W0, name="w", sharding=sharding)
        self.b = ps.Variable(B0, name="b", sharding=sharding)

    def __call__(self, x):
        return jnp.tanh(x @ self.w + self.b)


def loss_of(model, x):
    return jnp.mean((model(x) - 0.5) ** 2)


def train(mode: str, sharding=None, **placement):
    """(model, optimizer) after STEPS Adam steps, run ``mode``: "eager" (the compiled
    update), "op_by_op" (jit_compile=False), "function" (a ps.function step) or "scan"
    (every step in one ps.function: a lax.scan whose body applies the gradients). With a
    ``sharding`` over a mesh, data parallel: the parameters on it, the batches split over
    its "data" axis."""
    model = Dense(sharding)
    xs = jnp.asarray(XS)
    if isinstance(sharding, NamedSharding):
        xs = jax.device_put(xs, NamedSharding(sharding.mesh, P(None, "data")))
    opt = ps.Optimizer(
        optax.adam(0.1), model, jit_compile=mode != "op_by_op", name="opt", **placement
    )
    grad = ps.value_and_grad(lambda x: loss_of(model, x), model)
    if mode in ("eager", "op_by_op"):
        for x in xs:
            opt.apply_gradients(grad(x)[1])
    elif mode == "function":
        step = step_of(model, opt)
        for x in xs:
            step(x)
        assert step.trace_count == 1
    else:

        @ps.function
        def steps(xs):
            def body(_, x):
                opt.apply_gradients(grad(x)[1])
                return None, None

            jax.lax.scan(body, None, xs)

        steps(xs)
    return model, opt


def step_of(model, opt) -> ps.Function:
    """One training step, a ps.function of the batch."""
    grad = ps.value_and_grad(lambda x: loss_of(model, x), model)
    return ps.function(lambda x: opt.apply_gradients(grad(x)[1]))


def values(model, opt) -> dict[str, np.ndarray]:
    return {v.name: np.asarray(v.numpy()) for v in [*model.variables, *opt.variables]}


def assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)


def slots(opt) -> list[ps.Variable]:
    return [v for v in opt.variables if v.name.endswith(("/mu", "/nu"))]


# ================================================================ one device (in process)

MODES = ["eager", "op_by_op", "function", "scan"]


@pytest.mark.parametrize("mode", MODES)
def test_host_slots_equal_the_default_placement(mode):
    with ps.VariableStore():
        want = values(*train(mode))
    with ps.VariableStore():
        model, opt = train(mode, slot_memory_kind=HOST)
        assert len(slots(opt)) == 4
        for v in slots(opt):  # still in host memory after the steps
            assert v.sharding.memory_kind == HOST, v.name
        for v in [*model.variables, opt.iterations, *opt.variables[1:2]]:  # count
            assert v.sharding.memory_kind != HOST, v.name
        assert_close(values(model, opt), want)


def test_the_compiled_step_moves_host_slots_inside_the_program():
    with ps.VariableStore():
        model, opt = train("eager", slot_memory_kind=HOST)
        step = step_of(model, opt)
        compiled = step.lower(jnp.asarray(XS[0])).compile()
        kinds = [sh.memory_kind for sh in jax.tree_util.tree_leaves(compiled.input_shardings)]
        out_kinds = [sh.memory_kind for sh in jax.tree_util.tree_leaves(compiled.output_shardings)]
        # the four slots are arguments and results in host memory: no eager copy before or
        # after the call, the program itself moves them to the device and back
        assert kinds.count(HOST) == 4 and out_kinds.count(HOST) == 4, (kinds, out_kinds)
        hlo = compiled.as_text()
        layout = next(line for line in hlo.splitlines() if "entry_computation_layout" in line)
        assert layout.count("S(5)") == 8  # host memory space: 4 parameters, 4 results
        step(jnp.asarray(XS[0]))
        step(jnp.asarray(XS[1]))
        assert step.trace_count == 1
        for v in slots(opt):
            assert v.sharding.memory_kind == HOST
        assert "may-alias" in hlo  # donated: updated in place in host memory


def test_an_optimizer_built_in_the_first_trace_places_its_slots():
    """Keras-style: the optimizer is created inside the step's first trace."""
    with ps.VariableStore():
        want = values(*train("function"))
    with ps.VariableStore():
        model, built = Dense(), []

        @ps.function
        def step(x):
            if not built:
                built.append(
                    ps.Optimizer(optax.adam(0.1), model, name="opt", slot_memory_kind=HOST)
                )
            built[0].apply_gradients(ps.value_and_grad(lambda: loss_of(model, x), model)()[1])

        for x in XS:
            step(jnp.asarray(x))
        assert step.trace_count == 1
        assert {v.sharding.memory_kind for v in slots(built[0])} == {HOST}
        assert_close(values(model, built[0]), want)


def test_host_slots_work_with_a_slot_sharding_that_carries_the_kind():
    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind=HOST)
    with ps.VariableStore():
        want = values(*train("function"))
    with ps.VariableStore():
        model, opt = train("function", slot_sharding=lambda v: host if v.ndim == 2 else None)
        kinds = {v.name: v.sharding.memory_kind for v in slots(opt)}
        assert kinds["opt/dense/w/mu"] == kinds["opt/dense/w/nu"] == HOST
        assert kinds["opt/dense/b/mu"] != HOST
        assert_close(values(model, opt), want)


def test_checkpoints_save_and_restore_host_slots(tmp_path):
    for how in ("sync", "async", "sharded"):
        with ps.VariableStore():
            model, opt = train("eager", slot_memory_kind=HOST)
            saved = values(model, opt)
            ckpt = ps.Checkpoint(model=model, optimizer=opt)
            if how == "sync":
                path = ckpt.save(str(tmp_path / "one"))
            elif how == "async":
                manager = ps.CheckpointManager(tmp_path / "async", ckpt, async_save=True)
                manager.save(1)
                manager.wait()
            else:
                path = ps.Saver([*model.variables, *opt.variables], sharded=True).save(
                    str(tmp_path / "sharded")
                )
        with ps.VariableStore():  # a fresh model and optimizer, slots in host memory
            model2 = Dense()
            opt2 = ps.Optimizer(optax.adam(0.1), model2, name="opt", slot_memory_kind=HOST)
            if how == "sync":
                ps.Checkpoint(model=model2, optimizer=opt2).restore(path).assert_consumed()
            elif how == "async":
                manager = ps.CheckpointManager(
                    tmp_path / "async", ps.Checkpoint(model=model2, optimizer=opt2)
                )
                manager.restore_latest()
            else:
                ps.Saver([*model2.variables, *opt2.variables], sharded=True).restore(path)
            assert_close(values(model2, opt2), saved)
            for v in slots(opt2):
                assert v.sharding.memory_kind == HOST, (how, v.name)


def test_a_default_checkpoint_restores_into_host_slots(tmp_path):
    """The placement is no part of a checkpoint's keys: either way round restores."""
    with ps.VariableStore():
        model, opt = train("eager")
        saved = values(model, opt)
        path = ps.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "c"))
    with ps.VariableStore():
        model2 = Dense()
        opt2 = ps.Optimizer(optax.adam(0.1), model2, name="opt", slot_memory_kind=HOST)
        ps.Checkpoint(model=model2, optimizer=opt2).restore(path).assert_consumed()
        assert_close(values(model2, opt2), saved)
        assert {v.sharding.memory_kind for v in slots(opt2)} == {HOST}


def test_abstract_optimizer_creates_host_slots_abstract(tmp_path):
    with ps.VariableStore():
        want_model, want_opt = train("eager", slot_memory_kind=HOST)
        saved = values(want_model, want_opt)
        path = ps.Checkpoint(model=want_model, optimizer=want_opt).save(str(tmp_path / "c"))
    for fill in ("initialize", "restore"):
        with ps.VariableStore():
            with ps.abstract():
                model = Dense()
                opt = ps.Optimizer(optax.adam(0.1), model, name="opt", slot_memory_kind=HOST)
            for v in slots(opt):
                assert v.is_abstract and v.sharding.memory_kind == HOST, v.name
            if fill == "initialize":
                ps.initialize([model, opt])
                for v in slots(opt):
                    np.testing.assert_array_equal(v.numpy(), np.zeros(v.shape))
            else:
                ps.Checkpoint(model=model, optimizer=opt).restore(path).assert_consumed()
                assert_close(values(model, opt), saved)
            for v in slots(opt):
                assert not v.is_abstract and v.value().sharding.memory_kind == HOST, v.name
            opt.apply_gradients(
                {"dense/w": jnp.ones(W0.shape), "dense/b": jnp.ones(B0.shape)}
            )  # and steps
            assert {v.sharding.memory_kind for v in slots(opt)} == {HOST}


# ---------------------------------------------------------------- bad input, one device


def assert_nothing_created(make: Callable[[], object], error: type[Exception], *words: str):
    with ps.VariableStore() as store:
        model = Dense()
        before = [v.name for v in store.variables()]
        with pytest.raises(error) as info:
            make(model)
        message = str(info.value)
        for word in words:
            assert word in message, (word, message)
        assert [v.name for v in store.variables()] == before
        # not even the optimizer's name was taken: the next one is "optimizer"
        assert ps.Optimizer(optax.adam(0.1), model).iterations.name == "optimizer/iterations"
        return message


def test_unknown_memory_kind_is_a_clear_error():
    assert_nothing_created(
        lambda m: ps.Optimizer(optax.adam(0.1), m, slot_memory_kind="host"),
        ValueError,
        "'host'",
        "not a memory kind",
        "variable 'dense/b'",
        "pinned_host",
    )


def test_memory_kind_the_backend_lacks_is_a_clear_error(monkeypatch):
    # XLA:CPU and XLA:GPU have all three kinds; a backend with device memory only (as some
    # have) is what _placement.memory_kinds reports here. The message names the platform.
    monkeypatch.setattr(_placement, "memory_kinds", lambda device: ["device"])
    assert_nothing_created(
        lambda m: ps.Optimizer(optax.adam(0.1), m, slot_memory_kind=HOST),
        ValueError,
        "'pinned_host'",
        f"not a memory of the variable's {jax.devices()[0].platform} devices",
        "variable 'dense/b'",
        "'device'",
    )


def test_bad_slot_sharding_types_are_clear_errors():
    assert_nothing_created(
        lambda m: ps.Optimizer(optax.adam(0.1), m, slot_memory_kind=5),
        TypeError,
        "slot_memory_kind must be a str",
    )
    assert_nothing_created(
        lambda m: ps.Optimizer(optax.adam(0.1), m, slot_sharding="data"),
        TypeError,
        "slot_sharding must be a ps.sharding.LayoutMap",
    )
    assert_nothing_created(
        lambda m: ps.Optimizer(optax.adam(0.1), m, slot_sharding=lambda v: P("data")),
        TypeError,
        "returned P('data',) for variable 'dense/b'",
        "NamedSharding(mesh, spec)",
    )


# ========================================================== 8 devices (in a subprocess)

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def _mesh(axis_type=AxisType.Auto):
    return jax.make_mesh((8,), ("data",), axis_types=(axis_type,))


def _zero1(mesh):
    """ZeRO-1: each slot split over the data axis along its first dimension that fits."""
    return lambda v: NamedSharding(mesh, P("data") if v.shape[0] % 8 == 0 else P())


def w_slots(opt) -> list[ps.Variable]:
    return [v for v in slots(opt) if "/w/" in v.name]


def _shard_bytes(v) -> int:
    return sum(s.data.nbytes for s in v.value().addressable_shards if s.device.id == 0)


@check
def check_zero1_equals_the_default_placement():
    mesh = _mesh()
    rep = NamedSharding(mesh, P())
    layout = ps.sharding.LayoutMap(mesh)
    layout["w$"] = ("data", None)  # keyed by the parameter's name; b: its own sharding
    ways = {  # slot_sharding -> (w's slots' sharding, bytes of one on device 0)
        "callable": (_zero1(mesh), NamedSharding(mesh, P("data")), W0.nbytes // 8),
        "layout map": (layout, NamedSharding(mesh, P("data", None)), W0.nbytes // 8),
        "one sharding": (rep.with_memory_kind(HOST), rep.with_memory_kind(HOST), W0.nbytes),
    }
    for mode in ("eager", "function", "scan"):  # (op by op: on one device, above)
        with ps.VariableStore():
            want = values(*train(mode, rep))
        for how, (slot_sharding, w_sharding, nbytes) in ways.items():
            if how != "callable" and mode != "function":
                continue  # every way once; every mode with the callable
            with ps.VariableStore():
                model, opt = train(mode, rep, slot_sharding=slot_sharding)
                by = {v.name: v for v in slots(opt)}
                assert by["opt/dense/w/mu"].sharding == w_sharding, (how, mode)
                if how == "layout map":  # no key matches b: its slots stay like it
                    assert by["opt/dense/b/mu"].sharding == model.b.sharding
                assert _shard_bytes(by["opt/dense/w/nu"]) == nbytes
                assert model.w.sharding == rep  # parameters stay replicated
                assert_close(values(model, opt), want)
        if mode in ("function", "scan"):  # ZeRO-1 slots in host memory
            with ps.VariableStore():
                model, opt = train(mode, rep, slot_sharding=_zero1(mesh), slot_memory_kind=HOST)
                for v in slots(opt):  # b's 12 rows are not split 8 ways
                    spec = P("data") if "/w/" in v.name else P()
                    assert v.sharding == NamedSharding(mesh, spec, memory_kind=HOST), v.name
                assert_close(values(model, opt), want)


@check
def check_zero1_step_holds_an_eighth_of_the_slots_per_device():
    mesh = _mesh()
    rep = NamedSharding(mesh, P())
    sizes = {}
    for label, kw in {"default": {}, "zero1": {"slot_sharding": _zero1(mesh)}}.items():
        with ps.VariableStore():
            step = step_of(*train("eager", rep, **kw))
            x = jax.device_put(XS[0], NamedSharding(mesh, P("data")))
            stats = step.lower(x).compile().memory_analysis()
            sizes[label] = stats.argument_size_in_bytes
    # Adam's mu and nu of w: a whole copy on every device, or an eighth (b's stay whole)
    assert sizes["default"] - sizes["zero1"] == 2 * (W0.nbytes - W0.nbytes // 8), sizes


@check
def check_zero1_on_an_explicit_mesh():
    mesh = _mesh(AxisType.Explicit)
    rep = NamedSharding(mesh, P())
    with ps.VariableStore():
        want = values(*train("function", rep))
    with ps.VariableStore():
        model, opt = train("function", rep, slot_sharding=_zero1(mesh), slot_memory_kind=HOST)
        assert_close(values(model, opt), want)


@check
def check_zero1_checkpoints_and_abstract():
    mesh = _mesh()
    rep = NamedSharding(mesh, P())
    zero1 = NamedSharding(mesh, P("data"))
    with tempfile.TemporaryDirectory() as d:
        with ps.VariableStore():
            model, opt = train("function", rep, slot_sharding=_zero1(mesh))
            saved = values(model, opt)
            path = ps.Saver([*model.variables, *opt.variables], sharded=True).save(
                os.path.join(d, "ckpt")
            )
            manager = ps.CheckpointManager(
                os.path.join(d, "managed"), ps.Checkpoint(model=model, optimizer=opt)
            )
            manager.save(1)
        for how in ("concrete", "abstract"):
            with ps.VariableStore():
                with ps.abstract() if how == "abstract" else contextlib.nullcontext():
                    model2 = Dense(rep)
                    opt2 = ps.Optimizer(
                        optax.adam(0.1), model2, name="opt", slot_sharding=_zero1(mesh)
                    )
                for v in w_slots(opt2):
                    assert v.sharding == zero1 and v.is_abstract == (how == "abstract")
                ps.Saver([*model2.variables, *opt2.variables], sharded=True).restore(path)
                assert_close(values(model2, opt2), saved)
                for v in w_slots(opt2):
                    assert v.value().sharding == zero1
                    assert {s.data.shape[0] for s in v.value().addressable_shards} == {
                        v.shape[0] // 8
                    }
            with ps.VariableStore():  # the single-file format, restored by a manager
                with ps.abstract():
                    model3 = Dense(rep)
                    opt3 = ps.Optimizer(
                        optax.adam(0.1), model3, name="opt", slot_sharding=_zero1(mesh)
                    )
                ps.CheckpointManager(
                    os.path.join(d, "managed"), ps.Checkpoint(model=model3, optimizer=opt3)
                ).restore_latest()
                assert_close(values(model3, opt3), saved)
                assert {v.sharding for v in w_slots(opt3)} == {zero1}
    with ps.VariableStore():  # ps.initialize computes the slots straight onto their shards
        with ps.abstract():
            model4 = Dense(rep)
            opt4 = ps.Optimizer(
                optax.adam(0.1), model4, slot_sharding=_zero1(mesh), slot_memory_kind=HOST
            )
        ps.initialize([model4, opt4])
        for v in w_slots(opt4):
            assert v.value().sharding == zero1.with_memory_kind(HOST)


def only_w(sharding):
    return lambda v: sharding if v.ndim == 2 else None


@check
def check_bad_slot_shardings_are_clear_errors():
    mesh = _mesh()
    rep = NamedSharding(mesh, P())
    half = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    other = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    layout = ps.sharding.LayoutMap(mesh)
    layout["w"] = ("data",)  # rank 1 for a rank-2 variable
    cases = [
        (only_w(NamedSharding(mesh, P("data", None, None))), "rank 3", "'dense/w'"),
        (only_w(NamedSharding(half, P("data"))), "devices", "'dense/w'"),
        (only_w(NamedSharding(other, P("data"))), "mesh", "'dense/w'"),
        (only_w(NamedSharding(mesh, P(None, "data"))), "'dense/w'", "12"),
        (layout, "'dense/w'", "rank 2"),
    ]
    for slot_sharding, *words in cases:
        with ps.VariableStore() as store:
            model = Dense(rep)
            try:
                ps.Optimizer(optax.adam(0.1), model, slot_sharding=slot_sharding)
            except ValueError as e:
                for word in words:
                    assert word in str(e), (word, str(e))
            else:
                raise AssertionError(f"no error for {words}")
            assert [v.name for v in store.variables()] == ["dense/w", "dense/b"]


results, test_multi_device = multi_device_tests(CHECKS, __file__, "slot_placement_results")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        run_checks(CHECKS, sys.argv[1])
