"""Checkpoints: the safetensors format layer, Saver, CheckpointManager, inspection, integrity."""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
import threading
import time
from pathlib import Path

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file

import paramstore as ps
from paramstore import checkpoint, cli
from paramstore.checkpoint import CheckpointError, CheckpointManager, Saver, atomic
from paramstore.checkpoint import manager as _checkpoint_manager
from paramstore.checkpoint.formats.safetensors import file as _checkpoint_file

STRING = np.dtypes.StringDType()


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-exact equality (NaN payloads included); strings compare as values."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == STRING:
        return a.tolist() == b.tolist()
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def variable(arr: np.ndarray, name: str) -> ps.Variable:
    return ps.Variable(arr, name=name, dtype=str if arr.dtype == STRING else None)


def values(variables):
    return [v.numpy() for v in variables]


def assert_unchanged(variables, before):
    for v, b in zip(variables, before):
        assert same_bytes(v.numpy(), b), f"{v.name} changed"


def header_of(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_with_header(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.fixture
def model():
    """Three variables (float, int, string) and their saved checkpoint."""
    w = ps.Variable(np.arange(12, dtype=np.float32).reshape(3, 4), name="dense/w")
    b = ps.Variable(np.array([1, 2, 3], np.int32), name="dense/b")
    s = ps.Variable(["alpha", "β"], name="vocab")
    return [w, b, s]


@pytest.fixture
def saved(model, tmp_path):
    path = Path(Saver(model).save(tmp_path / "model.safetensors"))
    return model, path


# --------------------------------------------------------------------- format layer


ALL_DTYPES = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    ml_dtypes.bfloat16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.int4,
]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (5,), (2, 3)], ids=str)
def test_arrays_round_trip_bit_exactly(tmp_path, dtype, shape):
    rng = np.random.default_rng(0)
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if np.dtype(dtype) == np.bool_:
        arr = rng.integers(0, 2, size=shape).astype(bool)
    elif np.dtype(dtype) == np.dtype(ml_dtypes.int4):
        arr = rng.integers(-8, 8, size=shape).astype(dtype)
    else:
        arr = np.frombuffer(rng.bytes(nbytes), dtype=dtype).reshape(shape)  # NaNs included
    path = checkpoint.write_arrays(tmp_path / "x.safetensors", {"a/b": arr})
    back = checkpoint.read_arrays(path)["a/b"]
    assert same_bytes(back, arr)
    assert checkpoint.list_variables(path) == [("a/b", shape, np.dtype(dtype))]


def test_strings_round_trip(tmp_path):
    arr = np.array([["", "héllo"], ["\x00nul", "日本語" * 100]], dtype=STRING)
    scalar = np.array("only", dtype=STRING)
    empty = np.zeros((0, 2), dtype=STRING)
    path = checkpoint.write_arrays(tmp_path / "s", {"s": arr, "t": scalar, "e": empty})
    back = checkpoint.read_arrays(path)
    assert back["s"].dtype == STRING and back["s"].tolist() == arr.tolist()
    assert back["t"].shape == () and back["t"].tolist() == "only"
    assert back["e"].shape == (0, 2)


def test_file_is_standard_safetensors(tmp_path):
    arrays = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "bf16": np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16),
        "flag": np.array([True, False]),
        "c": np.array([1 + 2j], dtype=np.complex64),
        "wide": np.array([1 + 2j], dtype=np.complex128),  # no safetensors dtype: raw bytes
    }
    path = checkpoint.write_arrays(tmp_path / "m.safetensors", arrays)
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata()
        assert meta["paramstore.format_version"] == str(checkpoint.FORMAT_VERSION)
        for name in ("f32", "bf16", "flag", "c"):
            assert same_bytes(f.get_tensor(name), arrays[name])
        assert f.get_tensor("wide").dtype == np.uint8  # its true dtype is in the metadata
    tensors = json.loads(meta["paramstore.tensors"])
    assert tensors["wide"] == {
        "xxh3": tensors["wide"]["xxh3"],
        "dtype": "complex128",
        "shape": [1],
    }


