"""Devices and sharding: ps.device, Variable(device=/sharding=), placement kept by assigns,
ps.function, the optimizer and restore; data- and tensor-parallel training on 8 devices.

The main test process has one CPU device, so every multi-device check runs in a
subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``: this file is also
that subprocess's script (``python tests/sharding/test_sharding.py OUT.json``). It runs every
``check_*`` function below once and writes ``{name: "ok" | traceback}``; the tests
``test_multi_device[name]`` read that file (computed once per session, shared by xdist
workers).
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
import functools
import importlib
import importlib.util
import re
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _backends import device_names
from _bounded import BOUND
from _multidevice import multi_device_tests, run_checks
from jax.sharding import AxisType, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import paramstore as ps
from paramstore._core.context import TRACE_EPOCH

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def auto_mesh(shape: tuple[int, ...], names: tuple[str, ...], devices=None):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=devices)


def _block(x):
    """Wait for a step: with many multi-device steps in flight, XLA's in-process CPU
    collectives on forced devices can deadlock (jax 0.10, few cores), so the checks never
    queue more than one."""
    return jax.block_until_ready(x)


def runner_cache_size(f) -> int:
    """How many executables a ps.function's compiled entries hold (one per signature)."""
    return sum(entry.runner._cache_size() for entry in f._cache.values())


# ================================================================ one device (in process)


def test_device_context_places_variables():
    cpu0 = jax.devices("cpu")[0]
    for spec in ("cpu:0", "cpu", "CPU:0", "/device:CPU:0", cpu0):
        with ps.device(spec) as dev:
            v = ps.Variable([1.0, 2.0])
        assert dev == cpu0
        assert v.device == cpu0
        assert v.sharding == SingleDeviceSharding(cpu0)
    w = ps.Variable(1.0, device="cpu:0")
    assert w.device == cpu0
    with ps.device("cpu:0"):
        g = ps.get_variable("g", shape=(2,))
    assert g.device == cpu0


def test_placement_kept_by_assigns_on_one_device():
    v = ps.Variable(np.arange(4.0, dtype=np.float32), device="cpu:0")
    sh = v.sharding
    v.assign(np.ones(4, np.float32))
    v.assign_add(1.0)
    v[1:3].assign([5.0, 6.0])
    v[0].assign_sub(1.0)
    assert v.sharding == sh
    np.testing.assert_array_equal(v.numpy(), [1.0, 5.0, 6.0, 2.0])


def test_unknown_device_is_a_clear_error_and_creates_nothing(fresh_store):
    # the devices listed are the default backend's: cpu:0 here, gpu:0 on one GPU
    message = rf"No device 'cpu:99' exists here; the devices are: {device_names()}\.$"
    with pytest.raises(ValueError, match=message), ps.device("cpu:99"):
        ps.Variable(1.0, name="never")
    with pytest.raises(ValueError, match=r"No device 'warp:0'"):
        ps.Variable(1.0, name="never", device="warp:0")
    with pytest.raises(ValueError, match="No device"):
        ps.Variable(1.0, name="never", device="cpu:x")
    assert fresh_store.variables() == []
    assert ps.Variable(1.0, name="never").name == "never"  # the name was not taken


@pytest.mark.skipif(bool(jax.devices()[0].platform == "gpu"), reason="a GPU exists here")
def test_gpu_name_without_a_gpu_is_a_clear_error(fresh_store):
    with pytest.raises(ValueError, match=r"No device 'gpu:0' exists here; the devices are"):
        ps.Variable(1.0, device="gpu:0")
    assert fresh_store.variables() == []


def test_device_and_sharding_arguments_are_checked(fresh_store):
    cpu0 = jax.devices()[0]
    with pytest.raises(ValueError, match="either device= or sharding="):
        ps.Variable(1.0, device="cpu:0", sharding=SingleDeviceSharding(cpu0))
    with pytest.raises(TypeError, match="sharding= must be a jax.sharding.Sharding"):
        ps.Variable(1.0, sharding="cpu:0")
    with pytest.raises(TypeError, match="A device is a string"):
        ps.Variable(1.0, device=0)
    assert fresh_store.variables() == []


