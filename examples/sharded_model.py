"""A model whose parameters are sharded 8 ways from birth: FSDP + tensor parallel, K steps
fused with ``lax.scan``, async sharded checkpoints, one process or several.

    python examples/sharded_model.py                      # 8 forced CPU devices, 1 process
    python examples/sharded_model.py --ckpt /tmp/run      # resumes from /tmp/run if there
    # 2 processes x 4 devices on this machine (docs/sharding.md, "Several processes"):
    for i in 0 1; do python examples/sharded_model.py --processes 2 --process-id $i \\
        --ckpt /tmp/run & done; wait

The mesh is ``("data", "model")`` (4 x 2 on 8 devices). Each weight is split over both
axes: FSDP over ``"data"`` (the rows of the first layer, the columns of the second) and
tensor parallel over ``"model"`` (the hidden units), so each device holds 1/8 of it. The
layouts are given by name (``ps.sharding.LayoutMap``); the model is first built abstract
(``ps.abstract()``: shapes, dtypes and shardings, nothing allocated), then either restored
from the checkpoint directory (each value read straight into its sharding, whatever mesh
or process count wrote it) or initialized by ``ps.initialize`` as one program compiled
with the variables' output shardings: no device ever holds a whole weight (docs/sharding.md,
"Models larger than one device").
"""

from __future__ import annotations

import argparse
import os


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="devices in all (CPU, forced)")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--coordinator", default="127.0.0.1:12355")
    parser.add_argument("--width", type=int, default=256, help="model width d")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden units h")
    parser.add_argument("--calls", type=int, default=3, help="compiled calls")
    parser.add_argument("--fused", type=int, default=4, help="steps per call (lax.scan)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ckpt", default=None, help="checkpoint directory (resume from it)")
    return parser.parse_args()


def start_jax(args: argparse.Namespace) -> None:
    """Configure JAX before it starts; join the other processes when there are several."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices // args.processes)
    if args.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            args.coordinator, num_processes=args.processes, process_id=args.process_id
        )


def device_grid(sharding, shape) -> str:
    """Which device holds which block of a 2-D array, as text (works on every process:
    it reads the sharding, not the values)."""
    rows: dict[int, dict[int, str]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        r, c = (s.start or 0 for s in index)
        cell = rows.setdefault(r, {})
        cell[c] = (cell.get(c, "") + f",{device.id}").lstrip(",")
    return "\n".join(" ".join(f"[{rows[r][c]:^5}]" for c in sorted(rows[r])) for r in sorted(rows))


def main() -> None:
    args = parse()
    start_jax(args)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import paramstore as ps

    mesh = jax.make_mesh(
        (jax.device_count() // 2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2
    )
    d, h = args.width, args.hidden
    layouts = {  # variable name -> one mesh axis (or None) per dimension
        "mlp/w_in": ("data", "model"),
        "mlp/b_in": ("model",),
        "mlp/w_out": ("model", "data"),
        "mlp/b_out": (None,),
    }
    shapes = {"mlp/w_in": (d, h), "mlp/b_in": (h,), "mlp/w_out": (h, d), "mlp/b_out": (d,)}
    inits = {
        "mlp/w_in": ps.initializers.glorot_uniform(seed=1),
        "mlp/b_in": ps.initializers.zeros(),
        "mlp/w_out": ps.initializers.glorot_uniform(seed=2),
        "mlp/b_out": ps.initializers.zeros(),
    }
    manager_dir = args.ckpt
    resume = bool(manager_dir) and os.path.isdir(manager_dir) and bool(os.listdir(manager_dir))

    layout_map = ps.sharding.LayoutMap(mesh)  # layouts by name
    for name, layout in layouts.items():
        layout_map[f"^{name}$"] = layout
    with ps.abstract(), ps.device(layout_map), ps.name_scope("mlp"):
        # shapes, dtypes and shardings only: nothing allocated, no initializer run
        params = [ps.Variable(inits[n], shape=shapes[n], name=n.split("/")[1]) for n in shapes]
    if resume:
        ps.Saver(params).restore(manager_dir)  # each value read straight into its sharding
    else:
        ps.initialize(params)  # the initializers as one program with these output shardings
    w_in, b_in, w_out, b_out = params
    opt = ps.Optimizer(optax.adam(1e-3), params)  # slots sharded like their parameters
    manager = None
    if manager_dir:
        manager = ps.CheckpointManager(
            manager_dir, [*params, *opt.variables], max_to_keep=2, async_save=True, sharded=True
        )
        if resume:
            manager.restore_latest()  # parameters and Adam state, onto this mesh

    def loss_fn(x: jax.Array, y: jax.Array) -> jax.Array:
        hidden = jax.nn.gelu(x @ w_in + b_in)  # hidden units split over "model"
        return jnp.mean((hidden @ w_out + b_out - y) ** 2)

    @ps.function
    def train(xs: jax.Array, ys: jax.Array) -> jax.Array:
        """``--fused`` Adam steps in one compiled call."""

        def body(carry: None, batch: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
            loss, grads = ps.value_and_grad(lambda: loss_fn(*batch), params)()
            opt.apply_gradients(grads)
            return carry, loss

        return jax.lax.scan(body, None, (xs, ys))[1]

    rng = np.random.default_rng(0)  # the same data on every process
    target = rng.standard_normal((d, d)).astype(np.float32) / np.sqrt(d)
    batches = NamedSharding(mesh, P(None, "data"))  # K steps, each batch split over "data"
    main_process = jax.process_index() == 0
    if main_process:
        print(
            f"{jax.device_count()} devices in {jax.process_count()} process(es), mesh "
            f"{dict(mesh.shape)}; "
            + (f"resumed at step {int(opt.iterations.numpy())}" if resume else "initialized")
        )
        print(
            f"mlp/w_in {w_in.shape}: {w_in.sharding.spec}, each device holds "
            f"{w_in.sharding.shard_shape(w_in.shape)}; device ids per block:"
        )
        print(device_grid(w_in.sharding, w_in.shape))
    # the targets computed on the devices: NumPy's matmul may round differently per process
    make_targets = jax.jit(lambda xs: xs @ target, out_shardings=batches)
    for call in range(args.calls):
        x = rng.standard_normal((args.fused, args.batch, d)).astype(np.float32)
        xs = jax.device_put(x, batches)
        ys = make_targets(xs)
        losses = train(xs, ys)
        step = int(opt.iterations.numpy())
        if manager is not None:
            manager.save(step)  # returns once the values are off the devices
        if main_process:
            print(f"call {call}: steps up to {step}, loss {float(losses[-1]):.4f}")
    if manager is not None:
        manager.wait()
        if main_process:
            print("checkpoints:", [os.path.basename(p) for p in manager.checkpoints])
    assert train.trace_count == 1
    assert w_in.sharding.spec == P("data", "model")  # still split 8 ways


if __name__ == "__main__":
    main()