def test_tensors_are_aligned_to_their_itemsize(tmp_path):
    arrays: dict[str, np.ndarray] = {
        "u8": np.ones(3, np.uint8),
        "f64": np.ones(3),
        "f16": np.ones(1, np.float16),
    }
    path = Path(checkpoint.write_arrays(tmp_path / "x", arrays))
    header, _ = header_of(path)
    n = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    for name, a in arrays.items():
        assert (n + header[name]["data_offsets"][0]) % a.dtype.itemsize == 0


def test_reads_plain_safetensors_files_only_when_allowed_unverified(tmp_path):
    """Files from other programs (no paramstore metadata, no checksums) are refused unless the
    caller accepts unverified data; then they load and restore."""
    path = tmp_path / "foreign.safetensors"
    save_file({"dense/w": np.full((3, 4), 7, np.float32)}, str(path))
    w = ps.Variable(np.zeros((3, 4), np.float32), name="dense/w")
    with pytest.raises(CheckpointError, match="no paramstore checksums.*allow_unverified"):
        Saver([w]).restore(path)
    assert np.all(w.numpy() == 0)
    listed = checkpoint.list_variables(path, allow_unverified=True)
    assert listed == [("dense/w", (3, 4), np.dtype(np.float32))]
    Saver([w]).restore(path, allow_unverified=True)
    assert np.all(w.numpy() == 7)


def test_never_pickles(tmp_path, monkeypatch, saved):
    for module in Path(ps.__file__).parent.rglob("*.py"):  # the whole package
        source = module.read_text()
        assert not re.search(r"^\s*(import|from)\s+(c?pickle|dill|marshal)", source, re.M)
        assert "allow_pickle" not in source and "np.load(" not in source, module
    forbid = pytest.fail  # any unpickling during a save/restore cycle fails the test
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: forbid("pickle.loads called"))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: forbid("pickle.load called"))
    monkeypatch.setattr(np, "load", lambda *a, **k: forbid("np.load called"))
    variables, path = saved
    Saver(variables).restore(path)
    Saver(variables).save(path)


# ---------------------------------------------------------------------------- Saver


def test_save_returns_path_and_restore_fills_in_place(saved, tmp_path):
    (w, b, s), path = saved
    assert path == tmp_path / "model.safetensors"
    assert Saver([w]).save(tmp_path / "model", step=42) == str(tmp_path / "model-42")
    before = values([w, b, s])
    w.assign(jnp.zeros((3, 4)))
    b.assign(jnp.zeros(3, jnp.int32))
    s.assign(["x", "y"])
    assert Saver([w, b, s]).restore(path) == []
    assert_unchanged([w, b, s], before)
    assert s.dtype == STRING


def test_saver_names(tmp_path):
    with ps.name_scope("outer"):
        v1 = ps.Variable(1.0, name="v1")
    v2 = ps.Variable(2.0, name="v2")
    path = Saver({"my_v2": v2, "first": v1}).save(tmp_path / "d")
    assert [n for n, _, _ in checkpoint.list_variables(path)] == ["first", "my_v2"]
    path = Saver([v1, v2]).save(tmp_path / "l")
    assert [n for n, _, _ in checkpoint.list_variables(path)] == ["outer/v1", "v2"]
    v2.assign(0.0)
    Saver({"my_v2": v2}).restore(tmp_path / "d")
    assert float(v2.value()) == 2.0


def test_saver_none_saves_every_live_variable_of_the_default_store(tmp_path):
    a = ps.Variable(1.0, name="a")
    saver = Saver()
    b = ps.Variable(2.0, name="b")  # listed at save time
    path = saver.save(tmp_path / "all")
    assert [n for n, _, _ in checkpoint.list_variables(path)] == ["a", "b"]
    with ps.VariableStore():
        ps.Variable(3.0, name="other")  # another store: not saved by that saver
        assert [n for n, _, _ in checkpoint.list_variables(saver.save(path))] == ["a", "b"]
    a.assign(0.0)
    b.assign(0.0)
    saver.restore(path)
    assert float(a.value()) == 1.0 and float(b.value()) == 2.0