def test_sharding_that_does_not_fit_on_one_device_mesh(fresh_store):
    mesh = jax.make_mesh((1,), ("x",))
    with pytest.raises(ValueError, match=r"variable 'v'.*spec P\(None, 'x'\) names 2 dimensions"):
        ps.Variable([1.0, 2.0], name="v", sharding=NamedSharding(mesh, P(None, "x")))
    assert fresh_store.variables() == []


def test_reshard_and_settle_on_one_device(fresh_store):
    cpu0 = jax.devices()[0]
    v = ps.Variable([1.0, 2.0], name="v")
    assert not v.value().committed
    ps.sharding.reshard(v, SingleDeviceSharding(cpu0))
    assert v.value().committed and v.device == cpu0
    with pytest.raises(TypeError, match="reshard expects"):
        ps.sharding.reshard([v], "cpu:0")
    with pytest.raises(ValueError, match="no variable named 'nope'"):
        ps.sharding.reshard([v], {"nope": SingleDeviceSharding(cpu0)})


# ------------------------------------------------------------------ checkpoint formats


needs_orbax = pytest.mark.skipif(
    importlib.util.find_spec("orbax") is None, reason="orbax-checkpoint missing"
)


def test_format_is_a_file_in_one_process_unless_sharded_is_asked(tmp_path, monkeypatch):
    v = ps.Variable(np.arange(3.0, dtype=np.float32), name="v")
    path = ps.Saver([v]).save(tmp_path / "plain")
    assert os.path.isfile(path)
    assert ps.Saver([v])._writes_sharded() is False
    assert ps.Saver([v], sharded=True)._writes_sharded() is True
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # as in a multi-process run
    assert ps.Saver([v])._writes_sharded() is True
    with pytest.raises(ps.checkpoint.CheckpointError, match=r"sharded=False\) writes one file"):
        ps.Saver([v], sharded=False).save(tmp_path / "never")
    assert not (tmp_path / "never").exists()
    with pytest.raises(TypeError, match="sharded must be None, True or False"):
        ps.Saver([v], sharded="yes")


def test_sharded_format_without_orbax_is_a_clear_import_error(tmp_path, monkeypatch):
    v = ps.Variable([1.0], name="v")
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install 'paramstore\[sharded\]'"):
        ps.Saver([v], sharded=True).save(tmp_path / "ckpt")
    ps.Saver([v]).restore(ps.Saver([v]).save(tmp_path / "file"))  # single files still work


@needs_orbax
def test_sharded_checkpoint_round_trip_in_one_process(tmp_path, capsys):
    w = ps.Variable(np.arange(6.0, dtype=np.float32).reshape(2, 3), name="dense/w")
    s = ps.Variable(["a", "béta"], name="labels")
    e = ps.Variable(np.zeros((0, 2), np.int32), name="empty")
    path = ps.Saver([w, s, e], sharded=True).save(tmp_path / "model", step=7)
    assert path.endswith("model-7") and os.path.isdir(path)
    assert ps.checkpoint.list_variables(path) == [
        ("dense/w", (2, 3), np.dtype(np.float32)),
        ("empty", (0, 2), np.dtype(np.int32)),
        ("labels", (2,), np.dtypes.StringDType()),
    ]
    np.testing.assert_array_equal(ps.checkpoint.load_variable(path, "dense/w"), w.numpy())
    with pytest.raises(ps.checkpoint.CheckpointError, match="has no variable 'dense/x'"):
        ps.checkpoint.load_variable(path, "dense/x")
    w.assign(np.zeros((2, 3), np.float32))
    s.assign(["", ""])
    ps.Saver([w, s, e]).restore(path)
    np.testing.assert_array_equal(w.numpy(), np.arange(6.0).reshape(2, 3))
    assert s.numpy().tolist() == ["a", "béta"]
    assert importlib.import_module("paramstore.cli").inspect(path, values=True) == 0
    assert "sharded (Orbax)" in capsys.readouterr().out


