"""Sharded (Orbax) checkpoints: per-shard integrity, every flipped bit caught, shards that do
not cover an array, async saves, a kill -9 mid-save, saves from two threads, restore onto
other meshes.

The main test process has one CPU device; the checks that need 8 run in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (this file is that subprocess's
script: ``python tests/checkpoint/test_sharded_checkpoint.py OUT.json``), as in tests/sharding/test_sharding.py.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the 8-device subprocess: before jax is imported
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import importlib.util
import json
import signal
import subprocess
import threading
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import xxhash

import paramstore as ps
from paramstore.checkpoint import CheckpointError, Saver
from paramstore.checkpoint.formats.orbax import integrity

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("orbax") is None, reason="orbax-checkpoint missing"
)
_GOLDEN = 0x9E3779B1


def reference_sums(a: np.ndarray) -> tuple[int, int]:
    """The format's sums computed naively on the host over the whole array."""
    a = np.asarray(a)
    if a.dtype.kind == "c":
        a = np.stack([a.real, a.imag], axis=-1)
    if a.dtype == np.bool_:
        w = a.astype(np.uint64).reshape(-1)
    elif a.dtype.itemsize < 4:
        w = a.view(f"u{a.dtype.itemsize}").reshape(-1).astype(np.uint64)
    else:
        w = np.ascontiguousarray(a).view(np.uint32).reshape(-1).astype(np.uint64)
    j = np.arange(w.size, dtype=np.uint64)
    s1 = int((w * (2 * j + 1)).sum(dtype=np.uint64) % 2**32)
    s2 = int(((w + 1) * (((j * _GOLDEN) & 0xFFFFFFFF) | 1)).sum(dtype=np.uint64) % 2**32)
    return s1, s2


def sums_of(x) -> tuple[int, int]:
    return integrity.total(s for _, s in integrity.fetch(integrity.dispatch_sums({"x": x})["x"]))


@pytest.fixture
def variables():
    rng = np.random.default_rng(0)
    return [
        ps.Variable(rng.standard_normal((6, 5)).astype(np.float32), name="w"),
        ps.Variable(np.arange(7, dtype=np.int8), name="i8"),
        ps.Variable(np.array([True, False, True]), name="flags"),
        ps.Variable(np.ones((2, 3), ml_dtypes.bfloat16), name="half"),
        ps.Variable(np.array([1 + 2j, 3 - 1j], np.complex64), name="z"),
        ps.Variable(3.5, name="scalar"),
        ps.Variable(np.zeros((0, 4), np.float32), name="empty"),
        ps.Variable(["alpha", "beta"], name="words"),
    ]


def snapshot(variables):
    return [np.asarray(v.numpy()).copy() for v in variables]


def change(variables):
    for v in variables:
        if v.dtype == np.dtypes.StringDType():
            v.assign(["changed"] * v.shape[0])
        elif v.size and v.dtype != np.bool_:
            v.assign(np.asarray(v.numpy()) + np.asarray(1, v.dtype))


def refused(variables, path, match=None):
    """Restoring ``path`` raises CheckpointError and leaves every variable as it was."""
    before = snapshot(variables)
    with pytest.raises(CheckpointError, match=match) as info:
        Saver(variables).restore(path)
    for v, b in zip(variables, before):
        assert np.asarray(v.numpy()).tolist() == b.tolist(), v.name
    return str(info.value)


def saved(tmp_path, variables) -> Path:
    path = Path(Saver(variables, sharded=True).save(tmp_path / "ckpt"))
    change(variables)
    return path


def rewrite(file: Path, edit) -> None:
    """Edit the body of a digest-wrapped JSON file and store it with a valid digest (a
    deliberate edit, not a flipped bit)."""
    wrapper = json.loads(file.read_text())
    body = edit(json.loads(wrapper["body"]))
    wrapper["body"] = json.dumps(body, separators=(",", ":"))
    wrapper["xxh3"] = xxhash.xxh3_64_hexdigest(wrapper["body"].encode())
    file.write_text(json.dumps(wrapper))


