"""Abstract models: ``with ps.abstract():``, ``v.is_abstract``, ``ps.initialize``, the errors
for any use of an abstract variable, and ``set_initial_value`` (the restore entry point).

The 8-device checks (abstract variables with layouts, ``ps.initialize`` as one sharded
program) are in ``tests/sharding/test_layout.py``'s subprocess."""

from __future__ import annotations

import copy
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import paramstore as ps
from paramstore._variable import abstract as _abstract
from paramstore.variable import set_initial_value

ABSTRACT = r"Variable '{}' is abstract .* restore a checkpoint .* ps\.initialize"


def _mesh():
    return jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])


def _abstract_dense(units=3, features=4, **kwargs):
    layer = ps.nn.Dense(units, **kwargs)
    with ps.abstract(), layer.name_scope:
        layer.build((None, features))
    layer.built = True
    return layer


def test_abstract_variables_have_shape_dtype_sharding_and_no_value(fresh_store):
    before = jax.live_arrays()  # held, so none is collected and its id reused meanwhile
    held = {id(a) for a in before}
    mesh = _mesh()
    lm = ps.sharding.LayoutMap(mesh)
    lm["w"] = ("data", "model")

    def init(shape, dtype=jnp.float32):
        return jnp.ones(shape, dtype)

    with ps.abstract(), ps.device(lm):
        w = ps.Variable(init, shape=(512, 512), name="w")
        b = ps.Variable(lambda: jnp.zeros((512,), jnp.bfloat16), name="b", trainable=False)
        s = ps.Variable(jax.ShapeDtypeStruct((2, 3), jnp.int32), name="s")
        g = ps.get_variable("g", (7,))
    assert [v.is_abstract for v in (w, b, s, g)] == [True] * 4
    assert (w.shape, w.dtype, w.ndim, w.size) == ((512, 512), np.float32, 2, 512 * 512)
    assert w.sharding == NamedSharding(mesh, P("data", "model"))
    assert b.dtype == jnp.bfloat16 and not b.trainable and b.sharding.spec == P()
    assert s.shape == (2, 3) and s.dtype == np.int32
    assert [a.shape for a in jax.live_arrays() if id(a) not in held] == []  # nothing allocated
    assert "abstract" in repr(w) and "'w'" in repr(w)
    assert sorted(v.name for v in fresh_store.variables()) == ["b", "g", "s", "w"]
    assert not ps.Variable(1.0).is_abstract


def test_every_use_of_an_abstract_variable_is_a_clear_error(fresh_store):
    with ps.abstract():
        v = ps.Variable(ps.initializers.ones(), shape=(2,), name="v")

    @ps.function
    def step():
        v.assign_add(jnp.ones(2))

    uses = {
        "read": lambda: v.value(),
        "read_value": lambda: v.read_value(),
        "numpy": lambda: v.numpy(),
        "np.asarray": lambda: np.asarray(v),
        "arithmetic": lambda: v + 1,
        "jnp": lambda: jnp.sin(v),
        "method": lambda: v.sum(),
        "index": lambda: v[0] + 1,
        "assign": lambda: v.assign([1.0, 2.0]),
        "assign_add": lambda: v.assign_add([1.0, 1.0]),
        "assign_add of its dtype": lambda: v.assign_add(jnp.ones(2)),  # skips _coerce
        "assign_sub": lambda: v.assign_sub([1.0, 1.0]),
        "sliced assign": lambda: v[0].assign(1.0),
        "step": step,
        "ps.state": lambda: ps.state([v]),
        "deepcopy": lambda: copy.deepcopy(v),
        "optimizer step": lambda: ps.Optimizer(optax.sgd(0.1), [v]).apply_gradients([jnp.ones(2)]),
        "pytree": lambda: jax.tree_util.tree_leaves(v),
    }
    for what, use in uses.items():
        with pytest.raises(ValueError, match=ABSTRACT.format("v")):
            use()
        assert v.is_abstract, what
    assert not hasattr(v, "no_such_attribute")  # AttributeError, not the abstract error
    # the optimizer's own state is abstract too (see the optimizer tests below)
    assert sorted(x.name for x in fresh_store.variables()) == ["optimizer/iterations", "v"]


def test_initialize_runs_the_initializers_with_the_eager_values(fresh_store):
    with ps.VariableStore():
        eager = ps.nn.Dense(3, bias_initializer="ones")
        eager(jnp.ones((1, 4)))
        want = {v.name: v.numpy() for v in eager.variables}
    layer = _abstract_dense(bias_initializer="ones")
    assert all(v.is_abstract for v in layer.variables)
    done = ps.initialize(layer)
    assert {v.name for v in done} == {"dense/kernel", "dense/bias"}
    for v in layer.variables:
        assert not v.is_abstract and type(v) is ps.Variable
        np.testing.assert_array_equal(v.numpy(), want[v.name])
    assert layer(jnp.ones((1, 4))).shape == (1, 3)
    assert ps.initialize(layer) == []  # concrete variables are left alone
    layer.kernel.assign_add(jnp.ones((4, 3)))
    np.testing.assert_allclose(layer.kernel.numpy(), want["dense/kernel"] + 1)


def test_initialize_without_initializer_is_a_clear_error_and_changes_nothing(fresh_store):
    with ps.abstract():
        a = ps.Variable(ps.initializers.zeros(), shape=(2,), name="a")
        s = ps.Variable(jax.ShapeDtypeStruct((2,), jnp.float32), name="s")
    with pytest.raises(ValueError, match=r"'s' is abstract with no initializer .* Restore"):
        ps.initialize([a, s])
    assert a.is_abstract and s.is_abstract


