"""Checkpoint save and restore throughput, next to the disk's limit and the alternatives.

Run: ``python benchmarks/checkpoint.py`` (``--small`` for a quick run, ``--dir`` to pick the
disk; the default is a temporary directory under the current one).

Cases: 512 MiB in 64 float32 arrays ("large"), 4,096 arrays of 16 KiB ("many"), and a
10 KB model ("tiny"). Methods, all on the same bytes:

* raw: one sequential ``write`` of every array's bytes to a new file then ``fsync`` (save;
  each save method starts with its previous output deleted and the disk synced), and reading
  them back into fresh arrays (restore): the disk's and memory's limit, no format at all.
  Restores are timed twice: from the page cache ("warm", the usual case right after a
  save) and with the file evicted from it first (``posix_fadvise(DONTNEED)``, "cold").
* paramstore: ``Saver.save`` (atomic, XXH3-64 per tensor, fsync) and ``Saver.restore``
  (validate, verify checksums, one batched ``device_put``, assign).
* ps.Checkpoint: the same through ``ps.Checkpoint(model=...)``, whose keys are attribute
  paths found by walking the objects (the cost of object-based keys).
* ``np.savez`` + fsync / ``np.load``; Orbax ``StandardCheckpointer`` when installed.

Each figure is the median (and the minimum) of ``--repeats`` runs, the methods taking turns
within each repeat; ratios are raw's time over the method's (1.0 = as fast as raw), of the
medians and of the minima. On a machine shared with other work, disk and CPU contention
make single runs vary widely: compare the ratios, and prefer a quiet machine. The save rows also give the peak extra host memory that
``tracemalloc`` sees during the paramstore save (NumPy reports its buffers to it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field

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


@dataclass
class Method:
    """One timed operation; ``setup`` runs untimed before each call."""

    name: str
    op: str  # "save" or "restore"
    note: str
    fn: Callable[[], object]
    setup: Callable[[], object] = lambda: None
    times: list[float] = field(default_factory=list)


def run_interleaved(methods: list[Method], repeats: int) -> None:
    """Each repeat runs every method once, in turn, so that load from other processes on a
    shared machine drifts over all of them alike rather than over one method's runs."""
    for _ in range(repeats):
        for m in methods:
            m.setup()
            t = time.perf_counter()
            m.fn()
            m.times.append(time.perf_counter() - t)


def raw_save(path: str, arrays: list[np.ndarray]) -> None:
    with open(path, "wb") as f:
        for a in arrays:
            f.write(a.data.cast("B"))
        f.flush()
        os.fsync(f.fileno())


