"""Integrity of every format: header edits, bit flips, nesting bombs, oversized headers, the
Orbax checksum manifest. Each case raises CheckpointError naming the file and the problem,
changes no variable and leaves no temporary file."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

import paramstore as ps
from paramstore import checkpoint, cli
from paramstore.checkpoint import CheckpointError, Saver
from paramstore.checkpoint.formats.safetensors import file as _checkpoint_file
from paramstore.checkpoint.formats.safetensors import header as _header

needs_orbax = pytest.mark.skipif(
    importlib.util.find_spec("orbax") is None, reason="orbax-checkpoint missing"
)


@pytest.fixture
def variables():
    a = ps.Variable(np.arange(4, dtype=np.float32), name="a")
    b = ps.Variable(np.arange(6, dtype=np.int32).reshape(2, 3), name="b")
    s = ps.Variable(["x", "yz"], name="s")
    return [a, b, s]


def split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def check_refused(variables, path, match):
    before = [v.numpy().copy() for v in variables]
    with pytest.raises(CheckpointError, match=match) as info:
        Saver(variables).restore(path)
    assert str(path) in str(info.value)
    for v, b in zip(variables, before):
        assert v.numpy().tolist() == b.tolist()
    assert not [n for n in os.listdir(os.path.dirname(path)) if ".tmp-" in n]


def change(variables):
    for v in variables:
        if v.dtype != np.dtypes.StringDType():
            v.assign(v.numpy() + 100)


def test_renamed_checksum_key_plus_bit_flip_is_an_error(tmp_path, variables):
    path = Path(Saver(variables).save(tmp_path / "c.safetensors"))
    change(variables)
    header, data = split(path)
    meta = header["__metadata__"]
    meta["paramstore.tensorz"] = meta.pop("paramstore.tensors")
    data = bytearray(data)
    data[0] ^= 1
    join(path, header, bytes(data))
    check_refused(variables, path, "lacks paramstore.tensors")


@pytest.mark.parametrize("edit", ["drop-version", "drop-entry-checksum", "short-checksum"])
def test_no_header_edit_switches_verification_off(tmp_path, variables, edit):
    path = Path(Saver(variables).save(tmp_path / "c.safetensors"))
    change(variables)
    header, data = split(path)
    meta = header["__metadata__"]
    tensors = json.loads(meta["paramstore.tensors"])
    if edit == "drop-version":
        del meta["paramstore.format_version"]
        match = "lacks paramstore.format_version"
    elif edit == "drop-entry-checksum":
        del tensors["a"]["xxh3"]
        match = "checksum of 'a' is missing"
    else:
        tensors["a"]["xxh3"] = "abcd"
        match = "checksum of 'a' is missing or not 16 hex digits"
    meta["paramstore.tensors"] = json.dumps(tensors)
    join(path, header, data)
    check_refused(variables, path, match)


@pytest.mark.parametrize("where", ["header", "data"])
def test_every_single_bit_flip_is_caught(tmp_path, variables, where):
    path = Path(Saver(variables).save(tmp_path / "c.safetensors"))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    rng = np.random.default_rng(0)
    lo, hi = (8, 8 + n) if where == "header" else (8 + n, len(raw))
    for pos in rng.choice(np.arange(lo, hi), size=min(20, hi - lo), replace=False):
        flipped = bytearray(raw)
        flipped[pos] ^= 1 << int(rng.integers(8))
        path.write_bytes(bytes(flipped))
        try:
            Saver(variables).restore(path)
        except CheckpointError:
            continue
        # a flip in header padding or JSON whitespace may leave the same meaning
        assert split(path)[0] == json.loads(raw[8 : 8 + n]) and where == "header"


def test_nesting_bomb_is_refused_before_parsing(tmp_path, variables):
    path = tmp_path / "bomb.safetensors"
    meta = b'"__metadata__":{"paramstore.format_version":"2"},'
    text = b"{" + meta + b'"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    check_refused(variables, path, "nests 100001 levels deep")
    # without any paramstore key it is refused sooner, as unverified
    text = b"{" + b'"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    check_refused(variables, path, "no paramstore checksums")
    assert cli.main(["inspect", str(path)]) == 1


def test_oversized_header_fails_fast(tmp_path, variables, monkeypatch):
    """Refused from its length alone: the header is neither read nor parsed (counted, not
    timed). The file is sparse: 101 MiB long, nothing written past the first bytes."""
    path = tmp_path / "huge.safetensors"
    n = 101 * 2**20
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + b"{")
        f.truncate(8 + n)
    parsed = []
    monkeypatch.setattr(_header, "parse_json", lambda *a: parsed.append(a))
    check_refused(variables, path, "exceeds the 16 MiB")
    assert parsed == []


def test_a_readme_is_not_a_checkpoint(tmp_path, variables):
    path = tmp_path / "README.md"
    path.write_text("# Hello\n\nThis is not a checkpoint at all.\n")
    check_refused(variables, path, "is not a paramstore checkpoint")


def test_writer_refuses_a_header_readers_would_refuse(tmp_path, monkeypatch):
    monkeypatch.setattr(_checkpoint_file, "MAX_HEADER", 64)
    with pytest.raises(CheckpointError, match="header would take"):
        checkpoint.write_arrays(tmp_path / "c.safetensors", {"a" * 100: np.zeros(1)})
    assert os.listdir(tmp_path) == []


def test_version_1_files_are_still_read_with_their_crc32(tmp_path):
    """A file as paramstore 0.1 wrote it (format 1, CRC-32) restores and is verified."""
    import zlib

    arr = np.arange(5, dtype=np.float32)
    meta = {
        "paramstore.format_version": "1",
        "paramstore.tensors": json.dumps({"a": {"crc32": f"{zlib.crc32(arr.tobytes()):08x}"}}),
    }
    header = {"__metadata__": meta, "a": {"dtype": "F32", "shape": [5], "data_offsets": [0, 20]}}
    path = tmp_path / "old.safetensors"
    join(path, header, arr.tobytes())
    np.testing.assert_array_equal(checkpoint.load_variable(path, "a"), arr)
    bad = bytearray(arr.tobytes())
    bad[3] ^= 4
    join(path, header, bytes(bad))
    with pytest.raises(CheckpointError, match="crc32"):
        checkpoint.load_variable(path, "a")


def test_load_variable_of_a_string_variable_returns_strings(tmp_path, variables):
    path = Saver(variables).save(tmp_path / "c.safetensors")
    got = checkpoint.load_variable(path, "s")
    assert got.dtype == np.dtypes.StringDType() and got.tolist() == ["x", "yz"]


# The sharded (Orbax) format's integrity: tests/checkpoint/test_sharded_checkpoint.py.


def test_a_tensor_whose_last_chunk_is_small_round_trips(tmp_path):
    """A tensor of 16 MiB + 100 KiB: its first chunk is hashed by the worker, its small last
    chunk must follow it there (hashed inline first, the checksum was wrong)."""
    a = np.arange((16 * 2**20 + 100 * 1024) // 4, dtype=np.float32)
    path = _checkpoint_file.write_arrays(tmp_path / "odd.safetensors", {"a": a})
    with _checkpoint_file.SafetensorsFile(path) as f:
        np.testing.assert_array_equal(f.load({"a": None})["a"], a)
