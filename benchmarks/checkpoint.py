"""Checkpoint save and restore throughput, next to the disk's limit and the alternatives.

Run: ``python benchmarks/checkpoint.py`` (``--small`` for a quick run, ``--dir`` to pick the
disk; the default is a temporary directory under the current one).

Cases: 512 MiB in 64 float32 arrays ("large"), 4,096 arrays of 16 KiB ("many"), and a
10 KB model ("tiny"). Methods, all on the same bytes:

* raw: one sequential ``write`` of every array's bytes then ``fsync`` (save), and reading
  them back into fresh arrays (restore): the disk's and memory's limit, no format at all.
* paramstore: ``Saver.save`` (atomic, CRC-32 per tensor, fsync) and ``Saver.restore``
  (validate, verify checksums, ``device_put``, assign).
* ``np.savez`` + fsync / ``np.load``; Orbax ``StandardCheckpointer`` when installed.

Each figure is the median of ``--repeats`` runs; ratios are raw's time over the method's
(1.0 = as fast as raw). The save rows also give the peak extra host memory that
``tracemalloc`` sees during the paramstore save (NumPy reports its buffers to it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import paramstore as ps
from paramstore.checkpoint import Saver

try:
    import orbax.checkpoint as ocp
except ImportError:  # optional comparison
    ocp = None


@dataclass(frozen=True)
class Case:
    name: str
    count: int
    elements: int  # float32 elements per array

    @property
    def nbytes(self) -> int:
        return self.count * self.elements * 4


def cases(small: bool) -> list[Case]:
    big = Case("large: 64 x 1 MiB" if small else "large: 64 x 8 MiB", 64, (1 if small else 8) << 18)
    return [big, Case("many: 4096 x 16 KiB", 4096, 4096), Case("tiny: 10 KB model", 5, 512)]


def median_time(
    fn: Callable[[], object], repeats: int, setup: Callable[[], object] = lambda: None
) -> float:
    times = []
    for _ in range(repeats):
        setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def raw_save(path: str, arrays: list[np.ndarray]) -> None:
    with open(path, "wb") as f:
        for a in arrays:
            f.write(memoryview(a).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def raw_restore(path: str, arrays: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    with open(path, "rb") as f:
        for a in arrays:
            b = np.empty_like(a)
            f.readinto(memoryview(b).cast("B"))
            out.append(b)
    return out


def npz_save(path: str, arrays: list[np.ndarray]) -> None:
    with open(path, "wb") as f:
        np.savez(f, *arrays)
        f.flush()
        os.fsync(f.fileno())


def npz_restore(path: str) -> list[np.ndarray]:
    with np.load(path) as z:
        return [z[k] for k in z.files]


def bench_case(case: Case, root: str, repeats: int) -> list[tuple[str, str, float, float, str]]:
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(case.elements, dtype=np.float32) for _ in range(case.count)]
    with ps.VariableStore():
        variables = [ps.Variable(a, name=f"layer_{i}/w") for i, a in enumerate(arrays)]
    jax.block_until_ready([v.value() for v in variables])
    saver = Saver(variables)
    mb = case.nbytes / 1e6
    d = tempfile.mkdtemp(dir=root)
    rows: list[tuple[str, str, float, float, str]] = []
    try:
        raw = os.path.join(d, "raw.bin")
        t_raw = median_time(lambda: raw_save(raw, arrays), repeats)
        t_raw_r = median_time(lambda: raw_restore(raw, arrays), repeats)
        ckpt = os.path.join(d, "ckpt.safetensors")
        t_ps = median_time(lambda: saver.save(ckpt), repeats)
        zero = [jnp.zeros_like(v.value()) for v in variables]

        def clear() -> None:
            for v, z in zip(variables, zero):
                v.assign(z)

        t_ps_r = median_time(lambda: jax.block_until_ready(saver.restore(ckpt)), repeats, clear)
        assert all(np.array_equal(v.numpy(), a) for v, a in zip(variables, arrays))
        tracemalloc.start()
        saver.save(ckpt)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        npz = os.path.join(d, "x.npz")
        t_npz = median_time(lambda: npz_save(npz, arrays), repeats)
        t_npz_r = median_time(lambda: npz_restore(npz), repeats)
        rows += [
            ("raw write+fsync", "save", t_raw, mb, ""),
            ("paramstore", "save", t_ps, mb, f"peak extra {peak / 2**20:.1f} MiB"),
            ("np.savez+fsync", "save", t_npz, mb, ""),
        ]
        if ocp is not None:
            rows.append(("orbax Standard", "save", orbax_save(d, variables, repeats), mb, ""))
        rows += [
            ("raw read", "restore", t_raw_r, mb, ""),
            ("paramstore", "restore", t_ps_r, mb, ""),
            ("np.load", "restore", t_npz_r, mb, ""),
        ]
        if ocp is not None:
            rows.append(("orbax Standard", "restore", orbax_restore(d, variables, repeats), mb, ""))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return rows


def _orbax_tree(variables: list[ps.Variable]) -> dict[str, jax.Array]:
    return {v.name.replace("/", "."): v.value() for v in variables}


def orbax_save(d: str, variables: list[ps.Variable], repeats: int) -> float:
    tree = _orbax_tree(variables)
    target = os.path.join(d, "orbax")
    with ocp.StandardCheckpointer() as ck:

        def save() -> None:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(target)
            ck.save(target, tree)
            ck.wait_until_finished()

        return median_time(save, repeats)


def orbax_restore(d: str, variables: list[ps.Variable], repeats: int) -> float:
    tree = _orbax_tree(variables)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    with ocp.StandardCheckpointer() as ck:
        return median_time(
            lambda: jax.block_until_ready(ck.restore(os.path.join(d, "orbax"), abstract)), repeats
        )


def print_table(case: Case, rows: list[tuple[str, str, float, float, str]]) -> None:
    print(f"\n{case.name} ({case.nbytes / 2**20:.2f} MiB)")
    print(f"{'method':<16} {'op':<8} {'median':>10} {'MB/s':>9} {'x raw':>7}  note")
    raw = {op: t for m, op, t, _, _ in rows if m.startswith("raw")}
    for method, op, t, mb, note in rows:
        ms = f"{t * 1e3:.1f} ms" if t < 10 else f"{t:.2f} s"
        print(f"{method:<16} {op:<8} {ms:>10} {mb / t:>9.0f} {raw[op] / t:>7.2f}  {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a quick run (64 MiB large case)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per figure")
    parser.add_argument("--dir", default=".", help="where to write (a temp dir inside)")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.small else 5)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; orbax: "
        f"{'yes' if ocp is not None else 'not installed'}; median of {repeats}"
    )
    root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    try:
        for case in cases(args.small):
            print_table(case, bench_case(case, root, repeats))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