# ---------------------------------------------------------------------------- the sums


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(1000, dtype=np.float32).reshape(10, 100),
        np.arange(7, dtype=np.int8),
        np.array([True, False, True]),
        np.ones((3, 4), ml_dtypes.bfloat16),
        np.array([1 + 2j, 3 - 1j], np.complex64),
        np.array(2.5, np.float32),
        np.arange(3 * 70_000, dtype=np.int32).reshape(3, 70_000),  # rows longer than a block
        np.arange(200_003, dtype=np.uint16),  # one long row, folded, with a tail
    ],
    ids=["f32", "i8", "bool", "bf16", "c64", "scalar", "long-rows", "1d-tail"],
)
def test_device_sums_equal_the_definition(arr):
    assert sums_of(jnp.asarray(arr)) == reference_sums(arr)
    assert sums_of(arr) == reference_sums(arr)  # a NumPy value: summed on a CPU device


def test_every_single_bit_flip_changes_the_sums():
    for dtype in (np.uint8, np.float32, ml_dtypes.bfloat16):
        a = np.arange(48).astype(dtype)
        raw = a.view(np.uint8)
        base = sums_of(a)
        for byte in (0, 13, raw.size - 1):
            for bit in range(8):
                b = raw.copy()
                b[byte] ^= 1 << bit
                assert sums_of(b.view(a.dtype)) != base, (dtype, byte, bit)


def test_the_sums_program_needs_no_temporary_the_size_of_a_shard():
    """XLA's CPU backend materializes a reduction's input: summed in blocks, the
    temporaries stay a fraction of the shard (a 16 MiB shard here)."""
    shard = jnp.zeros((2048, 2048), jnp.float32)
    zeros = jnp.zeros(2, jnp.uint32)
    compiled = integrity._shard_sums.lower(shard, zeros, zeros).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < shard.nbytes / 8, temp


def test_coverage_of_shards():
    assert integrity.uncovered((4, 4), [((0, 2), (0, 4)), ((2, 4), (0, 4))]) is None
    assert "hold 8 of its 16" in integrity.uncovered((4, 4), [((0, 2), (0, 4))])
    assert "hold 20 of its 16" in integrity.uncovered((4, 4), [((0, 3), (0, 4)), ((2, 4), (0, 4))])
    # the right volume, but overlapping (and so leaving a gap)
    assert integrity.uncovered((4, 4), [((0, 2), (0, 4)), ((1, 3), (0, 4))]) == "its shards overlap"
    tiles = [((0, 2), (0, 2)), ((0, 2), (2, 4)), ((2, 4), (0, 2)), ((2, 4), (0, 2))]
    assert integrity.uncovered((4, 4), tiles) == "its shards overlap"  # a gap at [2:4, 2:4]
    tiles[-1] = ((2, 4), (2, 4))
    assert integrity.uncovered((4, 4), tiles) is None
    assert integrity.uncovered((), [()]) is None
    assert "outside" in integrity.uncovered((4, 4), [((0, 5), (0, 4))])


# --------------------------------------------------------------------- round trip, format


def test_round_trip_of_every_kind_of_value(tmp_path, variables):
    before = snapshot(variables)
    path = saved(tmp_path, variables)
    assert {p.name for p in (path / "paramstore").iterdir()} == {"metadata", "process_0.json"}
    wrapper = json.loads((path / "paramstore" / "metadata").read_text())
    assert wrapper["version"] == 3 and wrapper["format"] == "paramstore-sharded"
    Saver(variables).restore(path)
    for v, b in zip(variables, before):
        assert np.asarray(v.numpy()).tolist() == b.tolist(), v.name
    assert ps.checkpoint.load_variable(path, "words").tolist() == ["alpha", "beta"]
    np.testing.assert_array_equal(ps.checkpoint.load_variable(path, "w"), before[0])