@needs_orbax
def test_sharded_checkpoint_manager(tmp_path):
    v = ps.Variable(0, name="step")
    for async_save in (False, True):
        directory = tmp_path / f"run-{async_save}"
        m = ps.CheckpointManager(directory, [v], max_to_keep=2, sharded=True, async_save=async_save)
        for step in range(4):
            v.assign(step)
            assert m.save(step) == str(directory / f"ckpt-{step}")
        m.wait()
        assert m.checkpoints == [str(directory / "ckpt-2"), str(directory / "ckpt-3")]
        again = ps.CheckpointManager(directory, [v], sharded=True)  # picks them up
        v.assign(-1)
        assert again.restore_latest() == str(directory / "ckpt-3")
        assert int(v.numpy()) == 3
        assert ps.checkpoint.list_variables(directory) == [("step", (), np.dtype(np.int32))]


@needs_orbax
def test_corrupt_sharded_checkpoint_is_a_clear_error_and_changes_nothing(tmp_path):
    w = ps.Variable(np.arange(4.0, dtype=np.float32), name="w")
    path = Path(ps.Saver([w], sharded=True).save(tmp_path / "ckpt"))
    w.assign(np.zeros(4, np.float32))
    data = [f for f in (path / "arrays").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert data
    for f in data:
        f.write_bytes(b"garbage")
    with pytest.raises(ps.checkpoint.CheckpointError, match="could not be read"):
        ps.Saver([w]).restore(path)
    np.testing.assert_array_equal(w.numpy(), np.zeros(4))
    (path / "paramstore" / "metadata").write_text("{not json")
    with pytest.raises(ps.checkpoint.CheckpointError, match="metadata .* cannot be read"):
        ps.Saver([w]).restore(path)
    with pytest.raises(ps.checkpoint.CheckpointError, match="not readable"):
        ps.checkpoint.list_variables(path)


@pytest.mark.slow
def test_data_parallel_example_runs():
    example = Path(__file__).resolve().parents[2] / "examples" / "data_parallel.py"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, str(example), "--tensor", "2", "--steps", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 devices, mesh {'data': 4, 'model': 2}" in proc.stdout
    assert "step   2  loss" in proc.stdout and "traced 1 time(s)" in proc.stdout


# ============================================================== multi-device (subprocess)


@check
def check_variable_placement():
    devs = jax.devices()
    assert len(devs) == 8
    mesh = auto_mesh((8,), ("x",))
    sh = NamedSharding(mesh, P("x"))
    v = ps.Variable(np.arange(16, dtype=np.float32), name="v", sharding=sh)
    assert v.sharding == sh and v.device is None
    assert [s.data.shape for s in v.value().addressable_shards] == [(2,)] * 8
    assert ps.Variable(1.0, device="cpu:3").device == devs[3]
    assert ps.Variable(1.0, device=devs[5]).device == devs[5]
    with ps.device("cpu:6"):
        inner = ps.Variable([1, 2])
        explicit = ps.Variable([1, 2], device="cpu:2")  # an explicit argument wins
        with ps.name_scope("scope"):
            got = ps.get_variable("g", shape=(3,))
    assert inner.device == devs[6] and explicit.device == devs[2] and got.device == devs[6]
    with ps.device(mesh) as rep:  # a Mesh: replicated over it
        r = ps.Variable(np.ones((3, 5), np.float32))
    assert r.sharding == rep == NamedSharding(mesh, P())
    with ps.device(sh):
        s = ps.Variable(np.ones(8, np.float32))
    assert s.sharding == sh
    assert ps.Variable(1.0).device == devs[0]  # the context is gone


@check
def check_assigns_keep_sharding():
    mesh = auto_mesh((4, 2), ("a", "b"))
    for spec in (P("a", "b"), P(None, "b"), P(), P("a")):
        sh = NamedSharding(mesh, spec)
        v = ps.Variable(np.zeros((8, 4), np.float32), sharding=sh)
        expect = np.zeros((8, 4), np.float32)
        v.assign(np.ones((8, 4), np.float32))  # from the host
        expect[:] = 1
        v.assign(jax.device_put(jnp.full((8, 4), 2.0), jax.devices()[7]))  # another device
        expect[:] = 2
        v.assign_add(1.0)
        v.assign_sub(np.ones((8, 4), np.float32))
        v.assign_add(jnp.arange(4.0))  # broadcast
        expect += np.arange(4.0)
        v[1:3].assign(np.full((2, 4), 7.0, np.float32))
        expect[1:3] = 7
        v[0].assign_add(1.0)
        expect[0] += 1
        v[:, 1].assign_sub([1.0] * 8)
        expect[:, 1] -= 1
        assert v.sharding == sh, (spec, v.sharding)
        np.testing.assert_array_equal(v.numpy(), expect)


def _assign_in_a_step(m):
    shardings = [
        NamedSharding(m, P()),
        NamedSharding(m, P("data")),
        NamedSharding(m, P(None, "model")),
        NamedSharding(m, P("data", "model")),
    ]
    vs = [ps.Variable(np.ones((8, 4), np.float32), sharding=sh) for sh in shardings]
    on3 = ps.Variable(np.ones(3, np.float32), device="cpu:3")
    count = ps.Variable(0)  # no placement: settles with the step's inputs, once

    @ps.function
    def step(x):
        for v in vs:
            v.assign(v * 0.5 + x)
        count.assign_add(1)
        return sum(v.sum() for v in vs)

    @ps.function
    def other(y):
        on3.assign_add(y)
        return on3.sum()

    for _ in range(3):  # waiting for each: see _block
        _block(step(jnp.float32(1.0)))
        _block(other(jnp.ones(3, jnp.float32)))
    for v, sh in zip(vs, shardings):
        assert v.sharding == sh, (v.sharding, sh)
        np.testing.assert_allclose(v.numpy(), 1.875)
    assert on3.device == jax.devices()[3]
    np.testing.assert_array_equal(on3.numpy(), 4.0)
    assert int(count.numpy()) == 3
    assert count.sharding == NamedSharding(m, P())
    assert step.trace_count == 1 and runner_cache_size(step) == 1, runner_cache_size(step)
    assert other.trace_count == 1 and runner_cache_size(other) == 1


@check
def check_function_keeps_sharding_without_recompiling():
    _assign_in_a_step(auto_mesh((4, 2), ("data", "model")))
    _assign_in_a_step(jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2))


