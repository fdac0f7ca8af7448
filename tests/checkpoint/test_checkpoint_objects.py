"""ps.Checkpoint: attribute-path keys, status, deferred restoration; CheckpointManager's inputs."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import optax
import pytest

import paramstore as ps
from paramstore.checkpoint import CheckpointError, CheckpointManager, Saver, objects, saver
from paramstore.checkpoint.formats.safetensors import file


class Dense(ps.Module):
    def __init__(self, n_in: int, n_out: int, name: str | None = None) -> None:
        self.w = ps.Variable(np.full((n_in, n_out), 0.5, np.float32), name="w")
        self.b = ps.Variable(np.zeros(n_out, np.float32), name="b")

    def __call__(self, x):
        return x @ self.w + self.b


class Lazy(ps.Module):
    """Builds its variables on the first call, as a Keras layer does."""

    def __init__(self, n_out: int) -> None:
        self.n_out = n_out

    def __call__(self, x):
        if "w" not in vars(self):
            self.w = ps.Variable(np.ones((x.shape[-1], self.n_out), np.float32), name="w")
        return x @ self.w


class MLP(ps.Module):
    def __init__(self) -> None:
        self.layers = [Dense(3, 4), Dense(4, 2)]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def perturb(variables, by=1.0):
    for v in variables:
        if np.issubdtype(v.dtype, np.floating):
            v.assign(v.numpy() + by)


def snapshot(variables):
    return [v.numpy().copy() for v in variables]


def test_keys_are_attribute_paths_and_a_rebuilt_model_restores(tmp_path):
    model = MLP()
    opt = ps.Optimizer(optax.adam(0.1), model)
    perturb(model.variables)
    ckpt = ps.Checkpoint(model=model, optimizer=opt)
    path = ckpt.save(tmp_path / "c.safetensors")
    names = [n for n, _, _ in ps.checkpoint.list_variables(path)]
    assert "model/layers/0/w" in names and "model/layers/1/b" in names
    assert "optimizer/iterations" in names
    # slots by the parameter's path and optax's, shared state by optax's path
    assert {"optimizer/model/layers/0/w/mu", "optimizer/model/layers/1/b/nu"} <= set(names)
    assert "optimizer/count" in names
    assert not any(n.startswith("mlp") for n in names)  # not store names

    rebuilt = MLP()  # a re-run notebook cell: store names mlp_1/...
    assert rebuilt.variables[0].name != model.variables[0].name
    opt2 = ps.Optimizer(optax.adam(0.1), rebuilt)
    status = ps.Checkpoint(model=rebuilt, optimizer=opt2).restore(path)
    status.assert_consumed()
    for a, b in zip(model.variables, rebuilt.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_shared_variable_is_saved_once_and_restored_everywhere(tmp_path):
    shared = Dense(2, 2)
    model = ps.Module()
    model.a = shared
    model.b = [shared]
    path = ps.Checkpoint(m=model).save(tmp_path / "c.safetensors")
    names = sorted(n for n, _, _ in ps.checkpoint.list_variables(path))
    assert names == ["m/a/b", "m/a/w"]
    shared.w.assign(np.zeros((2, 2), np.float32))
    ps.Checkpoint(m=model).restore(path).assert_consumed()
    assert np.all(model.b[0].w.numpy() == 0.5)


def test_assert_consumed_reports_unused_values_and_unmatched_variables(tmp_path):
    model = MLP()
    path = ps.Checkpoint(model=model).save(tmp_path / "c.safetensors")
    smaller = ps.Module()
    smaller.layers = [Dense(3, 4)]
    status = ps.Checkpoint(model=smaller).restore(path)
    with pytest.raises(CheckpointError, match=r"2 value\(s\).*model/layers/1/b"):
        status.assert_consumed()
    assert status.expect_partial() is status
    status.assert_existing_objects_matched()  # every existing variable got a value

    bigger = ps.Module()
    bigger.layers = [Dense(3, 4), Dense(4, 2), Dense(2, 2)]
    status = ps.Checkpoint(model=bigger).restore(path)
    with pytest.raises(CheckpointError, match=r"no value for 2 variable\(s\).*layers/2"):
        status.assert_existing_objects_matched()


def test_deferred_restoration_of_a_layer_built_on_first_call(tmp_path):
    layer = Lazy(2)
    model = ps.Module()
    model.head = layer
    layer(np.ones((1, 3), np.float32))
    layer.w.assign(np.full((3, 2), 7.0, np.float32))
    path = ps.Checkpoint(model=model).save(tmp_path / "c.safetensors")

    fresh = ps.Module()
    fresh.head = Lazy(2)
    status = ps.Checkpoint(model=fresh).restore(path)
    with pytest.raises(CheckpointError, match="model/head/w"):
        status.assert_consumed()  # not built yet
    out = fresh.head(np.ones((1, 3), np.float32))  # builds w: receives the saved value
    np.testing.assert_array_equal(fresh.head.w.numpy(), np.full((3, 2), 7.0))
    np.testing.assert_array_equal(np.asarray(out), np.full((1, 2), 21.0))
    status.assert_consumed()
    assert "_ps_pending" not in vars(fresh.head)  # nothing left behind


def test_deferred_restoration_of_a_submodule_assigned_later(tmp_path):
    model = MLP()
    perturb(model.variables, 2.0)
    path = ps.Checkpoint(model=model).save(tmp_path / "c.safetensors")
    empty = ps.Module()
    status = ps.Checkpoint(model=empty).restore(path)
    empty.layers = [Dense(3, 4), Dense(4, 2)]  # a whole list of modules, built later
    status.assert_consumed()
    for a, b in zip(model.variables, empty.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_deferred_value_of_the_wrong_shape_is_an_error(tmp_path):
    layer = Lazy(2)
    layer(np.ones((1, 3), np.float32))
    holder = ps.Module()
    holder.head = layer
    path = ps.Checkpoint(model=holder).save(tmp_path / "c.safetensors")
    fresh = ps.Module()
    fresh.head = Lazy(2)
    ps.Checkpoint(model=fresh).restore(path)
    with pytest.raises(CheckpointError, match="shape"):
        fresh.head(np.ones((1, 5), np.float32))  # builds a (5, 2) w


def test_module_setattr_hook_is_inert_without_pending_restores():
    m = Dense(2, 2)
    m.extra = ps.Variable(np.ones(2, np.float32), name="extra")
    assert "_ps_pending" not in vars(m)
    assert len(m.variables) == 3


def test_generator_like_objects_and_nested_checkpoints(tmp_path):
    class Gen:
        def __init__(self) -> None:
            self.state = ps.Variable(np.array([1, 2], np.uint32), trainable=False, name="s")

    gen = Gen()
    v = ps.Variable(np.float32(3.0), name="v")
    inner = ps.Checkpoint(v=v)
    path = ps.Checkpoint(rng=gen, inner=inner).save(tmp_path / "c.safetensors")
    assert sorted(n for n, _, _ in ps.checkpoint.list_variables(path)) == ["inner/v", "rng/state"]
    gen.state.assign(np.array([9, 9], np.uint32))
    v.assign(0.0)
    ps.Checkpoint(rng=gen, inner=inner).restore(path).assert_consumed()
    assert gen.state.numpy().tolist() == [1, 2] and float(v.numpy()) == 3.0


def test_objects_exposing_variables_are_keyed_by_position(tmp_path):
    class Bag:
        def __init__(self) -> None:
            self.variables = [ps.Variable(np.float32(1.0), name="x")]

    bag = Bag()
    path = ps.Checkpoint(bag=bag).save(tmp_path / "c.safetensors")
    assert [n for n, _, _ in ps.checkpoint.list_variables(path)] == ["bag/variables/0"]
    bag.variables[0].assign(5.0)
    ps.Checkpoint(bag=bag).restore(path).assert_consumed()
    assert float(bag.variables[0].numpy()) == 1.0


def test_checkpoint_rejects_other_objects():
    with pytest.raises(TypeError, match="expected a Module"):
        ps.Checkpoint(model=object())
    with pytest.raises(ValueError, match="at least one"):
        ps.Checkpoint()


def test_corrupt_file_changes_nothing_and_defers_nothing(tmp_path):
    model = MLP()
    path = ps.Checkpoint(model=model).save(tmp_path / "c.safetensors")
    raw = bytearray(Path(path).read_bytes())
    raw[-3] ^= 0x10
    Path(path).write_bytes(bytes(raw))
    rebuilt = ps.Module()
    rebuilt.layers = [Dense(3, 4)]
    before = snapshot(rebuilt.variables)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        ps.Checkpoint(model=rebuilt).restore(path)
    for a, b in zip(before, rebuilt.variables):
        np.testing.assert_array_equal(a, b.numpy())
    assert "_ps_pending" not in vars(rebuilt)


def test_manager_with_a_checkpoint(tmp_path):
    model = MLP()
    opt = ps.Optimizer(optax.sgd(0.1), model)
    manager = CheckpointManager(tmp_path / "run", ps.Checkpoint(model=model, optimizer=opt))
    perturb(model.variables, 3.0)
    path = manager.save(1)
    assert os.path.basename(path) == "ckpt-1.safetensors"
    rebuilt = MLP()
    opt2 = ps.Optimizer(optax.sgd(0.1), rebuilt)
    again = CheckpointManager(tmp_path / "run", ps.Checkpoint(model=rebuilt, optimizer=opt2))
    assert again.restore_latest() == path
    for a, b in zip(model.variables, rebuilt.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_manager_accepts_modules_and_optimizers_in_a_list(tmp_path):
    model = MLP()
    opt = ps.Optimizer(optax.adam(0.1), model)
    manager = CheckpointManager(tmp_path / "run", [model, opt])
    path = manager.save(3)
    names = {n for n, _, _ in ps.checkpoint.list_variables(path)}
    assert names == {v.name for v in (*model.variables, *opt.variables)}


@pytest.mark.parametrize(
    "step, error", [(-5, ValueError), (1.0, TypeError), (True, TypeError), ("3", TypeError)]
)
def test_manager_bad_steps_write_nothing(tmp_path, step, error):
    v = ps.Variable(np.float32(1.0), name="v")
    manager = CheckpointManager(tmp_path / "run", [v])
    with pytest.raises(error, match="step"):
        manager.save(step)
    assert os.listdir(tmp_path / "run") == []


def test_allow_missing_that_restores_nothing_is_an_error(tmp_path):
    model = Dense(2, 2)
    path = Saver(model).save(tmp_path / "c.safetensors")
    rebuilt = Dense(2, 2)  # dense_1/...
    before = snapshot(rebuilt.variables)
    perturb(model.variables)
    with pytest.raises(CheckpointError, match=r"lacks 2 variable\(s\)"):
        Saver(rebuilt).restore(path)
    with pytest.raises(CheckpointError, match="would restore nothing.*ps.Checkpoint"):
        Saver(rebuilt).restore(path, allow_missing=True)
    for a, b in zip(before, rebuilt.variables):
        np.testing.assert_array_equal(a, b.numpy())


def test_saver_of_a_dict_of_modules_points_to_checkpoint():
    with pytest.raises(TypeError, match=r"ps.Checkpoint\(model=...\)"):
        Saver({"model": Dense(2, 2)})


def test_deferred_restoration_inside_a_compiled_function(tmp_path):
    class LazyInTrace(ps.Module):
        def __init__(self) -> None:
            pass

        def __call__(self, x):
            if "w" not in vars(self):
                n = x.shape[-1]
                self.w = ps.Variable(lambda: np.ones((n, 2), np.float32), name="w")
            return x @ self.w

    layer = LazyInTrace()
    layer(np.ones((1, 3), np.float32))
    layer.w.assign(np.full((3, 2), 7.0, np.float32))
    path = ps.Checkpoint(m=layer).save(tmp_path / "c.safetensors")
    fresh = LazyInTrace()
    status = ps.Checkpoint(m=fresh).restore(path)

    @ps.function
    def run(x):
        return fresh(x)

    np.testing.assert_array_equal(np.asarray(run(np.ones((1, 3), np.float32))), [[21.0, 21.0]])
    np.testing.assert_array_equal(fresh.w.numpy(), np.full((3, 2), 7.0))
    status.assert_consumed()


def test_a_save_walks_the_objects_once_and_checks_each_name_once(tmp_path, monkeypatch):
    """Checkpoint.save builds its {path: variable} mapping once and checks each name once
    (it used to build it twice and check every name three times)."""
    counts = {"walk": 0, "check": 0, "file check": 0}

    def counted(key, fn):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(objects, "object_paths", counted("walk", objects.object_paths))
    monkeypatch.setattr(saver, "check_name", counted("check", saver.check_name))
    monkeypatch.setattr(file, "check_name", counted("file check", file.check_name))
    model = ps.Module()
    model.w = ps.Variable(np.ones(3, np.float32))
    model.b = [ps.Variable(0.0), ps.Variable(1.0)]
    path = ps.Checkpoint(model=model).save(tmp_path / "c.safetensors")
    assert counts == {"walk": 1, "check": 3, "file check": 0}
    assert sorted(name for name, _, _ in ps.checkpoint.list_variables(path)) == [
        "model/b/0",
        "model/b/1",
        "model/w",
    ]
    with pytest.raises(CheckpointError, match="'__metadata__' is reserved"):
        ps.checkpoint.write_arrays(tmp_path / "x", {"__metadata__": np.ones(1)})  # still checked
