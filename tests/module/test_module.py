"""ps.Module: tracking, naming, name scopes, and tf.Module's traversal order."""

from __future__ import annotations

import collections
import gc

import jax
import numpy as np
import pytest

import paramstore as ps

# --------------------------------------------------------------------------- structure


def build_structure(base, var):
    """The same model for ``ps.Module`` and ``tf.Module``: ``var(tag, trainable)`` makes a
    variable whose name ends in ``tag``; every tag is unique."""

    class Leaf(base):
        def __init__(self, tag, inner=None):
            super().__init__(name=tag)
            self.w = var(f"{tag}_w")
            self.b = var(f"{tag}_b")
            if inner is not None:
                self.inner = inner

    class Model(base):
        def __init__(self):
            super().__init__(name="model")
            self.z_var = var("z")
            self.a_list = [var("l0"), Leaf("in_list"), var("l1")]
            self.m_dict = {"b": var("db"), "a": var("da"), "c": Leaf("in_dict")}
            self.child = Leaf("child", inner=Leaf("grand"))
            self.tup = (var("t0"), (var("t1"), {"y": var("t2"), "x": var("t3")}))
            self.frozen = var("nt", trainable=False)
            self.ordered = collections.OrderedDict([("q", var("oq")), ("p", var("op"))])
            self.alias = self.z_var  # the same variable twice: reported once, where first met
            self.nothing = None
            self.number = 3

    return Model()


# tf.Module order: attributes sorted by name, containers flattened with dict keys sorted
# (OrderedDicts too), a module's own variables before its submodules', each object once.
EXPECTED_VARIABLES = [
    "l0", "l1",  # a_list (its Leaf is a submodule)
    "z",  # alias (= z_var, so z_var adds nothing later)
    "nt",  # frozen
    "da", "db",  # m_dict, keys sorted
    "op", "oq",  # ordered, keys sorted as tf.nest does
    "t0", "t1", "t3", "t2",  # tup; its inner dict sorted: x, y
    "in_list_b", "in_list_w",  # then the submodules in the order found
    "child_b", "child_w",
    "grand_b", "grand_w",  # depth first: child's submodule before in_dict
    "in_dict_b", "in_dict_w",
]  # fmt: skip
EXPECTED_SUBMODULES = ["in_list", "child", "in_dict", "grand"]


def tags(variables):
    return [v.name.split(":")[0].split("/")[-1] for v in variables]


def ps_var(tag, trainable=True):
    return ps.Variable(0.0, name=tag, trainable=trainable)


def test_order_is_tf_modules():
    m = build_structure(ps.Module, ps_var)
    assert tags(m.variables) == EXPECTED_VARIABLES
    assert tags(m.trainable_variables) == [t for t in EXPECTED_VARIABLES if t != "nt"]
    assert tags(m.non_trainable_variables) == ["nt"]
    assert [s.name for s in m.submodules] == EXPECTED_SUBMODULES
    assert isinstance(m.variables, tuple) and isinstance(m.submodules, tuple)
    assert m.variables[2] is m.z_var
    # Deterministic: the same structure always gives the same order.
    with ps.VariableStore():
        again = build_structure(ps.Module, ps_var)
    assert tags(again.variables) == tags(m.variables)


@pytest.mark.tf
def test_order_matches_tf_module_oracle(tf):
    def tf_var(tag, trainable=True):
        return tf.Variable(0.0, name=tag, trainable=trainable)

    tf_model = build_structure(tf.Module, tf_var)
    ps_model = build_structure(ps.Module, ps_var)
    assert tags(ps_model.variables) == tags(tf_model.variables)
    assert tags(ps_model.trainable_variables) == tags(tf_model.trainable_variables)
    assert tags(ps_model.non_trainable_variables) == tags(tf_model.non_trainable_variables)
    assert [s.name for s in ps_model.submodules] == [s.name for s in tf_model.submodules]
    assert tags(ps_model.variables) == EXPECTED_VARIABLES  # and the plain test is right


# ---------------------------------------------------------------------------- tracking


class Dense(ps.Module):
    def __init__(self, n_in, n_out, name=None):
        self.w = ps.Variable(np.ones((n_in, n_out), np.float32), name="w")
        self.b = ps.Variable(np.zeros(n_out, np.float32), name="b")

    def __call__(self, x):
        return x @ self.w + self.b


def test_tracks_attributes_lists_tuples_dicts_and_nested_modules():
    class Net(ps.Module):
        def __init__(self):
            self.layers = [Dense(2, 3), Dense(3, 1)]
            self.extra = {"scale": ps.Variable(1.0, name="scale")}
            self.pair = (ps.Variable(0, name="step", trainable=False),)

    net = Net()
    names = [v.name for v in net.variables]
    assert names == [
        "net/scale",
        "net/step",
        "net/dense/b",
        "net/dense/w",
        "net/dense_1/b",
        "net/dense_1/w",
    ]
    assert [s.scope_name for s in net.submodules] == ["net/dense", "net/dense_1"]
    assert all(isinstance(s, Dense) for s in net.submodules)
    assert [v.name for v in net.non_trainable_variables] == ["net/step"]
    assert len(net.trainable_variables) == 5
    # Tracking is live: attributes added or replaced later are found.
    net.late = ps.Variable(2.0, name="late")
    net.layers.append(Dense(1, 1, name="head"))
    assert "late" in [v.name for v in net.variables]
    assert "head/w" in [v.name for v in net.variables]
    x = np.ones((1, 2), np.float32)
    for layer in net.layers[:2]:
        x = layer(x)
    np.testing.assert_array_equal(np.asarray(x), [[6.0]])