class Dense(ps.Module):
    def __init__(self, n: int, name: str | None = None):
        self.w = ps.Variable(jnp.full((n, n), 0.5), name="w")
        self.b = ps.Variable(jnp.zeros(n), name="b")


class Stack(ps.Module):
    def __init__(self, depth: int, name: str | None = None):
        self.layers = [Dense(2) for _ in range(depth)]


def test_saver_of_a_module_and_partial_restore(tmp_path):
    with ps.VariableStore():
        five = Stack(5)
        for i, layer in enumerate(five.layers):
            layer.w.assign(jnp.full((2, 2), float(i)))
        path = Saver(five).save(tmp_path / "five")
    with ps.VariableStore():
        six = Stack(6)
        first_five = [v for layer in six.layers[:5] for v in layer.variables]
        Saver(first_five).restore(path)  # the checkpoint may hold more or exactly these
        assert [float(layer.w.value()[0, 0]) for layer in six.layers] == [0, 1, 2, 3, 4, 0.5]
        last = six.layers[5]
        last.w.assign(jnp.full((2, 2), 9.0))
        six.layers[0].w.assign(jnp.full((2, 2), 7.0))
        with pytest.raises(CheckpointError, match="lacks 2 variable") as err:
            Saver(six).restore(path)
        assert str(path) in str(err.value) and last.w.name in str(err.value)
        assert float(six.layers[0].w.value()[0, 0]) == 7.0  # nothing restored
        skipped = Saver(six).restore(path, allow_missing=True)
        assert {v.name for v in skipped} == {last.w.name, last.b.name}
        assert float(six.layers[0].w.value()[0, 0]) == 0.0
        assert float(last.w.value()[0, 0]) == 9.0


def test_shape_or_dtype_mismatch_names_file_and_variable_and_changes_nothing(saved):
    (w, b, s), path = saved
    with ps.VariableStore():
        w2 = ps.Variable(np.ones((3, 4), np.float32), name="dense/w")
        b2 = ps.Variable(np.ones(4, np.int32), name="dense/b")  # wrong shape
        before = values([w2, b2])
        with pytest.raises(CheckpointError, match=r"shape \(3,\)") as err:
            Saver([w2, b2]).restore(path)
        assert str(path) in str(err.value) and "'dense/b'" in str(err.value)
        assert_unchanged([w2, b2], before)
    with ps.VariableStore():
        b3 = ps.Variable(np.ones(3, np.float32), name="dense/b")  # wrong dtype
        with pytest.raises(CheckpointError, match="dtype int32") as err:
            Saver([b3]).restore(path)
        assert str(path) in str(err.value) and "dense/b" in str(err.value)
        assert np.all(b3.numpy() == 1)


def test_all_variable_dtypes_round_trip(tmp_path):
    dtypes: list[type] = [np.bool_, np.int8, np.int16, np.int32, np.uint8, np.uint16]
    dtypes += [np.uint32, np.float16, ml_dtypes.bfloat16, np.float32, np.complex64]
    rng = np.random.default_rng(1)
    arrays: dict[str, np.ndarray] = {
        np.dtype(d).name: np.frombuffer(rng.bytes(6 * np.dtype(d).itemsize), d).reshape(2, 3)
        for d in dtypes
        if d is not np.bool_
    }
    arrays["bool"] = rng.integers(0, 2, (2, 3)).astype(bool)
    variables = [ps.Variable(a, name=k) for k, a in arrays.items()]
    path = Saver(variables).save(tmp_path / "all")
    with ps.VariableStore():
        fresh = [ps.Variable(np.zeros((2, 3), a.dtype), name=k) for k, a in arrays.items()]
        Saver(fresh).restore(path)
        for v, a in zip(fresh, arrays.values()):
            assert same_bytes(v.numpy(), a)


