"""init_from_checkpoint against its oracle, TF1's tf.compat.v1.train.init_from_checkpoint:
each assignment-map form, run by TensorFlow on TF variables and by paramstore on
ps.Variables of the same names, assigns the same values. Also TF2 and Keras files."""

from __future__ import annotations

import numpy as np
import pytest
from _lazy import lazy

import paramstore as ps
from paramstore.checkpoint import init_from_checkpoint

tf = lazy("tensorflow")
keras = lazy("keras")

pytestmark = pytest.mark.slow  # TensorFlow's import takes seconds

RNG = np.random.default_rng(1)
VALUES = {
    "old/dense/kernel": RNG.standard_normal((3, 2)).astype(np.float32),
    "old/dense/bias": RNG.standard_normal(2).astype(np.float32),
    "old/emb": RNG.standard_normal((4, 3)).astype(np.float32),
    "dense/kernel": RNG.standard_normal((3, 2)).astype(np.float32),
    "dense/bias": RNG.standard_normal(2).astype(np.float32),
    "emb": RNG.standard_normal((4, 3)).astype(np.float32),
}
SHAPES = {"dense/kernel": (3, 2), "dense/bias": (2,), "emb": (4, 3)}
NEW = {f"new/{k}": s for k, s in SHAPES.items()}


@pytest.fixture(scope="module")
def tf1_prefix(tmp_path_factory):
    graph = tf.Graph()
    with graph.as_default():
        for name, value in VALUES.items():
            tf.compat.v1.get_variable(name, initializer=value)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            return saver.save(sess, str(tmp_path_factory.mktemp("tf1") / "model"))


def tf1_oracle(prefix, shapes, amap):
    """What TF1 assigns: ``{variable name: value}`` (zeros where nothing is assigned)."""
    graph = tf.Graph()
    with graph.as_default():
        made = {
            n: tf.compat.v1.get_variable(n, shape=s, initializer=tf.zeros_initializer())
            for n, s in shapes.items()
        }
        tf_map = {k: made[v.name] if isinstance(v, ps.Variable) else v for k, v in amap.items()}
        tf.compat.v1.train.init_from_checkpoint(prefix, tf_map)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            return {n: sess.run(v) for n, v in made.items()}


@pytest.mark.parametrize(
    ("shapes", "amap"),
    [
        (NEW, {"old/": "new/"}),
        (NEW, {"old/dense/": "new/dense/"}),
        (NEW, {"old/dense/kernel": "new/dense/kernel", "old/emb": "new/emb"}),
        (NEW, {"old/emb": "VARIABLE new/emb"}),
        (NEW, {"/": "new/"}),
        (SHAPES, {"old/": "/"}),
        (SHAPES, {"/": "/"}),
        (NEW, {"old/dense/": "new/dense/", "emb": "new/emb"}),
    ],
)
def test_each_tf1_form_assigns_what_tf1_assigns(tf1_prefix, fresh_store, shapes, amap):
    ours = {n: ps.Variable(np.zeros(s, np.float32), name=n) for n, s in shapes.items()}
    amap = {
        k: ours[v.removeprefix("VARIABLE ")] if v.startswith("VARIABLE ") else v
        for k, v in amap.items()
    }
    want = tf1_oracle(tf1_prefix, shapes, amap)
    done = init_from_checkpoint(tf1_prefix, amap)
    for name, value in want.items():
        np.testing.assert_array_equal(ours[name].numpy(), value, err_msg=name)
    assigned = {n for n, v in want.items() if v.any()}
    assert set(done) == assigned
    for name, ckpt in done.items():
        np.testing.assert_array_equal(want[name], VALUES[ckpt])


def test_a_variable_missing_from_the_checkpoint_raises_as_in_tf1(tf1_prefix, fresh_store):
    shapes = {**NEW, "new/extra": (2,)}
    with pytest.raises(ValueError, match="old/extra"):
        tf1_oracle(tf1_prefix, shapes, {"old/": "new/"})  # names old/extra
    ours = [ps.Variable(np.zeros(s, np.float32), name=n) for n, s in shapes.items()]
    with pytest.raises(ValueError, match=r"variable 'new/extra' .* 'old/extra'"):
        init_from_checkpoint(tf1_prefix, {"old/": "new/"})
    assert not any(v.numpy().any() for v in ours)  # all or nothing


def test_a_missing_checkpoint_name_raises_as_in_tf1(tf1_prefix, fresh_store):
    with pytest.raises(ValueError, match="old/nope"):
        tf1_oracle(tf1_prefix, NEW, {"old/nope": "new/emb"})
    v = ps.Variable(np.zeros((4, 3), np.float32), name="new/emb")
    with pytest.raises(ValueError, match=r"key 'old/nope' matches no checkpoint name"):
        init_from_checkpoint(tf1_prefix, {"old/nope": "new/emb"})
    assert not v.numpy().any()


def test_tf2_and_keras_files(tmp_path, fresh_store):
    module = tf.Module()
    module.kernel = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
    prefix = tf.train.Checkpoint(model=module).save(str(tmp_path / "ckpt"))
    k = ps.Variable(np.zeros((2, 3), np.float32), name="k")
    init_from_checkpoint(prefix, [(r"model/kernel/\.ATTRIBUTES/VARIABLE_VALUE", "k")])
    np.testing.assert_array_equal(k.numpy(), np.arange(6).reshape(2, 3))

    path = str(tmp_path / "model.weights.h5")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense")])
    model.layers[0].set_weights([np.full((4, 3), 0.5, np.float32), np.arange(3, dtype=np.float32)])
    model.save_weights(path)
    kernel = ps.Variable(np.zeros((3, 4), np.float32), name="d/kernel")
    bias = ps.Variable(np.zeros(3, np.float32), name="d/bias")
    done = init_from_checkpoint(
        path,
        [(r"layers/dense/vars/0", "d/kernel"), (r"layers/dense/vars/1", "d/bias")],
        transforms={"kernel": np.transpose},
    )
    assert done == {"d/kernel": "layers/dense/vars/0", "d/bias": "layers/dense/vars/1"}
    np.testing.assert_array_equal(kernel.numpy(), np.full((3, 4), 0.5))
    np.testing.assert_array_equal(bias.numpy(), np.arange(3))
