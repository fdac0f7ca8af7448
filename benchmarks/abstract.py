"""A model born sharded: abstract creation, restore into it, and sharded init, against Flax NNX
and plain JAX/Orbax on 8 devices.

Run: ``python benchmarks/abstract.py`` (``--quick`` for a smoke run, ``--mib`` the model's
size, ``--repeats``, ``--rows creation restore init``, ``--devices N``).

The model is a transformer-ish stack of ``--blocks`` MLP blocks (``up``: Dense ``d -> 4d``,
``down``: Dense ``4d -> d``, float32, ``d`` chosen so the parameters total ``--mib`` MiB;
512 MiB by default: 4 blocks, ``d = 2048``), with FSDP plus tensor-parallel layouts on a
``{'data': 4, 'model': 2}`` mesh: ``up`` kernels ``("data", "model")``, ``up`` biases
``("model",)``, ``down`` kernels ``("model", "data")``, ``down`` biases replicated. Each
kernel is split over all 8 devices. Three row groups, every variant of a row measured in the
same run, variants interleaved run by run (order reversed every other run) so that machine
noise hits all alike; figures are medians of ``--repeats`` runs and ratios are to the anchor
of the same row:

* ``creation``: the abstract model. paramstore: ``with ps.abstract(), ps.device(layout_map):``
  build the ``ps.nn`` model (``model.build(input_shape)``). Flax NNX 0.12:
  ``nnx.get_abstract_model(lambda: Model(nnx.Rngs(0)), mesh)`` (``nnx.eval_shape`` under the
  mesh, then each variable's ``nnx.with_partitioning`` annotation turned into its
  ``NamedSharding``: NNX's documented way to an abstract sharded model). Anchor: the
  ``jax.ShapeDtypeStruct``\\ s with their ``NamedSharding``\\ s written by hand. Time (the mean
  of a batch of creations, so that short ones are measurable) and the process's peak RSS
  growth (nothing is allocated: ~0).
* ``restore``: a checkpoint of the same values saved once up front by each library, restored
  into a fresh abstract model (created outside the timing). paramstore:
  ``ps.Checkpoint(model=model).restore(path)`` from the sharded directory written by
  ``ps.Checkpoint(model=model, sharded=True).save`` (values verified: file digests and shard
  sums). Flax NNX: ``ocp.StandardCheckpointer().restore(path, abstract_state)`` then
  ``nnx.merge``, as Flax's checkpointing guide shows. Anchor: plain Orbax
  ``StandardCheckpointer().restore`` of a ``{name: array}`` checkpoint with
  ``jax.ShapeDtypeStruct`` targets carrying the shardings; and the same without Orbax's
  default zstd compression (paramstore's files are not compressed: the like-for-like view).
  The page cache is warm (one untimed restore of each first). Peak RSS growth (the restored
  arrays themselves are ``--mib`` MiB of host memory on forced CPU devices) and the largest
  single-device piece of any live ``jax.Array`` seen during the restore (sampled every
  0.5 ms, in one extra run per variant so that the sampler does not slow the timed ones):
  it must be a shard (``mib / blocks / 2 / 8`` for a kernel), never a whole array.
* ``init``: the initial values, each variant compiling its program every time (a new model
  is a new program). paramstore: ``ps.initialize(model)`` on the abstract model (its
  initializers run as one program with the variables' shardings as output shardings).
  Flax NNX: ``nnx.jit`` of the constructor under ``jax.set_mesh(mesh)`` (each annotated
  variable created sharded), as NNX's sharding guide shows. Anchor: ``jax.jit(init,
  out_shardings=...)`` of a hand-written init of the same arrays.

``--devices N`` (8 by default) runs on N CPU devices, forced with
``XLA_FLAGS=--xla_force_host_platform_device_count`` and ``JAX_PLATFORMS=cpu`` (set here
before JAX starts, so also on a machine with a GPU); ``--devices 0`` takes JAX's default
devices (a machine's GPUs).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from sharded import _peak_rss_reset, _rss, _watch_buffers  # same memory probes as sharded.py

ROWS = ("creation", "restore", "init")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices", type=int, default=8, help="CPU devices to force (0: JAX's default devices)"
    )
    parser.add_argument("--mib", type=int, default=512, help="model size: MiB of float32")
    parser.add_argument("--blocks", type=int, default=4, help="MLP blocks (2 Dense each)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=ROWS)
    parser.add_argument("--quick", action="store_true", help="8 MiB, 1 run: a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.mib, args.blocks, args.repeats = 8, 2, 1
    if args.devices:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        )
        os.environ["JAX_PLATFORMS"] = "cpu"  # the forced devices, even where a GPU is
    Bench(args).run()


class Bench:
    """The three models (paramstore, Flax NNX, plain arrays) of one size and layout, and
    the row groups measured on them."""

    def __init__(self, args: argparse.Namespace) -> None:
        import jax
        from jax.sharding import AxisType, NamedSharding
        from jax.sharding import PartitionSpec as P

        self.args = args
        n = len(jax.devices())
        shape = (n // 2, 2) if n % 2 == 0 and n > 1 else (n, 1)
        self.mesh = jax.make_mesh(shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        # 32 d^2 bytes per block (two d x 4d float32 kernels), d a multiple of 64
        d = int((args.mib * 2**20 / (32 * args.blocks)) ** 0.5) // 64 * 64
        self.d = max(64, d)
        self.specs = {  # per block: name -> (shape, PartitionSpec)
            "up/kernel": ((self.d, 4 * self.d), P("data", "model")),
            "up/bias": ((4 * self.d,), P("model")),
            "down/kernel": ((4 * self.d, self.d), P("model", "data")),
            "down/bias": ((self.d,), P()),
        }
        self.names = [f"{i}/{k}" for i in range(args.blocks) for k in self.specs]
        self.shardings = {
            f"{i}/{k}": NamedSharding(self.mesh, spec)
            for i in range(args.blocks)
            for k, (_, spec) in self.specs.items()
        }
        self.shapes = {
            f"{i}/{k}": shape for i in range(args.blocks) for k, (shape, _) in self.specs.items()
        }
        self.nbytes = sum(4 * _size(s) for s in self.shapes.values())
        self.shard_mib = 4 * self.d * 4 * self.d / n / 2**20
        self.root = tempfile.mkdtemp(prefix="ps-abstract-bench-")
        self.out: list[str] = []

    # ------------------------------------------------------------------ the models

    def ps_model(self) -> Any:
        """The ``ps.nn`` model, built abstract under the layout map."""
        import paramstore as ps

        layout = ps.sharding.LayoutMap(self.mesh)
        for k, (_, spec) in self.specs.items():
            layout[rf"{k.split('/')[0]}\d+/{k.split('/')[1]}$"] = spec
        with ps.VariableStore(), ps.abstract(), ps.device(layout):
            layers = []
            for i in range(self.args.blocks):
                layers += [
                    ps.nn.Dense(4 * self.d, name=f"up{i}"),
                    ps.nn.Dense(self.d, name=f"down{i}"),
                ]
            model = ps.nn.Sequential(layers)
            model.build((None, self.d))
        return model

    def nnx_class(self) -> Any:
        import jax
        from flax import nnx

        d, specs = self.d, self.specs
        glorot, zeros = jax.nn.initializers.glorot_uniform(), nnx.initializers.zeros_init()

        def dense(fan_in: int, fan_out: int, part: str, rngs: nnx.Rngs) -> nnx.Linear:
            return nnx.Linear(
                fan_in,
                fan_out,
                kernel_init=nnx.with_partitioning(glorot, tuple(specs[f"{part}/kernel"][1])),
                bias_init=nnx.with_partitioning(zeros, tuple(specs[f"{part}/bias"][1])),
                rngs=rngs,
            )

        class Block(nnx.Module):
            def __init__(self, rngs: nnx.Rngs) -> None:
                self.up = dense(d, 4 * d, "up", rngs)
                self.down = dense(4 * d, d, "down", rngs)

        blocks = self.args.blocks

        class Model(nnx.Module):
            def __init__(self, rngs: nnx.Rngs) -> None:
                self.blocks = nnx.List([Block(rngs) for _ in range(blocks)])

        return Model

    def hand_targets(self) -> dict[str, Any]:
        """The anchor's abstract model: ShapeDtypeStructs with their shardings."""
        import jax
        import jax.numpy as jnp

        return {
            name: jax.ShapeDtypeStruct(
                self.shapes[name], jnp.float32, sharding=self.shardings[name]
            )
            for name in self.names
        }

    # ------------------------------------------------------------------ running

    def run(self) -> None:
        import jax

        self.print(
            f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].device_kind} "
            f"({os.cpu_count()} host cores), mesh {dict(self.mesh.shape)}; model: "
            f"{self.args.blocks} blocks of Dense {self.d} -> {4 * self.d} -> {self.d}, "
            f"{len(self.names)} arrays, {self.nbytes / 2**20:.0f} MiB float32 (one kernel "
            f"shard {self.shard_mib:.1f} MiB); median of {self.args.repeats} interleaved runs"
        )
        try:
            if "creation" in self.args.rows:
                self.creation_rows()
            if "restore" in self.args.rows:
                self.restore_rows()
            if "init" in self.args.rows:
                self.init_rows()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def print(self, line: str = "") -> None:
        print(line)
        sys.stdout.flush()

    def measure(
        self,
        variants: dict[str, tuple[Callable[[], Any], Callable[[], Any]]],
        repeats: int,
        batch: int = 1,
        check: Callable[[str, Any], None] | None = None,
    ) -> dict[str, dict[str, float]]:
        """Median seconds and peak RSS growth (MiB) of each variant, ``{name: (prepare,
        run)}``: ``prepare()`` (untimed) returns the argument of ``run``; ``batch`` runs
        are timed together. Then one more run per variant with the buffer sampler on, for
        the largest single-device piece (with ``--quick``, the sampler runs in the timed
        runs instead, to keep the smoke run short). ``check(name, output)``, if given, runs
        on each variant's output of the timed runs (after the timing)."""
        import jax

        def once(name: str, sample: bool) -> tuple[float, float, float]:
            prepare, run = variants[name]
            inputs = [prepare() for _ in range(batch)]
            gc.collect()
            _trim()  # freed arrays leave the RSS, so the peak growth counts new ones
            seen, stop = [0], threading.Event()
            watcher = threading.Thread(target=_watch_buffers, args=(seen, stop), daemon=True)
            base = _peak_rss_reset()
            if sample:
                watcher.start()
            t0 = time.perf_counter()
            outs = [run(x) for x in inputs]
            jax.block_until_ready(outs)
            seconds = (time.perf_counter() - t0) / batch
            peak = max(0, _rss("VmHWM") - base) / 2**20
            if sample:
                stop.set()
                watcher.join()
                seen[0] = max(seen[0], _largest_piece())  # the results too, however fast
            if check is not None:
                for out in outs:
                    check(name, out)
            del outs, inputs
            return seconds, peak, seen[0] / 2**20

        runs: dict[str, list[tuple[float, float, float]]] = {k: [] for k in variants}
        for r in range(repeats):
            for name in list(variants) if r % 2 == 0 else list(reversed(variants)):
                runs[name].append(once(name, sample=self.args.quick))
        largest = {
            name: max(x[2] for x in runs[name]) if self.args.quick else once(name, True)[2]
            for name in variants
        }
        return {
            name: {
                "s": statistics.median(x[0] for x in runs[name]),
                "peak": statistics.median(x[1] for x in runs[name]),
                "largest": largest[name],
            }
            for name in variants
        }

    def table(self, title: str, results: dict[str, dict[str, float]], unit: str) -> None:
        scale = {"s": 1.0, "ms": 1e3}[unit]
        anchor = next(name for name in results if "[anchor]" in name)
        ref = results[anchor]["s"]
        self.print(f"\n## {title}")
        self.print(
            f"{'variant':54} {unit:>9} {'ratio':>7} {'peak RSS MiB':>13} {'largest piece MiB':>18}"
        )
        for name, r in results.items():
            self.print(
                f"{name:54} {r['s'] * scale:9.3f} {r['s'] / ref:7.2f} {r['peak']:13.1f} "
                f"{r['largest']:18.2f}"
            )

    # ------------------------------------------------------------------ row groups

    def creation_rows(self) -> None:
        from flax import nnx

        Model = self.nnx_class()
        variants = {
            "jax.ShapeDtypeStruct(sharding=) by hand [anchor]": (
                lambda: None,
                lambda _: self.hand_targets(),
            ),
            "ps.abstract() + ps.device(LayoutMap) + build": (
                lambda: None,
                lambda _: self.ps_model(),
            ),
            "Flax NNX nnx.get_abstract_model (eval_shape)": (
                lambda: None,
                lambda _: nnx.get_abstract_model(lambda: Model(nnx.Rngs(0)), self.mesh),
            ),
        }
        self.check_abstract(variants)  # also a first run of each: imports, caches
        batch = 2 if self.args.quick else 10
        results = self.measure(variants, max(3, self.args.repeats), batch=batch)
        self.table(
            f"abstract creation: {len(self.names)} variables, {self.nbytes / 2**20:.0f} MiB "
            f"described, mean of {batch} per run",
            results,
            "ms",
        )

    def check_abstract(self, variants: dict[str, Any]) -> None:
        """All three abstract models have the same shapes and shardings, and allocate
        nothing."""
        import jax

        live = len(jax.live_arrays())
        hand = variants["jax.ShapeDtypeStruct(sharding=) by hand [anchor]"][1](None)
        model = variants["ps.abstract() + ps.device(LayoutMap) + build"][1](None)
        _, state = variants["Flax NNX nnx.get_abstract_model (eval_shape)"][1](None)
        assert len(jax.live_arrays()) == live, "an abstract model allocated arrays"
        ps_specs = [(v.shape, v.sharding) for v in model.variables]
        nnx_specs = [(a.shape, a.sharding) for a in jax.tree.leaves(state)]
        hand_specs = [(s.shape, s.sharding) for s in hand.values()]
        assert all(v.is_abstract for v in model.variables)
        assert sorted(map(str, ps_specs)) == sorted(map(str, hand_specs)), (ps_specs, hand_specs)
        assert sorted(map(str, nnx_specs)) == sorted(map(str, hand_specs)), (nnx_specs, hand_specs)

    def restore_rows(self) -> None:
        import jax
        import orbax.checkpoint as ocp
        from flax import nnx

        import paramstore as ps

        Model = self.nnx_class()
        # the values: one sharded init, saved by each library
        model = self.ps_model()
        ps.initialize(model)
        values = {_ps_key(v.name): v.value() for v in model.variables}
        paths = {k: os.path.join(self.root, k) for k in ("ps", "nnx", "orbax", "raw")}
        ps.Checkpoint(model=model, sharded=True).save(paths["ps"])
        with jax.set_mesh(self.mesh):
            gdef, abs_state = nnx.get_abstract_model(lambda: Model(nnx.Rngs(0)), self.mesh)
        state = jax.tree_util.tree_map_with_path(lambda p, _: values[_nnx_key(p)], abs_state)
        standard = ocp.StandardCheckpointer()
        standard.save(paths["nnx"], state)
        standard.save(paths["orbax"], values)
        raw = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
        raw.save(paths["raw"], ocp.args.PyTreeSave(values))
        standard.wait_until_finished()
        del model, state

        def ps_restore(abstract: Any) -> Any:
            ps.Checkpoint(model=abstract).restore(paths["ps"]).assert_consumed()
            return [v.value() for v in abstract.variables]

        def nnx_abstract() -> Any:
            with jax.set_mesh(self.mesh):
                return nnx.get_abstract_model(lambda: Model(nnx.Rngs(0)), self.mesh)

        def nnx_restore(abstract: Any) -> Any:
            gdef, abs_state = abstract
            restored = ocp.StandardCheckpointer().restore(paths["nnx"], abs_state)
            return nnx.merge(gdef, restored)

        def orbax_restore(targets: Any) -> Any:
            return ocp.StandardCheckpointer().restore(paths["orbax"], targets)

        def raw_restore(targets: Any) -> Any:
            restore_args = {
                k: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape, dtype=t.dtype)
                for k, t in targets.items()
            }
            return raw.restore(
                paths["raw"], ocp.args.PyTreeRestore(item=targets, restore_args=restore_args)
            )

        variants = {
            "plain Orbax restore(ShapeDtypeStructs) [anchor]": (self.hand_targets, orbax_restore),
            "plain Orbax, no zstd (paramstore's files: none)": (self.hand_targets, raw_restore),
            "ps.Checkpoint(model=abstract).restore": (self.ps_model, ps_restore),
            "Flax NNX: StandardCheckpointer.restore + merge": (nnx_abstract, nnx_restore),
        }
        for name, (prepare, run) in variants.items():  # warm the page cache, check values
            got = run(prepare())
            arrays = jax.tree.leaves(got)
            if name.startswith("Flax"):
                arrays = [
                    a.value if hasattr(a, "value") else a for a in jax.tree.leaves(nnx.state(got))
                ]
            want = {(a.shape, str(a.sharding)) for a in values.values()}
            assert {(a.shape, str(a.sharding)) for a in arrays} == want, name
            del got, arrays
        results = self.measure(variants, self.args.repeats)
        self.table(
            f"restore into the abstract model: {self.nbytes / 2**20:.0f} MiB, sharded "
            "checkpoint, page cache warm",
            results,
            "s",
        )
        self.print(
            f"largest piece: the biggest single-device piece of any live jax.Array during "
            f"the restore (a kernel's shard: {self.shard_mib:.2f} MiB; whole kernel: "
            f"{self.shard_mib * len(jax.devices()):.0f} MiB)"
        )

    def init_rows(self) -> None:
        import jax
        import jax.numpy as jnp
        from flax import nnx

        import paramstore as ps

        Model = self.nnx_class()
        glorot = jax.nn.initializers.glorot_uniform()
        shardings = [self.shardings[n] for n in self.names]

        def anchor(_: Any) -> Any:
            def init() -> list[Any]:
                keys = jax.random.split(jax.random.key(0), len(self.names))
                return [
                    glorot(k, self.shapes[n], jnp.float32)
                    if n.endswith("kernel")
                    else jnp.zeros(self.shapes[n], jnp.float32)
                    for k, n in zip(keys, self.names)
                ]

            return jax.jit(init, out_shardings=shardings)()

        def ps_init(abstract: Any) -> Any:
            ps.initialize(abstract)
            return [v.value() for v in abstract.variables]

        def nnx_init(_: Any) -> Any:
            @nnx.jit
            def create() -> Any:
                return Model(nnx.Rngs(0))

            with jax.set_mesh(self.mesh):
                return create()

        variants = {
            "jax.jit(init, out_shardings=...) [anchor]": (lambda: None, anchor),
            "ps.initialize(abstract model)": (self.ps_model, ps_init),
            "Flax NNX: nnx.jit(Model) under jax.set_mesh": (lambda: None, nnx_init),
        }

        def placed(shape: Any, sharding: Any) -> tuple[tuple[int, ...], str]:
            # On one device every spec places the same way (jit may print it as P()).
            return tuple(shape), str(sharding) if sharding.num_devices > 1 else "one device"

        want = {placed(self.shapes[n], self.shardings[n]) for n in self.names}

        def check(name: str, out: Any) -> None:
            arrays = jax.tree.leaves(nnx.state(out) if name.startswith("Flax") else out)
            got = {placed(a.shape, a.sharding) for a in arrays}
            assert got == want, (name, got ^ want)

        if not self.args.quick:  # a first run of each: one-time Python costs
            for prepare, run in variants.values():
                jax.block_until_ready(run(prepare()))
        results = self.measure(variants, self.args.repeats, check=check)
        self.table(
            f"sharded init: {self.nbytes / 2**20:.0f} MiB, glorot_uniform kernels, zero "
            "biases, compiled each run",
            results,
            "s",
        )


def _trim() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``; no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _largest_piece() -> int:
    """The largest single-device piece (bytes) of any live jax.Array now."""
    import jax

    return max(
        (
            s.data.nbytes
            for x in jax.live_arrays()
            if not x.is_deleted()
            for s in x.addressable_shards
        ),
        default=0,
    )


def _ps_key(name: str) -> str:
    """``"up3/kernel"`` (a paramstore variable's name) -> ``"3/up/kernel"``."""
    found = re.search(r"(up|down)(\d+)/(kernel|bias)$", name)
    assert found, name
    return f"{found[2]}/{found[1]}/{found[3]}"


def _nnx_key(path: Any) -> str:
    """The path of an NNX state leaf (``['blocks'][3]['up']['kernel']``) -> ``"3/up/kernel"``."""
    import jax

    found = re.search(r"\[(\d+)\].*(up|down).*(kernel|bias)", jax.tree_util.keystr(path))
    assert found, path
    return f"{found[1]}/{found[2]}/{found[3]}"


def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    main()