def test_64_bit_variables_round_trip_with_x64(tmp_path):
    with jax.enable_x64(True):
        arrays = {
            "i64": np.array([-(2**62), 2**62], np.int64),
            "u64": np.array([2**64 - 1], np.uint64),
            "f64": np.array([np.pi, np.nan]),
            "c128": np.array([1e300 + 1j]),
        }
        variables = [ps.Variable(a, name=k) for k, a in arrays.items()]
        assert [v.dtype for v in variables] == [a.dtype for a in arrays.values()]
        path = Saver(variables).save(tmp_path / "x64")
        for v in variables:
            v.assign(jnp.zeros(v.shape, v.dtype))
        Saver(variables).restore(path)
        for v, a in zip(variables, arrays.values()):
            assert same_bytes(v.numpy(), a)


def test_restore_keeps_placement_and_sharding(saved):
    (w, b, s), path = saved
    before = w.sharding
    w.assign(jnp.zeros((3, 4)))
    Saver([w, b, s]).restore(path)
    assert w.sharding == before and w.value().sharding == before
    assert s.sharding is None


def test_restored_variables_keep_working_under_ps_function(saved):
    (w, b, s), path = saved

    @ps.function
    def step():
        w.assign_add(jnp.ones_like(w.value()))

    Saver([w, b, s]).restore(path)
    step()
    step()
    assert float(w.value()[0, 0]) == 2.0
    Saver([w]).restore(path)
    assert float(w.value()[0, 0]) == 0.0


def test_saving_inside_a_compiled_function_is_an_error(saved, tmp_path):
    (w, b, s), path = saved

    @ps.function
    def bad_save():
        Saver([w]).save(tmp_path / "inside")
        return w.value()

    @ps.function
    def bad_restore():
        Saver([w]).restore(path)
        return w.value()

    with pytest.raises(CheckpointError, match="inside a traced function"):
        bad_save()
    with pytest.raises(CheckpointError, match="inside a traced function"):
        bad_restore()
    assert not (tmp_path / "inside").exists()


def test_saver_rejects_bad_var_lists(tmp_path):
    with pytest.raises(TypeError, match=r"Saver: Expected Variables.*got a int.*ps\.Checkpoint"):
        Saver(42)
    with pytest.raises(TypeError, match="not a ps.Variable"):
        Saver({"x": np.zeros(3)})
    with pytest.raises(CheckpointError, match="reserved"):
        Saver({"__metadata__": ps.Variable(1.0)})
    a = ps.Variable(1.0, name="same")
    with ps.VariableStore():
        b = ps.Variable(2.0, name="same")
    with pytest.raises(
        ValueError, match=r"Saver: Several variables are named \['same'\].*pass a dict"
    ):
        Saver([a, b])


def test_restore_into_a_detached_copy_is_an_error_and_changes_nothing(saved):
    (w, b, s), path = saved
    b.assign(jnp.zeros(3, jnp.int32))
    detached = jax.tree_util.tree_map(lambda x: x, w)  # a pytree copy: cannot be assigned
    assert isinstance(detached, ps.Variable)
    with pytest.raises(TypeError, match="detached"):
        Saver({"dense/b": b, "dense/w": detached}).restore(path)
    assert np.all(b.numpy() == 0)


# ------------------------------------------------------------------------ integrity


def test_missing_file_and_missing_name(saved, tmp_path):
    (w, b, s), path = saved
    with pytest.raises(FileNotFoundError, match="nope"):
        Saver([w]).restore(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"no variable 'dense/ww' \(did you mean 'dense/w'"):
        checkpoint.load_variable(path, "dense/ww")
    assert np.array_equal(checkpoint.load_variable(path, "dense/b"), [1, 2, 3])


