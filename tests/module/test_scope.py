"""Names, scopes and sharing: name_scope, variable_scope, get_variable, VariableStore, seeds."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _backends import same_backend_env

import paramstore as ps


def store_snapshot(store):
    """Names, identities and exact contents of every live variable of ``store``."""
    return [(v.name, id(v), v.value(), v.numpy().tobytes()) for v in store.variables()]


def assert_store_unchanged(store, before):
    after = store_snapshot(store)
    assert len(after) == len(before)
    for (n0, i0, a0, b0), (n1, i1, a1, b1) in zip(before, after):
        assert (n0, i0, b0) == (n1, i1, b1)
        assert a0 is a1


# ------------------------------------------------------------------------ name_scope


def test_name_scope_prefixes_variable_names():
    with ps.name_scope("outer") as outer:
        a = ps.Variable(1.0, name="v")
        with ps.name_scope("inner") as inner:
            b = ps.Variable(1.0, name="v")
            c = ps.Variable(1.0)
    d = ps.Variable(1.0, name="v")
    assert outer == "outer/"
    assert inner == "outer/inner/"
    assert (a.name, b.name, c.name, d.name) == (
        "outer/v",
        "outer/inner/v",
        "outer/inner/Variable",
        "v",
    )


def test_reentering_a_name_scope_gives_the_same_prefix():
    with ps.name_scope("block"):
        a = ps.Variable(1.0, name="w")
    with ps.name_scope("block"):
        b = ps.Variable(1.0, name="w")
    assert (a.name, b.name) == ("block/w", "block/w_1")


def test_name_scope_does_not_prefix_get_variable():
    # TensorFlow 1: get_variable names come from the variable scopes only.
    with ps.variable_scope("vs"), ps.name_scope("ns"):
        g = ps.get_variable("g", shape=(2,))
        p = ps.Variable(1.0, name="p")
    assert g.name == "vs/g"
    assert p.name == "vs/ns/p"


def test_scopes_do_not_leak_out_of_a_module_built_inside_them():
    class Block(ps.Module):
        def __init__(self):
            self.v = ps.Variable(1.0, name="v")

    with ps.name_scope("outer"), ps.variable_scope("vs"):
        b = Block()
        inside = ps.Variable(1.0, name="inside")
    after = ps.Variable(1.0, name="after")
    assert b.v.name == "outer/vs/block/v"
    assert inside.name == "outer/vs/inside"
    assert after.name == "after"
    assert ps.get_variable("g", shape=()).name == "g"


def test_name_scope_rejects_non_strings():
    with pytest.raises(TypeError, match="str"), ps.name_scope(3):
        pass


# ----------------------------------------------------------------------- get_variable


def test_get_variable_shape_dtype_initializer():
    with ps.variable_scope("one"):
        w = ps.get_variable("w", shape=(2, 3))
        b = ps.get_variable("b", shape=[3], initializer=ps.initializers.zeros())
        c = ps.get_variable("c", shape=(2,), initializer=ps.initializers.constant(7.0))
        i = ps.get_variable("i", shape=(4,), dtype=jnp.int32)
        o = ps.get_variable(
            "o", shape=(2, 2), dtype=jnp.float16, initializer=ps.initializers.ones()
        )
        k = ps.get_variable("k", initializer=np.array([1, 2], np.int32), dtype=jnp.int32)
        n = ps.get_variable("n", shape=(), trainable=False, initializer=ps.initializers.ones())
    assert (w.name, w.shape, w.dtype) == ("one/w", (2, 3), np.float32)
    limit = np.sqrt(6.0 / (2 + 3))  # default: glorot_uniform for floats
    assert np.all(np.abs(w.numpy()) <= limit) and np.any(w.numpy() != 0)
    assert (b.name, b.shape) == ("one/b", (3,))
    np.testing.assert_array_equal(b.numpy(), np.zeros(3, np.float32))
    np.testing.assert_array_equal(c.numpy(), [7.0, 7.0])
    assert i.dtype == np.int32
    np.testing.assert_array_equal(i.numpy(), np.zeros(4, np.int32))  # zeros for non-floats
    assert o.dtype == np.float16 and o.numpy().dtype == np.float16
    np.testing.assert_array_equal(o.numpy(), np.ones((2, 2), np.float16))
    assert k.shape == (2,)
    np.testing.assert_array_equal(k.numpy(), [1, 2])
    assert n.trainable is False and n.shape == ()


def test_get_variable_without_reuse_raises_and_changes_nothing(fresh_store):
    with ps.variable_scope("one"):
        v = ps.get_variable("v", shape=(2,))
    before = store_snapshot(fresh_store)
    with ps.variable_scope("one"):
        with pytest.raises(ValueError, match="Variable one/v already exists"):
            ps.get_variable("v", shape=(2,))
        with pytest.raises(ValueError, match="Variable one/v already exists"):
            ps.get_variable("v", shape=(5,), initializer=ps.initializers.ones())
    assert_store_unchanged(fresh_store, before)
    assert v.name == "one/v"


def test_reuse_true_returns_the_very_same_object(fresh_store):
    with ps.variable_scope("one"):
        v = ps.get_variable("v", shape=(2, 3))
    with ps.variable_scope("one", reuse=True) as scope:
        assert scope.reuse is True and scope.name == "one"
        assert ps.get_variable("v", shape=(2, 3)) is v
        assert ps.get_variable("v") is v
    assert len(fresh_store.variables()) == 1


def test_reuse_of_a_missing_name_raises_and_creates_nothing(fresh_store):
    with ps.variable_scope("one"):
        ps.get_variable("v", shape=(2,))
    before = store_snapshot(fresh_store)
    with (
        ps.variable_scope("one", reuse=True),
        pytest.raises(ValueError, match="Variable one/nope does not exist"),
    ):
        ps.get_variable("nope", shape=(2,))
    assert_store_unchanged(fresh_store, before)
    with ps.variable_scope("one"):
        assert ps.get_variable("nope", shape=(1,)).name == "one/nope"  # the name is still free


@pytest.mark.parametrize("reuse", [True, ps.AUTO_REUSE])
def test_sharing_with_a_different_shape_or_dtype_raises(fresh_store, reuse):
    with ps.variable_scope("one"):
        v = ps.get_variable("v", shape=(2, 3))
    before = store_snapshot(fresh_store)
    with ps.variable_scope("one", reuse=reuse):
        with pytest.raises(ValueError) as info:
            ps.get_variable("v", shape=(3, 3))
        assert "one/v" in str(info.value)
        assert "(3, 3)" in str(info.value) and "(2, 3)" in str(info.value)
        with pytest.raises(ValueError) as info:
            ps.get_variable("v", shape=(2, 3), dtype=jnp.int32)
        assert "int32" in str(info.value) and "float32" in str(info.value)
    assert_store_unchanged(fresh_store, before)
    assert v.shape == (2, 3) and v.dtype == np.float32


def test_auto_reuse_gets_or_creates(fresh_store):
    def layer():
        with ps.variable_scope("layer", reuse=ps.AUTO_REUSE):
            return ps.get_variable("w", shape=(2,), initializer=ps.initializers.ones())

    a = layer()
    b = layer()
    assert a is b and a.name == "layer/w"
    assert len(fresh_store.variables()) == 1


def test_reuse_is_inherited_and_cannot_be_switched_off(fresh_store):
    with ps.variable_scope("one"), ps.variable_scope("inner"):
        v = ps.get_variable("v", shape=(2,))
    with ps.variable_scope("one", reuse=True):
        for inner_reuse in (None, False):
            with ps.variable_scope("inner", reuse=inner_reuse) as scope:
                assert scope.reuse is True
                assert scope.name == "one/inner"
                assert ps.get_variable("v", shape=(2,)) is v
                with pytest.raises(ValueError, match="does not exist"):
                    ps.get_variable("fresh", shape=(2,))
    with ps.variable_scope("auto", reuse=ps.AUTO_REUSE):
        with ps.variable_scope("nested", reuse=False) as scope:
            assert scope.reuse is ps.AUTO_REUSE
            x = ps.get_variable("x", shape=())
            assert ps.get_variable("x", shape=()) is x
        with ps.variable_scope("strict", reuse=True) as scope:
            assert scope.reuse is True
    assert [v.name for v in fresh_store.variables()] == ["one/inner/v", "auto/nested/x"]


def test_reuse_value_is_validated():
    with pytest.raises(ValueError, match="reuse"), ps.variable_scope("s", reuse="yes"):
        pass


def test_get_variable_bad_input_changes_nothing(fresh_store):
    with ps.variable_scope("one"):
        ps.get_variable("v", shape=(2,))
    before = store_snapshot(fresh_store)
    with ps.variable_scope("one"):
        with pytest.raises(TypeError, match="dtype"):
            ps.get_variable("w", shape=(2,), dtype="no_such_dtype")
        with pytest.raises(ValueError, match="shape"):
            ps.get_variable("w")  # no shape, no value
        with pytest.raises(ValueError, match=r"\(3,\).*\(2,\)"):
            ps.get_variable("w", shape=(2,), initializer=np.ones(3, np.float32))
    assert_store_unchanged(fresh_store, before)


def test_plain_variables_in_a_scope_are_renamed():
    with ps.variable_scope("one"):
        shared = ps.get_variable("v", shape=())
        a = ps.Variable(1.0, name="v")
        b = ps.Variable(2.0, name="v")
    assert (shared.name, a.name, b.name) == ("one/v", "one/v_1", "one/v_2")
    with ps.variable_scope("two"):
        names = [ps.Variable(0, name="v").name for _ in range(3)]
    assert names == ["two/v", "two/v_1", "two/v_2"]


# ----------------------------------------------------------------------- VariableStore


def test_default_store_and_isolation(fresh_store):
    outer = ps.Variable(1.0, name="v")
    with ps.VariableStore() as store:
        assert store is not fresh_store
        inner = ps.Variable(2.0, name="v")
        assert inner.name == "v"
        with ps.variable_scope("s"):
            g = ps.get_variable("g", shape=())
        with ps.VariableStore() as deeper:
            third = ps.Variable(3.0, name="v")
            assert third.name == "v"
            assert deeper.variables()[0] is third and len(deeper.variables()) == 1
        assert [v.name for v in store.variables()] == ["v", "s/g"]
        assert store.variables()[0] is inner and store.variables()[1] is g
    after = ps.Variable(4.0, name="v")
    assert after.name == "v_1"
    assert [v.name for v in fresh_store.variables()] == ["v", "v_1"]
    assert fresh_store.variables()[0] is outer
    # Re-running the same "cell" in a fresh store does not collide.
    for _ in range(2):
        with ps.VariableStore(), ps.variable_scope("cell"):
            assert ps.get_variable("w", shape=()).name == "cell/w"


def test_names_stay_unique_when_threads_create_variables(fresh_store):
    made = []

    def work():
        with fresh_store:  # each thread has its own default-store stack
            made.extend(ps.Variable(0.0, name="v") for _ in range(200))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    names = [v.name for v in made]
    assert len(set(names)) == 800
    assert set(names) == {"v"} | {f"v_{i}" for i in range(1, 800)}
    assert len(fresh_store.variables()) == 800


def test_get_or_create_runs_make_once_per_name_under_threads_and_keeps_what_it_made(fresh_store):
    seen, barrier = [], threading.Barrier(8, timeout=30)

    def make(existing):
        seen.append(existing)
        if existing is not None:
            return existing
        time.sleep(0.01)  # a slow creation: the other threads must wait, not create
        return ps.Variable(1.0, name="shared")

    got = []

    def work():
        with fresh_store:
            barrier.wait()
            got.append(fresh_store.get_or_create("shared", make))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert len(got) == 8 and all(v is got[0] for v in got)
    assert seen[0] is None and all(e is got[0] for e in seen[1:])  # one creation
    got.clear()
    seen.clear()
    gc.collect()
    assert [v.name for v in fresh_store.variables()] == ["shared"]  # held strongly
    assert fresh_store.get_or_create("shared", lambda e: e).name == "shared"


def test_get_or_create_leaves_the_store_unchanged_when_make_raises(fresh_store):
    def make(existing):
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        fresh_store.get_or_create("x", make)
    assert fresh_store.variables() == [] and fresh_store.get("x") is None


class _Probes(set):
    """A store's set of taken names, counting membership tests."""

    probes = 0

    def __contains__(self, name: object) -> bool:
        self.probes += 1
        return super().__contains__(name)


