"""ps.Variable: dtypes, reads, assigns, slices, array behaviour, names, placement, pytrees."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _backends import device_names

import paramstore as ps

# ----------------------------------------------------------------------------- helpers


def snapshot(v):
    """Everything that must survive a failed operation untouched."""
    return {
        "value": v.value(),  # the very same array object: nothing was swapped in
        "bits": v.numpy().tobytes(),
        "dtype": v.dtype,
        "shape": v.shape,
        "name": v.name,
        "trainable": v.trainable,
        "sharding": v.sharding,
    }


def assert_unchanged(v, snap):
    assert v.value() is snap["value"]
    assert v.numpy().tobytes() == snap["bits"]
    assert v.dtype == snap["dtype"]
    assert v.shape == snap["shape"]
    assert v.name == snap["name"]
    assert v.trainable == snap["trainable"]
    assert v.sharding == snap["sharding"]


def store_snapshot(store):
    return [(v.name, id(v)) for v in store.variables()]


# ----------------------------------------------------------------------- dtype inference


@pytest.mark.parametrize(
    ("value", "dtype", "shape"),
    [
        (3.14, np.float32, ()),
        (7, np.int32, ()),
        ([1, 2, 3], np.int32, (3,)),
        ([True, False], np.bool_, (2,)),
        ([5 + 4j], np.complex64, (1,)),
        ([[1.0, 2.0], [3.0, 4.0]], np.float32, (2, 2)),
        ([], np.float32, (0,)),
    ],
)
def test_dtype_inference_follows_tensorflow(value, dtype, shape):
    v = ps.Variable(value)
    assert v.dtype == np.dtype(dtype)
    assert v.shape == shape
    assert isinstance(v.value(), jax.Array)
    assert v.value().dtype == np.dtype(dtype)
    np.testing.assert_array_equal(v.numpy(), np.asarray(value, dtype=dtype))


@pytest.mark.tf
@pytest.mark.parametrize("value", [3.14, 7, [1, 2, 3], [True, False], [[1.0, 2.0]], -5, 0.5])
def test_dtype_inference_matches_tensorflow_oracle(tf, value):
    assert ps.Variable(value).dtype == np.dtype(tf.Variable(value).dtype.as_numpy_dtype)


@pytest.mark.tf
def test_repr_and_errors_match_tensorflow_oracle(tf):
    # Scalars print as the Python value (numpy=1.5; 0.1 as float32 is 0.10000000149011612).
    for value in ([1, 2, 3], 1.5, 7, True, 0.1, -5, [[True, False]]):
        t = tf.Variable(value, name="name")
        with ps.VariableStore():  # a fresh store: the name stays 'name', not 'name_1'
            p = ps.Variable(value, name="name")
        expected = repr(t).replace("<tf.Variable 'name:0'", "<ps.Variable 'name'")
        assert expected.startswith("<ps.Variable 'name'")  # the replace did replace
        assert repr(p) == expected
    with pytest.raises(ValueError):
        tf.Variable([1.0, 2.0]).assign([1.0, 2.0, 3.0])
    with pytest.raises(ValueError):
        ps.Variable([1.0, 2.0]).assign([1.0, 2.0, 3.0])
    with pytest.raises(TypeError):
        hash(tf.Variable(1.0))
    with pytest.raises(TypeError):
        hash(ps.Variable(1.0))


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.float16, np.int32, np.bool_])
def test_numpy_arrays_keep_their_dtype(dtype):
    arr = np.array([1, 0, 1], dtype=dtype)
    v = ps.Variable(arr)
    assert v.dtype == np.dtype(dtype)
    assert v.value().dtype == np.dtype(dtype)
    np.testing.assert_array_equal(v.numpy(), arr)


def test_jax_arrays_keep_their_dtype():
    v = ps.Variable(jnp.ones((2,), jnp.bfloat16))
    assert v.dtype == jnp.bfloat16
    w = ps.Variable(np.arange(3, dtype=np.int64))  # 64-bit becomes 32-bit without x64, as in JAX
    assert w.dtype == np.int32


@pytest.mark.parametrize(
    ("value", "dtype", "expected"),
    [
        ([1, 2], jnp.float16, np.array([1, 2], np.float16)),
        (1, jnp.complex64, np.array(1, np.complex64)),
        (np.array([1, 2], np.int32), "float32", np.array([1, 2], np.float32)),
        (np.array([1.0, 2.0]), "float32", np.array([1, 2], np.float32)),
    ],
)
def test_explicit_dtype_casts(value, dtype, expected):
    # Casts that keep the values (as assign takes them); the lossy ones that used to
    # truncate ([1.7, -2.2] to int32, [0, 3] to bool) are refused: tests/variable/test_variable_input.py
    v = ps.Variable(value, dtype=dtype)
    assert v.dtype == expected.dtype
    assert v.numpy().dtype == expected.dtype
    np.testing.assert_array_equal(v.numpy(), expected)


def test_variable_holds_a_strongly_typed_array():
    # A weakly typed JAX value (from Python scalars) must not make the variable weakly typed:
    # a float32 variable behaves like a float32 array in every expression.
    v = ps.Variable(jax.lax.add(1.0, 2.0))
    assert v.dtype == np.float32
    assert not v.value().weak_type
    assert (v * np.ones(2, np.float16)).dtype == np.float32
    v.assign(jax.lax.add(2.0, 2.0))
    assert not v.value().weak_type
    assert (v * np.ones(2, np.float16)).dtype == np.float32
    assert v.numpy() == 4.0


def test_unknown_dtype_raises_type_error_and_creates_nothing(fresh_store):
    before = store_snapshot(fresh_store)
    with pytest.raises(TypeError, match="(?i)dtype.*not_a_dtype"):
        ps.Variable([1, 2], dtype="not_a_dtype")
    assert store_snapshot(fresh_store) == before
    assert ps.Variable(1).name == "Variable"  # no name was used up


def test_64bit_dtype_without_x64_is_a_clear_type_error(fresh_store):
    with pytest.raises(TypeError, match="64-bit"):
        ps.Variable([1.0], dtype=jnp.float64)
    assert fresh_store.variables() == []


@pytest.mark.parametrize("args", [(), (None,)])
def test_no_initial_value_raises_type_error(fresh_store, args):
    with pytest.raises(TypeError, match="missing required argument 'initial_value'"):
        ps.Variable(*args)
    assert fresh_store.variables() == []


def test_zero_arg_callable_initial_value():
    calls = []

    def init():
        calls.append(1)
        return jnp.arange(3.0)

    v = ps.Variable(init, name="c")
    assert calls == [1]
    assert v.dtype == np.float32
    np.testing.assert_array_equal(v.numpy(), [0.0, 1.0, 2.0])
    w = ps.Variable(lambda: [1, 2], dtype=jnp.float32)
    assert w.dtype == np.float32
    np.testing.assert_array_equal(w.numpy(), [1.0, 2.0])


def test_failing_initializer_creates_nothing(fresh_store):
    def boom():
        raise RuntimeError("init failed")

    with pytest.raises(RuntimeError, match="init failed"):
        ps.Variable(boom, name="w")
    assert fresh_store.variables() == []
    assert ps.Variable(1.0, name="w").name == "w"


def test_building_from_another_variable_copies():
    a = ps.Variable([1.0, 2.0], name="a")
    b = ps.Variable(a, name="b")
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(b.numpy(), [1.0, 2.0])
    a.assign([5.0, 6.0])
    np.testing.assert_array_equal(b.numpy(), [1.0, 2.0])
    b.assign_add([1.0, 1.0])
    np.testing.assert_array_equal(a.numpy(), [5.0, 6.0])
    np.testing.assert_array_equal(b.numpy(), [2.0, 3.0])
    with pytest.raises(TypeError, match="float32 to variable .* of dtype int32"):
        ps.Variable(a, dtype=jnp.int32)  # lossy: refused as assign refuses it
    c = ps.Variable(a.value().astype(jnp.int32), dtype=jnp.int32)
    assert c.dtype == np.int32
    np.testing.assert_array_equal(c.numpy(), [5, 6])
    assert ps.Variable(a, dtype=jnp.float32).dtype == np.float32


# ---------------------------------------------------------------------------- strings


@pytest.mark.parametrize(
    "make", [lambda: ps.Variable(["abc"]), lambda: ps.Variable(["abc"], dtype=str)]
)
def test_string_variable(make):
    s = make()
    assert s.shape == (1,)
    assert isinstance(s.value(), np.ndarray)
    assert s.value().dtype.kind == "T"  # NumPy StringDType, host side
    assert s.device is None and s.sharding is None
    assert s.numpy().tolist() == ["abc"]
    out = s.numpy()
    out[0] = "changed"
    assert s.numpy().tolist() == ["abc"]  # numpy() is a copy
    assert s.assign(["xyz"]) is s
    assert s.numpy().tolist() == ["xyz"]
    assert repr(s) == (
        f"<ps.Variable '{s.name}' shape=(1,) dtype=string, numpy=array(['xyz'], dtype=StringDType())>"
    )


def test_string_variable_scalar_from_dtype_str():
    s = ps.Variable("hello", dtype=str, name="greeting")
    assert s.shape == ()
    assert s.numpy().item() == "hello"
    assert s.name == "greeting"
    s.assign("bye", read_value=False)
    assert s.numpy().item() == "bye"


def test_string_variable_from_another_string_variable_or_string_array():
    s = ps.Variable(["a", "b"], name="s")
    copy = ps.Variable(s)
    assert copy.numpy().tolist() == ["a", "b"] and copy.value().dtype.kind == "T"
    s.assign(["c", "d"])
    assert copy.numpy().tolist() == ["a", "b"]
    t = ps.Variable(np.array(["x"], dtype=np.dtypes.StringDType()))
    assert t.numpy().tolist() == ["x"]
    t.assign(np.array(["y"]))  # a fixed-width NumPy str array is fine too
    assert t.numpy().tolist() == ["y"]


def test_string_variable_rejects_bad_assigns_and_changes_nothing():
    s = ps.Variable(["abc", "de"])
    snap = snapshot(s)
    with pytest.raises(ValueError, match=r"Shapes \(2,\) and \(3,\) are incompatible"):
        s.assign(["a", "b", "c"])
    assert_unchanged(s, snap)
    with pytest.raises(TypeError, match="string"):
        s.assign([1, 2])  # numbers are not strings: no silent '1', '2'
    assert_unchanged(s, snap)
    with pytest.raises(TypeError, match="string"):
        s.assign_add(["x", "y"])
    assert_unchanged(s, snap)


# ----------------------------------------------------------------------------- reading


def test_value_read_value_and_numpy():
    v = ps.Variable([1.0, 2.0, 3.0])
    assert isinstance(v.value(), jax.Array)
    assert v.read_value() is v.value()
    n = v.numpy()
    assert isinstance(n, np.ndarray) and n.dtype == np.float32
    n[0] = 100.0  # a copy: the variable does not change
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0, 3.0])
    assert not np.shares_memory(v.numpy(), v.numpy())


def test_properties():
    v = ps.Variable(jnp.zeros((2, 3)), name="p", trainable=False)
    assert v.shape == (2, 3)
    assert v.ndim == 2
    assert v.size == 6
    assert v.dtype == np.float32
    assert v.name == "p"
    assert v.trainable is False
    assert ps.Variable(1.0).trainable is True
    assert v.device == jax.devices()[0]
    assert v.sharding == v.value().sharding


def test_numpy_view_cannot_write_into_the_variable():
    v = ps.Variable([1.0, 2.0])
    arr = np.asarray(v)
    try:
        arr[0] = 42.0
    except ValueError:
        pass  # read-only view: fine
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])


# ---------------------------------------------------------------------------- assigns


def test_assign_methods_return_the_variable_or_none():
    a = ps.Variable([1, 2], name="a")
    assert a.assign_add([2, 3]) is a
    np.testing.assert_array_equal(a.assign_add([2, 3]).numpy(), [5, 8])
    assert a.assign_sub([1, 1]) is a
    assert a.assign([0, 1]) is a
    assert a.assign([7, 7], read_value=False) is None
    assert a.assign_add([1, 1], read_value=False) is None
    assert a.assign_sub([2, 2], read_value=False) is None
    np.testing.assert_array_equal(a.numpy(), [6, 6])
    assert a.dtype == np.int32 and a.value().dtype == np.int32


def test_assign_add_and_sub_broadcast_the_delta():
    v = ps.Variable(jnp.zeros((2, 3)))
    v.assign_add(1.5)
    v.assign_sub([0.5, 0.0, 1.0])
    np.testing.assert_array_equal(
        v.numpy(), np.array([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]], np.float32)
    )
    assert v.shape == (2, 3)


@pytest.mark.parametrize(
    ("var_value", "new", "expected"),
    [
        (np.zeros(2, np.float32), [1, 2], np.array([1, 2], np.float32)),
        (np.zeros(2, np.int32), np.array([3, -4], np.int8), np.array([3, -4], np.int32)),
        (np.zeros(2, np.float32), np.array([3, 4], np.int16), np.array([3, 4], np.float32)),
        (np.zeros(2, np.uint8), [200, 255], np.array([200, 255], np.uint8)),
        (np.zeros(2, np.int8), [-128, 127], np.array([-128, 127], np.int8)),
        (np.zeros(2, np.float16), [0.5, -1.25], np.array([0.5, -1.25], np.float16)),
        (np.zeros(2, np.complex64), [1, 2.5], np.array([1, 2.5], np.complex64)),
        (np.zeros(2, np.complex64), np.array([1, 2], np.float32), np.array([1, 2], np.complex64)),
        (np.zeros(2, np.int32), [True, False], np.array([1, 0], np.int32)),
        (np.zeros(2, np.bool_), [True, False], np.array([True, False])),
        (
            np.zeros(2, np.float32),
            jnp.array([1.0, 2.0], jnp.bfloat16),
            np.array([1, 2], np.float32),
        ),
    ],
)
def test_lossless_conversions_keep_the_variable_dtype(var_value, new, expected):
    v = ps.Variable(var_value)
    v.assign(new)
    assert v.dtype == expected.dtype
    assert v.value().dtype == expected.dtype
    assert v.numpy().dtype == expected.dtype
    np.testing.assert_array_equal(v.numpy(), expected)


def test_python_ints_update_unsigned_variables():
    v = ps.Variable(np.array([10, 20], np.uint8))
    v.assign_add(5)
    v.assign_sub([1, 2])
    v[0].assign_add(1)
    np.testing.assert_array_equal(v.numpy(), np.array([15, 23], np.uint8))
    assert v.dtype == np.uint8


@pytest.mark.parametrize(
    ("var_value", "bad", "src_name"),
    [
        (np.array(1, np.int32), 1.5, "float"),
        (np.zeros(2, np.int32), [1.5, 2.0], "float"),
        (np.zeros(2, np.float32), np.array([1.0, 2.0], np.float64), "float64"),
        (np.zeros(2, np.int32), jnp.array([1.0, 2.0], jnp.float32), "float32"),
        (np.zeros(2, np.int32), np.array([1, 2], np.int64), "int64"),
        (np.zeros(2, np.float32), [1j, 2.0], "complex"),
        (np.zeros(2, np.float16), np.ones(2, np.float32), "float32"),
        (np.zeros(2, np.bool_), [1, 0], "int"),
        (np.zeros(2, np.int32), ["1", "2"], "str"),
        (np.zeros(2, np.int8), [300, 1], ""),
        (np.zeros(2, np.uint8), [-1, 1], ""),
    ],
)
def test_lossy_assign_raises_type_error_and_changes_nothing(var_value, bad, src_name):
    v = ps.Variable(var_value, name="target")
    snap = snapshot(v)
    dst = v.dtype.name
    for op in (v.assign, v.assign_add, v.assign_sub):
        if op is not v.assign and v.dtype == np.bool_:
            continue
        with pytest.raises(TypeError) as info:
            op(bad)
        msg = str(info.value)
        assert "target" in msg
        assert dst in msg
        assert src_name in msg
        assert_unchanged(v, snap)


def test_lossy_message_names_both_dtypes():
    v = ps.Variable(np.zeros(3, np.float32), name="w")
    with pytest.raises(TypeError, match=r"float64.*'w'.*float32"):
        v.assign(np.ones(3, np.float64))
    i = ps.Variable(1, name="i")
    with pytest.raises(TypeError, match=r"float64.*'i'.*int32"):
        i.assign(1.5)


@pytest.mark.parametrize(
    ("shape", "bad"),
    [((2,), [1.0, 2.0, 3.0]), ((2,), 1.0), ((2, 2), [1.0, 2.0]), ((), [1.0])],
)
def test_assign_wrong_shape_raises_value_error_and_changes_nothing(shape, bad):
    v = ps.Variable(jnp.zeros(shape), name="s")
    snap = snapshot(v)
    got = np.shape(bad)
    with pytest.raises(ValueError) as info:
        v.assign(bad)
    assert f"Shapes {shape} and {got} are incompatible" in str(info.value)
    assert "'s'" in str(info.value)
    assert_unchanged(v, snap)


def test_assign_shape_message_exact_example():
    v = ps.Variable([1.0, 2.0])
    with pytest.raises(ValueError, match=r"Shapes \(2,\) and \(3,\) are incompatible"):
        v.assign([1.0, 2.0, 3.0])


def test_assign_add_delta_that_does_not_broadcast_raises():
    v = ps.Variable(jnp.zeros((2, 3)))
    snap = snapshot(v)
    for op in (v.assign_add, v.assign_sub):
        with pytest.raises(ValueError, match=r"Shapes \(2, 3\) and \(2,\) are incompatible"):
            op([1.0, 2.0])
        assert_unchanged(v, snap)
    with pytest.raises(ValueError, match="incompatible"):
        v.assign_add(jnp.ones((4, 2, 3)))  # broadcasting must not grow the variable
    assert_unchanged(v, snap)


def test_bool_variables_only_assign():
    b = ps.Variable([True, False])
    snap = snapshot(b)
    for op in (b.assign_add, b.assign_sub, b[0].assign_add):
        with pytest.raises(TypeError, match="bool"):
            op([True, True] if op is not b[0].assign_add else True)
        assert_unchanged(b, snap)
    b.assign([False, True])
    np.testing.assert_array_equal(b.numpy(), [False, True])
    b[0].assign(True)
    np.testing.assert_array_equal(b.numpy(), [True, True])


def test_assign_of_another_variable_uses_its_value():
    a = ps.Variable([1.0, 2.0])
    b = ps.Variable([0.0, 0.0])
    b.assign(a)
    b.assign_add(a)
    np.testing.assert_array_equal(b.numpy(), [2.0, 4.0])
    a.assign([9.0, 9.0])
    np.testing.assert_array_equal(b.numpy(), [2.0, 4.0])


# ---------------------------------------------------------------------- immutable backing


def test_values_read_before_an_assign_keep_their_contents():
    v = ps.Variable([1.0, 2.0, 3.0])
    old = v.value()
    old_np = np.asarray(v)
    old_slice = v[1:].value()
    v.assign([4.0, 5.0, 6.0])
    v.assign_add(1.0)
    v[0].assign(0.0)
    v[jnp.array([1, 2])].assign_sub([1.0, 1.0])
    np.testing.assert_array_equal(old, [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(old_np, [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(old_slice, [2.0, 3.0])
    np.testing.assert_array_equal(v.numpy(), [0.0, 5.0, 6.0])


# ---------------------------------------------------------------------------- slices


def test_sliced_assigns():
    v = ps.Variable([1, 2, 3, 4], name="v")
    assert v[1:].assign([20, 30, 40]) is v
    np.testing.assert_array_equal(v.numpy(), [1, 20, 30, 40])
    assert v[0].assign_add(10) is v
    np.testing.assert_array_equal(v.numpy(), [11, 20, 30, 40])
    idx = np.array([1, 3])
    assert v[idx].assign_sub([5, 6]) is v
    np.testing.assert_array_equal(v.numpy(), [11, 15, 30, 34])
    v[jnp.array([0, 2])].assign_add(jnp.array([1, 2], jnp.int32))
    np.testing.assert_array_equal(v.numpy(), [12, 15, 32, 34])
    assert v[:2].assign([0, 0], read_value=False) is None
    np.testing.assert_array_equal(v.numpy(), [0, 0, 32, 34])
    assert v.dtype == np.int32 and v.shape == (4,)


def test_sliced_assigns_2d_mask_and_broadcast():
    m = ps.Variable(jnp.zeros((2, 3)))
    m[:, 1].assign([1.0, 2.0])
    m[1].assign_add(0.5)  # the delta broadcasts into the row
    m[m > 0.75].assign_sub(jnp.ones(2))  # a boolean mask selects (0, 1) and (1, 1)
    expected = np.array([[0.0, 0.0, 0.0], [0.5, 1.5, 0.5]], np.float32)
    np.testing.assert_array_equal(m.numpy(), expected)
    assert m.shape == (2, 3) and m.dtype == np.float32


def test_sliced_assign_that_does_not_fit_raises_value_error():
    v = ps.Variable([1.0, 2.0, 3.0], name="v")
    snap = snapshot(v)
    with pytest.raises(ValueError, match=r"Shapes \(2,\) and \(3,\) are incompatible"):
        v[1:].assign([7.0, 8.0, 9.0])
    assert_unchanged(v, snap)
    with pytest.raises(ValueError, match="incompatible"):
        v[0].assign([1.0, 2.0])
    assert_unchanged(v, snap)
    with pytest.raises(ValueError, match="incompatible"):
        v[np.array([0, 1])].assign_sub([1.0, 2.0, 3.0])
    assert_unchanged(v, snap)
    with pytest.raises(TypeError, match="float64"):
        v[0].assign(np.float64(1.0))
    assert_unchanged(v, snap)


@pytest.mark.parametrize("index", [5, -4, np.array([0, 7]), jnp.array([0, 3]), (0, 0)], ids=repr)
def test_sliced_assign_out_of_range_raises_and_changes_nothing(index):
    v = ps.Variable([1, 2, 3])
    snap = snapshot(v)
    for op in ("assign", "assign_add", "assign_sub"):
        with pytest.raises(IndexError):
            getattr(v[index], op)(1)
        assert_unchanged(v, snap)


def test_slice_reads_like_an_array():
    v = ps.Variable([[1, 2], [3, 4]])
    assert int(v[1, 0]) == 3
    np.testing.assert_array_equal(v[1].numpy(), [3, 4])
    np.testing.assert_array_equal(v[:, 1] + 1, [3, 5])
    assert v[0].shape == (2,)
    assert isinstance(v[0].value(), jax.Array)
    np.testing.assert_array_equal(np.asarray(v[0]), [1, 2])


# ----------------------------------------------------------------- operators & protocols


@pytest.mark.parametrize(
    "op",
    [
        lambda a, b: a + b,
        lambda a, b: a - b,
        lambda a, b: a * b,
        lambda a, b: a / b,
        lambda a, b: a // b,
        lambda a, b: a % b,
        lambda a, b: a**b,
        lambda a, b: -a + abs(b),
        lambda a, b: 2 * a - b / 4,
        lambda a, b: 10.0 - a,
    ],
)
def test_arithmetic_operators_match_numpy(op):
    x = np.array([1.0, 2.0, 3.0], np.float32)
    y = np.array([2.0, 0.5, 4.0], np.float32)
    a, b = ps.Variable(x), ps.Variable(y)
    for lhs, rhs in ((a, b), (a, y), (x, b), (a, jnp.asarray(y))):
        out = op(lhs, rhs)
        assert isinstance(out, (jax.Array, np.ndarray))
        assert not isinstance(out, ps.Variable)
        np.testing.assert_allclose(np.asarray(out), op(x, y), rtol=1e-6)


def test_integer_and_bitwise_operators():
    a = ps.Variable([6, 3], name="a")
    b = ps.Variable([3, 5], name="b")
    np.testing.assert_array_equal(a & b, [2, 1])
    np.testing.assert_array_equal(a | b, [7, 7])
    np.testing.assert_array_equal(a ^ b, [5, 6])
    np.testing.assert_array_equal(a << 1, [12, 6])
    np.testing.assert_array_equal(a >> 1, [3, 1])
    np.testing.assert_array_equal(~a, [-7, -4])


def test_matmul():
    w = ps.Variable(jnp.arange(6.0).reshape(2, 3))
    x = np.ones((3, 2), np.float32)
    np.testing.assert_array_equal(w @ x, np.arange(6.0).reshape(2, 3) @ x)
    np.testing.assert_array_equal(x.T @ ps.Variable(jnp.ones((3, 4))), np.full((2, 4), 3.0))
    np.testing.assert_array_equal(w @ ps.Variable(x), np.arange(6.0).reshape(2, 3) @ x)


def test_comparisons_are_elementwise():
    a = ps.Variable([1, 2, 3])
    b = ps.Variable([1, 5, 3])
    eq = a == b
    assert eq.shape == (3,) and eq.dtype == np.bool_
    np.testing.assert_array_equal(eq, [True, False, True])
    np.testing.assert_array_equal(a != b, [False, True, False])
    np.testing.assert_array_equal(a < b, [False, True, False])
    np.testing.assert_array_equal(a <= 2, [True, True, False])
    np.testing.assert_array_equal(a > 1, [False, True, True])
    np.testing.assert_array_equal(2 >= a, [True, True, False])  # noqa: SIM300 (reflected)
    np.testing.assert_array_equal(a == 2, [False, True, False])


def test_indexing_len_iter_and_scalars():
    v = ps.Variable([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    assert len(v) == 3
    assert float(v[2][1]) == 6.0
    np.testing.assert_array_equal(v[1], [3.0, 4.0])
    assert [r.tolist() for r in v] == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    s = ps.Variable(2.5)
    assert float(s) == 2.5 and int(s) == 2 and bool(s) is True
    assert [10, 20, 30][ps.Variable(1)] == 20


def test_array_methods_and_properties():
    v = ps.Variable([[1, 2, 3], [4, 5, 6]])
    assert int(v.sum()) == 21
    np.testing.assert_array_equal(v.sum(axis=0), [5, 7, 9])
    assert v.reshape(3, 2).shape == (3, 2)
    assert v.reshape(-1).tolist() == [1, 2, 3, 4, 5, 6]
    assert v.T.shape == (3, 2)
    np.testing.assert_array_equal(v.T, np.array([[1, 4], [2, 5], [3, 6]]))
    f = v.astype(jnp.float32)
    assert f.dtype == np.float32 and v.dtype == np.int32
    assert float(v.mean()) == 3.5
    assert int(v.max()) == 6


def test_numpy_and_jax_protocols():
    v = ps.Variable([0.0, 1.0, 2.0])
    w = ps.Variable([1.0, 2.0, 3.0])
    n = np.asarray(v)
    assert isinstance(n, np.ndarray) and n.dtype == np.float32
    np.testing.assert_array_equal(n, [0.0, 1.0, 2.0])
    assert np.asarray(v, dtype=np.float64).dtype == np.float64
    j = jnp.asarray(v)
    assert isinstance(j, jax.Array) and j.dtype == np.float32
    np.testing.assert_allclose(jnp.sin(v), np.sin([0.0, 1.0, 2.0]), rtol=1e-6)
    assert float(jnp.dot(v, w)) == 8.0
    np.testing.assert_array_equal(jnp.where(v > 0.5, v, w), [1.0, 1.0, 2.0])
    np.testing.assert_array_equal(np.add(v, 1), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(jnp.stack([v, w]), [[0.0, 1.0, 2.0], [1.0, 2.0, 3.0]])


def test_jax_transformations_accept_variables_and_create_none(fresh_store):
    v = ps.Variable([1.0, 2.0], name="v")
    before = store_snapshot(fresh_store)
    np.testing.assert_array_equal(jax.jit(lambda x: x * 2)(v), [2.0, 4.0])
    np.testing.assert_array_equal(jax.jit(lambda x: jnp.sin(x) * 0 + x)(v), [1.0, 2.0])
    np.testing.assert_array_equal(jax.vmap(lambda x: x + 1)(v), [2.0, 3.0])
    g = jax.grad(lambda x: (x**2).sum())(v)
    np.testing.assert_array_equal(np.asarray(g), [2.0, 4.0])
    assert store_snapshot(fresh_store) == before


def test_repr_is_exactly_tensorflow_like():
    v = ps.Variable([1, 2, 3], name="name")
    assert (
        repr(v)
        == "<ps.Variable 'name' shape=(3,) dtype=int32, numpy=array([1, 2, 3], dtype=int32)>"
    )
    s = ps.Variable(1.5, name="s")
    assert repr(s) == "<ps.Variable 's' shape=() dtype=float32, numpy=1.5>"  # 0-d: as TF
    assert repr(ps.Variable(7, name="i")) == "<ps.Variable 'i' shape=() dtype=int32, numpy=7>"
    v.assign([4, 5, 6])
    assert (
        repr(v)
        == "<ps.Variable 'name' shape=(3,) dtype=int32, numpy=array([4, 5, 6], dtype=int32)>"
    )


# ------------------------------------------------------------------------- hashing


def test_variables_are_unhashable_with_a_clear_error():
    v = ps.Variable(1.0)
    with pytest.raises(TypeError, match=r"unhashable.*ref\(\)"):
        hash(v)
    with pytest.raises(TypeError):
        {v}  # noqa: B018
    with pytest.raises(TypeError):
        {v: 1}  # noqa: B018
    with pytest.raises(TypeError, match="unhashable"):
        hash(v[0:1])


def test_ref_is_a_hashable_key():
    v = ps.Variable([1.0])
    w = ps.Variable([1.0])  # equal values, different variables
    r = v.ref()
    assert r.deref() is v
    assert v.ref() == r and hash(v.ref()) == hash(r)
    assert w.ref() != r
    d = {v.ref(): "v", w.ref(): "w"}
    assert d[v.ref()] == "v" and d[w.ref()] == "w"
    assert {v.ref(), v.ref(), w.ref()} == {r, w.ref()}


# --------------------------------------------------------------------------- names


def test_unique_default_names():
    names = [ps.Variable(0.0).name for _ in range(3)]
    assert names == ["Variable", "Variable_1", "Variable_2"]


def test_same_name_twice_gets_a_suffix():
    a = ps.Variable(1.0, name="Mark")
    b = ps.Variable(2.0, name="Mark")
    assert (a.name, b.name) == ("Mark", "Mark_1")
    assert float(a) == 1.0 and float(b) == 2.0


def test_fresh_store_starts_over():
    keep = [ps.Variable(1.0, name="Mark"), ps.Variable(1.0)]
    with ps.VariableStore() as store:
        inner = [ps.Variable(1.0, name="Mark"), ps.Variable(1.0)]
        assert [v.name for v in inner] == ["Mark", "Variable"]
        assert [v.name for v in store.variables()] == ["Mark", "Variable"]
    assert ps.Variable(1.0, name="Mark").name == "Mark_1"
    assert [v.name for v in keep] == ["Mark", "Variable"]


def test_names_of_dead_variables_are_not_reused(fresh_store):
    v = ps.Variable(1.0, name="x")
    del v
    gc.collect()
    assert fresh_store.variables() == []
    assert ps.Variable(1.0, name="x").name == "x_1"


def test_name_must_be_a_string(fresh_store):
    with pytest.raises(TypeError, match="name"):
        ps.Variable(1.0, name=3)
    assert fresh_store.variables() == []


# ------------------------------------------------------------------------ placement


def test_device_and_sharding_are_kept_across_assigns():
    v = ps.Variable(jnp.zeros(3), device="cpu:0")
    dev, sharding = v.device, v.sharding
    assert dev == jax.devices("cpu")[0]
    v.assign([1.0, 2.0, 3.0])
    v.assign_add(jnp.ones(3))
    v.assign_sub(np.ones(3, np.float32))
    v[1:].assign([0.0, 0.0])
    assert v.device == dev
    assert v.sharding == sharding
    assert v.value().sharding == sharding


def test_device_context_places_variables():
    with ps.device("cpu:0") as dev:
        v = ps.Variable(1.0)
    assert dev == jax.devices("cpu")[0]
    assert v.device == dev
    w = ps.Variable(1.0, device=jax.devices()[0])
    assert w.device == jax.devices()[0]
    s = ps.Variable(1.0, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert s.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])


@pytest.mark.parametrize("name", ["cpu:99", "nosuchdevice:0", "gpu:42"])
def test_unknown_device_raises_value_error(fresh_store, name):
    # The message lists the devices there are (the default backend's: cpu:0, or gpu:0 ...).
    with pytest.raises(ValueError, match=f"the devices are: {device_names()}\\.$"), ps.device(name):
        pass
    with pytest.raises(ValueError, match=name):
        ps.Variable(1.0, device=name)
    assert fresh_store.variables() == []


_MULTI_DEVICE = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    import paramstore as ps
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    d0, d1 = jax.devices()[:2]
    with ps.device("cpu:1"):
        v = ps.Variable(jnp.zeros(4))
    assert v.device == d1, v.device
    v.assign(jax.device_put(jnp.ones(4), d0))
    v.assign_add(jax.device_put(jnp.ones(4), d0))
    v[0].assign(5.0)
    assert v.device == d1 and v.value().sharding.device_set == {d1}
    np.testing.assert_array_equal(v.numpy(), [5.0, 2.0, 2.0, 2.0])
    mesh = Mesh(np.array([d0, d1]), ("x",))
    sh = NamedSharding(mesh, P("x"))
    w = ps.Variable(jnp.arange(4.0), sharding=sh)
    assert w.sharding == sh and w.device is None
    w.assign(jnp.zeros(4))
    w.assign_add(1.0)
    w[1:].assign_sub(jnp.ones(3))
    assert w.sharding == sh, w.sharding
    np.testing.assert_array_equal(w.numpy(), [1.0, 0.0, 0.0, 0.0])
    print("OK")
    """
)