def _corrupt_cases(path: Path) -> dict[str, bytes]:
    raw = path.read_bytes()
    header, data = header_of(path)
    n = struct.unpack("<Q", raw[:8])[0]
    cases = {
        "truncated": raw[:-5],
        "header cut": raw[: 8 + n // 2],
        "empty": b"",
        "garbage": b"\x00" * 3 + b"not a checkpoint" * 3,
        "flipped data byte": raw[:-3] + bytes([raw[-3] ^ 0x10]) + raw[-2:],
        "huge header length": struct.pack("<Q", 2**60) + raw[8:],
        "trailing bytes": raw + b"\x00" * 8,
    }
    lying = json.loads(json.dumps(header))
    lying["dense/w"]["shape"] = [3, 5]  # 60 bytes, offsets say 48
    cases["shape lies"] = _rebuilt(lying, data)
    lying = json.loads(json.dumps(header))
    lying["dense/w"]["data_offsets"][1] += 4
    cases["offsets overlap"] = _rebuilt(lying, data)
    lying = json.loads(json.dumps(header))
    lying["dense/w"]["dtype"] = "F64"
    cases["dtype lies"] = _rebuilt(lying, data)
    lying = json.loads(json.dumps(header))
    lying["dense/w"]["dtype"] = "PICKLE"
    cases["unknown dtype"] = _rebuilt(lying, data)
    meta = json.loads(header["__metadata__"]["paramstore.tensors"])
    meta["vocab"]["shape"] = [5]
    lying = json.loads(json.dumps(header))
    lying["__metadata__"]["paramstore.tensors"] = json.dumps(meta)
    cases["string count lies"] = _rebuilt(lying, data)
    lying = json.loads(json.dumps(header))
    lying["__metadata__"]["paramstore.format_version"] = "99"
    cases["future version"] = _rebuilt(lying, data)
    text = raw[8 : 8 + n].replace(b'"dense/b"', b'"dense/w"', 1)
    cases["duplicate name"] = raw[:8] + text + data
    return cases


def _rebuilt(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize(
    "case",
    [
        "truncated",
        "header cut",
        "empty",
        "garbage",
        "flipped data byte",
        "huge header length",
        "trailing bytes",
        "shape lies",
        "offsets overlap",
        "dtype lies",
        "unknown dtype",
        "string count lies",
        "future version",
        "duplicate name",
    ],
)
def test_corrupt_files_raise_and_change_nothing(saved, case):
    variables, path = saved
    path.write_bytes(_corrupt_cases(path)[case])
    for v in variables:
        v.assign(v.value() if v.dtype == STRING else jnp.zeros(v.shape, v.dtype) + 1)
    changed = values(variables)
    with pytest.raises(CheckpointError) as err:
        Saver(variables).restore(path)
    assert str(path) in str(err.value)
    assert_unchanged(variables, changed)


def test_checksum_error_names_the_variable(saved):
    variables, path = saved
    header, data = header_of(path)
    raw = bytearray(path.read_bytes())
    start = len(raw) - len(data) + header["dense/b"]["data_offsets"][0]
    raw[start] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"variable 'dense/b' fails its checksum"):
        Saver(variables).restore(path)
    with pytest.raises(CheckpointError, match="checksum"):
        checkpoint.load_variable(path, "dense/b")
    assert checkpoint.load_variable(path, "dense/w").shape == (3, 4)  # others still load


def test_large_tensor_corruption_is_caught_by_the_threaded_checksum(tmp_path):
    big = ps.Variable(np.arange(3 << 20, dtype=np.float32), name="big")  # checksummed in chunks
    path = Path(Saver([big]).save(tmp_path / "big"))
    with open(path, "r+b") as f:
        f.seek(-(5 << 20), os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x80]))
    big.assign(jnp.zeros(3 << 20))
    with pytest.raises(CheckpointError, match="'big' fails its checksum"):
        Saver([big]).restore(path)
    assert float(big.value().sum()) == 0.0


def test_failed_save_leaves_the_old_file_and_no_temp(saved, monkeypatch):
    variables, path = saved
    old = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(_checkpoint_file, "_write_tensor", boom)
    with pytest.raises(OSError, match="disk full"):
        Saver(variables).save(path)
    assert path.read_bytes() == old
    assert os.listdir(path.parent) == [path.name]


# ------------------------------------------------------------- list/load/inspect