@jax.tree_util.register_pytree_node_class
class Pair:
    """A user pytree (not a list, tuple or dict): flattened the way JAX does, b before a."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def tree_flatten(self):
        return (self.b, self.a), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[1], children[0])


def test_tracks_variables_inside_other_pytrees():
    class Holder(ps.Module):
        def __init__(self):
            self.pair = Pair(ps.Variable(0.0, name="a"), [ps.Variable(0.0, name="b")])
            self.point = collections.namedtuple("Point", "y x")(ps.Variable(0.0, name="y"), 1)

    h = Holder()
    assert [v.name for v in h.variables] == ["holder/b", "holder/a", "holder/y"]


def test_each_object_is_reported_once_and_cycles_terminate():
    class Node(ps.Module):
        def __init__(self, name=None):
            self.v = ps.Variable(0.0, name="v")

    a, b = Node(name="a"), Node(name="b")
    a.peer, b.peer = b, a  # a cycle
    a.self_ref = a
    a.shared = [b.v, b.v, b]
    # Sorted attributes: peer, self_ref, shared (meets b.v first), v.
    assert [v.name for v in a.variables] == ["b/v", "a/v"]
    assert [s.name for s in a.submodules] == ["b"]
    assert [v.name for v in b.variables] == ["b/v", "a/v"]


def test_module_does_not_keep_dead_variables_alive_in_the_store(fresh_store):
    m = Dense(2, 2)
    assert [v.name for v in fresh_store.variables()] == ["dense/w", "dense/b"]
    del m
    gc.collect()
    assert fresh_store.variables() == []


# ------------------------------------------------------------------------------- names


def test_default_name_is_snake_case_class_name():
    class MyFancyModel(ps.Module):
        pass

    class HTTPLayer(ps.Module):
        def __init__(self):
            self.v = ps.Variable(1.0, name="v")

    assert MyFancyModel().name == "my_fancy_model"
    h = HTTPLayer()
    assert h.name == "http_layer"
    assert h.v.name == "http_layer/v"
    assert ps.Module().name == "module"
    assert ps.Module(name="plain").name == "plain"


def test_variables_are_named_in_the_module_scope_and_scopes_are_unique():
    a = Dense(2, 2)
    b = Dense(2, 2)
    c = Dense(2, 2, name="head")
    assert (a.name, b.name, c.name) == ("dense", "dense", "head")
    assert (a.scope_name, b.scope_name, c.scope_name) == ("dense", "dense_1", "head")
    assert [v.name for v in a.variables] == ["dense/b", "dense/w"]
    assert [v.name for v in b.variables] == ["dense_1/b", "dense_1/w"]
    assert [v.name for v in c.variables] == ["head/b", "head/w"]
    with ps.name_scope("outer"):
        d = Dense(1, 1)
    assert d.w.name == "outer/dense/w"


def test_with_name_scope_reenters_the_module_scope():
    m = Dense(1, 1)
    m2 = Dense(1, 1)
    with ps.name_scope("elsewhere"), m2.name_scope:
        extra = ps.Variable(0.0, name="extra")
        with ps.variable_scope("vs"):
            g = ps.get_variable("g", shape=())
    assert extra.name == "dense_1/extra"
    assert g.name == "dense_1/vs/g"
    with m.name_scope:
        assert ps.Variable(0.0, name="w").name == "dense/w_1"
    assert ps.Variable(0.0, name="w").name == "w"


def test_name_passed_to_super_init_is_used():
    class Encoder(ps.Module):
        def __init__(self):
            super().__init__(name="encoder")
            self.w = ps.Variable(1.0, name="w")

    class Keras(ps.Module):
        def __init__(self, units, **kwargs):
            super().__init__(**kwargs)
            self.w = ps.Variable(np.zeros(units, np.float32), name="w")

    class Renamed(ps.Module):
        def __init__(self, name=None):
            super().__init__(name=name or "custom")
            self.w = ps.Variable(1.0, name="w")

    e1, e2 = Encoder(), Encoder()
    assert (e1.name, e1.w.name) == ("encoder", "encoder/w")
    assert (e2.name, e2.w.name) == ("encoder", "encoder_1/w")
    k = Keras(3, name="proj")
    assert (k.name, k.w.name) == ("proj", "proj/w")
    assert Keras(2).w.name == "keras/w"
    assert Renamed().w.name == "custom/w"
    r = Renamed(name="given")
    assert (r.name, r.w.name) == ("given", "given/w")


def test_invalid_module_name_raises():
    with pytest.raises(ValueError, match="not a valid module name"):
        ps.Module(name="has space")
    with pytest.raises(ValueError, match="not a valid module name"):
        Dense(1, 1, name="a/b")


def test_repr_names_the_module():
    m = Dense(2, 2)
    assert "dense" in repr(m) and "2 variables" in repr(m)


def test_default_name_in_the_subclass_signature_names_the_module():
    class Model(ps.Module):
        def __init__(self, units=2, name="model"):
            self.w = ps.Variable(np.zeros(units, np.float32), name="w")

    m = Model()
    assert m.name == "model"
    assert m.w.name == "model/w"