@check
def check_optimizer_state_is_placed_like_the_params():
    mesh = auto_mesh((2, 4), ("data", "model"))
    w = ps.Variable(
        np.ones((4, 8), np.float32), name="w", sharding=NamedSharding(mesh, P(None, "model"))
    )
    b = ps.Variable(np.zeros(8, np.float32), name="b", sharding=NamedSharding(mesh, P("model")))
    opt = ps.Optimizer(optax.adam(1e-2), [w, b])
    by_name = {v.name: v for v in opt.variables}
    for name in ("w/mu", "w/nu"):
        assert by_name[f"optimizer/{name}"].sharding == w.sharding
    for name in ("b/mu", "b/nu"):
        assert by_name[f"optimizer/{name}"].sharding == b.sharding

    @ps.function
    def step(x):
        loss, grads = ps.value_and_grad(lambda: jnp.sum((x @ w + b) ** 2), [w, b])()
        opt.apply_gradients(grads)
        return loss

    x = jax.device_put(jnp.ones((6, 4)), NamedSharding(mesh, P("data")))
    for _ in range(3):
        _block(step(x))
    opt.apply_gradients([jnp.ones((4, 8)), jnp.ones(8)])  # eagerly, too
    after = {v.name: v.sharding for v in opt.variables}
    # the scalar step counters end up replicated over the params' mesh
    assert after.pop("optimizer/iterations") == NamedSharding(mesh, P())
    assert after.pop("optimizer/count") == NamedSharding(mesh, P())
    assert after == {k: v.sharding for k, v in by_name.items() if k in after}
    assert int(opt.iterations.numpy()) == 4
    assert step.trace_count == 1 and runner_cache_size(step) == 1, runner_cache_size(step)