def test_list_and_load_variables(saved, tmp_path):
    (w, b, s), path = saved
    assert checkpoint.list_variables(path) == [
        ("dense/b", (3,), np.dtype(np.int32)),
        ("dense/w", (3, 4), np.dtype(np.float32)),
        ("vocab", (2,), STRING),
    ]
    assert checkpoint.load_variable(path, "vocab").tolist() == ["alpha", "β"]
    manager = CheckpointManager(tmp_path / "run", [w])
    manager.save(3)
    w.assign(jnp.ones((3, 4)))
    manager.save(10)
    assert checkpoint.list_variables(tmp_path / "run") == [("dense/w", (3, 4), np.dtype("f4"))]
    assert np.all(checkpoint.load_variable(tmp_path / "run", "dense/w") == 1)  # latest
    # a directory holding model.safetensors is a (Hugging Face layout) checkpoint: that file
    assert checkpoint.list_variables(tmp_path / "run" / "..") == checkpoint.list_variables(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="No checkpoint in directory"):
        checkpoint.list_variables(tmp_path / "empty")


def test_inspect_cli(saved, capsys, tmp_path):
    _, path = saved
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "3 variables" in out
    assert "dense/w  [3, 4]  float32  12" in out and "vocab" in out and "string" in out
    assert cli.main(["inspect", str(path), "--values"]) == 0
    out = capsys.readouterr().out
    assert "min" in out and "mean" in out and "5.5" in out  # mean of arange(12)
    assert cli.main(["inspect", str(path), "--name", "dense/b", "--values"]) == 0
    out = capsys.readouterr().out
    assert "array([1, 2, 3], dtype=int32)" in out and "dense/w" not in out
    assert cli.main(["inspect", str(tmp_path / "missing")]) == 1
    assert "error:" in capsys.readouterr().err
    path.write_bytes(path.read_bytes()[:-1])
    assert cli.main(["inspect", str(path)]) == 1
    assert "truncated" in capsys.readouterr().err
    assert cli.main(["inspect", str(path), "--name", "nope"]) == 1


# ----------------------------------------------------------------- CheckpointManager


def test_manager_keeps_the_newest_and_picks_up_existing(tmp_path):
    v = ps.Variable(0.0, name="v")
    manager = CheckpointManager(tmp_path / "run", [v], max_to_keep=3)
    assert manager.latest_checkpoint is None and manager.restore_latest() is None
    for step in range(5):
        v.assign(float(step))
        assert manager.save(step) == str(tmp_path / "run" / f"ckpt-{step}.safetensors")
    names = [os.path.basename(p) for p in manager.checkpoints]
    assert names == ["ckpt-2.safetensors", "ckpt-3.safetensors", "ckpt-4.safetensors"]
    again = CheckpointManager(tmp_path / "run", Saver([v]), max_to_keep=3)
    assert again.checkpoints == manager.checkpoints and again.latest_step == 4
    v.assign(-1.0)
    assert again.restore_latest() == manager.latest_checkpoint
    assert float(v.value()) == 4.0
    again.save(10)
    assert [os.path.basename(p) for p in again.checkpoints][-1] == "ckpt-10.safetensors"
    assert len(again.checkpoints) == 3


def test_manager_ignores_temp_files_and_cleans_stale_ones(tmp_path):
    v = ps.Variable(1.0, name="v")
    run = tmp_path / "run"
    run.mkdir()
    stale = run / ".ckpt-7.safetensors.tmp-999999999-0123abcd"  # no such process
    live = run / f".ckpt-8.safetensors.tmp-{os.getppid()}-0123abcd"  # a writer still running
    # this process's own: a leftover of a failed save, unless a save here still uses it
    mine = run / f".ckpt-9.safetensors.tmp-{os.getpid()}-0123abcd"
    in_use = run / f".ckpt-10.safetensors.tmp-{os.getpid()}-0123abcd"
    for p in (stale, live, mine, in_use):
        p.write_bytes(b"partial")
    (run / "notes.txt").write_text("not a checkpoint")
    with atomic.live_temp(str(in_use), str(in_use)):
        manager = CheckpointManager(run, [v])
        assert manager.checkpoints == []
        assert not stale.exists() and live.exists() and not mine.exists() and in_use.exists()
    manager.save(1)
    assert not in_use.exists()  # no longer in use: removed by the next save
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-1.safetensors"]


