"""Layouts by name (ps.sharding.LayoutMap), partitions with axis rules, sharded creation.

In-process tests use a one-device mesh (semantics and every error path); the checks that
need several devices run in an 8-device subprocess: this file is also that subprocess's
script (``python tests/sharding/test_layout.py OUT.json``), as in ``tests/sharding/test_sharding.py``.
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
import re
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _multidevice import init_programs, multi_device_tests, run_checks
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import paramstore as ps
from paramstore._variable import abstract as _abstract

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def auto_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def one_device_mesh():
    return jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])


def names(store) -> list[str]:
    return sorted(v.name for v in store.variables())


# ================================================================ one device (in process)


def test_layout_map_is_dict_like_with_keras_lookup():
    lm = ps.sharding.LayoutMap(one_device_mesh())
    lm[r"dense.*/kernel"] = (None, "model")
    lm["dense/bias"] = ["model"]
    lm[r".*bias"] = P()
    assert len(lm) == 3 and list(lm) == [r"dense.*/kernel", "dense/bias", r".*bias"]
    assert "dense/bias" in lm and "dense_1/kernel" not in lm  # `in` is about keys
    assert lm["dense_1/kernel"] == (None, "model")  # searched in the name
    assert lm["dense/bias"] == ("model",)  # the exact key wins over r".*bias"
    assert lm["other/bias"] == P()
    assert lm["embedding/embeddings"] is None  # no match: replicated
    assert lm.mesh is lm.device_mesh
    del lm[r".*bias"]
    assert lm["other/bias"] is None
    assert "LayoutMap(mesh=" in repr(lm)


def test_layout_map_bad_keys_and_values_are_clear_errors():
    lm = ps.sharding.LayoutMap(one_device_mesh())
    lm["a"] = ("data",)
    with pytest.raises(ValueError, match=r"key 'a' already has the layout"):
        lm["a"] = ("model",)
    assert lm["a"] == ("data",)
    with pytest.raises(ValueError, match=r"not a regular expression"):
        lm["dense(/kernel"] = ("data",)
    with pytest.raises(TypeError, match="a layout is a tuple of mesh axis names"):
        lm["b"] = "data"
    with pytest.raises(TypeError, match="A LayoutMap key is a regular expression"):
        lm[3] = ("data",)  # type: ignore[index]
    assert list(lm) == ["a"]
    with pytest.raises(TypeError, match="needs a jax.sharding.Mesh"):
        ps.sharding.LayoutMap("mesh")  # type: ignore[arg-type]


def test_two_matching_regexes_raise_naming_both_and_create_nothing(fresh_store):
    lm = ps.sharding.LayoutMap(one_device_mesh())
    lm[r"dense"] = (None, "model")
    lm[r"kernel$"] = ("data", None)
    with ps.device(lm):
        with pytest.raises(ValueError, match=r"'dense/kernel' matches 2 LayoutMap keys") as e:
            ps.Variable(jnp.ones((2, 2)), name="dense/kernel")
        assert "'dense'" in str(e.value) and "'kernel$'" in str(e.value)
        layer = ps.nn.Dense(2)
        with pytest.raises(ValueError, match=r"'dense/kernel' matches 2"):
            layer(jnp.ones((1, 2)))
    assert names(fresh_store) == [] and not layer.built


@pytest.mark.parametrize(
    "layout, message",
    [
        ((None, "model", None), r"'w' .* has 3 entries, but the variable has shape \(2, 4\)"),
        (P("data"), r"'w' .* has 1 entries, but the variable has shape \(2, 4\) \(rank 2\)"),
        (("data", "nope"), r"'w' .* names mesh axis 'nope', which the mesh .* lacks"),
    ],
)
def test_bad_layout_names_the_variable_and_creates_nothing(fresh_store, layout, message):
    lm = ps.sharding.LayoutMap(one_device_mesh())
    lm["w"] = layout
    calls = []
    with ps.device(lm):
        for make in (
            lambda: ps.Variable(jnp.ones((2, 4)), name="w"),
            lambda: ps.Variable(lambda: calls.append(1) or jnp.ones((2, 4)), name="w"),
            lambda: ps.get_variable("w", (2, 4)),
        ):
            with pytest.raises(ValueError, match=message):
                make()
    assert names(fresh_store) == []
    with ps.device(lm):  # the name was not taken: a good layout now gets "w" itself
        del lm["w"]
        assert ps.Variable(jnp.ones((2, 4)), name="w").name == "w"


def test_layout_values_partition_spec_and_sharding(fresh_store):
    mesh = one_device_mesh()
    lm = ps.sharding.LayoutMap(mesh)
    lm["a"] = P("data", None)
    lm["b"] = NamedSharding(mesh, P(None, "model"))
    lm["c"] = (("data", "model"), None)
    lm["d"] = P()  # replicated whatever the rank
    with ps.device(lm):
        vs = [ps.Variable(jnp.ones((2, 2)), name=n) for n in "abcde"]
    specs = ps.sharding.specs(vs)
    assert specs == {
        "a": P("data", None),
        "b": P(None, "model"),
        "c": P(("data", "model"), None),
        "d": P(),
        "e": P(),
    }
    assert all(isinstance(v.sharding, NamedSharding) and v.sharding.mesh == mesh for v in vs)


def test_partition_metadata_and_axis_rules(fresh_store):
    mesh = one_device_mesh()
    v = ps.Variable(jnp.ones((2, 3)), name="plain", partition=("embed", "mlp"))
    assert v.partition == ("embed", "mlp") and ps.sharding.specs(v) == {"plain": P()}
    assert ps.Variable(1.0).partition is None
    with ps.sharding.axis_rules(mesh, {"embed": "data", "mlp": "model"}):
        w = ps.Variable(jnp.ones((2, 3)), name="w", partition=("embed", "mlp"))
        u = ps.Variable(jnp.ones((2, 3)), name="u", partition=("embed", "heads"))  # no rule
        d = ps.nn.Dense(4, kernel_partition=("embed", "mlp"), bias_partition=("mlp",))
        d(jnp.ones((1, 3)))
    assert w.sharding.spec == P("data", "model") and w.partition == ("embed", "mlp")
    assert u.sharding.spec == P("data", None)
    assert ps.sharding.specs(d) == {"dense/bias": P("model"), "dense/kernel": P("data", "model")}
    assert d.kernel.partition == ("embed", "mlp") and d.bias.partition == ("mlp",)
    lm = ps.sharding.LayoutMap(mesh)
    lm["x"] = ("model", None)
    with ps.sharding.axis_rules(mesh, [("embed", "data")]), ps.device(lm):
        x = ps.Variable(jnp.ones((2, 3)), name="x", partition=("embed", None))  # entry wins
        y = ps.Variable(jnp.ones((2, 3)), name="y", partition=("embed", None))  # no entry
        z = ps.Variable(jnp.ones((2, 3)), name="z")  # neither: replicated over the map's mesh
    assert (x.sharding.spec, y.sharding.spec, z.sharding.spec) == (
        P("model", None),
        P("data", None),
        P(),
    )


def test_partition_errors_name_the_variable_and_create_nothing(fresh_store):
    mesh = one_device_mesh()
    with pytest.raises(ValueError, match=r"'w' has shape \(2, 3\) \(rank 2\), but its partition"):
        ps.Variable(jnp.ones((2, 3)), name="w", partition=("embed",))
    with pytest.raises(TypeError, match=r"'w': partition= is a tuple"):
        ps.Variable(jnp.ones((2, 3)), name="w", partition="embed")
    with pytest.raises(TypeError, match=r"'w': partition=\(3, None\)"):
        ps.Variable(jnp.ones((2, 3)), name="w", partition=(3, None))
    rule = r"rule 'embed' -> 'nope' names mesh axis 'nope'"
    with pytest.raises(ValueError, match=rule), ps.sharding.axis_rules(mesh, {"embed": "nope"}):
        pass
    with ps.sharding.axis_rules(mesh, {"embed": "data", "mlp": "data"}):
        with pytest.raises(ValueError, match=r"'w': its partition .* both 'embed' and 'mlp'"):
            ps.Variable(jnp.ones((2, 3)), name="w", partition=("embed", "mlp"))
        wrong_rank = r"'dense/kernel' has shape \(3, 2\) \(rank 2\), but its"
        with pytest.raises(ValueError, match=wrong_rank):
            ps.nn.Dense(2, kernel_partition=("mlp",))(jnp.ones((1, 3)))
    assert names(fresh_store) == []


def test_variable_from_an_initializer_and_shape(fresh_store):
    v = ps.Variable(ps.initializers.ones(), shape=(2, 3), dtype=jnp.bfloat16, name="v")
    assert v.shape == (2, 3) and v.dtype == jnp.bfloat16 and float(v.sum()) == 6.0
    w = ps.Variable(ps.initializers.glorot_uniform(), shape=4, name="w")
    assert w.shape == (4,) and w.dtype == np.float32
    with pytest.raises(ValueError, match=r"\(3,\) and \(2,\) are incompatible"):
        ps.Variable([1.0, 2.0], shape=(3,), name="bad")
    with pytest.raises(TypeError, match="shape= must be an int or a sequence"):
        ps.Variable(ps.initializers.ones(), shape="x", name="bad")
    assert names(fresh_store) == ["v", "w"]


def test_shape_dtype_struct_outside_abstract_is_a_clear_error(fresh_store):
    with pytest.raises(TypeError, match=r"jax.ShapeDtypeStruct outside ps.abstract\(\)"):
        ps.Variable(jax.ShapeDtypeStruct((2,), jnp.float32), name="s")
    assert names(fresh_store) == []


# ============================================================= 8 devices (subprocess)


def _tp_layout(mesh):
    lm = ps.sharding.LayoutMap(mesh)
    lm[r"dense.*/kernel"] = ("data", "model")
    lm[r"dense.*/bias"] = ("model",)
    return lm


@check
def check_every_way_a_variable_is_born_gets_its_layout():
    mesh = auto_mesh((4, 2), ("data", "model"))
    lm = _tp_layout(mesh)
    lm["w"] = (None, "model")
    lm["gv"] = ("data",)
    want = {"dense/kernel": P("data", "model"), "dense/bias": P("model")}
    layer = ps.nn.Dense(8)
    with ps.device(lm):
        w = ps.Variable(jnp.ones((4, 8)), name="w")
        w2 = ps.Variable(lambda: jnp.ones((4, 8)), name="w")  # "w_1": key "w" found in it
        other = ps.Variable(lambda: jnp.ones((4, 8)), name="other")  # no key: replicated
        gv = ps.get_variable("gv", (16,))
        layer(jnp.ones((2, 8)))
    assert w.sharding.spec == P(None, "model") and w2.sharding.spec == P(None, "model")
    assert other.sharding == NamedSharding(mesh, P())
    assert gv.sharding.spec == P("data")
    assert ps.sharding.specs(layer) == want
    # built in the first trace of a ps.function
    traced = ps.nn.Dense(8, name="dense_t")

    @ps.function
    def f(x):
        with ps.device(lm):
            return traced(x)

    y = f(jnp.ones((2, 8)))
    assert y.shape == (2, 8)
    assert ps.sharding.specs(traced) == {
        "dense_t/kernel": P("data", "model"),
        "dense_t/bias": P("model"),
    }
    f(jnp.ones((2, 8)))
    assert f.trace_count == 1
    with ps.VariableStore():  # the traced, sharded creation drew the eager values
        eager = ps.nn.Dense(8, name="dense_t")
        eager(jnp.ones((2, 8)))
    np.testing.assert_array_equal(traced.kernel.numpy(), eager.kernel.numpy())
    assert traced.kernel.value().addressable_shards[0].data.shape == (2, 4)
    # optimizer slots: exactly like their parameter, whatever the context
    for i, context in enumerate((lm, mesh, NamedSharding(mesh, P("data")))):
        with ps.device(context):
            opt = ps.Optimizer(optax.adam(1e-3), layer, name=f"adam{i}")
        slots = {v.name: v.sharding for v in opt.variables}
        for p in layer.variables:
            for slot in ("mu", "nu"):
                assert slots[f"adam{i}/{p.name}/{slot}"] == p.sharding, (context, p.name, slot)
        assert slots[f"adam{i}/iterations"].spec == P()


@check
def check_optimizer_slots_keep_sharding_in_a_training_step():
    mesh = auto_mesh((4, 2), ("data", "model"))
    with ps.device(_tp_layout(mesh)):
        model = ps.nn.Sequential([ps.nn.Dense(16), ps.nn.Dense(8)])
        model(jnp.ones((8, 8)))
    with ps.device(mesh):  # the case: mu came out P()
        opt = ps.Optimizer(optax.adam(1e-2), model)

    @ps.function
    def step(x):
        loss, grads = ps.value_and_grad(lambda: jnp.mean(model(x) ** 2), model)()
        opt.apply_gradients(grads)
        return loss

    x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("data")))
    for _ in range(2):
        jax.block_until_ready(step(x))
    params = {v.name: v.sharding for v in model.variables}
    for v in opt.variables:
        owner = v.name.removeprefix("optimizer/").rsplit("/", 1)[0]
        if owner in params:
            assert v.sharding == params[owner], v.name
    assert step.trace_count == 1


@check
def check_sharded_creation_equals_eager_and_draws_one_key_per_variable():
    mesh = auto_mesh((4, 2), ("data", "model"))
    sh = NamedSharding(mesh, P("data", "model"))
    init = ps.initializers.glorot_uniform()
    with ps.VariableStore():
        eager = ps.Variable(init, shape=(16, 8), name="k").numpy()
    with ps.VariableStore():
        a = ps.Variable(init, shape=(16, 8), name="k", sharding=sh)
        b = ps.Variable(lambda: init((16, 8)), name="k", sharding=sh)  # "k_1"
        c = ps.get_variable("g", (16, 8), initializer=init)
    assert a.sharding == sh and b.sharding == sh
    np.testing.assert_array_equal(a.numpy(), eager)  # same values, only placed
    assert not np.array_equal(a.numpy(), b.numpy())  # one key per variable
    assert not np.array_equal(a.numpy(), c.numpy())
    d = ps.Variable(init, shape=(16, 8), name="k", sharding=sh)  # fresh store: "k" again
    np.testing.assert_array_equal(d.numpy(), eager)


@check
def check_sharded_init_program_output_shardings_and_memory():
    mesh = auto_mesh((8,), ("x",))
    sh = NamedSharding(mesh, P(None, "x"))
    n = 1024
    whole = n * n * 4
    programs = []
    real = _abstract.init_program

    def spy(makes, shardings):
        program = real(makes, shardings)
        programs.append(program)
        return program

    _abstract.init_program = spy
    try:
        v = ps.Variable(ps.initializers.random_normal(), shape=(n, n), name="w", sharding=sh)
    finally:
        _abstract.init_program = real
    assert len(programs) == 1 and v.sharding == sh
    compiled = programs[0].lower().compile()
    assert compiled.output_shardings == [sh]
    mem = compiled.memory_analysis()
    assert mem.output_size_in_bytes == whole // 8  # one shard per device
    assert mem.temp_size_in_bytes < whole  # never a whole array per device
    assert all(s.data.shape == (n, n // 8) for s in v.value().addressable_shards)


@check
def check_no_whole_array_is_live_during_sharded_creation():
    mesh = auto_mesh((8,), ("x",))
    n = 2048
    shard_bytes = n * n * 4 // 8
    biggest = [0]
    stop = threading.Event()

    def largest_buffer() -> int:
        out = 0
        for x in jax.live_arrays():
            with contextlib.suppress(Exception):
                out = max(out, max(s.data.nbytes for s in x.addressable_shards))
        return out

    def watch():
        while not stop.is_set():
            biggest[0] = max(biggest[0], largest_buffer())
            time.sleep(0.0005)

    real_put = jax.device_put

    def put(x, *args, **kwargs):  # the old path built the whole value, then placed it
        biggest[0] = max(biggest[0], largest_buffer())
        return real_put(x, *args, **kwargs)

    before = largest_buffer()
    watcher = threading.Thread(target=watch, daemon=True)
    jax.device_put = put
    watcher.start()
    try:
        lm = ps.sharding.LayoutMap(mesh)
        lm["big"] = (None, "x")
        with ps.device(lm):
            v = ps.Variable(ps.initializers.glorot_uniform(), shape=(n, n), name="big")
        jax.block_until_ready(v.value())
    finally:
        stop.set()
        watcher.join(timeout=10)
        jax.device_put = real_put
    assert before < shard_bytes
    assert biggest[0] <= shard_bytes, (biggest[0], shard_bytes)
    assert v.sharding.spec == P(None, "x")


@check
def check_axis_rules_on_eight_devices_and_layer_partitions():
    mesh = auto_mesh((4, 2), ("data", "model"))
    rules = {"embed": "data", "mlp": "model", "vocab": None}
    with ps.sharding.axis_rules(mesh, rules):
        emb = ps.nn.Embedding(32, 8, embeddings_partition=("vocab", "embed"))
        emb(jnp.zeros((2,), jnp.int32))
        conv = ps.nn.Conv2D(
            4, 3, kernel_partition=(None, None, None, "mlp"), bias_partition=("mlp",)
        )
        conv(jnp.ones((1, 5, 5, 2)))
        mha = ps.nn.MultiHeadAttention(
            2,
            4,
            kernel_partition=("embed", "mlp", None),
            output_kernel_partition=("mlp", None, "embed"),
        )
        mha(jnp.ones((1, 3, 8)), jnp.ones((1, 3, 8)))
        ln = ps.nn.LayerNormalization(gamma_partition=("embed",), beta_partition=("embed",))
        ln(jnp.ones((2, 8)))
    assert emb.embeddings.sharding.spec == P(None, "data")
    assert ps.sharding.specs(conv) == {
        "conv2d/kernel": P(None, None, None, "model"),
        "conv2d/bias": P("model"),
    }
    specs = ps.sharding.specs(mha)
    assert specs["multi_head_attention/query/kernel"] == P("data", "model", None)
    assert specs["multi_head_attention/attention_output/kernel"] == P("model", None, "data")
    assert specs["multi_head_attention/query/bias"] == P()
    assert ln.gamma.sharding.spec == P("data")


@check
def check_layout_that_does_not_divide_is_a_clear_error():
    mesh = auto_mesh((4, 2), ("data", "model"))
    lm = ps.sharding.LayoutMap(mesh)
    lm["odd"] = ("data",)
    with ps.VariableStore() as store, ps.device(lm):
        with contextlib.suppress(ValueError):
            ps.Variable(lambda: jnp.ones((6,)), name="odd")
            raise AssertionError("no error")
        assert store.variables() == []
    with ps.device(lm):
        try:
            ps.Variable(ps.initializers.ones(), shape=(6,), name="odd")
        except ValueError as e:
            assert re.search(r"variable 'odd' with shape \(6,\) does not fit", str(e)), str(e)
        else:
            raise AssertionError("no error")


@check
def check_abstract_model_with_layouts_initializes_as_one_sharded_program():
    mesh = auto_mesh((4, 2), ("data", "model"))
    lm = _tp_layout(mesh)
    with ps.VariableStore():
        eager = ps.nn.Sequential([ps.nn.Dense(16), ps.nn.Dense(8)])
        eager(jnp.ones((1, 8)))
        want = {v.name: v.numpy() for v in eager.variables}
    live = len(jax.live_arrays())
    model = ps.nn.Sequential([ps.nn.Dense(16), ps.nn.Dense(8)])
    with ps.abstract(), ps.device(lm):
        for layer, features in zip(model.layers, (8, 16)):
            with layer.name_scope:  # what layer.build(input_shape) does once it exists
                layer.build((None, features))
            layer.built = True
    assert len(jax.live_arrays()) == live
    assert all(v.is_abstract for v in model.variables)
    assert ps.sharding.specs(model) == {
        "dense/kernel": P("data", "model"),
        "dense/bias": P("model"),
        "dense_1/kernel": P("data", "model"),
        "dense_1/bias": P("model"),
    }
    programs = init_programs(lambda: ps.initialize(model))
    assert len(programs) == 1 and len(programs[0]) == 4  # one program for the model
    for v in model.variables:
        assert not v.is_abstract and v.sharding == NamedSharding(mesh, P(*lm[v.name]))
        np.testing.assert_array_equal(v.numpy(), want[v.name])
    # the restore entry point: a host array goes straight onto the variable's sharding
    with ps.abstract(), ps.device(lm):
        k = ps.Variable(jax.ShapeDtypeStruct((8, 4), jnp.float32), name="dense_9/kernel")
    value = np.arange(32, dtype=np.float32).reshape(8, 4)
    ps.variable.set_initial_value(k, value)
    assert k.sharding == NamedSharding(mesh, P("data", "model"))
    assert all(s.data.shape == (2, 2) for s in k.value().addressable_shards)
    np.testing.assert_array_equal(k.numpy(), value)


@check
def check_abstract_model_and_optimizer_restored_from_a_checkpoint_equal_the_original():
    import tempfile

    mesh = auto_mesh((4, 2), ("data", "model"))
    lm = _tp_layout(mesh)

    def make():
        with ps.device(lm):
            model = ps.nn.Sequential([ps.nn.Dense(8, name="dense"), ps.nn.Dense(4, name="dense_1")])
            model.build((None, 8))
        return model, ps.Optimizer(optax.adam(1e-2), model, name="adam")

    def step(model, opt, x):
        loss, grads = ps.value_and_grad(lambda: jnp.mean(model(x) ** 2), model)()
        opt.apply_gradients(grads)
        return loss

    x = jax.random.normal(jax.random.key(1), (8, 8))
    with ps.VariableStore():
        model, opt = make()
        step(model, opt, x)  # moments and count not zero
        want = {v.name: (v.numpy(), v.sharding) for v in [*model.variables, *opt.variables]}
        path = tempfile.mkdtemp() + "/ckpt"
        ps.Checkpoint(model=model, optimizer=opt).save(path)
    with ps.VariableStore(), ps.abstract():
        model, opt = make()
    assert all(v.is_abstract for v in [*model.variables, *opt.variables])
    kernel = opt.variables[[v.name for v in opt.variables].index("adam/dense/kernel/mu")]
    assert kernel.sharding == NamedSharding(mesh, P("data", "model"))  # like its parameter
    assert opt.iterations.sharding == NamedSharding(mesh, P())
    ps.Checkpoint(model=model, optimizer=opt).restore(path)
    got = [*model.variables, *opt.variables]
    assert sorted(v.name for v in got) == sorted(want)
    for v in got:
        assert not v.is_abstract and v.sharding == want[v.name][1], v.name
        np.testing.assert_array_equal(v.numpy(), want[v.name][0])
    assert int(opt.iterations.numpy()) == 1
    before = model.variables[0].numpy()
    step(model, opt, x)
    assert int(opt.iterations.numpy()) == 2 and not np.allclose(model.variables[0].numpy(), before)
    for v in [*model.variables, *opt.variables]:
        assert v.sharding == want[v.name][1], v.name  # the step keeps every placement


layout_results, test_multi_device = multi_device_tests(CHECKS, __file__, "layout_results")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        run_checks(CHECKS, sys.argv[1])
