"""Hostile TensorFlow checkpoints (issue 16): crafted ``.index`` protos, entries that are not
tensors, FIFOs as data files, and a fuzz of ``python -m paramstore inspect`` over damaged
real TF, Keras and paramstore files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from _bounded import BOUND, in_thread

import paramstore as ps
from paramstore import checkpoint, cli
from paramstore.checkpoint import CheckpointError, Saver

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------- a hand-made TensorFlow index


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, bytes):
        return varint(number << 3 | 2) + varint(len(value)) + value
    return varint(number << 3) + varint(value)


def entry(dtype: int, shape, offset: int = 0, size: int = 0, shard: int = 0) -> bytes:
    dims = b"".join(field(2, field(1, d)) for d in shape)
    return field(1, dtype) + field(2, dims) + field(3, shard) + field(4, offset) + field(5, size)


def block(items) -> bytes:
    body = b"".join(varint(0) + varint(len(k)) + varint(len(v)) + k + v for k, v in items)
    return body + (0).to_bytes(4, "little") + (1).to_bytes(4, "little")


def write_index(prefix: str, entries: dict[str, bytes], data: bytes = b"", shards: int = 1):
    """A TensorFlow ``.index`` (LevelDB table: one data block, an index block, a footer)
    and its data file."""
    items = [(b"", field(1, shards))] + sorted((k.encode(), v) for k, v in entries.items())
    data_block = block(items)
    handle = varint(0) + varint(len(data_block))
    index_block = block([(items[-1][0] + b"\xff", handle)])
    meta_block = block([])
    raw = data_block + bytes(5)
    meta_at = len(raw)
    raw += meta_block + bytes(5)
    index_at = len(raw)
    raw += index_block + bytes(5)
    footer = varint(meta_at) + varint(len(meta_block)) + varint(index_at) + varint(len(index_block))
    raw += footer + bytes(40 - len(footer)) + struct_magic()
    Path(prefix + ".index").write_bytes(raw)
    for i in range(shards):
        Path(f"{prefix}.data-{i:05d}-of-{shards:05d}").write_bytes(data)
    return prefix


def struct_magic() -> bytes:
    return (0xDB4775248B80FB57).to_bytes(8, "little")


def test_a_hand_made_index_reads_like_tensorflows(tmp_path):
    data = np.arange(6, dtype=np.float32).tobytes()
    prefix = write_index(str(tmp_path / "ok"), {"w": entry(1, (2, 3), 0, 24)}, data)
    assert checkpoint.list_variables(prefix) == [("w", (2, 3), np.dtype(np.float32))]


@pytest.mark.parametrize(
    "entries, match",
    [
        ({"w": entry(1, (2, -5), 0, 24)}, "a dimension is -5"),
        ({"w": entry(1, (2, 3), 0, 2**40)}, r"claims bytes \[0, \+1099511627776\)"),
        ({"w": entry(1, (2**40, 2**40), 0, 24)}, "needs"),
        ({"w": entry(1, (2, 3), -8, 24)}, r"claims bytes \[-8"),
        ({"w": entry(1, (2, 3), 0, 24, shard=3)}, "names data file 3 of 1"),
        ({"w": entry(7, (2**40,), 0, 24)}, "24 bytes for 1099511627776 strings"),
        ({"w": entry(1, (1,) * 300, 0, 4)}, "more than 254 dimensions"),
    ],
)
def test_crafted_index_entries_are_refused_before_tensorflow(tmp_path, entries, match):
    prefix = write_index(str(tmp_path / "bad"), entries, bytes(24))
    v = ps.Variable(np.ones((2, 3), np.float32), name="v")
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=match):
        checkpoint.list_variables(prefix)
    with pytest.raises(CheckpointError, match=match):
        Saver({"w": v}).restore(prefix)
    assert time.perf_counter() - start < BOUND
    assert np.all(v.numpy() == 1)


def test_inspect_of_a_negative_dimension_does_not_abort(tmp_path):
    """Before: SIGABRT in TensorFlow ("Check failed: size >= 0")."""
    prefix = write_index(str(tmp_path / "bad"), {"w": entry(1, (2, -5), 0, 24)}, bytes(24))
    run = subprocess.run(
        [sys.executable, "-m", "paramstore", "inspect", prefix],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 1, run
    assert "a dimension is -5" in run.stderr and "Traceback" not in run.stderr


def test_a_truncated_or_garbled_index_is_refused(tmp_path):
    prefix = write_index(str(tmp_path / "c"), {"w": entry(1, (2, 3), 0, 24)}, bytes(24))
    raw = Path(prefix + ".index").read_bytes()
    for damaged in (raw[:-1], raw[:20], b"\x00" * len(raw), raw[:-8] + b"\xff" * 8):
        Path(prefix + ".index").write_bytes(damaged)
        with pytest.raises(CheckpointError, match="corrupt"):
            checkpoint.list_variables(prefix)


def test_a_100k_entry_index_lists_in_bounded_time(tmp_path):
    entries = {f"layer_{i:06d}/kernel": entry(1, (2,), 8 * i, 8) for i in range(100_000)}
    prefix = write_index(str(tmp_path / "many"), entries, bytes(8 * 100_000))
    start = time.perf_counter()
    listed = checkpoint.list_variables(prefix)
    assert len(listed) == 100_000 and listed[5] == ("layer_000005/kernel", (2,), np.float32)
    assert time.perf_counter() - start < BOUND  # ~1 s; see benchmarks/checkpoint_hostile.py


# ------------------------------------------------------------------ real TF files


@pytest.fixture(scope="module")
def iterator_checkpoint(tmp_path_factory):
    tf = pytest.importorskip("tensorflow")
    directory = tmp_path_factory.mktemp("tfdata")
    it = iter(tf.data.Dataset.range(10))
    next(it)
    w = tf.Variable(np.arange(3, dtype=np.float32))
    return tf.train.Checkpoint(it=it, w=w).save(str(directory / "ckpt"))


def test_a_tf_data_iterator_is_skipped_by_name(iterator_checkpoint, capsys):
    names = [n for n, _, _ in checkpoint.list_variables(iterator_checkpoint)]
    assert "w/.ATTRIBUTES/VARIABLE_VALUE" in names
    with checkpoint.opened(iterator_checkpoint) as r:
        skipped = dict(r.skipped)  # type: ignore[attr-defined]
    (name,) = [n for n in skipped if n.startswith("it/")]
    assert "DT_VARIANT" in skipped[name]
    with pytest.raises(CheckpointError, match=f"'{name}' holds DT_VARIANT"):
        checkpoint.load_variable(iterator_checkpoint, name)
    assert cli.main(["inspect", iterator_checkpoint, "--values"]) == 0
    out = capsys.readouterr().out
    assert f"skipped '{name}'" in out and "DT_VARIANT" in out
    w = ps.Variable(np.zeros(3, np.float32), name="w")
    Saver({"w/.ATTRIBUTES/VARIABLE_VALUE": w}).restore(iterator_checkpoint)
    assert w.numpy().tolist() == [0, 1, 2]


def test_a_fifo_as_a_data_file_is_refused(iterator_checkpoint, tmp_path):
    prefix = str(tmp_path / "ckpt-1")
    shutil.copy(iterator_checkpoint + ".index", prefix + ".index")
    (data,) = [p for p in os.listdir(os.path.dirname(iterator_checkpoint)) if ".data-" in p]
    os.mkfifo(prefix + data[data.index(".data-") :])
    error = in_thread(lambda: checkpoint.list_variables(prefix))
    assert isinstance(error, CheckpointError) and "a FIFO" in str(error)


# ---------------------------------------------------------------------------- fuzz

FUZZ = textwrap.dedent(
    """
    import contextlib, io, random, sys, time
    import tensorflow  # imported before the clock starts (it takes seconds)
    from paramstore import cli
    seed, out, sources = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    rng = random.Random(seed)
    worst = 0.0
    for i in range(150):
        src = rng.choice(sources)
        raw = bytearray(open(src, "rb").read())
        how = rng.choice(["flip", "truncate", "random", "bytes"])
        if how == "flip":
            for _ in range(rng.randint(1, 8)):
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        elif how == "truncate":
            raw = raw[: rng.randrange(len(raw))]
        elif how == "random":
            raw = bytearray(rng.randbytes(rng.randrange(1, 4096)))
        else:
            for _ in range(rng.randint(1, 4)):
                at = rng.randrange(len(raw))
                raw[at : at + 8] = rng.randbytes(8)
        name = out + (src[src.rindex("."):] if src.endswith((".h5", ".index")) else "")
        if src.endswith(".index"):
            import shutil
            base = src[: -len(".index")]
            for suffix in (".data-00000-of-00001",):
                shutil.copy(base + suffix, out + suffix)
            name = out + ".index"
        open(name, "wb").write(bytes(raw))
        err = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            status = cli.main(["inspect", name.removesuffix(".index"), "--values"])
        worst = max(worst, time.perf_counter() - start)
        assert status in (0, 1), status
        assert "Traceback" not in err.getvalue(), err.getvalue()
    print("worst", worst)
    """
)


def test_fuzz_inspect_never_crashes_hangs_or_prints_a_traceback(tmp_path, iterator_checkpoint):
    h5py = pytest.importorskip("h5py")
    keras = tmp_path / "k.weights.h5"
    with h5py.File(keras, "w") as f:
        f.create_dataset("layers/dense/vars/0", data=np.ones((4, 3), np.float32))
        f.create_dataset("layers/dense/vars/1", data=np.arange(3, dtype=np.float32))
    own = checkpoint.write_arrays(
        tmp_path / "c.safetensors",
        {"a": np.arange(8.0), "s": np.array(["x", "yz"], dtype=np.dtypes.StringDType())},
    )
    sources = [str(keras), own, iterator_checkpoint + ".index"]
    for seed in (20261123,):
        run = subprocess.run(
            [sys.executable, "-c", FUZZ, str(seed), str(tmp_path / f"fuzz{seed}"), *sources],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        worst = float(run.stdout.split()[-1])
        assert worst < BOUND