def test_many_variables_of_one_name_are_named_in_linear_time():
    # Counted, not timed: naming n variables of one name tests O(n) candidate names in all
    # (quadratic naming would test ~n^2 / 2: half a million for 1,000 variables).
    def probes(n: int) -> int:
        with ps.VariableStore() as store:
            store._taken = taken = _Probes()
            unnamed = [ps.Variable(0.0) for _ in range(n)]
            named = [ps.Variable(0.0, name="w") for _ in range(n)]
        assert unnamed[-1].name == f"Variable_{n - 1}" and named[-1].name == f"w_{n - 1}"
        return taken.probes

    small, large = probes(250), probes(1_000)
    assert large <= 4 * small + 100, (small, large)  # 4x the variables, 4x the probes
    assert large <= 8 * 2 * 1_000, large  # a few per variable (5 today)


def test_store_tracks_plain_variables_weakly(fresh_store):
    a = ps.Variable(1.0, name="a")
    b = ps.Variable(2.0, name="b")
    with ps.variable_scope("s"):
        ps.get_variable("shared", shape=())  # held by the store: shared state
    assert [v.name for v in fresh_store.variables()] == ["a", "b", "s/shared"]
    del b
    gc.collect()
    assert [v.name for v in fresh_store.variables()] == ["a", "s/shared"]
    assert fresh_store.variables()[0] is a
    with ps.variable_scope("s", reuse=True):
        assert ps.get_variable("shared").name == "s/shared"


