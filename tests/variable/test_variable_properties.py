"""Property tests: random sequences of (sliced) assigns against a NumPy model, bit for bit."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import paramstore as ps

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

DTYPES = [np.bool_, np.int8, np.int32, np.uint8, np.float16, np.float32, np.complex64]


def elements(dtype):
    """Values that are exactly representable, and whose sums over a few ops stay exact."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return st.booleans()
    if dtype.kind in "iu":
        info = np.iinfo(dtype)  # the full range: integer ops wrap the same in NumPy and XLA
        return st.integers(max(info.min, -(2**20)), min(info.max, 2**20))
    if dtype == np.float16:
        return st.integers(-64, 64).map(lambda k: k / 4)  # |x| <= 16, quarters: exact
    quarter = st.integers(-4096, 4096).map(lambda k: k / 8)
    if dtype == np.complex64:
        return st.builds(complex, quarter, quarter)
    return quarter


def arrays(dtype, shape):
    return hnp.arrays(dtype, shape, elements=elements(dtype))


def as_input(draw, arr, dtype):
    """The same value as a NumPy array, a Python value, or a jax.Array of the variable's dtype."""
    # (an empty Python list has no dtype and loses trailing dimensions: arrays only then)
    kind = draw(st.sampled_from(["numpy", "python", "jax"] if arr.size else ["numpy", "jax"]))
    if kind == "numpy":
        return arr
    if kind == "python":
        return arr.tolist() if arr.ndim else arr.item()
    return jnp.asarray(arr, dtype=dtype)


@st.composite
def indices(draw, shape):
    """A basic or integer-array index into ``shape`` (no duplicate positions)."""
    if not shape:
        return draw(st.sampled_from([(), Ellipsis]))
    n = shape[0]
    options = [st.just(Ellipsis), st.builds(slice, st.integers(-4, 4), st.integers(-4, 4))]
    if n:
        options.append(st.integers(-n, n - 1))
        options.append(
            st.lists(st.integers(0, n - 1), unique=True, max_size=n).map(
                lambda ix: np.array(ix, dtype=np.int32)
            )
        )
    if len(shape) == 2 and shape[1]:
        m = shape[1]
        options.append(st.tuples(st.builds(slice, st.integers(0, n)), st.integers(-m, m - 1)))
    return draw(st.one_of(options))


@st.composite
def programs(draw):
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3))
    init = draw(arrays(dtype, shape))
    kinds = ["assign", "slice_assign", "bad_assign"]
    if dtype != np.bool_:
        kinds += ["add", "sub", "slice_add", "slice_sub"]
    ops = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(kinds))
        if kind.startswith("slice"):
            index = draw(indices(shape))
            target = np.empty(shape, dtype)[index].shape
            scalar = kind != "slice_assign" and draw(st.booleans())
            value = draw(arrays(dtype, () if scalar else target))
            ops.append((kind, index, value, as_input(draw, value, dtype)))
        elif kind == "bad_assign":
            bad_shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
            if bad_shape == shape:
                bad_shape = (*shape, 1)
            value = draw(arrays(dtype, bad_shape))
            ops.append((kind, None, value, as_input(draw, value, dtype)))
        else:
            scalar = kind != "assign" and draw(st.booleans())
            value = draw(arrays(dtype, () if scalar else shape))
            ops.append((kind, None, value, as_input(draw, value, dtype)))
    return dtype, init, ops


def apply_model(model, kind, index, value):
    """What the op does, in NumPy (which wraps integers and rounds floats like XLA)."""
    out = model.copy()
    if kind == "assign":
        return value.copy()
    if kind == "add":
        return np.asarray(np.add(out, value), dtype=model.dtype)
    if kind == "sub":
        return np.asarray(np.subtract(out, value), dtype=model.dtype)
    if kind == "slice_assign":
        out[index] = value
    elif kind == "slice_add":
        out[index] = np.add(out[index], value)
    elif kind == "slice_sub":
        out[index] = np.subtract(out[index], value)
    return out


def assert_same(v, model):
    got = v.numpy()
    assert v.dtype == model.dtype and got.dtype == model.dtype
    assert v.shape == model.shape and got.shape == model.shape
    assert got.tobytes() == model.tobytes(), (got, model)


@SETTINGS
@given(programs())
def test_assign_sequences_match_numpy(program):
    dtype, init, ops = program
    with ps.VariableStore():
        v = ps.Variable(init)
        model = init.copy()
        assert_same(v, model)
        for kind, index, value, given_value in ops:
            if kind == "bad_assign":
                before = v.value()
                with pytest.raises(ValueError, match="incompatible"):
                    v.assign(given_value)
                assert v.value() is before
            elif kind.startswith("slice"):
                method = {"slice_assign": "assign", "slice_add": "assign_add"}.get(
                    kind, "assign_sub"
                )
                assert getattr(v[index], method)(given_value) is v
                model = apply_model(model, kind, index, value)
            else:
                method = {"assign": "assign", "add": "assign_add"}.get(kind, "assign_sub")
                assert getattr(v, method)(given_value, read_value=False) is None
                model = apply_model(model, kind, None, value)
            assert_same(v, model)


@SETTINGS
@given(
    st.sampled_from(DTYPES).flatmap(
        lambda dt: arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
    )
)
def test_round_trip_is_bit_exact(arr):
    with ps.VariableStore():
        v = ps.Variable(arr)
        assert_same(v, arr)
        copy = ps.Variable(v)
        assert_same(copy, arr)
        if arr.size:  # an empty Python list loses trailing dimensions
            python = ps.Variable(arr.tolist() if arr.ndim else arr.item(), dtype=arr.dtype)
            assert_same(python, arr)


@SETTINGS
@given(
    st.sampled_from([np.int8, np.uint8, np.int32, np.float16, np.float32]),
    st.sampled_from([np.float64, np.complex64, np.int64, np.float32, np.int32]),
)
def test_unsafe_typed_arrays_are_rejected_and_change_nothing(var_dtype, src_dtype):
    var_dtype, src_dtype = np.dtype(var_dtype), np.dtype(src_dtype)
    with ps.VariableStore():
        v = ps.Variable(np.ones(3, var_dtype))
        before = v.value()
        src = np.ones(3, src_dtype)
        if np.can_cast(src_dtype, var_dtype, "safe"):
            v.assign(src)
            assert v.dtype == var_dtype
            np.testing.assert_array_equal(v.numpy(), np.ones(3, var_dtype))
        else:
            with pytest.raises(TypeError, match=var_dtype.name):
                v.assign(src)
            assert v.value() is before