@check
def check_optimizer_counters_are_placed_at_creation():
    mesh = auto_mesh((8,), ("data",))
    w = ps.Variable(np.ones((4, 8), np.float32), name="w", sharding=NamedSharding(mesh, P()))
    opt = ps.Optimizer(optax.adam(1e-2), [w])
    counters = [v for v in opt.variables if v.shape == ()]
    assert [v.name for v in counters] == ["optimizer/iterations", "optimizer/count"]
    for v in counters:  # before any step: with the params, not on the default device
        assert v.sharding == NamedSharding(mesh, P()), (v.name, v.sharding)


# ---------------------------------------------------------------- training on 8 devices


def _mlp_params(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (
            (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
            (rng.standard_normal(b) * 0.1).astype(np.float32),
        )
        for a, b in zip(sizes[:-1], sizes[1:])
    ]


def _data(n, d_in, d_out, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d_in)).astype(np.float32)
    y = rng.standard_normal((n, d_out)).astype(np.float32)
    return x, y


class MLP(ps.Module):
    """Dense layers; ``shardings[i] = (w_sharding, b_sharding)`` (None: unplaced)."""

    def __init__(self, params, shardings=None, name=None):
        shardings = shardings or [(None, None)] * len(params)
        self.layers = [
            (
                ps.Variable(w, name=f"w{i}", sharding=ws),
                ps.Variable(b, name=f"b{i}", sharding=bs),
            )
            for i, ((w, b), (ws, bs)) in enumerate(zip(params, shardings))
        ]

    def __call__(self, x):
        for i, (w, b) in enumerate(self.layers):
            x = x @ w + b
            if i < len(self.layers) - 1:
                x = jax.nn.relu(x)
        return x


def _train(model, x, y, steps=5):
    """Adam steps through one ps.function; the losses and the final parameters."""
    opt = ps.Optimizer(optax.adam(1e-2), model)

    @ps.function
    def step(x, y):
        loss, grads = ps.value_and_grad(lambda: jnp.mean((model(x) - y) ** 2), model)()
        opt.apply_gradients(grads)
        return loss

    losses = [float(step(x, y)) for _ in range(steps)]
    assert step.trace_count == 1
    assert runner_cache_size(step) == 1, runner_cache_size(step)  # no recompilation
    return losses, [v.numpy() for v in model.trainable_variables], opt


def _one_device_reference(params, x, y, steps=5):
    with ps.VariableStore(), ps.device("cpu:0"):
        model = MLP(params)
        losses, final, _ = _train(model, jnp.asarray(x), jnp.asarray(y), steps)
    return losses, final


@check
def check_data_parallel_mlp_matches_one_device():
    params = _mlp_params([16, 32, 32, 4])
    x, y = _data(64, 16, 4)
    want_losses, want_params = _one_device_reference(params, x, y)
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        with ps.VariableStore():
            mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
            with ps.device(mesh):  # parameters replicated over the 8 devices
                model = MLP(params)
            batch = NamedSharding(mesh, P("data"))
            xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
            losses, final, opt = _train(model, xs, ys)
            np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
            for got, want in zip(final, want_params):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            rep = NamedSharding(mesh, P())
            assert all(v.sharding == rep for v in model.variables)
            assert all(v.sharding == rep for v in opt.variables)


