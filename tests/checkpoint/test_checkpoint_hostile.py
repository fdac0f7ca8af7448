"""Hostile files (issue 16): readers that cannot be turned against the user.

Each case builds its file here (h5py, TensorFlow's own writer, or a hand-made index), and
checks the error type, what the message names, that no variable changed, and a time bound
(generous: it catches a hang or an allocation, not a slowdown; the speed figures are in
benchmarks/checkpoint_hostile.py).
"""

from __future__ import annotations

import os
import struct
import time

import h5py
import numpy as np
import pytest
from _bounded import BOUND, in_thread

import paramstore as ps
from paramstore import checkpoint, cli
from paramstore.checkpoint import CheckpointError, Saver
from paramstore.checkpoint.formats.safetensors import header as _header


def refused(path, match, name="layers/dense/vars/0", shape=(4,)):
    """Every entry point refuses ``path`` with CheckpointError matching ``match``, in time,
    and a Saver over a variable changes nothing."""
    v = ps.Variable(np.full(shape, 7.0, np.float32), name="v")
    start = time.perf_counter()
    for call in (
        lambda: checkpoint.list_variables(path),
        lambda: checkpoint.load_variable(path, name),
        lambda: Saver({name: v}).restore(path),
    ):
        with pytest.raises(CheckpointError, match=match):
            call()
    assert cli.main(["inspect", str(path)]) == 1
    assert time.perf_counter() - start < BOUND
    assert np.all(v.numpy() == 7.0)


# --------------------------------------------------------------------------- HDF5


@pytest.fixture
def h5(tmp_path):
    def make(build):
        path = tmp_path / "model.weights.h5"
        with h5py.File(path, "w") as f:
            build(f)
        return path

    return make


def test_external_storage_is_refused(h5, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 2)
    path = h5(
        lambda f: f.create_dataset(
            "layers/dense/vars/0", shape=(16,), dtype="f4", external=[(str(secret), 0, 64)]
        )
    )
    refused(path, r"'layers/dense/vars/0' has external storage", shape=(16,))


