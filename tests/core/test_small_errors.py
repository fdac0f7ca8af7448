"""Small error paths of issue 28: each a clear error naming what is wrong, nothing changed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paramstore as ps


def test_a_metric_name_that_is_not_a_str_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="module name must be a str.*int 123"):
        ps.metrics.Mean(name=123)
    assert ps.metrics.Mean(name="loss").name == "loss"


def test_update_with_none_names_the_variable_and_changes_nothing() -> None:
    a = ps.Variable(np.zeros(2, np.float32), name="upd_a")
    b = ps.Variable(np.zeros(3, np.float32), name="upd_b")
    with pytest.raises(TypeError, match="value for variable 'upd_b' is None.*shape \\(3,\\)"):
        ps.update([a, b], {"upd_a": np.ones(2, np.float32), "upd_b": None})
    np.testing.assert_array_equal(a.numpy(), np.zeros(2))
    np.testing.assert_array_equal(b.numpy(), np.zeros(3))


def test_a_layout_using_a_mesh_axis_twice_names_the_variable() -> None:
    mesh = jax.make_mesh((1,), ("x",))
    layout = ps.sharding.LayoutMap(mesh)
    layout["dup.*"] = ("x", "x")
    match = "variable 'dup_w'.*mesh axis 'x' more than once"
    with pytest.raises(ValueError, match=match), ps.device(layout):
        ps.Variable(jnp.ones((2, 2)), name="dup_w")


def test_initialize_gives_string_variables_their_initial_values() -> None:
    with ps.abstract():
        s = ps.Variable("hello", name="init_s")
        t = ps.Variable(np.array(["a", "bc"]), name="init_t")
        f = ps.Variable(jnp.ones(3), name="init_f")
    assert sorted(v.name for v in ps.initialize([s, t, f])) == ["init_f", "init_s", "init_t"]
    assert not any(v.is_abstract for v in (s, t, f))
    assert s.numpy() == "hello"
    assert list(t.numpy()) == ["a", "bc"]
    np.testing.assert_array_equal(f.numpy(), np.ones(3))