@check
def check_tensor_parallel_mlp_matches_one_device():
    params = _mlp_params([16, 32, 32, 4])
    x, y = _data(64, 16, 4)
    want_losses, want_params = _one_device_reference(params, x, y)
    mesh = auto_mesh((2, 4), ("data", "model"))

    def ns(*spec):
        return NamedSharding(mesh, P(*spec))

    # Megatron-style: column-parallel, row-parallel, then a replicated head.
    shardings = [
        (ns(None, "model"), ns("model")),
        (ns("model", None), ns()),
        (ns(), ns()),
    ]
    model = MLP(params, shardings)
    xs, ys = jax.device_put(x, ns("data")), jax.device_put(y, ns("data"))
    losses, final, opt = _train(model, xs, ys)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(final, want_params):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    placed = [sh for pair in shardings for sh in pair]
    assert [v.sharding for v in model.trainable_variables] == placed
    w0 = model.layers[0][0].value()
    assert {s.data.shape for s in w0.addressable_shards} == {(16, 8)}  # really split
    slots = {v.name: v.sharding for v in opt.variables}
    assert slots["optimizer/mlp/w0/mu"] == placed[0]
    assert slots["optimizer/mlp/w1/nu"] == placed[2]


# ------------------------------------------------------------------------ checkpoints


@check
def check_restore_keeps_each_variables_sharding():
    import tempfile

    mesh = auto_mesh((4, 2), ("a", "b"))
    other = auto_mesh((2,), ("x",), devices=jax.devices()[6:])
    w = ps.Variable(
        np.arange(32.0, dtype=np.float32).reshape(8, 4),
        name="w",
        sharding=NamedSharding(mesh, P("a", "b")),
    )
    b = ps.Variable(np.arange(4, dtype=np.int32), name="b", sharding=NamedSharding(mesh, P()))
    with tempfile.TemporaryDirectory() as d:
        path = ps.Saver([w, b]).save(os.path.join(d, "ckpt"))
        with ps.VariableStore():  # the same names, on another mesh and another device
            w2 = ps.Variable(
                np.zeros((8, 4), np.float32), name="w", sharding=NamedSharding(other, P(None, "x"))
            )
            b2 = ps.Variable(np.zeros(4, np.int32), name="b", device="cpu:5")
            sh_w2, sh_b2 = w2.sharding, b2.sharding
            ps.Saver([w2, b2]).restore(path)
            assert w2.sharding == sh_w2 and b2.sharding == sh_b2
            np.testing.assert_array_equal(w2.numpy(), w.numpy())
            np.testing.assert_array_equal(b2.numpy(), b.numpy())


@check
def check_sharded_checkpoint_restores_onto_another_mesh():
    import tempfile

    mesh = auto_mesh((4, 2), ("a", "b"))
    other = auto_mesh((2,), ("x",), devices=jax.devices()[2:4])
    w = ps.Variable(
        np.arange(64.0, dtype=np.float32).reshape(8, 8),
        name="w",
        sharding=NamedSharding(mesh, P("a", "b")),
    )
    c = ps.Variable(np.arange(4, dtype=np.int32), name="c", sharding=NamedSharding(mesh, P("a")))
    with tempfile.TemporaryDirectory() as d:
        path = ps.Saver([w, c], sharded=True).save(os.path.join(d, "ckpt"))
        # every device's shard went to disk once (one process: one OCDBT store)
        assert {p.name for p in Path(path).rglob("ocdbt.process_*")} == {"ocdbt.process_0"}
        with ps.VariableStore():
            w2 = ps.Variable(
                np.zeros((8, 8), np.float32), name="w", sharding=NamedSharding(other, P("x"))
            )
            c2 = ps.Variable(np.zeros(4, np.int32), name="c", device="cpu:7")
            placed = (w2.sharding, c2.sharding)
            ps.Saver([w2, c2]).restore(path)
            assert (w2.sharding, c2.sharding) == placed
            np.testing.assert_array_equal(w2.numpy(), w.numpy())
            np.testing.assert_array_equal(c2.numpy(), c.numpy())
            assert {s.data.shape for s in w2.value().addressable_shards} == {(4, 8)}
            # and onto new shardings, which the variables then keep
            new = NamedSharding(other, P(None, "x"))
            ps.Saver([w2]).restore(path, sharding=new)
            assert w2.sharding == new
            np.testing.assert_array_equal(w2.numpy(), w.numpy())
            w2.assign_add(1.0)
            assert w2.sharding == new