def raw_restore(path: str, arrays: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    with open(path, "rb") as f:
        for a in arrays:
            b = np.empty_like(a)
            f.readinto(b.data.cast("B"))
            out.append(b)
    return out


def fresh(path: str) -> None:
    """Untimed, before each save: remove the previous output and sync the filesystem, so
    that no method pays (in its fsync's journal commit) for freeing another's blocks."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)
    os.sync()


def evict(path: str) -> None:
    """Drop ``path`` from the page cache (its pages are clean after the fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def npz_save(path: str, arrays: list[np.ndarray]) -> None:
    with open(path, "wb") as f:
        np.savez(f, *arrays)
        f.flush()
        os.fsync(f.fileno())


def npz_restore(path: str) -> list[np.ndarray]:
    with np.load(path) as z:
        return [z[k] for k in z.files]


def bench_case(case: Case, root: str, repeats: int) -> tuple[list[Method], float]:
    """The timed methods of one case, and the tracemalloc peak of one paramstore save."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(case.elements, dtype=np.float32) for _ in range(case.count)]
    with ps.VariableStore():
        variables = [ps.Variable(a, name=f"layer_{i}/w") for i, a in enumerate(arrays)]
    jax.block_until_ready([v.value() for v in variables])
    saver = Saver(variables)
    holder = ps.Module(name="holder")
    holder.layers = variables
    objects = ps.Checkpoint(model=holder)
    zero = [jnp.zeros_like(v.value()) for v in variables]

    def clear() -> None:
        for v, z in zip(variables, zero):
            v.assign(z)

    def clear_and_evict(path: str) -> None:
        clear()
        evict(path)

    d = tempfile.mkdtemp(dir=root)
    raw, ckpt, npz, obj = (
        os.path.join(d, n) for n in ("raw.bin", "ckpt.safetensors", "x.npz", "obj.safetensors")
    )
    try:
        orbax = os.path.join(d, "orbax")
        saves = [
            Method(
                "raw write+fsync", "save", "", lambda: raw_save(raw, arrays), lambda: fresh(raw)
            ),
            Method("paramstore", "save", "", lambda: saver.save(ckpt), lambda: fresh(ckpt)),
            Method("ps.Checkpoint", "save", "", lambda: objects.save(obj), lambda: fresh(obj)),
            Method("np.savez+fsync", "save", "", lambda: npz_save(npz, arrays), lambda: fresh(npz)),
        ]
        if ocp is not None:
            save = orbax_saver(orbax, variables)
            saves.append(Method("orbax Standard", "save", "", save, lambda: fresh(orbax)))
        run_interleaved(saves, repeats)

        def restore() -> None:
            saver.restore(ckpt)
            jax.block_until_ready([v.value() for v in variables])

        def restore_objects() -> None:
            objects.restore(obj)
            jax.block_until_ready([v.value() for v in variables])

        restores = [
            Method("raw read", "restore", "warm", lambda: raw_restore(raw, arrays)),
            Method("paramstore", "restore", "warm", restore, clear),
            Method("ps.Checkpoint", "restore", "warm", restore_objects, clear),
            Method("np.load", "restore", "warm", lambda: npz_restore(npz)),
        ]
        if ocp is not None:
            restores.append(
                Method("orbax Standard", "restore", "warm", orbax_restorer(d, variables))
            )
        restores += [
            Method(
                "raw read", "restore", "cold", lambda: raw_restore(raw, arrays), lambda: evict(raw)
            ),
            Method("paramstore", "restore", "cold", restore, lambda: clear_and_evict(ckpt)),
        ]
        run_interleaved(restores, repeats)
        assert all(np.array_equal(v.numpy(), a) for v, a in zip(variables, arrays))
        tracemalloc.start()
        saver.save(ckpt)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return saves + restores, peak


def _orbax_tree(variables: list[ps.Variable]) -> dict[str, jax.Array]:
    return {v.name.replace("/", "."): v.value() for v in variables}


def orbax_saver(target: str, variables: list[ps.Variable]) -> Callable[[], None]:
    tree = _orbax_tree(variables)
    ck = ocp.StandardCheckpointer()

    def save() -> None:
        ck.save(target, tree)
        ck.wait_until_finished()

    return save


def orbax_restorer(d: str, variables: list[ps.Variable]) -> Callable[[], None]:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _orbax_tree(variables))
    ck = ocp.StandardCheckpointer()
    return lambda: jax.block_until_ready(ck.restore(os.path.join(d, "orbax"), abstract))


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 10 else f"{t:.2f} s"


def print_table(case: Case, methods: list[Method], peak: float) -> None:
    print(f"\n{case.name} ({case.nbytes / 2**20:.2f} MiB)")
    print(
        f"{'method':<16} {'op':<8} {'cache':<6} {'median':>10} {'min':>10} {'MB/s':>7} "
        f"{'x raw':>6} {'(min)':>6}"
    )
    med = {(m.name, m.op, m.note): statistics.median(m.times) for m in methods}
    low = {(m.name, m.op, m.note): min(m.times) for m in methods}
    for key, t in med.items():
        name, op, note = key
        raw = ("raw write+fsync" if op == "save" else "raw read", op, note)
        mbs = case.nbytes / 1e6 / t
        print(
            f"{name:<16} {op:<8} {note:<6} {_ms(t):>10} {_ms(low[key]):>10} {mbs:>7.0f} "
            f"{med[raw] / t:>6.2f} {low[raw] / low[key]:>6.2f}"
        )
    print(f"paramstore save: peak extra host memory (tracemalloc) {peak / 2**20:.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a quick run (64 MiB large case)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per figure")
    parser.add_argument("--dir", default=".", help="where to write (a temp dir inside)")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.small else 7)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; orbax: "
        f"{'yes' if ocp is not None else 'not installed'}; median of {repeats}"
    )
    root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=os.path.abspath(args.dir))
    try:
        for case in cases(args.small):
            print_table(case, *bench_case(case, root, repeats))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
