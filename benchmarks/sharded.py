"""A data-parallel Adam step on 8 devices: ps.function against hand-written jax.jit.

Run: ``python benchmarks/sharded.py`` (``--quick`` for a short run, ``--devices N``,
``--rows dp parallel creation checkpoint optimizer`` to pick row groups).

Row groups: ``dp`` (below), ``parallel`` (FSDP and tensor-parallel Adam steps against
``jax.jit`` and Flax NNX, ``parallel_rows``), ``creation`` (sharded creation of a
8192x8192 weight against ``jax.jit(init, out_shardings=...)``, ``creation_rows``) and
``checkpoint`` (a sharded checkpoint of ``--checkpoint-mib`` MiB against plain Orbax, async
saves and steps during them, ``checkpoint_rows``) and ``optimizer`` (where Adam's state
lives: replicated, ZeRO-1, host memory, both; device bytes of the compiled step and its time
against hand-written ``jax.jit``, ``optimizer_rows``).

Both variants train the same MLP with ``optax.adam`` on a 1-D ``"data"`` mesh: parameters
and optimizer state replicated (``P()``), the batch split over the devices (``P("data")``).
The reference is ``jax.jit`` over ``(params, opt_state, x, y)`` with ``in_shardings`` /
``out_shardings`` set to those shardings and the state donated; the paramstore variant is a
``ps.function`` step over Variables created under ``with ps.device(mesh)`` and a
``ps.Optimizer``. Each step is timed blocking (wait for the loss every step) and pipelined
(dispatch step i+1 before waiting for step i: at most two steps in flight). Not fully
async: with more steps in flight, XLA's in-process CPU collectives on forced devices can
deadlock (jax 0.10, seen on a 2-core machine: "Termination timeout for all reduce ...
Expected 8 threads to join the rendezvous"), with plain ``jax.jit`` as much as with
paramstore. Figures are medians over ``--repeats`` runs, the two
variants interleaved run by run so that machine noise hits both alike; ratios are
paramstore / jax.jit. ``--devices N`` (8 by default) runs on N CPU devices, forced with
``XLA_FLAGS=--xla_force_host_platform_device_count`` and ``JAX_PLATFORMS=cpu`` (set here
before JAX starts, so also on a machine with a GPU); ``--devices 0`` takes JAX's default
devices: ``--devices 0 --rows optimizer`` on one GPU gives the GPU's rows.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

# name, layers, width, batch (step.py's Config, built once jax may be imported)
MODELS = {
    "dispatch": ("dispatch-bound (4 x 32, batch 64)", 4, 32, 64),
    "many": ("many-variable (50 x 16, batch 64)", 50, 16, 64),
    "compute": ("compute-bound (4 x 512, batch 1024)", 4, 512, 1024),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices", type=int, default=8, help="CPU devices to force (0: JAX's default devices)"
    )
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="few steps, for a smoke test")
    parser.add_argument(
        "--checkpoint-mib", type=int, default=512, help="sharded checkpoint rows: total MiB"
    )
    parser.add_argument(
        "--rows", nargs="*", default=["dp", "parallel", "creation", "checkpoint", "optimizer"]
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 10, 3
    if args.devices:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        )
        os.environ["JAX_PLATFORMS"] = "cpu"  # the forced devices, even where a GPU is

    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import paramstore as ps

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import step as single  # the same model, initial values and optimizer as step.py

    Config, MLP, init_params, mlp, lr = (
        single.Config,
        single.MLP,
        single.init_params,
        single.mlp,
        single.LR,
    )
    mesh = jax.make_mesh((len(jax.devices()),), ("data",), axis_types=(AxisType.Auto,))
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def data(cfg: Config) -> tuple[jax.Array, jax.Array]:
        x, y = single.data(cfg)
        return jax.device_put(x, split), jax.device_put(y, split)

    def jax_reference(cfg: Config) -> Callable[[], jax.Array]:
        tx = optax.adam(lr)
        params = jax.device_put(
            [(jnp.asarray(w), jnp.asarray(b)) for w, b in init_params(cfg)], rep
        )
        state = [params, jax.device_put(tx.init(params), rep)]
        x, y = data(cfg)

        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(lambda p: jnp.mean((mlp(p, x) - y) ** 2))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        jitted = jax.jit(
            step,
            in_shardings=(rep, rep, split, split),
            out_shardings=(rep, rep, rep),
            donate_argnums=(0, 1),
        )

        def run() -> jax.Array:
            state[0], state[1], loss = jitted(state[0], state[1], x, y)
            return loss

        return run

    def paramstore_function(cfg: Config) -> Callable[[], jax.Array]:
        with ps.device(mesh):  # parameters and optimizer state replicated over the mesh
            model = MLP(cfg)
            opt = ps.Optimizer(optax.adam(lr), model)
        x, y = data(cfg)

        @ps.function
        def step(x, y):
            loss, grads = ps.value_and_grad(lambda: jnp.mean((model(x) - y) ** 2), model)()
            opt.apply_gradients(grads)
            return loss

        return lambda: step(x, y)

    variants = {"jax.jit (shardings, donated)": jax_reference, "ps.function": paramstore_function}

    def time_steps(run: Callable[[], jax.Array], steps: int) -> tuple[float, float]:
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(steps):
            run().block_until_ready()
        blocking = (time.perf_counter() - t0) / steps
        t0 = time.perf_counter()
        previous = run()
        for _ in range(steps - 1):
            loss = run()
            previous.block_until_ready()  # at most 2 steps in flight (see the docstring)
            previous = loss
        previous.block_until_ready()
        return blocking, (time.perf_counter() - t0) / steps

    print(
        f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].device_kind} "
        f"({os.cpu_count()} host cores), mesh {dict(mesh.shape)}; "
        f"median of {args.repeats} interleaved runs"
    )
    worst = 0.0
    for key in args.models if "dp" in args.rows else []:
        cfg = Config(*MODELS[key])
        steps = args.steps if key != "compute" else max(args.steps // 4, 5)
        runs: dict[str, Callable[[], jax.Array]] = {}
        with ps.VariableStore():
            for name, build in variants.items():
                runs[name] = build(cfg)
                for _ in range(3):
                    runs[name]().block_until_ready()  # compile and warm up
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
            for r in range(args.repeats):
                order = list(runs) if r % 2 == 0 else list(reversed(runs))
                for name in order:
                    times[name].append(time_steps(runs[name], steps))
        print(f"\n## {cfg.name}: {steps} steps, Adam, data parallel")
        print(f"{'variant':30} {'blocking us':>12} {'ratio':>7} {'pipelined us':>13} {'ratio':>7}")
        ref = None
        for name, ts in times.items():
            b = statistics.median(t[0] for t in ts)
            a = statistics.median(t[1] for t in ts)
            ref = ref or (b, a)
            print(f"{name:30} {b * 1e6:12.1f} {b / ref[0]:7.2f} {a * 1e6:13.1f} {a / ref[1]:7.2f}")
            if name == "ps.function":
                worst = max(worst, b / ref[0], a / ref[1])
    if "dp" in args.rows:
        print(f"\nworst ratio ps.function / jax.jit: {worst:.2f}x (target <= 1.10x)")
    sys.stdout.flush()
    if "parallel" in args.rows:
        parallel_rows(args)
    if "creation" in args.rows:
        creation_rows(args)
    if "checkpoint" in args.rows:
        checkpoint_rows(args)
    if "optimizer" in args.rows:
        optimizer_rows(args)


# ------------------------------------------------- FSDP and tensor parallel (issue 17)


def _interleaved(runs: dict[str, Callable[[], object]], steps: int, repeats: int) -> dict:
    """Median seconds per step of each run (blocking, at most two in flight), runs
    interleaved repeat by repeat so that machine noise hits all alike."""
    import jax

    def once(run: Callable[[], object]) -> tuple[float, float]:
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(steps):
            jax.block_until_ready(run())
        blocking = (time.perf_counter() - t0) / steps
        t0 = time.perf_counter()
        previous = run()
        for _ in range(steps - 1):
            loss = run()
            jax.block_until_ready(previous)
            previous = loss
        jax.block_until_ready(previous)
        return blocking, (time.perf_counter() - t0) / steps

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for r in range(repeats):
        for name in list(runs) if r % 2 == 0 else list(reversed(runs)):
            times[name].append(once(runs[name]))
    return {
        name: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts))
        for name, ts in times.items()
    }


def parallel_rows(args: argparse.Namespace) -> None:
    """FSDP over ``("data",)`` and tensor parallel over ``("data", "model")``: an Adam step
    of a 4 x 512 MLP (batch 256), each parameter sharded as the layout says. Variants:
    hand-written ``jax.jit`` with those in/out shardings and donated state; ``ps.function``
    over a model built under ``ps.device(LayoutMap)`` and a ``ps.Optimizer`` built under
    ``ps.device(mesh)`` (its slots must still follow the parameters); Flax NNX 0.12
    (``nnx.jit``) over ``nnx.Param``s placed with the same shardings."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import paramstore as ps

    layers, width, batch, lr = 4, 512, 256, 1e-3
    steps, repeats = (5, 3) if args.quick else (10, 5)
    rng = np.random.default_rng(0)
    init = [
        (
            (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
            np.zeros(width, np.float32),
        )
        for _ in range(layers)
    ]
    x_np = rng.standard_normal((batch, width)).astype(np.float32)
    y_np = rng.standard_normal((batch, width)).astype(np.float32)

    def mlp(params, x):
        for i, (w, b) in enumerate(params):
            x = x @ w + b
            x = jnp.tanh(x) if i < len(params) - 1 else x
        return x

    n = len(jax.devices())
    setups = {
        f"FSDP mesh {{'data': {n}}}": (
            jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,)),
            [(P("data", None), P()) for _ in range(layers)],
        ),
        f"tensor parallel mesh {{'data': {n // 2}, 'model': 2}}": (
            jax.make_mesh((n // 2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2),
            [
                (P(None, "model"), P("model")) if i % 2 == 0 else (P("model", None), P())
                for i in range(layers)
            ],
        ),
    }
    print(f"\n# FSDP and tensor-parallel Adam steps ({layers} x {width}, batch {batch})")
    worst = 0.0

    compiled: dict[str, Callable[[], Any]] = {}

    def variants(mesh: Any, specs: list) -> dict[str, Callable[[], object]]:
        shardings = [(NamedSharding(mesh, a), NamedSharding(mesh, b)) for a, b in specs]
        rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        x, y = jax.device_put(x_np, split), jax.device_put(y_np, split)

        def reference() -> Callable[[], object]:
            tx = optax.adam(lr)
            params = [
                (jax.device_put(w, sw), jax.device_put(b, sb))
                for (w, b), (sw, sb) in zip(init, shardings)
            ]
            state = [params, tx.init(params)]
            opt_sh = jax.tree.map(
                lambda a: a.sharding if len(a.sharding.device_set) > 1 else rep, state[1]
            )
            state[1] = jax.device_put(state[1], opt_sh)  # the counter replicated

            def step(params, opt_state, x, y):
                loss, g = jax.value_and_grad(lambda p: jnp.mean((mlp(p, x) - y) ** 2))(params)
                updates, opt_state = tx.update(g, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, loss

            jitted = jax.jit(
                step,
                in_shardings=(shardings, opt_sh, split, split),
                out_shardings=(shardings, opt_sh, rep),
                donate_argnums=(0, 1),
            )

            def run() -> object:
                state[0], state[1], loss = jitted(state[0], state[1], x, y)
                return loss

            compiled["jax.jit"] = lambda: jitted.lower(state[0], state[1], x, y).compile()
            return run

        def paramstore() -> Callable[[], object]:
            layout = ps.sharding.LayoutMap(mesh)
            for i, (a, b) in enumerate(specs):
                layout[f"^layer{i}/w$"], layout[f"^layer{i}/b$"] = a, b
            with ps.device(layout):
                model = [
                    (ps.Variable(w, name=f"layer{i}/w"), ps.Variable(b, name=f"layer{i}/b"))
                    for i, (w, b) in enumerate(init)
                ]
            with ps.device(mesh):  # slots must follow the parameters anyway
                opt = ps.Optimizer(optax.adam(lr), [v for pair in model for v in pair])

            @ps.function
            def step(x, y):
                vs = [v for pair in model for v in pair]
                loss, grads = ps.value_and_grad(lambda: jnp.mean((mlp(model, x) - y) ** 2), vs)()
                opt.apply_gradients(grads)
                return loss

            def program() -> Any:  # the step's one compiled entry (paramstore internals)
                (entry,) = step._cache.values()
                don = [v._value for v in entry.donated]
                ro = [v._value for v in entry.readonly]
                return entry.runner.lower(don, ro, [x, y]).compile()

            compiled["ps.function"] = program
            return lambda: step(x, y)

        def flax_nnx() -> Callable[[], object]:
            class Model(nnx.Module):
                def __init__(self):
                    self.layers = nnx.List(
                        [
                            nnx.List(
                                [nnx.Param(jax.device_put(w, sw)), nnx.Param(jax.device_put(b, sb))]
                            )
                            for (w, b), (sw, sb) in zip(init, shardings)
                        ]
                    )

                def __call__(self, x):
                    return mlp([(w[...], b[...]) for w, b in self.layers], x)

            model = Model()
            opt = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

            @nnx.jit
            def step(model, opt, x, y):
                loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
                opt.update(model, grads)
                return loss

            return lambda: step(model, opt, x, y)

        return {
            "jax.jit (shardings, donated)": reference(),
            "ps.function": paramstore(),
            "Flax NNX 0.12 nnx.jit": flax_nnx(),
        }

    for title, (mesh, specs) in setups.items():
        with ps.VariableStore():
            runs = variants(mesh, specs)
            for run in runs.values():
                for _ in range(3):
                    jax.block_until_ready(run())  # compile and warm up
            times = _interleaved(runs, steps, repeats)
            programs = {name: _program_summary(make()) for name, make in compiled.items()}
        print(f"\n## {title}: {steps} steps, median of {repeats} interleaved runs")
        print(f"{'variant':30} {'blocking ms':>12} {'ratio':>7} {'pipelined ms':>13} {'ratio':>7}")
        ref = times["jax.jit (shardings, donated)"]
        for name, (b, a) in times.items():
            print(f"{name:30} {b * 1e3:12.2f} {b / ref[0]:7.2f} {a * 1e3:13.2f} {a / ref[1]:7.2f}")
        for name, summary in programs.items():
            print(f"  program of {name:12}: {summary}")
        ours = times["ps.function"]
        nnx_t = times["Flax NNX 0.12 nnx.jit"]
        worst = max(worst, ours[0] / ref[0], ours[1] / ref[1])
        print(
            f"ps.function / NNX: {ours[0] / nnx_t[0]:.2f} blocking, {ours[1] / nnx_t[1]:.2f} pipelined"
        )
    print(
        f"\nworst ratio ps.function / jax.jit (FSDP, tensor parallel): {worst:.2f}x "
        "(target <= 1.05x)"
    )
    sys.stdout.flush()


# ---------------------------------------------------------- sharded creation (issue 17)


def _program_summary(compiled: Any) -> str:
    """Flops, bytes accessed and collectives of a compiled step (XLA's own figures): equal
    figures mean the same program, whatever the timings on a loaded machine say."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    ops = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
    found = {op: text.count(f" {op}(") + text.count(f" {op}-start(") for op in ops}
    collectives = ", ".join(f"{n} {op}" for op, n in found.items() if n) or "none"
    return (
        f"{cost.get('flops', 0):,.0f} flops, {cost.get('bytes accessed', 0):,.0f} bytes "
        f"accessed, collectives: {collectives}"
    )


def _peak_rss_reset() -> int:
    """Reset the process's peak RSS (Linux: clear_refs 5) and return the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss("VmRSS")


def _watch_buffers(seen: list[int], stop: threading.Event) -> None:
    """Record in ``seen[0]`` the largest single-device piece of any live jax.Array."""
    import jax

    while not stop.is_set():
        for x in jax.live_arrays():
            try:
                seen[0] = max(seen[0], max(s.data.nbytes for s in x.addressable_shards))
            except Exception:  # deleted or donated meanwhile
                pass
        time.sleep(0.0005)


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def creation_rows(args: argparse.Namespace) -> None:
    """Sharded creation of an 8192x8192 float32 glorot_uniform weight split over all
    devices (``P(None, "x")``): ``ps.Variable(init, shape=..., sharding=...)`` against
    ``jax.jit(init, out_shardings=...)`` (both compile each time: a new variable is a new
    program) and against the eager path (whole array on one device, then ``device_put``).
    Memory: the compiled init program's memory analysis per device, and the process's peak
    RSS growth during creation divided by the device count (the CPU devices share the
    host's memory; ``clear_refs`` resets the peak before each creation)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import paramstore as ps
    from paramstore._variable import abstract as _abstract

    n, dev = 8192, len(jax.devices())
    mesh = jax.make_mesh((dev,), ("x",))
    sh = NamedSharding(mesh, P(None, "x"))
    shard_mib = n * n * 4 / dev / 2**20
    repeats = 2 if args.quick else 5
    glorot = ps.initializers.glorot_uniform

    def reference():
        init = glorot(key=jax.random.key(0))
        return jax.jit(lambda: init((n, n)), out_shardings=sh)()

    def paramstore():
        with ps.VariableStore():
            return ps.Variable(glorot(), shape=(n, n), name="w", sharding=sh).value()

    def eager_then_place():
        return jax.device_put(glorot(key=jax.random.key(0))((n, n)), sh)

    programs = []
    real = _abstract.init_program
    _abstract.init_program = lambda m, s: programs.append(real(m, s)) or programs[-1]
    try:
        paramstore()
    finally:
        _abstract.init_program = real
    mem = programs[0].lower().compile().memory_analysis()
    ref_mem = (
        jax.jit(lambda: glorot(key=jax.random.key(0))((n, n)), out_shardings=sh)
        .lower()
        .compile()
        .memory_analysis()
    )

    variants = {
        "jax.jit(init, out_shardings)": reference,
        "ps.Variable(init, sharding=)": paramstore,
        "eager init, then device_put": eager_then_place,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    peaks: dict[str, list[float]] = {k: [] for k in variants}
    largest: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(repeats):
        for name in list(variants) if r % 2 == 0 else list(reversed(variants)):
            gc.collect()
            base = _peak_rss_reset()
            seen, stop = [0], threading.Event()
            watcher = threading.Thread(target=_watch_buffers, args=(seen, stop), daemon=True)
            watcher.start()
            t0 = time.perf_counter()
            out = variants[name]()
            jax.block_until_ready(out)
            times[name].append(time.perf_counter() - t0)
            stop.set()
            watcher.join()
            peaks[name].append((_rss("VmHWM") - base) / dev / 2**20)
            largest[name].append(seen[0] / 2**20)
            del out
    print(
        f"\n# sharded creation of a {n}x{n} float32 weight over {dev} devices "
        f"(one shard {shard_mib:.0f} MiB), median of {repeats} interleaved runs"
    )
    for what, m in (("ps init program", mem), ("jax.jit reference", ref_mem)):
        print(
            f"{what}: per device output {m.output_size_in_bytes / 2**20:.0f} MiB, "
            f"temporaries {m.temp_size_in_bytes / 2**20:.0f} MiB"
        )
    bound = 1.5 * shard_mib + mem.temp_size_in_bytes / 2**20
    ref_t = statistics.median(times["jax.jit(init, out_shardings)"])
    print(
        f"{'variant':32} {'time s':>8} {'ratio':>7} {'largest buffer MiB':>19} "
        f"{'peak RSS/device MiB':>20} {'vs bound':>9}"
    )
    for name in variants:
        t, peak = statistics.median(times[name]), statistics.median(peaks[name])
        big = max(largest[name])
        print(f"{name:32} {t:8.3f} {t / ref_t:7.2f} {big:19.0f} {peak:20.0f} {peak / bound:9.2f}")
    print(
        "largest buffer: the biggest array piece on any one device seen during creation "
        "(jax.live_arrays sampled every 0.5 ms)"
    )
    print(
        f"bound: 1.5 x shard + init temporaries = {bound:.0f} MiB per device "
        "(targets: ps time <= 1.2x jax.jit, peak <= bound)"
    )
    sys.stdout.flush()


# ------------------------------------------------------------------- checkpoint rows


def checkpoint_rows(args: argparse.Namespace) -> None:
    """Sharded checkpoint of ``mib`` MiB (float32 arrays of 64 MiB, row- and column-sharded
    over the mesh): ``ps.Saver(sharded=True)`` save/restore against plain Orbax on the same
    arrays (same shardings, same composite layout); an async ``CheckpointManager.save``
    against a synchronous one; and FSDP Adam steps while an async save is being written
    against steps without. Medians of ``--repeats // 2`` (at least 3), paramstore and Orbax
    interleaved; the size is ``--checkpoint-mib``."""
    import shutil
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import paramstore as ps

    mib, repeats = args.checkpoint_mib, max(3, args.repeats // 2)
    mesh = jax.make_mesh((len(jax.devices()),), ("data",), axis_types=(AxisType.Auto,))
    axis = mesh.axis_names[0]
    count = max(1, mib // 64)
    side = 4096 if mib >= 64 else max(64, int((mib * 2**18) ** 0.5) // 64 * 64)
    rng = np.random.default_rng(0)
    specs = [P(axis, None) if i % 2 == 0 else P(None, axis) for i in range(count)]
    host = [rng.standard_normal((side, side), dtype=np.float32) for _ in range(count)]
    arrays = [jax.device_put(h, NamedSharding(mesh, s)) for h, s in zip(host, specs)]
    total = sum(a.nbytes for a in arrays) / 2**20
    root = tempfile.mkdtemp(prefix="ps-sharded-bench-")
    with ps.VariableStore():
        variables = [ps.Variable(a, name=f"w{i}") for i, a in enumerate(arrays)]
        saver = ps.Saver(variables, sharded=True)
        tree = {f"v{i}": v.value() for i, v in enumerate(variables)}
        targets = {
            k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for k, a in tree.items()
        }
        restore_args = {
            k: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype)
            for k, a in tree.items()
        }
        zstd = ocp.Checkpointer(ocp.CompositeCheckpointHandler())  # Orbax's default
        raw = ocp.Checkpointer(  # what paramstore writes: no zstd
            ocp.CompositeCheckpointHandler(
                arrays=ocp.PyTreeCheckpointHandler(use_compression=False)
            )
        )

        def orbax_save(checkpointer: Any, name: str) -> Callable[[], None]:
            def run() -> None:
                args = ocp.args.Composite(arrays=ocp.args.PyTreeSave(tree))
                checkpointer.save(os.path.join(root, name), args, force=True)

            return run

        def orbax_restore(checkpointer: Any, name: str) -> Callable[[], None]:
            def run() -> None:
                args = ocp.args.Composite(
                    arrays=ocp.args.PyTreeRestore(item=targets, restore_args=restore_args)
                )
                out = checkpointer.restore(os.path.join(root, name), args)["arrays"]
                jax.block_until_ready(out)

            return run

        def ps_save() -> None:
            saver.save(os.path.join(root, "ps"))

        def ps_restore() -> None:
            saver.restore(os.path.join(root, "ps"))
            jax.block_until_ready([v.value() for v in variables])

        saves = {
            "Orbax (zstd, default)": orbax_save(zstd, "zstd"),
            "Orbax, no zstd": orbax_save(raw, "raw"),
            "paramstore": ps_save,
        }
        restores = {
            "Orbax (zstd, default)": orbax_restore(zstd, "zstd"),
            "Orbax, no zstd": orbax_restore(raw, "raw"),
            "paramstore": ps_restore,
        }
        times: dict[tuple[str, str], list[float]] = {}
        for r in range(repeats + 1):  # the first round compiles and warms the page cache
            for op, fns in (("save", saves), ("restore", restores)):
                order = list(fns) if r % 2 else list(reversed(fns))
                for name in order:
                    gc.collect()
                    t0 = time.perf_counter()
                    fns[name]()
                    if r:
                        times.setdefault((op, name), []).append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"\n## sharded checkpoint: {count} x {side}x{side} float32 ({total:.0f} MiB), "
            f"mesh {dict(mesh.shape)}, median of {repeats}"
        )
        names = list(saves)
        print(
            f"{'op':8} "
            + " ".join(f"{n + ' s':>22}" for n in names)
            + "   ps / Orbax default, / no zstd"
        )
        for op in ("save", "restore"):
            ps_s = med[(op, "paramstore")]
            cells = " ".join(f"{med[(op, n)]:22.3f}" for n in names)
            print(
                f"{op:8} {cells}   {ps_s / med[(op, names[0])]:7.2f} {ps_s / med[(op, names[1])]:7.2f}"
            )

        # async save: time for save() to return, and FSDP steps while it is written
        with ps.device(NamedSharding(mesh, P(axis))):
            w1 = ps.Variable(
                rng.standard_normal((1024, 1024), dtype=np.float32) * 0.03, name="fsdp1"
            )
            w2 = ps.Variable(
                rng.standard_normal((1024, 1024), dtype=np.float32) * 0.03, name="fsdp2"
            )
        opt = ps.Optimizer(optax.adam(1e-3), [w1, w2])
        x = jax.device_put(
            rng.standard_normal((256, 1024), dtype=np.float32), NamedSharding(mesh, P(axis))
        )

        @ps.function
        def step(x: jax.Array) -> jax.Array:
            def loss() -> jax.Array:
                return jnp.mean((jax.nn.relu(x @ w1) @ w2 - x) ** 2)

            value, grads = ps.value_and_grad(loss, [w1, w2])()
            opt.apply_gradients(grads)
            return value

        for _ in range(3):
            step(x).block_until_ready()

        def steps(n: int) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                step(x).block_until_ready()
            return (time.perf_counter() - t0) / n

        sync_manager = ps.CheckpointManager(
            os.path.join(root, "sync"), variables, max_to_keep=1, sharded=True
        )
        async_manager = ps.CheckpointManager(
            os.path.join(root, "async"), variables, max_to_keep=1, sharded=True, async_save=True
        )
        rows: dict[str, list[float]] = {
            k: [] for k in ("sync", "async", "alone", "during", "n", "orbax")
        }
        orbax_async = ocp.AsyncCheckpointer(ocp.CompositeCheckpointHandler())
        for r in range(repeats + 1):
            t0 = time.perf_counter()  # plain Orbax's own async save, for reference
            orbax_async.save(
                os.path.join(root, "orbax-async"),
                ocp.args.Composite(arrays=ocp.args.PyTreeSave(tree)),
                force=True,
            )
            orbax_s = time.perf_counter() - t0
            orbax_async.wait_until_finished()
            t0 = time.perf_counter()
            sync_manager.save(r)
            sync_s = time.perf_counter() - t0
            alone = steps(10)
            t0 = time.perf_counter()
            async_manager.save(r)
            async_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            n = 0
            while n < 5 or not _finished(async_manager):
                step(x).block_until_ready()
                n += 1
                if n >= 200:
                    break
            during = (time.perf_counter() - t0) / n
            async_manager.wait()
            if r:
                for k, v in zip(rows, (sync_s, async_s, alone, during, n, orbax_s)):
                    rows[k].append(v)
        m = {k: statistics.median(v) for k, v in rows.items()}
        print(
            f"\n## async sharded save ({total:.0f} MiB) and FSDP Adam steps (2 x 1024x1024) meanwhile"
        )
        print(f"{'':34} {'s / step ms':>12} {'ratio':>7}")
        print(f"{'synchronous CheckpointManager.save':34} {m['sync'] * 1e3:12.1f} {1:7.2f}")
        print(
            f"{'async save() returns after':34} {m['async'] * 1e3:12.1f} {m['async'] / m['sync']:7.3f}"
        )
        print(f"{'(plain Orbax async save() returns)':34} {m['orbax'] * 1e3:12.1f}")
        print(f"{'step, no save':34} {m['alone'] * 1e3:12.2f} {1:7.2f}")
        print(
            f"{'step during the async save':34} {m['during'] * 1e3:12.2f} {m['during'] / m['alone']:7.2f}"
            f"   ({m['n']:.0f} steps)"
        )
    shutil.rmtree(root, ignore_errors=True)


def _finished(manager: Any) -> bool:
    """Whether a manager's background sharded save has finished (benchmark only: reads the
    manager's save in flight, an ``checkpoint.formats.orbax.format.AsyncWriter``)."""
    pending = getattr(manager, "_pending", None)
    writer = getattr(pending, "_inner", pending)  # the manager wraps it to prune after
    return writer is None or writer.done()


# ------------------------------------------------------- optimizer state placement (issue 26)


def optimizer_rows(args: argparse.Namespace) -> None:
    """Where Adam's state lives, for a data-parallel MLP whose Adam state is most of the
    step's memory (``--quick``: 2 x 256, else 4 x 512; batch 64 split over the devices,
    parameters replicated). Placements: replicated slots (the default), ZeRO-1 (slots split
    over "data", ``slot_sharding=``), host memory (``slot_memory_kind="pinned_host"``) and
    both. Memory: the compiled step's ``memory_analysis()`` per device, arguments and
    outputs (see ``device_bytes`` for how host memory is taken out on each backend). Slots
    on the device: device arguments less the replicated variant's, plus its slot bytes. Time: each paramstore step
    against a hand-written ``jax.jit`` with the same in/out shardings and memory kinds, the
    host slots moved by ``jax.device_put`` inside it; medians, interleaved."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import step as single  # step.py's MLP: its initial values, data and forward pass
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import paramstore as ps

    layers, width, batch = (2, 256, 64) if args.quick else (4, 512, 64)
    steps, repeats = (3, 2) if args.quick else (10, 5)
    lr, host = 1e-3, "pinned_host"
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    cfg = single.Config(f"{layers} x {width}", layers, width, batch)
    init, mlp = single.init_params(cfg), single.mlp
    x, y = (jax.device_put(a, split) for a in single.data(cfg))
    param_bytes = sum(w.nbytes + b.nbytes for w, b in init)

    placements = {  # name: (slot spec, memory kind)
        "replicated slots (default)": (P(), None),
        "ZeRO-1 (slots split over data)": (P("data"), None),
        "slots in pinned_host": (P(), host),
        "ZeRO-1 + pinned_host": (P("data"), host),
    }

    def reference(spec: Any, kind: str | None) -> tuple[Callable[[], object], Any]:
        tx = optax.adam(lr)
        slot_sh = NamedSharding(mesh, spec, memory_kind=kind)
        on_device = NamedSharding(mesh, spec)
        params = jax.device_put([(w, b) for w, b in init], rep)
        state0 = tx.init(params)
        state_sh = jax.tree.map(lambda a: slot_sh if a.ndim else rep, state0)
        state = [params, jax.device_put(state0, state_sh)]

        def step(params, opt_state, x, y):
            if kind is not None:  # host slots: to the device for the update
                opt_state = jax.tree.map(
                    lambda a, sh: jax.device_put(a, on_device) if sh is slot_sh else a,
                    opt_state,
                    state_sh,
                )
            loss, g = jax.value_and_grad(lambda p: jnp.mean((mlp(p, x) - y) ** 2))(params)
            updates, opt_state = tx.update(g, opt_state, params)
            opt_state = jax.tree.map(
                lambda a, sh: jax.device_put(a, sh) if sh is slot_sh else a, opt_state, state_sh
            )
            return optax.apply_updates(params, updates), opt_state, loss

        jitted = jax.jit(
            step,
            in_shardings=(rep, state_sh, split, split),
            out_shardings=(rep, state_sh, rep),
            donate_argnums=(0, 1),
        )

        def run() -> object:
            state[0], state[1], loss = jitted(state[0], state[1], x, y)
            return loss

        return run, jitted.lower(state[0], state[1], x, y).compile()

    def paramstore(spec: Any, kind: str | None) -> tuple[Callable[[], object], Any]:
        with ps.device(mesh):
            model = [
                (ps.Variable(w, name=f"w{i}"), ps.Variable(b, name=f"b{i}"))
                for i, (w, b) in enumerate(init)
            ]
        vs = [v for pair in model for v in pair]
        slot_sharding = None if spec == P() else NamedSharding(mesh, spec)
        opt = ps.Optimizer(optax.adam(lr), vs, slot_sharding=slot_sharding, slot_memory_kind=kind)

        @ps.function
        def step(x, y):
            loss, grads = ps.value_and_grad(lambda: jnp.mean((mlp(model, x) - y) ** 2), vs)()
            opt.apply_gradients(grads)
            return loss

        return (lambda: step(x, y)), step.lower(x, y).compile()

    def device_bytes(compiled: Any) -> tuple[int, int, int]:
        """(arguments, of which in host memory, outputs on the device) per device.

        The backends split host memory (``S(5)`` in the entry layout) differently: XLA:CPU
        counts host-memory arguments and outputs in ``argument_size_in_bytes`` /
        ``output_size_in_bytes`` (its ``host_*`` fields stay 0), XLA:GPU in
        ``host_argument_size_in_bytes`` / ``host_output_size_in_bytes`` only. So all the
        arguments are the sum of the two fields on either backend, and the host part is
        read from the program's input/output shardings (on GPU it equals the ``host_*``
        field): device = all - host, never negative (subtracting the host bytes from
        ``argument_size_in_bytes`` alone was, on a GPU)."""
        stats = compiled.memory_analysis()

        def host_bytes(pairs: Any) -> int:
            return sum(
                int(np.prod(sh.shard_shape(a.shape))) * a.dtype.itemsize
                for sh, a in pairs
                if sh.memory_kind == host
            )

        ins = host_bytes(
            zip(jax.tree.leaves(compiled.input_shardings[0]), jax.tree.leaves(compiled.in_avals[0]))
        )
        outs = host_bytes((o.sharding, o) for o in jax.tree.leaves(compiled.out_info))
        args = stats.argument_size_in_bytes + stats.host_argument_size_in_bytes
        out = stats.output_size_in_bytes + stats.host_output_size_in_bytes
        return args, ins, out - outs

    print(
        f"\n# optimizer state placement: Adam, MLP {layers} x {width} (parameters "
        f"{param_bytes / 2**20:.2f} MiB, Adam slots {2 * param_bytes / 2**20:.2f} MiB), batch "
        f"{batch} over {n} devices, parameters replicated; {steps} steps, median of {repeats}"
    )
    runs: dict[str, Callable[[], object]] = {}
    memory: dict[str, tuple[int, int, int]] = {}
    programs: dict[str, str] = {}
    with ps.VariableStore():
        for name, (spec, kind) in placements.items():
            for who, build in (("ps.function", paramstore), ("jax.jit", reference)):
                run, compiled = build(spec, kind)
                jax.block_until_ready(run())  # warm up
                runs[f"{name}|{who}"] = run
                memory[f"{name}|{who}"] = device_bytes(compiled)
                programs[f"{name}|{who}"] = _program_summary(compiled)
        times = _interleaved(runs, steps, repeats)
    mib = 2**20
    base_args, base_host, _ = memory[f"{next(iter(placements))}|ps.function"]
    base_slots = 2 * param_bytes  # replicated: every device holds all of mu and nu
    print(
        f"{'placement':30} {'args MiB':>9} {'host':>6} {'device':>7} {'jax.jit':>8} "
        f"{'out dev':>8} {'slots dev':>10} {'/ repl.':>8} {'ps ms':>8} {'jax.jit ms':>11} "
        f"{'ratio':>6}"
    )
    worst = 0.0
    for name in placements:
        args_b, host_b, out_b = memory[f"{name}|ps.function"]
        ref_args, ref_host, _ = memory[f"{name}|jax.jit"]
        slots_dev = (args_b - host_b) - (base_args - base_host) + base_slots
        ps_t = times[f"{name}|ps.function"][0]
        ref_t = times[f"{name}|jax.jit"][0]
        worst = max(worst, ps_t / ref_t)
        print(
            f"{name:30} {args_b / mib:9.3f} {host_b / mib:6.3f} {(args_b - host_b) / mib:7.3f} "
            f"{(ref_args - ref_host) / mib:8.3f} {out_b / mib:8.3f} {slots_dev / mib:10.3f} "
            f"{slots_dev / base_slots:8.3f} {ps_t * 1e3:8.2f} {ref_t * 1e3:11.2f} "
            f"{ps_t / ref_t:6.2f}"
        )
    for name in placements:
        ours, theirs = programs[f"{name}|ps.function"], programs[f"{name}|jax.jit"]
        if ours == theirs:
            print(f"  {name}: ps.function and jax.jit programs alike: {ours}")
        else:
            print(f"  {name}: ps.function {ours}\n  {'':{len(name)}}  jax.jit     {theirs}")
    print(
        "per device; args: memory_analysis()'s argument_size_in_bytes + "
        "host_argument_size_in_bytes, host: those in "
        "pinned_host (S(5)), device: args - host (jax.jit: the hand-written step's), out dev: "
        "outputs on the device; ms: blocking step, median"
    )
    print(
        f"targets: ZeRO-1 slots on device <= {1 / n + 0.05:.3f} of replicated; pinned_host "
        f"slots 0 on device; ps.function / jax.jit <= 1.05x (worst here {worst:.2f}x)"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
