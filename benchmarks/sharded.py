"""A data-parallel Adam step on 8 devices: ps.function against hand-written jax.jit.

Run: ``python benchmarks/sharded.py`` (``--quick`` for a short run, ``--devices N``).

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
paramstore / jax.jit. On CPU the devices are forced with
``XLA_FLAGS=--xla_force_host_platform_device_count`` (set here before JAX starts).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable

# name, layers, width, batch (step.py's Config, built once jax may be imported)
MODELS = {
    "dispatch": ("dispatch-bound (4 x 32, batch 64)", 4, 32, 64),
    "many": ("many-variable (50 x 16, batch 64)", 50, 16, 64),
    "compute": ("compute-bound (4 x 512, batch 1024)", 4, 512, 1024),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="CPU devices to force (0: as is)")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="few steps, for a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 10, 3
    if args.devices:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        )

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
    for key in args.models:
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
    print(f"\nworst ratio ps.function / jax.jit: {worst:.2f}x (target <= 1.10x)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