def test_placement_and_sharding_kept_on_two_devices():
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu"
    )
    out = subprocess.run(
        [sys.executable, "-c", _MULTI_DEVICE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("OK")


# --------------------------------------------------------------------------- pytree


def test_pytree_flattening_gives_the_value():
    v = ps.Variable([1.0, 2.0], name="v")
    leaves, treedef = jax.tree_util.tree_flatten(v)
    assert len(leaves) == 1 and leaves[0] is v.value()
    assert jax.tree_util.tree_leaves({"a": v, "b": [v]}) == [v.value(), v.value()]


def test_unflattening_makes_a_detached_variable(fresh_store):
    v = ps.Variable([1.0, 2.0], name="v")
    before = store_snapshot(fresh_store)
    _, treedef = jax.tree_util.tree_flatten(v)
    d = jax.tree_util.tree_unflatten(treedef, [jnp.array([7.0, 8.0])])
    assert isinstance(d, ps.Variable)
    np.testing.assert_array_equal(d.numpy(), [7.0, 8.0])
    m = jax.tree_util.tree_map(lambda x: x * 10, v)
    np.testing.assert_array_equal(np.asarray(m), [10.0, 20.0])
    assert store_snapshot(fresh_store) == before  # no variable was created
    for detached in (d, m):
        snap = snapshot(detached)
        for op in (detached.assign, detached.assign_add, detached.assign_sub, detached[0].assign):
            with pytest.raises(TypeError, match="ps.function|ps.pure"):
                op([1.0, 1.0] if op is not detached[0].assign else 1.0)
        for op in (detached.assign, detached.assign_add, detached.assign_sub):
            with pytest.raises(TypeError, match="ps.function|ps.pure"):  # a jax.Array too
                op(jnp.ones(2, jnp.float32))
        assert_unchanged(detached, snap)
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])  # the original is untouched
    assert ps.Variable(0.0, name="v").name == "v_1"  # unflattening took no name