def test_async_save_copies_now_writes_later(tmp_path, monkeypatch):
    v = ps.Variable(np.zeros(1000, np.float32), name="v")
    manager = CheckpointManager(tmp_path / "run", [v], async_save=True)
    gate = threading.Event()
    real = checkpoint.write_arrays

    def slow(path, arrays):
        gate.wait(10)
        return real(path, arrays)

    monkeypatch.setattr(_checkpoint_manager, "write_arrays", slow)
    path = manager.save(1)
    v.assign(jnp.ones(1000))  # after save returned: not in checkpoint 1
    assert not os.path.exists(path)  # still being written
    gate.set()
    assert manager.checkpoints == [path]  # waits for the pending save
    assert np.all(checkpoint.load_variable(path, "v") == 0)
    manager.save(2)
    manager.wait()
    latest = manager.latest_checkpoint
    assert latest is not None and np.all(checkpoint.load_variable(latest, "v") == 1)


def test_async_save_error_is_raised_by_wait_and_next_save(tmp_path, monkeypatch):
    v = ps.Variable(1.0, name="v")
    manager = CheckpointManager(tmp_path / "run", [v], async_save=True)

    def fail(path, arrays):
        time.sleep(0.01)
        raise OSError("no space left on device")

    monkeypatch.setattr(_checkpoint_manager, "write_arrays", fail)
    manager.save(1)
    with pytest.raises(OSError, match="no space left"):
        manager.wait()
    manager.wait()  # reported once
    manager.save(2)
    with pytest.raises(OSError, match="no space left") as err:
        manager.save(3)  # raises the error of save 2 and does not start save 3
    assert any("background save of" in note for note in err.value.__notes__)
    monkeypatch.undo()
    manager.save(4)
    manager.wait()
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-4.safetensors"]


def test_async_snapshot_survives_donation(tmp_path):
    """The host copy is independent of the device buffer that a ps.function donates."""
    v = ps.Variable(np.zeros(4096, np.float32), name="v")

    @ps.function
    def bump():
        v.assign_add(jnp.ones(4096))

    manager = CheckpointManager(tmp_path / "run", [v], async_save=True)
    for step in range(3):
        manager.save(step)
        bump()
    manager.wait()
    for step, path in enumerate(manager.checkpoints):
        assert np.all(checkpoint.load_variable(path, "v") == step)


# ------------------------------------------------------------------- property-based

_NAME = st.lists(
    st.text(alphabet="abcxyz_0123", min_size=1, max_size=4), min_size=1, max_size=3
).map("/".join)
_DTYPES: list[object] = [np.bool_, np.int8, np.int16, np.int32, np.uint8, np.uint16]
_DTYPES += [np.uint32, np.float16, ml_dtypes.bfloat16, np.float32, np.complex64, STRING]


@st.composite
def _array(draw):
    dtype = np.dtype(draw(st.sampled_from(_DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    n = int(np.prod(shape))
    if dtype == STRING:
        items = draw(st.lists(st.text(max_size=6), min_size=n, max_size=n))
        return np.array(items, dtype=STRING).reshape(shape)
    if dtype == np.bool_:
        return np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool).reshape(shape)
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    return np.frombuffer(raw, dtype=dtype).reshape(shape)  # any bits: NaNs, infs, subnormals


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(arrays=st.dictionaries(_NAME, _array(), min_size=1, max_size=5))
def test_random_variable_sets_round_trip_bit_exactly(tmp_path, arrays):
    path = tmp_path / "prop.safetensors"
    with ps.VariableStore():
        saved = {name: variable(a, name) for name, a in arrays.items()}
        Saver(saved).save(path)
    with ps.VariableStore():
        fresh = {name: variable(np.zeros(a.shape, a.dtype), name) for name, a in arrays.items()}
        Saver(fresh).restore(path)
        for name, a in arrays.items():
            assert same_bytes(fresh[name].numpy(), a), name
    assert sorted(checkpoint.list_variables(path)) == sorted(
        (n, a.shape, a.dtype) for n, a in arrays.items()
    )