def test_external_storage_on_a_fifo_or_dev_zero_is_refused_without_hanging(h5, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for source in (str(fifo), "/dev/zero"):
        path = h5(
            lambda f, s=source: f.create_dataset(
                "layers/dense/vars/0", shape=(2**20,), dtype="f4", external=[(s, 0, 2**22)]
            )
        )
        error = in_thread(lambda p=path: checkpoint.load_variable(p, "layers/dense/vars/0"))
        assert isinstance(error, CheckpointError) and "external storage" in str(error)


@pytest.mark.parametrize("shape", [(2**40,), (2**30,)])
def test_a_claimed_size_beyond_the_file_is_refused(h5, shape):
    path = h5(lambda f: f.create_dataset("layers/dense/vars/0", shape=shape, dtype="f4"))
    assert os.path.getsize(path) < 10_000
    refused(path, r"claims shape \[\d+\] of float32 .* but stores 0 bytes")


def test_a_gzip_bomb_is_refused(h5):
    zeros = np.zeros(2**22, np.float32)  # 16 MiB that gzip stores in ~16 KiB
    path = h5(lambda f: f.create_dataset("layers/dense/vars/0", data=zeros, compression="gzip"))
    assert os.path.getsize(path) < 2**20
    refused(path, r"bytes compressed")


def test_small_compressed_values_still_read(h5):
    data = np.zeros((64, 64), np.float32)
    path = h5(lambda f: f.create_dataset("layers/dense/vars/0", data=data, compression="gzip"))
    assert checkpoint.load_variable(path, "layers/dense/vars/0").shape == (64, 64)


@pytest.mark.parametrize(
    "kind, match",
    [
        ("vlen", "variable-length data"),
        ("vlen_str", "variable-length data"),
        ("reference", "object references"),
        ("array", "array dtype"),
        ("compound", "has the dtype"),
    ],
)
def test_dtypes_paramstore_cannot_hold_are_refused_by_name(h5, kind, match):
    def build(f):
        name = "layers/dense/vars/0"
        if kind == "vlen":
            ds = f.create_dataset(name, shape=(2,), dtype=h5py.vlen_dtype(np.int32))
            ds[0], ds[1] = np.arange(3, dtype=np.int32), np.arange(2, dtype=np.int32)
        elif kind == "vlen_str":
            f.create_dataset(name, data=["a", "bc"], dtype=h5py.string_dtype())
        elif kind == "reference":
            target = f.create_dataset("t", data=np.zeros(2))
            f.create_dataset(name, data=[target.ref], dtype=h5py.ref_dtype)
        elif kind == "array":
            f.create_dataset(name, shape=(2,), dtype=np.dtype(("f4", (3,))))
        else:
            f.create_dataset(name, shape=(2,), dtype=np.dtype([("a", "f4"), ("b", "i4")]))

    refused(h5(build), f"'layers/dense/vars/0' .*{match}")


@pytest.mark.parametrize("kind", ["soft", "external", "virtual"])
def test_links_and_virtual_datasets_are_refused(h5, tmp_path, kind):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as g:
        g.create_dataset("x", data=np.arange(4, dtype=np.float32))

    def build(f):
        f.create_dataset("real", data=np.zeros(4, np.float32))
        name = "layers/dense/vars/0"
        if kind == "soft":
            f[name] = h5py.SoftLink("/real")
        elif kind == "external":
            f[name] = h5py.ExternalLink(str(other), "/x")
        else:
            layout = h5py.VirtualLayout(shape=(4,), dtype="f4")
            layout[:] = h5py.VirtualSource(str(other), "x", shape=(4,))
            f.create_virtual_dataset(name, layout)

    what = {"soft": "soft link", "external": "external link", "virtual": "virtual dataset"}
    refused(h5(build), f"'layers/dense/vars/0' is an? {what[kind]}")


# -------------------------------------------------------------------- FIFOs, devices


def test_a_fifo_is_refused_before_open(tmp_path):
    fifo = tmp_path / "ckpt.safetensors"
    os.mkfifo(fifo)
    v = ps.Variable(np.zeros(2, np.float32), name="v")
    calls = [
        lambda: checkpoint.list_variables(fifo),
        lambda: checkpoint.load_variable(fifo, "v"),
        lambda: Saver([v]).restore(fifo),
        lambda: ps.Checkpoint(v=v).restore(fifo),
    ]
    for call in calls:
        error = in_thread(call)
        assert isinstance(error, CheckpointError), error
        assert "is not a regular file (a FIFO)" in str(error)
    assert in_thread(lambda: cli.main(["inspect", str(fifo)])) is None
    assert np.all(v.numpy() == 0)


def test_a_device_is_refused():
    with pytest.raises(CheckpointError, match="character device"):
        checkpoint.list_variables("/dev/zero")


# ----------------------------------------------------------------- safetensors header


def test_an_unverified_15_mib_header_is_refused_before_parsing(tmp_path, monkeypatch):
    path = tmp_path / "big.safetensors"
    entry = b'"t%07d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},'
    n = 15 * 2**20 // len(entry % 0)
    body = b"{" + b"".join(entry % i for i in range(n))[:-1] + b"}"
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body)
    parsed = []  # a parse takes seconds (see the benchmark): counted, not timed
    monkeypatch.setattr(_header, "parse_json", lambda *a: parsed.append(a))
    with pytest.raises(CheckpointError, match="no paramstore checksums"):
        checkpoint.list_variables(path)
    assert parsed == []


def test_a_bad_list_shape_names_its_tensor(tmp_path):
    header = b'{"__metadata__":{"paramstore.format_version":"2","paramstore.tensors":"{}"},'
    header += b'"dense/w":{"dtype":"F32","shape":[2,-1],"data_offsets":[0,8]}}'
    header += b" " * (-len(header) % 8)
    path = tmp_path / "c.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(CheckpointError, match=r"the shape of 'dense/w' \[2, -1\]"):
        checkpoint.list_variables(path)