def test_store_variables_and_trainable_variables(fresh_store):
    a = ps.Variable(1.0, name="a")
    n = ps.Variable(2.0, name="n", trainable=False)
    c = ps.Variable(3.0, name="c")
    assert [v.name for v in fresh_store.variables()] == ["a", "n", "c"]
    assert all(x is y for x, y in zip(fresh_store.variables(), [a, n, c]))
    assert [v.name for v in fresh_store.trainable_variables()] == ["a", "c"]
    assert all(x is y for x, y in zip(fresh_store.trainable_variables(), [a, c]))


def test_store_state_is_an_immutable_pytree(fresh_store):
    a = ps.Variable([1.0, 2.0], name="a")
    with ps.name_scope("blk"):
        b = ps.Variable(3, name="b")
    ps.Variable(["text"], name="s")  # host-side strings are not part of the state
    state = fresh_store.state()
    assert list(state.keys()) == ["a", "blk/b"]
    assert state["a"] is a.value() and state["blk/b"] is b.value()
    assert isinstance(state["a"], jax.Array)
    with pytest.raises(TypeError):
        state["a"] = jnp.zeros(2)
    with pytest.raises(TypeError):
        del state["a"]
    with pytest.raises(AttributeError):
        state.a = 1
    with pytest.raises(AttributeError):
        state.update({"a": 1})  # no dict mutators
    doubled = jax.tree_util.tree_map(lambda x: x * 2, state)
    assert list(doubled.keys()) == ["a", "blk/b"]
    np.testing.assert_array_equal(doubled["a"], [2.0, 4.0])
    assert int(doubled["blk/b"]) == 6
    assert jax.tree_util.tree_structure(doubled) == jax.tree_util.tree_structure(state)
    total = jax.jit(lambda s: s["a"].sum() + s["blk/b"])(state)
    assert float(total) == 6.0
    a.assign([9.0, 9.0])  # a snapshot: later assigns do not change it
    np.testing.assert_array_equal(state["a"], [1.0, 2.0])
    np.testing.assert_array_equal(fresh_store.state()["a"], [9.0, 9.0])


