"""``ps.nn.Repeat`` inside ``ps.abstract()``: building a deep stack costs nothing of its size.

Run: ``python benchmarks/repeat_abstract.py`` (``--quick``: width 1024).

The block is ``x + Dense(width, use_bias=False)(x)``; the stack is ``Repeat(Block, n)``.
Rows, one process, each over ``--runs`` fresh stores (medians; the first run of each row,
which traces and compiles for the first time, is left out):

* ``abstract build n=48``: ``with ps.abstract(): Repeat(Block, 48).build((None, width))``
  (48 x 4096 x 4096 float32 = 3 GiB stacked): seconds, bytes of arrays alive after it that
  were not before (``jax.live_arrays()``), and the growth of the process's peak RSS.
* ``concrete build n=2 [reference]``: the same built concretely with 2 blocks (what a
  concrete build costs per 2 blocks: the arrays exist).
* ``initialize n=2``: an abstract ``Repeat(Block, 2)`` made concrete by ``ps.initialize``
  (one compiled program), against the concrete build of the row above.

The targets: the abstract build of 48 blocks takes well under a second and allocates no
array; its peak RSS grows by far less than one block (64 MiB).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import resource
import statistics
import time

import jax

import paramstore as ps


def _block(width: int):
    class Block(ps.Module):
        def __init__(self, name=None):
            self.mlp = ps.nn.Dense(width, use_bias=False)

        def __call__(self, x):
            return x + self.mlp(x)

    return Block


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _new_bytes(before: set[int]) -> int:
    return sum(a.nbytes for a in jax.live_arrays() if id(a) not in before)


def _time(fn, runs: int) -> tuple[float, int, float]:
    """(median seconds, new live bytes of the last run, peak RSS growth MiB over all runs)."""
    times, new = [], 0
    rss = _rss_mib()
    for _ in range(runs + 1):
        with ps.VariableStore():
            before = {id(a) for a in jax.live_arrays()}
            t0 = time.perf_counter()
            kept = fn()
            times.append(time.perf_counter() - t0)
            new = _new_bytes(before)
            del kept
    return statistics.median(times[1:]), new, _rss_mib() - rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    width = 1024 if args.quick else 4096
    block = _block(width)

    def abstract(n: int):
        with ps.abstract():
            r = ps.nn.Repeat(block, n)
            r.build((None, width))
        return r

    def concrete(n: int):
        r = ps.nn.Repeat(block, n)
        r.build((None, width))
        jax.block_until_ready([v.value() for v in r.variables])
        return r

    def initialized(n: int):
        r = abstract(n)
        ps.initialize(r)
        jax.block_until_ready([v.value() for v in r.variables])
        return r

    print(
        f"# {datetime.date.today()}, {platform.machine()} {platform.system()}, "
        f"jax {jax.__version__}, {jax.devices()[0].platform}, width {width}"
    )
    rows = [
        ("abstract build n=48", lambda: abstract(48)),
        ("concrete build n=2 [reference]", lambda: concrete(2)),
        ("initialize n=2", lambda: initialized(2)),
    ]
    print(f"| {'row':32} | median s | new live MiB | peak RSS growth MiB |")
    print(f"|{'-' * 34}|---------:|-------------:|--------------------:|")
    results = {}
    for name, fn in rows:
        seconds, new, rss = _time(fn, args.runs)
        results[name] = seconds
        print(f"| {name:32} | {seconds:8.4f} | {new / 2**20:12.1f} | {rss:19.1f} |")
    stacked = 48 * width * width * 4 / 2**30
    print(
        f"\nabstract build of {stacked:.2f} GiB stacked / concrete build of 2 blocks: "
        f"{results['abstract build n=48'] / results['concrete build n=2 [reference]']:.3f}x; "
        f"initialize n=2 / concrete build n=2: "
        f"{results['initialize n=2'] / results['concrete build n=2 [reference]']:.2f}x"
    )


if __name__ == "__main__":
    main()
