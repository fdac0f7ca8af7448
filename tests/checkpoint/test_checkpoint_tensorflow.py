"""TensorFlow users' files (read-only): TF1 Saver and TF2 tf.train.Checkpoint prefixes and
Keras .weights.h5 files, written here by TensorFlow/Keras and read back."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from _lazy import lazy

import paramstore as ps
from paramstore import checkpoint, cli
from paramstore.checkpoint import CheckpointError, Saver

tf = lazy("tensorflow")
keras = lazy("keras")

pytestmark = pytest.mark.slow  # TensorFlow's import takes seconds


@pytest.fixture(scope="module")
def tf2_prefix(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tf2")
    kernel = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
    bias = tf.Variable(np.array([1.0, 2.0, 3.0], np.float32))
    module = tf.Module()
    module.kernel, module.bias = kernel, bias
    return tf.train.Checkpoint(model=module).save(str(directory / "ckpt"))


@pytest.fixture(scope="module")
def tf1_prefix(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tf1")
    graph = tf.Graph()
    with graph.as_default():
        with tf.compat.v1.variable_scope("dense"):
            tf.compat.v1.get_variable("kernel", initializer=np.full((3, 2), 0.25, np.float32))
            tf.compat.v1.get_variable("bias", initializer=np.array([5, 6], np.int64))
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            return saver.save(sess, str(directory / "model"))


@pytest.fixture(scope="module")
def keras_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("keras") / "model.weights.h5")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense")])
    model.layers[0].set_weights([np.full((4, 3), 0.5, np.float32), np.arange(3, dtype=np.float32)])
    model.save_weights(path)
    return path


def test_tf2_checkpoint(tf2_prefix, capsys):
    listed = dict((n, (s, d)) for n, s, d in checkpoint.list_variables(tf2_prefix))
    key = "model/kernel/.ATTRIBUTES/VARIABLE_VALUE"
    assert listed[key] == ((2, 3), np.dtype(np.float32))
    assert "_CHECKPOINTABLE_OBJECT_GRAPH" not in listed
    np.testing.assert_array_equal(
        checkpoint.load_variable(tf2_prefix, key), np.arange(6).reshape(2, 3)
    )
    w = ps.Variable(np.zeros((2, 3), np.float32), name="w")
    b = ps.Variable(np.zeros(3, np.float32), name="b")
    Saver({key: w, "model/bias/.ATTRIBUTES/VARIABLE_VALUE": b}).restore(tf2_prefix)
    assert w.numpy().sum() == 15 and b.numpy().tolist() == [1, 2, 3]
    assert cli.main(["inspect", tf2_prefix]) == 0
    assert "TensorFlow checkpoint" in capsys.readouterr().out
    # the .index file and the directory name the same checkpoint
    assert checkpoint.list_variables(tf2_prefix + ".index") == checkpoint.list_variables(
        os.path.dirname(tf2_prefix)
    )


def test_tf1_saver_checkpoint(tf1_prefix):
    assert checkpoint.list_variables(tf1_prefix) == [
        ("dense/bias", (2,), np.dtype(np.int64)),
        ("dense/kernel", (3, 2), np.dtype(np.float32)),
    ]
    k = ps.Variable(np.zeros((3, 2), np.float32), name="k")
    Saver({"dense/kernel": k}).restore(tf1_prefix)
    assert np.all(k.numpy() == 0.25)


def test_tf_checkpoint_corruption_is_a_checkpoint_error(tf2_prefix, tmp_path):
    import shutil

    prefix = str(tmp_path / "ckpt-1")
    for suffix in (".index", ".data-00000-of-00001"):
        shutil.copy(tf2_prefix + suffix, prefix + suffix)
    data = prefix + ".data-00000-of-00001"
    raw = bytearray(Path(data).read_bytes())
    at = bytes(raw).index(np.arange(6, dtype=np.float32).tobytes())  # model/kernel's data
    raw[at + 9] ^= 0x20
    Path(data).write_bytes(bytes(raw))
    w = ps.Variable(np.zeros((2, 3), np.float32), name="w")
    b = ps.Variable(np.zeros(3, np.float32), name="b")
    with pytest.raises(CheckpointError, match="corrupt"):
        Saver(
            {
                "model/kernel/.ATTRIBUTES/VARIABLE_VALUE": w,
                "model/bias/.ATTRIBUTES/VARIABLE_VALUE": b,
            }
        ).restore(prefix)
    assert w.numpy().sum() == 0 and b.numpy().sum() == 0


def test_keras_weights_h5(keras_file, capsys):
    listed = checkpoint.list_variables(keras_file)
    assert ("layers/dense/vars/0", (4, 3), np.dtype(np.float32)) in listed
    np.testing.assert_array_equal(
        checkpoint.load_variable(keras_file, "layers/dense/vars/1"), [0, 1, 2]
    )
    w = ps.Variable(np.zeros((4, 3), np.float32), name="w")
    Saver({"layers/dense/vars/0": w}).restore(keras_file)
    assert np.all(w.numpy() == 0.5)
    assert cli.main(["inspect", keras_file, "--name", "layers/*/vars/*"]) == 0
    assert "2 variables, 15 parameters" in capsys.readouterr().out


def test_without_the_extra_a_clear_error(tf2_prefix, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    # the index is read in Python: listing needs no TensorFlow; values do
    assert len(checkpoint.list_variables(tf2_prefix)) == 3
    with pytest.raises(ImportError, match=r"pip install 'paramstore\[tensorflow\]'"):
        checkpoint.load_variable(tf2_prefix, "model/bias/.ATTRIBUTES/VARIABLE_VALUE")