# ------------------------------------------------------------ initializers and names


def _model(layer_names, init_via):
    out = {}
    for lname in layer_names:
        if init_via == "variable":
            with ps.name_scope(lname):
                out[lname] = ps.Variable(lambda: ps.initializers.glorot_uniform()((3, 4)), name="w")
        else:
            with ps.variable_scope(lname):
                out[lname] = ps.get_variable(
                    "w", shape=(3, 4), initializer=ps.initializers.glorot_uniform()
                )
    return {k: v.numpy() for k, v in out.items()}


@pytest.mark.parametrize("init_via", ["variable", "get_variable"])
def test_same_seed_same_values(init_via):
    runs = []
    for seed in (3, 3, 4):
        with ps.VariableStore():
            ps.random.set_seed(seed)
            runs.append(_model(["l1", "l2"], init_via))
    for name in ("l1", "l2"):
        np.testing.assert_array_equal(runs[0][name], runs[1][name])
        assert not np.array_equal(runs[0][name], runs[2][name])
    assert not np.array_equal(runs[0]["l1"], runs[0]["l2"])


@pytest.mark.parametrize("init_via", ["variable", "get_variable"])
def test_initial_values_depend_on_names_not_creation_order(init_via):
    with ps.VariableStore():
        ps.random.set_seed(7)
        two = _model(["l1", "l2"], init_via)
    with ps.VariableStore():
        ps.random.set_seed(7)
        three = _model(["l0", "l1", "l2"], init_via)  # an extra layer inserted first
    for name in ("l1", "l2"):
        np.testing.assert_array_equal(two[name], three[name])
    assert not np.array_equal(three["l0"], three["l1"])