def test_set_initial_value_makes_an_abstract_variable_concrete(fresh_store):
    with ps.abstract():
        s = ps.Variable(jax.ShapeDtypeStruct((3,), jnp.float32), name="s")
        k = ps.Variable(lambda: jnp.zeros((2, 2), jnp.int32), name="k")
    with pytest.raises(ValueError, match=r"\(3,\) and \(2,\) are incompatible"):
        set_initial_value(s, np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="float64 to variable 'k' of dtype int32"):
        set_initial_value(k, np.ones((2, 2)) * 1.5)
    assert s.is_abstract and k.is_abstract  # nothing changed
    set_initial_value(s, np.arange(3, dtype=np.float32))
    set_initial_value(k, jnp.ones((2, 2), jnp.int32))
    assert not s.is_abstract and not k.is_abstract
    np.testing.assert_array_equal(s.numpy(), [0.0, 1.0, 2.0])
    assert s.assign_add([1.0, 1.0, 1.0]).numpy().tolist() == [1.0, 2.0, 3.0]
    np.testing.assert_array_equal(k.numpy(), np.ones((2, 2), np.int32))


def test_abstract_initializer_that_cannot_be_traced_is_a_clear_error(fresh_store):
    gen = ps.random.Generator(0)
    with ps.abstract(), pytest.raises(TypeError, match=r"'x' cannot be traced for its shape"):
        ps.Variable(lambda: gen.normal((2,)), name="x")
    assert [v.name for v in fresh_store.variables()] == ["generator"]


def test_an_abstract_variable_holds_its_own_initializer(fresh_store):
    with ps.abstract():
        v = ps.Variable(ps.initializers.zeros(), shape=(2,), name="v")
    known, make = _abstract.initializer_of(v)
    assert known and callable(make)
    assert _abstract.initializer_of(ps.Variable(1.0)) == (False, None)  # a concrete one: none
    ref = weakref.ref(v)
    del v, make
    gc.collect()
    assert ref() is None  # no table keeps it (or its initializer) alive
    assert not hasattr(_abstract, "_pending")  # no id()-keyed side table


def test_abstract_initializer_error_is_reported_with_its_cause(fresh_store):
    with ps.abstract(), pytest.raises(TypeError, match=r"'o' cannot be traced .*rank >= 2") as e:
        ps.Variable(ps.initializers.orthogonal(), shape=(3,), name="o")
    assert isinstance(e.value.__cause__, ValueError)
    assert fresh_store.variables() == []


def _abstract_model_and_adam():
    with ps.abstract():
        model = ps.nn.Sequential([ps.nn.Dense(4), ps.nn.Dense(2)])
        model.build((None, 3))
        opt = ps.Optimizer(optax.adam(1e-2), model)
    return model, opt


def test_optimizer_over_an_abstract_model_has_abstract_state_shaped_like_optax(fresh_store):
    before = jax.live_arrays()  # held, so none is collected and its id reused meanwhile
    held = {id(a) for a in before}
    model, opt = _abstract_model_and_adam()
    assert all(v.is_abstract for v in opt.variables) and opt.iterations.is_abstract
    assert [a.shape for a in jax.live_arrays() if id(a) not in held] == []  # nothing allocated
    shapes = {v.name: v.shape for v in model.variables}
    slots = {v.name: (v.shape, v.dtype) for v in opt.variables}
    assert slots["optimizer/iterations"] == ((), np.int32)
    assert slots["optimizer/count"] == ((), np.int32)
    for name, shape in shapes.items():
        assert slots[f"optimizer/{name}/mu"] == (shape, np.float32)
        assert slots[f"optimizer/{name}/nu"] == (shape, np.float32)


def test_initialize_model_and_optimizer_gives_the_state_of_a_concrete_optimizer(fresh_store):
    model, opt = _abstract_model_and_adam()
    assert len(ps.initialize([model, opt])) == len(model.variables) + len(opt.variables)
    want = optax.adam(1e-2).init(tuple(v.value() for v in model.trainable_variables))
    assert not any(v.is_abstract for v in opt.variables)
    assert [v.numpy().tolist() for v in opt.variables[1:]] == [
        np.asarray(a).tolist() for a in jax.tree_util.tree_leaves(want)
    ]
    assert int(opt.iterations.numpy()) == 0
    # then it trains
    x = jnp.ones((2, 3))
    loss = lambda: jnp.mean(model(x) ** 2)  # noqa: E731
    before = loss()
    for _ in range(3):
        opt.apply_gradients(ps.grad(loss, model)())
    assert int(opt.iterations.numpy()) == 3 and loss() < before
    # the model first, the optimizer in a second call
    model2, opt2 = _abstract_model_and_adam()
    ps.initialize(model2)
    ps.initialize(opt2)
    assert not any(v.is_abstract for v in opt2.variables)
    assert all(np.all(v.numpy() == 0) for v in opt2.variables)


def test_optimizer_state_cannot_be_initialized_before_its_parameters(fresh_store):
    model, opt = _abstract_model_and_adam()
    with pytest.raises(ValueError, match=r"'optimizer/.*' is initialized from .* 'dense.*abstract"):
        ps.initialize(opt)
    assert all(v.is_abstract for v in [*model.variables, *opt.variables])  # nothing changed


def test_using_the_optimizer_before_restore_is_the_abstract_error(fresh_store):
    model, opt = _abstract_model_and_adam()
    grads = tuple(jnp.zeros(v.shape) for v in model.trainable_variables)
    for use in (lambda: opt.apply_gradients(grads), lambda: opt.iterations.numpy()):
        with pytest.raises(ValueError, match=ABSTRACT.format(r"[\w/]+")):
            use()
    assert all(v.is_abstract for v in [*model.variables, *opt.variables])  # nothing changed
    ps.initialize([model, opt])
    opt.apply_gradients(grads)
    assert int(opt.iterations.numpy()) == 1