@check
def check_restore_onto_an_impossible_mesh_is_a_clear_error():
    import tempfile

    mesh = auto_mesh((2, 4), ("a", "b"))
    v = ps.Variable(np.arange(7.0, dtype=np.float32), name="seven", device="cpu:1")
    u = ps.Variable(np.arange(8.0, dtype=np.float32), name="eight", device="cpu:1")
    with tempfile.TemporaryDirectory() as d:
        for sharded in (False, True):
            path = ps.Saver([u, v], sharded=sharded).save(os.path.join(d, f"ckpt-{sharded}"))
            u.assign(np.zeros(8, np.float32))
            v.assign(np.zeros(7, np.float32))
            before = [(x.sharding, x.numpy()) for x in (u, v)]
            try:  # 'eight' fits over "a", 'seven' does not: nothing may change
                ps.Saver([u, v]).restore(path, sharding=NamedSharding(mesh, P("a")))
            except ValueError as e:
                message = str(e)
                assert "variable 'seven' with shape (7,) does not fit" in message, message
                assert "mesh {'a': 2, 'b': 4}" in message, message
            else:
                raise AssertionError("no error")
            for x, (sh, val) in zip((u, v), before):
                assert x.sharding == sh
                np.testing.assert_array_equal(x.numpy(), val)


# ------------------------------------------------------------------------- bad input


@check
def check_sharding_that_does_not_fit_is_a_clear_error():
    mesh = auto_mesh((2, 4), ("a", "b"))
    store = ps.VariableStore()
    with store:
        cases = [
            (
                (7,),
                P("a"),
                r"variable 'v' with shape \(7,\) does not fit: dimension 0 \(size "
                r"7\) would be split 2 ways by mesh axis 'a' of mesh \{'a': 2, 'b': 4\}",
            ),
            ((4, 6), P(None, "b"), r"dimension 1 \(size 6\) would be split 4 ways"),
            ((8,), P(("a", "b")), None),  # fits: 8 over 2 x 4
            ((4,), P("a", "b"), r"spec P\('a', 'b'\) names 2 dimensions, but the value has 1"),
        ]
        kept = []
        for shape, spec, message in cases:
            sh = NamedSharding(mesh, spec)
            if message is None:
                kept.append(ps.Variable(np.zeros(shape, np.float32), name="fits", sharding=sh))
                continue
            for initial in (np.zeros(shape, np.float32), functools.partial(jnp.zeros, shape)):
                try:
                    ps.Variable(initial, name="v", sharding=sh)
                except ValueError as e:
                    assert re.search(message, str(e)), str(e)
                else:
                    raise AssertionError(f"no error for {shape} on {spec}")
            with ps.device(sh):
                try:
                    ps.get_variable("v", shape=shape)
                except ValueError as e:
                    assert "does not fit" in str(e), str(e)
                else:
                    raise AssertionError("no error from get_variable")
        assert [v.name for v in store.variables()] == ["fits"], store.variables()
        assert ps.Variable(1.0, name="v").name == "v"  # no name was taken


@check
def check_reshard_moves_all_or_nothing():
    mesh = auto_mesh((8,), ("x",))
    a = ps.Variable(np.arange(8.0, dtype=np.float32), name="a")
    b = ps.Variable(np.arange(6.0, dtype=np.float32), name="b")
    before = [(v.sharding, v.numpy()) for v in (a, b)]
    try:
        ps.sharding.reshard([a, b], NamedSharding(mesh, P("x")))
    except ValueError as e:
        assert "variable 'b' with shape (6,)" in str(e), str(e)
    else:
        raise AssertionError("no error")
    for v, (sh, val) in zip((a, b), before):
        assert v.sharding == sh
        np.testing.assert_array_equal(v.numpy(), val)
    ps.sharding.reshard([a, b], lambda v: NamedSharding(mesh, P("x")) if v.name == "a" else mesh)
    assert a.sharding == NamedSharding(mesh, P("x"))
    assert b.sharding == NamedSharding(mesh, P())
    a.assign_add(1.0)
    assert a.sharding == NamedSharding(mesh, P("x"))
    np.testing.assert_array_equal(a.numpy(), np.arange(1.0, 9.0))