# -------------------------------------------------------------------------- threads


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32])
def test_concurrent_assign_add_loses_no_update(dtype):
    counter = ps.Variable(0, dtype=dtype)
    n_threads, n_calls = 8, 10_000
    start = threading.Barrier(n_threads)
    errors = []

    def work():
        try:
            start.wait()
            for _ in range(n_calls):
                counter.assign_add(1, read_value=False)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert counter.dtype == np.dtype(dtype)
    assert counter.numpy() == n_threads * n_calls


def test_concurrent_sliced_and_full_updates_lose_nothing():
    v = ps.Variable(np.zeros(4, np.int32))

    def work(i):
        for _ in range(300):
            v[i].assign_add(1)
            v.assign_sub(np.array([0, 0, 0, 0], np.int32))
            v.assign_add(np.array([1, 0, 0, 0], np.int32))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_array_equal(v.numpy(), [1500, 300, 300, 300])


def test_string_variable_from_a_numpy_stringdtype_array():
    v = ps.Variable(np.array(["a", "bc"], dtype=np.dtypes.StringDType()))
    assert v.dtype == np.dtypes.StringDType()
    assert v.numpy().tolist() == ["a", "bc"]


def test_a_lax_function_given_a_variable_names_it_and_the_fix():
    lax = jax.lax
    kernel = ps.Variable(jnp.ones((3, 3, 1, 2)), name="kernel")
    x = jnp.ones((1, 5, 5, 1))
    dims = ("NHWC", "HWIO", "NHWC")
    before = kernel.numpy().copy()
    with pytest.raises(ValueError, match=r"ps.Variable 'kernel'.*kernel\.value\(\)"):
        lax.conv_general_dilated(x, kernel, (1, 1), "VALID", dimension_numbers=dims)

    @ps.function
    def step(y):
        return lax.add(kernel, y)

    with pytest.raises(ValueError, match=r"ps.Variable 'kernel'.*JAX primitive"):
        step(jnp.ones((3, 3, 1, 2)))
    np.testing.assert_array_equal(kernel.numpy(), before)
    # the fix the message gives works, and jnp functions still take the Variable itself
    out = lax.conv_general_dilated(x, kernel.value(), (1, 1), "VALID", dimension_numbers=dims)
    assert out.shape == (1, 3, 3, 2)
    np.testing.assert_allclose(jnp.sin(kernel), np.sin(before))
