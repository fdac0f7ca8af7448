"""Hugging Face safetensors: plain and sharded checkpoints read by every reader entry point,
written by export_safetensors (read back by the safetensors library), and every malformed
checkpoint or bad export refused with nothing changed. (transformers itself loads an export
in tests/examples/test_gpt2_example.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import paramstore as ps
from paramstore.checkpoint import (
    CheckpointError,
    Saver,
    export_safetensors,
    init_from_checkpoint,
    list_variables,
    load_variable,
)
from paramstore.checkpoint.formats.huggingface import export as hf_export

TENSORS = {
    "a.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
    "a.bias": np.arange(4).astype(ml_dtypes.bfloat16),
    "b.weight": np.full((2, 2), 0.5, np.float16),
    "b.count": np.array([3, 4], np.int64),
}


def sharded(directory, tensors=TENSORS, split=("a.weight", "a.bias")):
    """An index and two shards, as transformers writes them."""
    files = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    first, second = files
    for name, value in tensors.items():
        files[first if name in split else second][name] = value
    weight_map = {}
    for file, part in files.items():
        save_file(part, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    path = os.path.join(directory, "model.safetensors.index.json")
    with open(path, "w") as f:
        json.dump(index, f)
    return path


@pytest.fixture(params=["file", "directory", "index", "sharded directory"])
def checkpoint(request, tmp_path):
    if request.param in ("file", "directory"):
        path = str(tmp_path / "model.safetensors")
        save_file(TENSORS, path, metadata={"format": "pt"})
        return path if request.param == "file" else str(tmp_path)
    index = sharded(str(tmp_path))
    return index if request.param == "index" else str(tmp_path)


def test_every_reader_entry_point(checkpoint, fresh_store):
    listed = list_variables(checkpoint, allow_unverified=True)
    assert listed == sorted((n, v.shape, v.dtype) for n, v in TENSORS.items())
    for name, value in TENSORS.items():
        got = load_variable(checkpoint, name, allow_unverified=True)
        assert got.dtype == value.dtype
        np.testing.assert_array_equal(got, value)
    w = ps.Variable(jnp.zeros((3, 4)), name="w")
    bias = ps.Variable(jnp.zeros(4, jnp.bfloat16), name="bias")
    half = ps.Variable(jnp.zeros((2, 2), jnp.float16), name="half")
    Saver({"a.weight": w, "a.bias": bias, "b.weight": half}).restore(
        checkpoint, allow_unverified=True
    )
    np.testing.assert_array_equal(w.numpy(), TENSORS["a.weight"])
    assert bias.dtype == jnp.bfloat16 and half.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(bias.numpy(), np.float32), np.arange(4))
    w.assign(jnp.zeros((3, 4)))
    init_from_checkpoint(checkpoint, [(r"a\.(weight)", r"w")], allow_unverified=True)
    np.testing.assert_array_equal(w.numpy(), TENSORS["a.weight"])


def test_without_allow_unverified_the_error_says_what_to_pass(checkpoint, fresh_store):
    w = ps.Variable(jnp.zeros((3, 4)), name="w")
    for call in (
        lambda: list_variables(checkpoint),
        lambda: load_variable(checkpoint, "a.weight"),
        lambda: Saver({"a.weight": w}).restore(checkpoint),
        lambda: init_from_checkpoint(checkpoint, {"a.weight": w}),
    ):
        with pytest.raises(CheckpointError, match="pass allow_unverified=True"):
            call()
    assert not w.numpy().any()


# --------------------------------------------------------------- malformed checkpoints


def _break(directory, how):
    index = sharded(directory)
    first = os.path.join(directory, "model-00001-of-00002.safetensors")
    data = json.loads(Path(index).read_text())
    if how == "missing shard":
        os.remove(first)
    elif how == "index disagrees":  # the index puts a.bias in the second shard
        data["weight_map"]["a.bias"] = "model-00002-of-00002.safetensors"
    elif how == "name outside the index":
        del data["weight_map"]["a.bias"]
    elif how == "index names a tensor no shard holds":
        data["weight_map"]["c.weight"] = "model-00002-of-00002.safetensors"
    elif how == "duplicated":
        save_file({"a.weight": TENSORS["a.weight"], "b.count": TENSORS["b.count"]}, first)
        data["weight_map"]["b.count"] = "model-00001-of-00002.safetensors"
    elif how == "truncated":
        with open(first, "r+b") as f:
            f.truncate(os.path.getsize(first) - 8)
    elif how == "not json":
        with open(index, "w") as f:
            f.write('{"weight_map": {"a.weight": ')
        return index
    elif how == "parent path":
        data["weight_map"]["a.weight"] = "../x.safetensors"
    elif how == "absolute path":
        data["weight_map"]["a.weight"] = os.path.abspath(first)
    elif how == "NUL byte":
        data["weight_map"]["a.weight"] = "model-00001\0.safetensors"
    elif how == "subdirectory":
        data["weight_map"]["a.weight"] = "sub/model-00001-of-00002.safetensors"
    elif how == "no weight_map":
        data = {"metadata": {}}
    with open(index, "w") as f:
        json.dump(data, f)
    return index


@pytest.mark.parametrize(
    ("how", "match"),
    [
        ("missing shard", r"names shard file 'model-00001-of-00002.safetensors', which does not"),
        (
            "index disagrees",
            r"shard 'model-00001-of-00002.safetensors' holds tensor 'a.bias', "
            r"which the index assigns to 'model-00002-of-00002.safetensors'",
        ),
        ("name outside the index", r"holds tensor 'a.bias', which the index assigns to no shard"),
        ("index names a tensor no shard holds", r"puts tensor 'c.weight' in shard"),
        (
            "duplicated",
            r"tensor 'b.count' is in two shards, 'model-00001-of-00002.safetensors' "
            r"and 'model-00002-of-00002.safetensors'",
        ),
        ("truncated", r"model-00001-of-00002.safetensors' is corrupt: the file is truncated"),
        ("not json", r"index '.*model.safetensors.index.json' is corrupt: it is not valid JSON"),
        ("parent path", r"names shard file '../x.safetensors', which is not a file name inside"),
        ("absolute path", r"names shard file '/.*', which is not a file name inside"),
        ("NUL byte", r"names shard file 'model-00001\\x00.safetensors', which is not a file"),
        ("subdirectory", r"names shard file 'sub/model-00001-of-00002.safetensors', which is not"),
        ("no weight_map", r"index '.*' is corrupt: it lacks a 'weight_map' object"),
    ],
)
def test_malformed_sharded_checkpoints_are_refused(tmp_path, fresh_store, how, match):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    index = _break(str(directory), how)
    w = ps.Variable(jnp.zeros((3, 4)), name="w")
    with pytest.raises(CheckpointError, match=match):
        init_from_checkpoint(directory, {"a.weight": w}, allow_unverified=True)
    with pytest.raises(CheckpointError, match=match):
        list_variables(index, allow_unverified=True)
    assert not w.numpy().any()


def test_a_header_claiming_more_bytes_than_the_file_holds(tmp_path, fresh_store):
    path = str(tmp_path / "model.safetensors")
    save_file({"x": np.ones(4, np.float32)}, path)
    raw = bytearray(Path(path).read_bytes())
    raw[:8] = (len(raw) * 2).to_bytes(8, "little")
    Path(path).write_bytes(bytes(raw))
    x = ps.Variable(jnp.zeros(4), name="x")
    with pytest.raises(CheckpointError, match=r"model.safetensors' is corrupt: the header length"):
        init_from_checkpoint(tmp_path, {"x": x}, allow_unverified=True)
    assert not x.numpy().any()


# ------------------------------------------------------------------------ export


@pytest.fixture
def model(fresh_store):
    return [
        ps.Variable(jnp.arange(12.0).reshape(3, 4), name="dense/kernel"),
        ps.Variable(jnp.arange(4, dtype=jnp.bfloat16), name="dense/bias"),
        ps.Variable(jnp.ones((2, 2), jnp.float16), name="ln/gamma"),
        ps.Variable(jnp.array([1, 2], jnp.int32), name="step"),
    ]


def test_export_one_file_read_by_safetensors(tmp_path, model):
    path = str(tmp_path / "out.safetensors")
    names = {"dense/kernel": "h.0.w", "step": None}
    assert export_safetensors(path, model, names=names) == path
    got = load_file(path)
    assert sorted(got) == ["dense/bias", "h.0.w", "ln/gamma"]
    np.testing.assert_array_equal(got["h.0.w"], model[0].numpy())
    assert got["dense/bias"].dtype == ml_dtypes.bfloat16 or got["dense/bias"].dtype == np.uint16
    assert list_variables(path, allow_unverified=True)[0] == (
        "dense/bias",
        (4,),
        ml_dtypes.bfloat16,
    )
    assert os.listdir(tmp_path) == ["out.safetensors"]  # no temporary file left


def test_export_sharded_in_hugging_faces_layout(tmp_path, model):
    path = str(tmp_path / "out")
    export_safetensors(path, model, names=lambda n: n.replace("/", "."), max_shard_size=20)
    files = sorted(os.listdir(path))
    assert files == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads(Path(os.path.join(path, "model.safetensors.index.json")).read_text())
    assert index["metadata"]["total_size"] == 48 + 8 + 8 + 8
    assert index["weight_map"] == {
        "dense.kernel": "model-00001-of-00003.safetensors",
        "dense.bias": "model-00002-of-00003.safetensors",
        "ln.gamma": "model-00002-of-00003.safetensors",
        "step": "model-00003-of-00003.safetensors",
    }
    for file in files[:-1]:
        load_file(os.path.join(path, file))
    assert load_variable(path, "ln.gamma", allow_unverified=True).dtype == np.float16
    # an existing directory (a model directory) gets the one-file layout; stale shards go
    export_safetensors(path, model)
    assert sorted(os.listdir(path)) == ["model.safetensors"]
    export_safetensors(path, model, max_shard_size=20)
    assert len(os.listdir(path)) == 4


@pytest.mark.parametrize(
    ("names", "error", "match"),
    [
        (
            {"dense/kernel": "x", "dense/bias": "x"},
            ValueError,
            r"variables 'dense/kernel' and 'dense/bias' are both named 'x'",
        ),
        ({"dense/kernel": 3}, TypeError, r"variable 'dense/kernel' is named 3; a name in the file"),
        ({"nope": "x"}, ValueError, r"names renames 'nope', which is none of the variables"),
        (lambda n: n.encode(), TypeError, r"variable 'dense/kernel' is named b'dense/kernel'"),
    ],
)
def test_bad_exports_write_nothing(tmp_path, model, names, error, match):
    path = tmp_path / "out.safetensors"
    with pytest.raises(error, match=match):
        export_safetensors(path, model, names=names)
    assert os.listdir(tmp_path) == []


def test_an_export_failing_midway_leaves_the_old_export(tmp_path, model, monkeypatch):
    path = str(tmp_path / "out")
    export_safetensors(path, model, max_shard_size=20)
    before = {f: Path(os.path.join(path, f)).read_bytes() for f in os.listdir(path)}
    real, calls = hf_export._host, []

    def fail_third(value):
        calls.append(value)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(value)

    monkeypatch.setattr(hf_export, "_host", fail_third)
    with pytest.raises(OSError, match="disk full"):
        export_safetensors(path, model, max_shard_size=20)
    with pytest.raises(OSError, match="disk full"):
        calls.clear()
        export_safetensors(tmp_path / "fresh", model, max_shard_size=20)
    assert {f: Path(os.path.join(path, f)).read_bytes() for f in os.listdir(path)} == before
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary file or directory left


def test_export_refuses_abstract_and_string_variables(tmp_path, fresh_store):
    with ps.abstract():
        a = ps.Variable(jax.ShapeDtypeStruct((2,), jnp.float32), name="a")
    s = ps.Variable("text", name="s")
    with pytest.raises(ValueError, match=r"variable 'a' is abstract \(no value yet\)"):
        export_safetensors(tmp_path / "x.safetensors", [a])
    with pytest.raises(ValueError, match=r"'s' has dtype string, which safetensors cannot hold"):
        export_safetensors(tmp_path / "x.safetensors", {"s": s})
    assert os.listdir(tmp_path) == []