@check
def check_reshard_racing_a_step_is_atomic():
    """A reshard while a ps.function step runs in another thread: the step never meets a
    deleted (donated mid-copy) buffer, never sees one variable moved and the other not (its
    difference stays), and no update is lost (the counts match)."""
    mesh = auto_mesh((2,), ("x",), devices=jax.devices()[:2])
    targets = [NamedSharding(mesh, P("x")), NamedSharding(mesh, P())]
    a = ps.Variable(np.zeros(64, np.float32), name="a", sharding=targets[1])
    b = ps.Variable(np.full(64, 100.0, np.float32), name="b", sharding=targets[1])

    @ps.function
    def step():
        a.assign_add(1.0)
        b.assign_add(1.0)
        return a.value() - b.value()

    steps, failures, stop = [0], [], threading.Event()

    def stepping():
        try:
            while not stop.is_set():
                diff = _block(step())
                steps[0] += 1
                np.testing.assert_array_equal(diff, np.full(64, -100.0))
        except BaseException as e:
            failures.append(e)

    t = threading.Thread(target=stepping, daemon=True)
    t.start()
    try:
        for i in range(41):
            ps.sharding.reshard([a, b], targets[i % 2])
            _block([a.value(), b.value()])
            # never one moved and the other not (a step returns both as it compiled them)
            assert a.sharding == b.sharding, (a.sharding, b.sharding)
    finally:
        stop.set()
        t.join(BOUND)
    assert not t.is_alive(), f"the stepping thread is still running after {BOUND} s"
    assert not failures, repr(failures[0])
    assert steps[0] > 0
    _block(step())  # the last reshard (to targets[0]) holds: no step writes on an old sharding
    steps[0] += 1
    assert a.sharding == b.sharding == targets[0], (a.sharding, b.sharding)
    np.testing.assert_array_equal(a.numpy(), np.full(64, float(steps[0])))
    np.testing.assert_array_equal(b.numpy(), np.full(64, 100.0 + steps[0]))


@check
def check_a_step_compiled_before_a_reshard_writes_on_the_new_sharding():
    """A ps.function traced before a reshard traces again on its next call (its program's
    out_shardings pinned the old layout); one whose variables did not move does not; a call
    that checked before a reshard in another thread (simulated) retraces, nothing lost."""
    mesh = auto_mesh((8,), ("x",))
    split, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    v = ps.Variable(np.zeros(16, np.float32), name="v", sharding=split)
    w = ps.Variable(np.zeros(16, np.float32), name="w", sharding=split)

    @ps.function
    def step():
        v.assign_add(1.0)
        return v.value().sum()

    @ps.function
    def other():
        w.assign_add(1.0)

    assert float(step()) == 16.0
    other()
    ps.sharding.reshard(v, whole)
    assert float(step()) == 32.0
    assert v.sharding == whole, v.sharding
    assert step.trace_count == 2, step.trace_count
    step()  # current again: no further trace
    other()  # its variable did not move: its trace holds
    assert (step.trace_count, other.trace_count) == (2, 1)
    assert w.sharding == split
    # A call on the fast path that checked the epoch before another thread's reshard bumped
    # it: ownership refuses the stale program under the lock (nothing runs), the call traces
    # anew and runs once.
    ps.sharding.reshard(v, split)
    for entry in step._fast.values():
        entry.epoch = TRACE_EPOCH.epoch
    assert float(step()) == 64.0
    assert v.sharding == split, v.sharding
    assert step.trace_count == 3, step.trace_count
    np.testing.assert_array_equal(v.numpy(), np.full(16, 4.0))


# ========================================================================== the harness


multi_device_results, test_multi_device = multi_device_tests(
    CHECKS, __file__, "multi_device_results"
)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        run_checks(CHECKS, sys.argv[1])