def test_module_layers_keep_their_values_when_a_layer_is_inserted():
    class Dense(ps.Module):
        def __init__(self, n_in, n_out, name=None):
            self.w = ps.Variable(lambda: ps.initializers.glorot_uniform()((n_in, n_out)), name="w")

    def build(names):
        with ps.VariableStore():
            ps.random.set_seed(11)
            layers = [Dense(3, 3, name=n) for n in names]
            return {layer.w.name: layer.w.numpy() for layer in layers}

    two = build(["first", "second"])
    three = build(["extra", "first", "second"])
    assert set(two) == {"first/w", "second/w"}
    for name in two:
        np.testing.assert_array_equal(two[name], three[name])


_RUN_TO_RUN = textwrap.dedent(
    """
    import paramstore as ps
    ps.random.set_seed(5)
    with ps.variable_scope("enc"):
        w = ps.get_variable("w", shape=(3, 4), initializer=ps.initializers.glorot_uniform())
    v = ps.Variable(lambda: ps.initializers.he_normal()((2, 5)), name="v")
    print(w.numpy().tobytes().hex(), v.numpy().tobytes().hex())
    """
)


def test_same_seed_same_values_run_to_run():
    ps.random.set_seed(5)
    with ps.variable_scope("enc"):
        w = ps.get_variable("w", shape=(3, 4), initializer=ps.initializers.glorot_uniform())
    v = ps.Variable(lambda: ps.initializers.he_normal()((2, 5)), name="v")
    here = f"{w.numpy().tobytes().hex()} {v.numpy().tobytes().hex()}"
    # Another process, with another str hash seed than this one's, gets the same bits on the
    # same backend (another backend may round the initializers' arithmetic differently).
    hashseed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    env = dict(same_backend_env(), PYTHONHASHSEED=hashseed)
    out = subprocess.run(
        [sys.executable, "-c", _RUN_TO_RUN], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == here
