"""Issue 36 item 15 and issue 38 items 3 and 6: small checks that accepted bad input or
refused good input. Each bad input raises the right error, says what is wrong, and changes
nothing (no variable created, no name taken, no value changed)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import paramstore as ps


def _names(store: ps.VariableStore) -> list[str]:
    return sorted(v.name for v in store.variables())


# ----------------------------------------------------------------- issue 38, item 6


@pytest.mark.parametrize("dtype", [">f4", ">f8", ">i4", ">i2"])
def test_a_big_endian_array_makes_a_variable_in_native_order(dtype: str) -> None:
    data = np.arange(6, dtype=dtype).reshape(2, 3)
    v = ps.Variable(data)
    native = ps.Variable(data.astype(data.dtype.newbyteorder("=")))
    assert v.dtype == native.dtype
    np.testing.assert_array_equal(v.numpy(), data)
    # and inside a list, and with dtype=
    np.testing.assert_array_equal(ps.Variable([data[0], data[1]]).numpy(), data)
    np.testing.assert_array_equal(ps.Variable(data, dtype=jnp.float32).numpy(), data)


# ----------------------------------------------------------------- issue 36, item 15


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"initial_scale": 1e39}, r"initial_scale must be a finite number > 0 that float32"),
        ({"initial_scale": 2.0**128}, r"initial_scale .*float32.*got 3\.40"),
        ({"initial_scale": 10**400}, r"initial_scale must be"),
        ({"initial_scale": 1e-50}, r"initial_scale must be"),  # 0 in float32
        ({"dynamic_growth_steps": 2**40}, r"dynamic_growth_steps must be an int in \[1, 2\*\*31\]"),
        ({"dynamic_growth_steps": 2**31 + 1}, r"got 2147483649"),
    ],
)
def test_loss_scale_refuses_what_float32_and_int32_cannot_hold(fresh_store, kwargs, match):
    var = ps.Variable(np.ones(2, np.float32), name="w")
    inner = ps.Optimizer(optax.sgd(0.1), [var])
    before = _names(fresh_store)
    with pytest.raises(ValueError, match=match):
        ps.LossScaleOptimizer(inner, **kwargs)
    assert _names(fresh_store) == before
    np.testing.assert_array_equal(var.numpy(), [1.0, 1.0])
    assert ps.LossScaleOptimizer(inner).scale.name == "loss_scale_optimizer/scale"


def test_loss_scale_largest_growth_steps_and_scale_work(fresh_store):
    var = ps.Variable(np.ones(2, np.float32), name="w")
    big = float(np.finfo(np.float32).max)
    opt = ps.LossScaleOptimizer(
        ps.Optimizer(optax.sgd(0.5), [var]), initial_scale=big, dynamic_growth_steps=2**31
    )
    assert math.isfinite(float(opt.scale.numpy()))
    opt.apply_gradients([(jnp.full(2, big), var)])  # unscaled: 1.0 each; finite
    np.testing.assert_allclose(var.numpy(), [0.5, 0.5])
    assert int(opt.step_counter.numpy()) == 1


@pytest.mark.parametrize("alpha", [float("inf"), -float("inf"), float("nan"), 10**400, 0.0])
def test_lora_alpha_must_be_finite_and_takes_no_name(alpha) -> None:
    with pytest.raises(ValueError, match=r"lora_alpha must be a positive number, finite.*got"):
        ps.nn.Dense(3, lora_rank=2, lora_alpha=alpha)
    layer = ps.nn.Dense(3)
    assert layer.scope_name == "dense"


def test_precision_and_recall_take_numpy_thresholds_as_keras() -> None:
    y_true = jnp.array([1, 0, 1, 1, 0, 1])
    y_pred = jnp.array([0.9, 0.6, 0.4, 0.7, 0.2, 0.55])
    for cls in (ps.metrics.Precision, ps.metrics.Recall):
        plain = cls(thresholds=0.5)
        numpy_one = cls(thresholds=np.float32(0.5))
        plain.update_state(y_true, y_pred)
        numpy_one.update_state(y_true, y_pred)
        assert np.shape(numpy_one.result()) == ()  # one threshold: a scalar, as a float gives
        np.testing.assert_array_equal(numpy_one.result(), plain.result())
        listed = cls(thresholds=[0.3, 0.6])
        numpy_list = cls(thresholds=[np.float32(0.3), np.float64(0.6)])
        listed.update_state(y_true, y_pred)
        numpy_list.update_state(y_true, y_pred)
        np.testing.assert_array_equal(numpy_list.result(), listed.result())
    auc = ps.metrics.AUC(thresholds=[np.float32(0.5)])
    assert auc is not None


@pytest.mark.parametrize("bad", [np.float32(1.5), [np.float64(0.2), np.float32(-0.1)], True])
def test_precision_still_refuses_numpy_values_out_of_range(fresh_store, bad) -> None:
    before = _names(fresh_store)
    with pytest.raises(ValueError, match=r"thresholds must be floats in \[0, 1\]"):
        ps.metrics.Precision(thresholds=bad)
    assert _names(fresh_store) == before


def test_update_with_a_dict_as_a_value_is_a_type_error_naming_it() -> None:
    v = ps.Variable(jnp.ones(3), name="v")
    w = ps.Variable(jnp.zeros(2), name="w")
    for partial in (True, False):
        values = {"v": {"x": 1}} if partial else {"v": {"x": 1}, "w": np.ones(2)}
        with pytest.raises(TypeError, match=r"value for variable 'v' is a dict.*flat"):
            ps.update([v, w], values, partial=partial)
        np.testing.assert_array_equal(v.numpy(), np.ones(3))
        np.testing.assert_array_equal(w.numpy(), np.zeros(2))


def test_average_name_before_apply_is_the_name_apply_gives() -> None:
    w = ps.Variable(jnp.ones(3), name="w")
    ps.Variable(jnp.ones(3), name="w/EMA")  # the plain name is taken
    ema = ps.ExponentialMovingAverage(0.9, name="EMA")
    predicted = ema.average_name(w)
    ema.apply([w])
    assert predicted == ema.average(w).name == "w/EMA_1"
    assert ema.average_name(w) == predicted


# ----------------------------------------------------------------- issue 38, item 3


def test_a_sharded_save_on_a_one_device_mesh(tmp_path) -> None:
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    v = ps.Variable(jnp.arange(12.0).reshape(3, 4), name="v", sharding=sharding)
    path = ps.Checkpoint(v=v, sharded=True).save(tmp_path / "sharded")
    assert mesh.devices.size == len(sharding.device_set) == 1  # JAX's cached set intact
    v.assign(jnp.zeros((3, 4)))
    ps.Checkpoint(v=v).restore(path).assert_consumed()
    np.testing.assert_array_equal(v.numpy(), np.arange(12.0).reshape(3, 4))
    assert v.sharding == sharding
