"""Data-parallel (and optionally tensor-parallel) training with paramstore on a mesh.

    python examples/data_parallel.py                 # 8 forced CPU devices, data parallel
    python examples/data_parallel.py --tensor 2      # a 4 x 2 mesh: data x model
    python examples/data_parallel.py --devices 4 --steps 50

The model is ordinary paramstore code: Modules and Variables, a ``ps.function`` training
step and a ``ps.Optimizer``. Only *placement* says how it runs on several devices:

* ``with ps.device(mesh):`` creates the parameters replicated over the mesh (the usual
  data-parallel model); ``sharding=NamedSharding(mesh, P(None, "model"))`` splits one
  (tensor parallelism);
* the batch is a ``jax.Array`` sharded over the ``"data"`` axis.

``jax.jit`` (under ``ps.function``) then compiles one SPMD program: each device computes
the gradient of its part of the batch, XLA inserts the all-reduce, and every assigned
variable (parameters and Adam's state) comes back with its own sharding, in place.
``--devices N`` (8 by default) runs on N CPU devices, forced with
``XLA_FLAGS=--xla_force_host_platform_device_count`` and ``JAX_PLATFORMS=cpu`` (so also on a
machine with a GPU); on a machine with several GPUs, pass ``--devices 0`` to use the real ones.
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices", type=int, default=8, help="CPU devices to force (0: JAX's default devices)"
    )
    parser.add_argument("--tensor", type=int, default=1, help="size of the 'model' mesh axis")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    if args.devices:  # before JAX starts: it reads the flag once
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        )
        os.environ["JAX_PLATFORMS"] = "cpu"  # the forced devices, even where a GPU is

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import paramstore as ps

    n = len(jax.devices())
    if n % args.tensor:
        sys.exit(f"--tensor {args.tensor} does not divide the {n} devices")
    mesh = jax.make_mesh(
        (n // args.tensor, args.tensor), ("data", "model"), axis_types=(AxisType.Auto,) * 2
    )

    def on(*spec: str | None) -> NamedSharding:
        return NamedSharding(mesh, P(*spec))

    class Dense(ps.Module):
        def __init__(self, n_in: int, n_out: int, split: str | None = None, name=None):
            # split="out": columns over "model" (column-parallel); "in": rows (row-parallel)
            w_spec = {"out": (None, "model"), "in": ("model", None)}.get(split or "", ())
            self.w = ps.Variable(
                lambda: ps.initializers.glorot_uniform()((n_in, n_out)),
                name="w",
                sharding=on(*w_spec) if args.tensor > 1 else None,
            )
            self.b = ps.Variable(
                jnp.zeros(n_out),
                name="b",
                sharding=on("model") if args.tensor > 1 and split == "out" else None,
            )

        def __call__(self, x):
            return x @ self.w + self.b

    class MLP(ps.Module):
        def __init__(self, sizes: list[int], name=None):
            splits = ["out", "in", None]
            self.layers = [
                Dense(a, b, split=splits[i] if i < len(splits) else None)
                for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))
            ]

        def __call__(self, x):
            for layer in self.layers[:-1]:
                x = jax.nn.gelu(layer(x))
            return self.layers[-1](x)

    ps.random.set_seed(0)
    with ps.device(mesh):  # everything not placed explicitly: replicated over the mesh
        model = MLP([32, 256, 256, 1])
        opt = ps.Optimizer(optax.adam(3e-3), model)

    @ps.function
    def train_step(x, y):
        loss, grads = ps.value_and_grad(lambda: jnp.mean((model(x) - y) ** 2), model)()
        opt.apply_gradients(grads)
        return loss

    rng = np.random.default_rng(0)
    true_w = rng.standard_normal((32, 1)).astype(np.float32)
    batch = on("data")  # the batch is split over the "data" axis
    print(f"{n} devices, mesh {dict(mesh.shape)}; parameters:")
    for v in model.trainable_variables:
        print(f"  {v.name:16} {str(v.shape):11} {v.sharding.spec}")
    for step in range(args.steps):
        x = rng.standard_normal((args.batch, 32)).astype(np.float32)
        y = np.tanh(x @ true_w / 4)
        # float() waits for the step; on forced CPU devices, keep it that way: XLA's
        # in-process collectives can deadlock with many steps in flight (jax 0.10).
        loss = float(train_step(jax.device_put(x, batch), jax.device_put(y, batch)))
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss:.5f}")
    w0 = model.layers[0].w
    print(
        f"traced {train_step.trace_count} time(s); layers[0].w keeps {w0.sharding.spec}, "
        f"shards of shape {w0.value().addressable_shards[0].data.shape}"
    )


if __name__ == "__main__":
    main()
