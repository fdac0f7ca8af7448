"""Bad input at creation (issue 15): explicit dtypes as strict as assign, bool flags, shapes,
uncalled initializer factories, reuse_variables, string variables."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paramstore as ps


@pytest.fixture(autouse=True)
def _fresh_store():
    with ps.VariableStore() as store:
        yield store


@pytest.mark.parametrize(
    ("value", "dtype", "message"),
    [
        (300, np.uint8, r"uint8 from 300: out of range \[0, 255\]"),
        (-1, np.uint8, r"uint8 from -1: out of range \[0, 255\]"),
        ([1, 256], np.uint8, r"out of range \[0, 255\]"),
        (np.array([70000]), np.int16, r"int16 from values in \[70000, 70000\]: out of range"),
        (jnp.array([-1]), jnp.uint8, r"out of range \[0, 255\]"),
        (1e10, np.int32, r"Python float 10000000000.0 .* dtype int32: the conversion would lose"),
        (float("nan"), np.int32, r"Python float nan .* dtype int32"),
        (float("inf"), np.int32, r"Python float inf .* dtype int32"),
        (np.array([1.5]), np.int32, r"float64 to variable 'bad' of dtype int32"),
        (2, np.bool_, r"dtype bool"),
        ([1.7, -2.2], np.int32, r"Python list \[1.7, -2.2\] .* dtype int32"),
        ([0, 3], "bool", r"dtype bool"),
        (jnp.array([1.5, 2.5]), jnp.int8, r"float32 to variable 'bad' of dtype int8"),
    ],
)
def test_an_explicit_dtype_refuses_what_assign_refuses(_fresh_store, value, dtype, message):
    with pytest.raises(TypeError, match=message):
        ps.Variable(value, dtype=dtype, name="bad")
    assert _fresh_store.variables() == []  # nothing made
    ok = ps.Variable(np.zeros(np.shape(value)), dtype=np.float32)  # the rules of assign:
    with pytest.raises(TypeError):
        ps.Variable(0, dtype=dtype).assign(value)  # ... which refuses the same values
    assert ok.dtype == np.float32


@pytest.mark.skipif(jax.config.read("jax_enable_x64"), reason="64-bit JAX makes it int64")
@pytest.mark.parametrize("value", [2**40, [1, 2**40], -(2**31) - 1])
def test_a_python_int_past_int32_says_to_enable_64_bit_jax(value):
    with pytest.raises(ValueError, match="does not fit in int32; enable 64-bit JAX"):
        ps.Variable(value, name="big")


def test_an_explicit_dtype_still_takes_lossless_and_same_kind_values():
    assert ps.Variable(255, dtype=np.uint8).numpy() == 255
    assert ps.Variable(3, dtype=np.float32).numpy() == 3.0
    assert ps.Variable(np.ones(3), dtype=jnp.float32).dtype == np.float32  # float64 -> 32
    assert ps.Variable(True, dtype=np.int32).numpy() == 1


@pytest.mark.parametrize("bad", ["no", 1, None.__class__, np.array([True])])
def test_trainable_must_be_a_bool(_fresh_store, bad):
    with pytest.raises(TypeError, match=r"trainable must be a bool"):
        ps.Variable(1.0, trainable=bad, name="t")
    with pytest.raises(TypeError, match=r"get_variable\('g'\): trainable must be a bool"):
        ps.get_variable("g", shape=(), trainable=bad)
    assert _fresh_store.variables() == []
    assert ps.Variable(1.0, trainable=np.bool_(False)).trainable is False


def test_donate_must_be_a_bool():
    with pytest.raises(TypeError, match=r"ps.function: donate must be a bool"):
        ps.function(lambda: None, donate="no")


@pytest.mark.parametrize(
    ("shape", "error", "message"),
    [
        ((True,), TypeError, "shape must be an int or a sequence of ints"),
        (True, TypeError, "shape must be an int or a sequence of ints"),
        ((2**40, 2**40), ValueError, "than an array can hold"),
    ],
)
def test_get_variable_rejects_bad_shapes(_fresh_store, shape, error, message):
    with pytest.raises(error, match=message):
        ps.get_variable("w", shape=shape)
    assert _fresh_store.variables() == []


@pytest.mark.parametrize("method", ["normal", "uniform"])
@pytest.mark.parametrize(
    ("shape", "error", "message"),
    [
        ((-1,), ValueError, r"shape \(-1,\) has a negative dimension"),
        ((2**40, 2**40), ValueError, "than an array can hold"),
        ((True,), TypeError, "shape must be a sequence of ints"),
    ],
)
def test_generator_rejects_bad_shapes_before_drawing(method, shape, error, message):
    g = ps.random.Generator(0)
    before = g.state.numpy()
    with pytest.raises(error, match=f"Generator.{method}: .*{message}"):
        getattr(g, method)(shape)
    np.testing.assert_array_equal(g.state.numpy(), before)  # no key drawn


def test_an_uncalled_initializer_factory_is_called_first():
    a = ps.get_variable("a", shape=(2, 3), initializer=ps.initializers.zeros)
    b = ps.get_variable("b", shape=(4,), initializer=ps.initializers.ones)
    c = ps.get_variable("c", shape=(3, 3), initializer=ps.initializers.glorot_uniform)
    np.testing.assert_array_equal(a.numpy(), np.zeros((2, 3)))
    np.testing.assert_array_equal(b.numpy(), np.ones(4))
    assert c.shape == (3, 3) and np.std(c.numpy()) > 0
    assert ps.initializers.resolve(ps.initializers.zeros)((2,)).shape == (2,)
    init = ps.initializers.ones()
    assert ps.initializers.resolve(init) is init  # an initializer is left alone


def test_an_uncalled_constant_factory_says_to_pass_its_value(_fresh_store):
    with pytest.raises(TypeError, match=r"constant\(value\)"):
        ps.get_variable("k", shape=(2,), initializer=ps.initializers.constant)
    assert _fresh_store.variables() == []


def test_reuse_variables_inside_a_variable_scope():
    with ps.variable_scope("layer") as scope:
        w = ps.get_variable("w", shape=(2,))
        assert scope.reuse is None
        scope.reuse_variables()
        assert scope.reuse is True
        assert ps.get_variable("w", shape=(2,)) is w
        with ps.variable_scope("inner"), pytest.raises(ValueError, match="does not exist"):
            ps.get_variable("v", shape=(2,))  # reuse inherited
        with pytest.raises(ValueError, match="does not exist"):
            ps.get_variable("missing", shape=(2,))
    with ps.variable_scope("layer"), pytest.raises(ValueError, match="already exists"):
        ps.get_variable("w", shape=(2,))  # a new block: reuse is off again
    with pytest.raises(RuntimeError, match="outside its with-block"):
        scope.reuse_variables()


def test_jax_functions_see_no_variable_inside_a_plain_trace():
    v = ps.Variable(jnp.ones(3))
    assert jax.jit(lambda x: x * 2)(v.value()).shape == (3,)


def test_string_variables_hold_utf8_text_only(_fresh_store):
    v = ps.Variable(np.array([b"alpha", b"caf\xc3\xa9"]), name="words")  # UTF-8 bytes: text
    assert v.numpy().tolist() == ["alpha", "café"]
    with pytest.raises(TypeError, match=r"String variable .* not valid utf-8"):
        ps.Variable(np.array([b"ok", b"\xff\xfe"]), name="raw")
    assert [x.name for x in _fresh_store.variables()] == ["words"]
    with pytest.raises(TypeError, match=r"String variable .* not valid utf-8"):
        v.assign(np.array([b"\xff", b"x"]))
    assert v.numpy().tolist() == ["alpha", "café"]  # unchanged


def test_eager_updates_check_every_delta_after_a_good_one(_fresh_store):
    """The eager fast path (a delta with the aval of one already checked) never lets a delta
    of another shape, dtype or weak type through: each is checked, converted or refused."""
    v = ps.Variable(np.zeros((2, 3), np.float32), name="acc")
    good = jnp.ones((2, 3), jnp.float32)
    v.assign_add(good)
    v.assign_add(good)  # the same aval: the fast path
    np.testing.assert_array_equal(v.numpy(), np.full((2, 3), 2.0, np.float32))
    v.assign_add(jnp.ones((3,), jnp.float32))  # broadcasts: allowed, checked
    v.assign_sub(jnp.asarray(1.0))  # weakly typed scalar: converted
    np.testing.assert_array_equal(v.numpy(), np.full((2, 3), 2.0, np.float32))
    for bad, error, message in [
        (
            jnp.ones((3, 2), jnp.float32),
            ValueError,
            r"\(3, 2\) to variable 'acc' of shape \(2, 3\)",
        ),
        (jnp.ones((2, 3), jnp.float64 if jax.config.x64_enabled else jnp.int32), TypeError, "acc"),
        (jnp.ones((2, 3), jnp.complex64), TypeError, "complex64"),
    ]:
        with pytest.raises(error, match=message):
            v.assign_add(bad)
        np.testing.assert_array_equal(v.numpy(), np.full((2, 3), 2.0, np.float32))
    v.assign_add(good)  # still fast and right after the refusals
    np.testing.assert_array_equal(v.numpy(), np.full((2, 3), 3.0, np.float32))
    assert v.dtype == np.float32 and v.shape == (2, 3)