@pytest.mark.slow
def test_every_bit_of_the_metadata_and_the_process_file_is_checked(tmp_path, variables):
    path = saved(tmp_path, variables)
    for name in ("metadata", "process_0.json"):
        file = path / "paramstore" / name
        raw = file.read_bytes()
        for pos in range(len(raw)):
            flipped = bytearray(raw)
            flipped[pos] ^= 1 << (pos % 8)
            file.write_bytes(bytes(flipped))
            before = snapshot(variables)
            try:
                Saver(variables).restore(path)
            except CheckpointError:
                pass
            else:
                pytest.fail(f"a flipped bit at byte {pos} of {name} restored silently")
            assert [v.tolist() for v in snapshot(variables)] == [b.tolist() for b in before]
        file.write_bytes(raw)


def test_bit_flips_in_every_file_orbax_wrote_are_caught(tmp_path, variables):
    path = saved(tmp_path, variables)
    files = [f for f in sorted(path.rglob("*")) if f.is_file() and f.parent.name != "paramstore"]
    assert any("ocdbt.process_0" in str(f) for f in files)
    rng = np.random.default_rng(1)
    for file in files:
        raw = file.read_bytes()
        for pos in {0, len(raw) // 2, len(raw) - 1, int(rng.integers(len(raw)))}:
            flipped = bytearray(raw)
            flipped[pos] ^= 1 << int(rng.integers(8))
            file.write_bytes(bytes(flipped))
            message = refused(variables, path)
            assert str(path) in message
            file.write_bytes(raw)


def test_a_flipped_bit_in_a_string_value_is_caught(tmp_path, variables):
    path = saved(tmp_path, variables)
    file = path / "paramstore" / "metadata"
    raw = file.read_bytes()
    assert raw.count(b"alpha") == 1
    file.write_bytes(raw.replace(b"alpha", b"clpha"))  # 'a' 0x61 -> 'c' 0x63: one bit
    refused(variables, path, "fails its digest")
    with pytest.raises(CheckpointError):
        ps.checkpoint.load_variable(path, "words")


def test_a_flipped_bit_in_a_name_is_caught_by_checkpoint_restore(tmp_path):
    w = ps.Variable(np.arange(4, dtype=np.float32), name="w")
    ckpt = ps.Checkpoint(sharded=True, weights=w)
    path = Path(ckpt.save(tmp_path / "objects"))
    w.assign(np.zeros(4, np.float32))
    file = path / "paramstore" / "metadata"
    raw = file.read_bytes()
    file.write_bytes(raw.replace(b"weights", b"weighus", 1))  # 't' 0x74 -> 'u' 0x75
    with pytest.raises(CheckpointError, match="fails its digest"):
        ps.Checkpoint(weights=w).restore(path)
    assert w.numpy().tolist() == [0, 0, 0, 0]


def test_an_edited_shard_sum_is_caught_by_the_values(tmp_path, variables):
    path = saved(tmp_path, variables)

    def edit(body):
        box, text = body["shards"]["v0"][0]
        body["shards"]["v0"][0] = [box, f"{(int(text[:8], 16) + 1) % 2**32:08x}{text[8:]}"]
        return body

    rewrite(path / "paramstore" / "process_0.json", edit)
    message = refused(variables, path, "variable 'w'")
    assert "shard [0:6, 0:5]" in message and "fails its checksum" in message


def test_shards_that_do_not_cover_an_array_are_refused(tmp_path, variables):
    path = saved(tmp_path, variables)

    def drop(body):
        body["shards"]["v0"] = []
        return body

    rewrite(path / "paramstore" / "process_0.json", drop)
    message = refused(variables, path, "shards of variable 'w' do not cover it")
    assert "hold 0 of its 30 elements" in message and "process_<i>.json" in message


def test_a_missing_process_part_is_refused_naming_it(tmp_path, variables):
    path = saved(tmp_path, variables)

    def two(body):
        body["processes"] = 2
        return body

    rewrite(path / "paramstore" / "metadata", two)
    message = refused(variables, path, "written by 2 process")
    assert "process_1.json is missing" in message


def test_an_older_format_version_is_refused_with_the_way_out(tmp_path, variables):
    path = saved(tmp_path, variables)
    file = path / "paramstore" / "metadata"
    wrapper = json.loads(file.read_text())
    wrapper["version"] = 2
    file.write_text(json.dumps(wrapper))
    refused(variables, path, "earlier paramstore .* save it again")


def test_a_directory_without_metadata_is_no_checkpoint(tmp_path, variables):
    """What a save killed before its metadata leaves: the manager does not list it."""
    directory = tmp_path / "run"
    manager = ps.CheckpointManager(directory, variables, sharded=True)
    manager.save(1)
    manager.save(2)
    (directory / "ckpt-2" / "paramstore" / "metadata").unlink()
    again = ps.CheckpointManager(directory, variables, sharded=True)
    assert again.checkpoints == [str(directory / "ckpt-1")]


def test_restore_into_an_abstract_model_makes_it_concrete(tmp_path):
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = Saver({"w": ps.Variable(value)}, sharded=True).save(tmp_path / "ckpt")
    with ps.abstract():
        w = ps.Variable(ps.initializers.zeros(), shape=(3, 4), name="w")
    assert w.is_abstract
    Saver([w]).restore(path)
    assert not w.is_abstract
    np.testing.assert_array_equal(w.numpy(), value)


# ------------------------------------------------------------------- async and threads


def test_async_save_returns_before_the_files_are_written_and_steps_run_meanwhile(tmp_path):
    w = ps.Variable(np.arange(2**20, dtype=np.float32), name="w")
    manager = ps.CheckpointManager(tmp_path, [w], sharded=True, async_save=True)
    manager.save(1)
    saved_value = w.numpy().copy()

    @ps.function
    def step():
        w.assign_add(jnp.ones_like(w.value()))

    for _ in range(3):
        step()  # while the background writes
    manager.wait()
    assert manager.latest_step == 1
    Saver([w]).restore(manager.latest_checkpoint)
    np.testing.assert_array_equal(w.numpy(), saved_value)


def test_a_reader_waits_for_an_async_save_of_its_path_in_flight(tmp_path, monkeypatch):
    """The background write holds the path's one lock (the lock readers and saves take), so
    a reader in another thread sees the finished checkpoint, never one being written."""
    w = ps.Variable(np.arange(64, dtype=np.float32), name="w")
    manager = ps.CheckpointManager(tmp_path / "run", [w], sharded=True, async_save=True)
    writing, release = threading.Event(), threading.Event()
    real = integrity.write_json

    def slow_write(*args, **kwargs):  # the metadata, written last by the background thread
        writing.set()
        assert release.wait(10), "the test did not release the save"
        return real(*args, **kwargs)

    monkeypatch.setattr(integrity, "write_json", slow_write)
    path = manager.save(1)
    assert writing.wait(10), "the background save did not start"
    got: list[object] = []
    reader = threading.Thread(
        target=lambda: got.append(ps.checkpoint.load_variable(path, "w")), daemon=True
    )
    reader.start()
    reader.join(0.5)
    assert reader.is_alive() and got == []  # waiting for the save's lock, not reading
    release.set()
    reader.join(10)
    assert not reader.is_alive(), "the reader was still blocked 10 s after the save finished"
    manager.wait()
    np.testing.assert_array_equal(got[0], np.arange(64, dtype=np.float32))


def test_a_failed_background_save_raises_at_wait(tmp_path, monkeypatch):
    w = ps.Variable(np.arange(8, dtype=np.float32), name="w")
    manager = ps.CheckpointManager(tmp_path / "run", [w], sharded=True, async_save=True)
    manager.save(1)
    manager.wait()

    def broken(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(integrity, "write_json", broken)
    manager.save(2)
    with pytest.raises(OSError, match="disk full"):
        manager.wait()
    monkeypatch.undo()
    assert manager.checkpoints == [str(tmp_path / "run" / "ckpt-1")]


_KILLED_SAVER = """
import os, signal, sys
import numpy as np
import paramstore as ps
w = ps.Variable(np.full((2048, 2048), 1.0, np.float32), name="w")
manager = ps.CheckpointManager(sys.argv[1], [w], sharded=True, async_save=True)
manager.save(1)
manager.wait()
w.assign(np.full((2048, 2048), 2.0, np.float32))
manager.save(2)
os.kill(os.getpid(), signal.SIGKILL)  # while step 2 is written in the background
"""


@pytest.mark.slow
def test_kill_9_during_an_async_save_leaves_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "run"
    root = str(Path(__file__).resolve().parents[2])  # this checkout's paramstore
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVER, str(directory)],
        env={**os.environ, "PYTHONPATH": root},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    w = ps.Variable(np.zeros((2048, 2048), np.float32), name="w")
    manager = ps.CheckpointManager(directory, [w], sharded=True)
    assert manager.latest_step in (1, 2)  # 2 only if it was complete before the kill
    assert manager.restore_latest() is not None
    assert float(w.numpy()[0, 0]) == manager.latest_step
    assert np.all(w.numpy() == w.numpy()[0, 0])


def test_saves_to_one_path_from_two_threads_are_serialized(tmp_path):
    w = ps.Variable(np.zeros(1000, np.float32), name="w")
    errors: list[BaseException] = []
    path = tmp_path / "same"

    def save(value: float) -> None:
        try:
            for _ in range(3):
                Saver({"w": ps.Variable(np.full(1000, value, np.float32))}, sharded=True).save(path)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=save, args=(float(i),)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a save hung"
    assert not errors, errors
    Saver({"w": w}).restore(path)
    assert set(w.numpy().tolist()) in ({1.0}, {2.0})


@pytest.mark.slow
def test_the_checkpoint_rows_of_the_sharded_benchmark_run():
    """Smoke only (figures are read by people): benchmarks/sharded.py --rows checkpoint."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "sharded.py"), "--rows", "checkpoint"]
        + ["--checkpoint-mib", "4", "--repeats", "2", "--devices", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ps / Orbax default, / no zstd" in done.stdout
    assert "async save() returns after" in done.stdout


# --------------------------------------------------------------------- 8 devices


def check_restore_onto_other_meshes_and_one_device(tmp: Path) -> None:
    from jax.sharding import NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("x",))
    rng = np.random.default_rng(0)
    value = rng.standard_normal((64, 24)).astype(np.float32)
    w = ps.Variable(value, name="w", sharding=NamedSharding(mesh, P("x")))
    c = ps.Variable(value[:8], name="c", sharding=NamedSharding(mesh, P(None, "x")))
    path = Saver([w, c], sharded=True).save(tmp / "eight")
    part = json.loads(
        json.loads((Path(path) / "paramstore" / "process_0.json").read_text())["body"]
    )
    assert len(part["shards"]["v0"]) == 8 and len(part["shards"]["v1"]) == 8  # one per shard
    grid = jax.make_mesh((2, 4), ("a", "b"))
    for target in (
        NamedSharding(grid, P("b", "a")),
        NamedSharding(grid, P(None, ("a", "b"))),
        NamedSharding(grid, P()),
        SingleDeviceSharding(jax.devices()[3]),
    ):
        w2 = ps.Variable(np.zeros((64, 24), np.float32), name="w2", sharding=target)
        Saver({"w": w2}).restore(path)
        assert w2.sharding == target
        np.testing.assert_array_equal(w2.numpy(), value)


def check_a_bad_shard_is_named_where_the_layout_is_the_writers(tmp: Path) -> None:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("x",))
    w = ps.Variable(np.ones((16, 4), np.float32), name="w", sharding=NamedSharding(mesh, P("x")))
    path = Path(Saver([w], sharded=True).save(tmp / "named"))

    def edit(body):
        shards = body["shards"]["v0"]
        i = next(i for i, (box, _) in enumerate(shards) if box[0] == [6, 8])
        text = shards[i][1]
        shards[i][1] = f"{text[:8]}{(int(text[8:], 16) ^ 1):08x}"
        return body

    rewrite(path / "paramstore" / "process_0.json", edit)
    w.assign(np.zeros((16, 4), np.float32))
    try:
        Saver([w]).restore(path)
    except CheckpointError as e:
        assert "shard [6:8, 0:4] of variable 'w'" in str(e), e
    else:
        raise AssertionError("an edited shard sum restored")
    assert w.numpy().sum() == 0


def check_shard_sums_run_on_the_devices_holding_the_shards(tmp: Path) -> None:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("a", "b"))
    x = jax.device_put(
        np.arange(64 * 32, dtype=np.float32).reshape(64, 32), NamedSharding(mesh, P("a"))
    )
    y = jax.device_put(np.ones((8, 16), np.int32), NamedSharding(mesh, P(None, ("a", "b"))))
    pending = integrity.dispatch_sums({"x": x, "y": y})
    # x is replicated over "b": one shard per row block is summed (replica 0), on its device
    assert len(pending["x"]) == 4 and len(pending["y"]) == 8
    holders = {s.device for s in x.addressable_shards if s.replica_id == 0}
    assert {p.devices().pop() for _, p, _ in pending["x"]} == holders
    assert sums_of(x) == reference_sums(np.asarray(x))
    assert integrity.total(s for _, s in integrity.fetch(pending["y"])) == reference_sums(
        np.asarray(y)
    )
    signature = ((("a", None), x.shape, np.dtype(np.float32)),)
    program = integrity._spmd_sums(mesh, signature)  # the one program for both arrays
    temp = program.lower(x).compile().memory_analysis().temp_size_in_bytes
    assert temp < x.nbytes / 4, temp  # per device, far below a shard (a quarter of x)


def check_one_byte_dtypes_sharded_over_eight_devices_bit_for_bit(tmp: Path) -> None:
    """int4 and float8_e4m3 (which Orbax cannot store) as bytes, each shard converted on its
    device; re-saved to the same path; restored onto another mesh."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("x",))
    rng = np.random.default_rng(0)
    made = {}
    for name, spec in (("int4", P("x")), ("float8_e4m3", P(None, "x"))):
        dtype = np.dtype(getattr(ml_dtypes, name))
        bits = rng.integers(0, 16 if name == "int4" else 256, (16, 8), dtype=np.uint8)
        value = bits.view(dtype) if name != "int4" else bits.astype(np.int8).astype(dtype)
        made[name] = ps.Variable(value, name=name, sharding=NamedSharding(mesh, spec))
    saved = {n: np.asarray(v.numpy()).tobytes() for n, v in made.items()}
    path = Saver(list(made.values()), sharded=True).save(tmp / "bytes")
    Saver(list(made.values()), sharded=True).save(path)  # swapped in over the first
    grid = jax.make_mesh((2, 4), ("a", "b"))
    for name, v in made.items():
        target = NamedSharding(grid, P("b", "a"))
        again = ps.Variable(np.zeros((16, 8), v.dtype), name=f"{name}_2", sharding=target)
        Saver({name: again}).restore(path)
        assert again.sharding == target and np.asarray(again.numpy()).tobytes() == saved[name]
    assert sorted(os.listdir(tmp)) == ["bytes"]


CHECKS = {
    name[len("check_") :]: fn
    for name, fn in sorted(globals().items())
    if name.startswith("check_") and callable(fn)
}


@pytest.fixture(scope="module")
def eight_device_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("eight") / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    root = str(Path(__file__).resolve().parents[2])  # this checkout's paramstore
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    if not out.exists():
        pytest.fail(
            f"the 8-device subprocess failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(CHECKS))
def test_eight_devices(name, eight_device_results):
    result = eight_device_results[name]
    assert result == "ok", result


if __name__ == "__main__":
    import tempfile

    assert len(jax.devices()) == 8
    results = {}
    for name, fn in CHECKS.items():
        with tempfile.TemporaryDirectory() as tmp, ps.VariableStore():
            try:
                fn(Path(tmp))
                results[name] = "ok"
            except BaseException:
                results[name] = traceback.format_exc()
    Path(sys.argv[1]).write_text(json.dumps(results))
