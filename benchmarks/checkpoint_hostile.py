"""What checking hostile files costs (issue 16): refusals next to a plain header read, and
listing large foreign indexes.

Run: ``python benchmarks/checkpoint_hostile.py`` (``--quick`` for a smoke run).

Rows (median and minimum of ``--repeats`` runs, taking turns within each repeat):

* paramstore header, verified: ``list_variables`` of a file whose header is ~15 MiB
  (100,000 variables): parse and check every entry (the reference).
* unverified 15 MiB header, refused: the same size of header without paramstore metadata
  (a safetensors file from elsewhere), refused before it is parsed. Target: <= 50 ms, and
  no slower than reading the header.
* FIFO refused: ``list_variables`` of a FIFO (stat, no open).
* TF index, 100,000 entries: ``list_variables`` of a hand-made TensorFlow ``.index`` with
  100,000 float32 entries, parsed and checked in Python. Target: <= 2 s.
* Keras .weights.h5, N datasets: ``list_variables``, every dataset checked (h5py).

Then the cost of atomic restores: ``Saver.restore`` of benchmarks/checkpoint.py's "many"
(4,096 x 16 KiB) and "tiny" (10 KB) cases with its assignments under the state lock (as
shipped) against the same restore with the lock taken per variable only (the assignments
of ``checkpoint.saver._assign_all`` called directly, as before). Target: <= 1.05x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import paramstore as ps
from paramstore import checkpoint
from paramstore.checkpoint import CheckpointError, Saver
from paramstore.checkpoint import saver as _checkpoint_saver

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_checkpoint_hostile_tf import entry, write_index  # noqa: E402  (the tests' writer)


def unverified_header(path: str, nbytes: int) -> None:
    row = b'"t%07d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},'
    entries = nbytes // len(row % 0)
    body = b"{" + b"".join(row % i for i in range(entries))[:-1] + b"}"
    body += b" " * (-len(body) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(body)) + body)


def refused(path: str) -> None:
    try:
        checkpoint.list_variables(path)
    except CheckpointError:
        return
    raise AssertionError(f"{path} was not refused")


def measure(
    rows: dict[str, Callable[[], object]], repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall times and this process's CPU times (``time.process_time``: what the work costs
    on a machine shared with other jobs, where the wall time mostly measures waiting)."""
    wall: dict[str, list[float]] = {name: [] for name in rows}
    cpu: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, fn in rows.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n_header = 2_000 if args.quick else 100_000
    n_index = 2_000 if args.quick else 100_000
    n_h5 = 200 if args.quick else 5_000
    repeats = 1 if args.quick else args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        verified = checkpoint.write_arrays(
            os.path.join(tmp, "v.safetensors"),
            {f"t{i:07d}": np.zeros(0, np.float32) for i in range(n_header)},
        )
        unverified = os.path.join(tmp, "u.safetensors")
        unverified_header(unverified, (15 << 20) if not args.quick else 1 << 20)
        fifo = os.path.join(tmp, "fifo")
        os.mkfifo(fifo)
        prefix = write_index(
            os.path.join(tmp, "tf"),
            {f"layer_{i:06d}/kernel": entry(1, (2,), 8 * i, 8) for i in range(n_index)},
            bytes(8 * n_index),
        )
        rows: dict[str, Callable[[], object]] = {
            f"paramstore header, verified ({os.path.getsize(verified) >> 20} MiB, "
            f"{n_header:,} entries)": lambda: checkpoint.list_variables(verified),
            f"unverified header ({os.path.getsize(unverified) >> 20} MiB), refused": lambda: (
                refused(unverified)
            ),
            "FIFO, refused": lambda: refused(fifo),
            f"TF index, {n_index:,} entries, listed": lambda: checkpoint.list_variables(prefix),
        }
        try:
            import h5py

            h5 = os.path.join(tmp, "k.weights.h5")
            with h5py.File(h5, "w") as f:
                for i in range(n_h5):
                    f.create_dataset(f"layers/l{i}/vars/0", data=np.zeros(4, np.float32))
            rows[f"Keras .weights.h5, {n_h5:,} datasets, listed"] = lambda: (
                checkpoint.list_variables(h5)
            )
        except ImportError:
            pass
        times, cpu = measure(rows, repeats)
    ref = statistics.median(next(iter(times.values())))
    print(f"{'row':<58} {'median':>10} {'min':>10} {'cpu':>10} {'/ header':>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        c = statistics.median(cpu[name])
        print(
            f"{name:<58} {med * 1e3:>8.1f}ms {min(ts) * 1e3:>8.1f}ms {c * 1e3:>8.1f}ms "
            f"{med / ref:>9.3f}"
        )
    restores(args.repeats, args.quick)


def restores(repeats: int, quick: bool) -> None:
    """Restore with the assignments under the state lock (shipped) and without (before),
    interleaved call by call; wall-time and CPU-time medians and their ratios."""
    locked = _checkpoint_saver.assign_all
    cases = {"many (4,096 x 16 KiB)": (4096, 4096, 16), "tiny (10 KB)": (10, 256, 400)}
    print(
        f"\n{'restore':<24} {'lock wall':>10} {'before':>10} {'ratio':>6}"
        f" {'lock cpu':>10} {'before':>10} {'ratio':>6}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for label, (count, elements, reps) in cases.items():
            if quick:
                count, reps = min(count, 64), 2
            variables = [
                ps.Variable(np.ones(elements, np.float32), name=f"{label[:4]}{i}")
                for i in range(count)
            ]
            saver = Saver(variables)
            path = saver.save(os.path.join(tmp, "c.safetensors"))
            saver.restore(path)  # warm up
            wall: dict[bool, list[float]] = {True: [], False: []}
            cpu: dict[bool, list[float]] = {True: [], False: []}
            for rep in range(reps):
                # ABBA order: the first restore of a pair measured ~2x the second whichever
                # variant it was (buffers freed from the pair before), so both take turns
                for lock in (True, False) if rep % 2 else (False, True):
                    _checkpoint_saver.assign_all = locked if lock else _checkpoint_saver._assign_all
                    start, start_cpu = time.perf_counter(), time.process_time()
                    saver.restore(path)
                    wall[lock].append(time.perf_counter() - start)
                    cpu[lock].append(time.process_time() - start_cpu)
            _checkpoint_saver.assign_all = locked
            w1, w0 = statistics.median(wall[True]), statistics.median(wall[False])
            c1, c0 = statistics.median(cpu[True]), statistics.median(cpu[False])
            print(
                f"{label:<24} {w1 * 1e3:>8.2f}ms {w0 * 1e3:>8.2f}ms {w1 / w0:>6.3f}"
                f" {c1 * 1e3:>8.2f}ms {c0 * 1e3:>8.2f}ms {c1 / c0:>6.3f}"
            )


if __name__ == "__main__":
    main()
