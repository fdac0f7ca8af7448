"""Quantized weights (issue 34): a QLoRA step, quantize while loading, and ps.plan's cost.

Run: ``python benchmarks/quantized.py`` (``--quick`` for a smoke run; ``--rows step load
plan``; ``--steps``, ``--load-mib``, ``--plan-layers``). 8 CPU devices are forced
(``XLA_FLAGS``, set here before JAX starts).

* ``step``: ``benchmarks/depth.py``'s model (``--blocks`` pre-LN transformer blocks in a
  ``ps.nn.Repeat``, d_model 64, 4 heads, MLP 256, batch 8 x 32), LoRA rank 8 on both MLP
  ``Dense`` layers of every block, Adam on the adapters, one ``ps.function`` step. Rows:
  ``float32 LoRA`` (the base in float32), ``QLoRA int8`` (``ps.nn.quantize(model, "int8")``:
  the MLP and the attention projections), and ``hand-written JAX`` (the same int8 scheme
  as plain arrays: int8 kernels and float32 scales, the same int8 matmul/einsum functions,
  ``lax.scan`` over the stacked blocks, ``jax.jit`` with the adapters and Adam state
  donated). Columns: the compiled step's device argument bytes
  (``memory_analysis().argument_size_in_bytes``) and the median step time (variants take
  turns step by step). Targets: QLoRA's argument bytes <= 0.35x float32 LoRA's; QLoRA step
  <= 1.10x the hand-written JAX step.
* ``load``: a float32 safetensors file of ``--load-mib`` MiB (8 Dense kernels ``(d, d)``)
  into an abstract int8 model FSDP-sharded over the 8 devices: ``init_from_checkpoint``
  (quantizing each tensor on the host as it is read) against the anchor ``safetensors``'
  ``load_file`` + quantizing by hand (NumPy abs-max, the same arithmetic) +
  ``jax.device_put`` onto the same shardings. Each variant runs in a fresh child process;
  columns: time, and the peak RSS growth above the loaded (quantized) model, in units of
  the largest float tensor. Targets: time <= 1.2x the anchor; RSS growth <= 1.2x.
* ``plan``: ``ps.plan`` of a train step (Adam) of an abstract model of ``--plan-layers``
  Dense layers ``8192 x 8192`` (16 layers: 1.07 B parameters), FSDP over 8 devices: time
  and RSS growth (targets: < 10 s, < 100 MiB), in a child process. The growth is measured
  after one tiny compiled program (XLA's compiler starts once per process, ~25-30 MiB, for
  any first compile: not the plan's); the growth from a cold process is printed too.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import argparse
import datetime
import json
import math
import platform
import resource
import statistics
import subprocess
import tempfile
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import paramstore as ps
from paramstore.nn._quant_ops import abs_max_quantize, int8_einsum, int8_matmul

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import depth  # noqa: E402  (the model of benchmarks/depth.py)

RANK = 8


def rss_mib() -> float:
    """The process's current resident set size, MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class PeakRSS:
    """The highest resident set size seen while the block runs (sampled every 0.5 ms)."""

    def __enter__(self) -> PeakRSS:
        self.peak, self._stop = rss_mib(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.0005):
            self.peak = max(self.peak, rss_mib())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mib())


# ------------------------------------------------------------------------ the QLoRA step


def ps_step(blocks: int, quantized: bool, rank: int | None = None) -> tuple[Any, Any]:
    x = depth.data()
    with ps.VariableStore():
        model = ps.nn.Repeat(depth.Block, blocks)
        model.build(tuple(x.shape))
        if quantized:
            ps.nn.quantize(model, "int8")
        for v in model.variables:
            v.trainable = False
        ps.nn.enable_lora(model, RANK if rank is None else rank, where=r"dense")
        opt = ps.Optimizer(optax.adam(depth.LR), model.trainable_variables)

        @ps.function
        def step(x: jax.Array) -> jax.Array:
            loss, g = ps.value_and_grad(lambda: jnp.mean(model(x) ** 2), model)()
            opt.apply_gradients(g)
            return loss

        step(x)
        args = step.lower(x).compile().memory_analysis().argument_size_in_bytes
    return (lambda: step(x)), args


def jax_step(blocks: int) -> tuple[Any, Any]:
    """The QLoRA scheme by hand: int8 kernels and scales as arrays, the same functions."""
    x = depth.data()
    floats = jax.jit(jax.vmap(depth.init_layer))(jax.random.split(jax.random.key(0), blocks))
    frozen: dict[str, Any] = {}
    for k, v in floats.items():
        if k.endswith("_k"):
            axes = (-3, -2) if k == "o_k" else (-3,) if k in ("q_k", "k_k", "v_k") else (-2,)
            q, s = abs_max_quantize(v, axes, "int8")
            frozen[k], frozen[k + "_s"] = q, s
        else:
            frozen[k] = v
    keys = jax.random.split(jax.random.key(1), 2)
    lora = {  # alpha = rank: the update is a @ b
        "a1": jax.random.normal(keys[0], (blocks, depth.D, RANK)) * 0.1,
        "b1": jnp.zeros((blocks, RANK, depth.MLP)),
        "a2": jax.random.normal(keys[1], (blocks, depth.MLP, RANK)) * 0.1,
        "b2": jnp.zeros((blocks, RANK, depth.D)),
    }
    tx = optax.adam(depth.LR)
    heads, hd = depth.HEADS, depth.D // depth.HEADS

    def block(p: dict[str, Any], h: jax.Array) -> jax.Array:
        a = depth._ln(h, p["ln1_g"], p["ln1_b"])
        proj = {n: int8_einsum("bsd,dhk->bshk", a, p[f"{n}_k"], p[f"{n}_k_s"], (-1,)) + p[f"{n}_b"] for n in "qkv"}  # fmt: skip
        q = proj["q"] * (1.0 / math.sqrt(hd))
        scores = jax.nn.softmax(jnp.einsum("bshk,bthk->bhts", proj["k"], q), axis=-1)
        att = jnp.einsum("bhts,bshk->bthk", scores, proj["v"])
        h = h + int8_einsum("bthk,hkd->btd", att, p["o_k"], p["o_k_s"], (-2, -1)) + p["o_b"]
        a = depth._ln(h, p["ln2_g"], p["ln2_b"])
        u = int8_matmul(a, p["fc1_k"], p["fc1_k_s"]) + a @ p["a1"] @ p["b1"]  # alpha / rank = 1
        u = jax.nn.gelu(u + p["fc1_b"])
        return h + int8_matmul(u, p["fc2_k"], p["fc2_k_s"]) + (u @ p["a2"] @ p["b2"]) + p["fc2_b"]

    del heads

    def loss_fn(lp: Any, fz: Any) -> jax.Array:
        y, _ = jax.lax.scan(lambda h, p: (block(p, h), None), x, {**fz, **lp})
        return jnp.mean(y**2)

    def _step(lp: Any, s: Any, fz: Any) -> Any:
        loss, g = jax.value_and_grad(loss_fn)(lp, fz)
        updates, s = tx.update(g, s, lp)
        return optax.apply_updates(lp, updates), s, loss

    step_jit = jax.jit(_step, donate_argnums=(0, 1))
    state = [lora, tx.init(lora)]

    def step() -> jax.Array:
        state[0], state[1], loss = step_jit(state[0], state[1], frozen)
        return loss

    step()
    args = step_jit.lower(state[0], state[1], frozen).compile().memory_analysis()
    return step, args.argument_size_in_bytes


def bench_step(blocks: int, steps: int) -> None:
    variants = {
        "float32 LoRA": ps_step(blocks, False),
        "QLoRA int8 (ps.function)": ps_step(blocks, True),
        "hand-written JAX int8 [reference]": jax_step(blocks),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(steps):
        for name, (step, _) in variants.items():
            t0 = time.perf_counter()
            jax.block_until_ready(step())
            times[name].append(time.perf_counter() - t0)
    print(f"\n## step: {blocks} blocks, LoRA rank {RANK} on the MLP, Adam")
    print(f"{'variant':36s} {'arg bytes':>12s} {'median ms':>10s} {'min ms':>8s}")
    for name, (_, args) in variants.items():
        med, low = statistics.median(times[name]) * 1e3, min(times[name]) * 1e3
        print(f"{name:36s} {args:12d} {med:10.2f} {low:8.2f}")
    f32, q8 = variants["float32 LoRA"][1], variants["QLoRA int8 (ps.function)"][1]
    print(f"QLoRA argument bytes / float32 LoRA's: {q8 / f32:.3f} (target <= 0.35)")
    # The adapters, their Adam slots and the input are the same bytes in both steps, so the
    # ratio has a floor above the int8 base's own 1/4 that grows with the rank.
    print(f"{'LoRA rank':>10s} {'float32 LoRA':>13s} {'QLoRA int8':>11s} {'ratio':>6s}")
    for rank in (1, 2, 4, 8, 16):
        f, q = ps_step(blocks, False, rank)[1], ps_step(blocks, True, rank)[1]
        print(f"{rank:>10d} {f:>13d} {q:>11d} {q / f:>6.3f}")
    ratio = statistics.median(times["QLoRA int8 (ps.function)"]) / statistics.median(
        times["hand-written JAX int8 [reference]"]
    )
    print(f"QLoRA step / hand-written JAX step: {ratio:.3f} (target <= 1.10)")


# ------------------------------------------------------------------- quantize while loading


def _load_child(path: str, d: int, layers: int, how: str) -> dict[str, float]:
    from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415 - child-only
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415
    from safetensors.numpy import load_file  # noqa: PLC0415

    from paramstore.nn._quant_ops import quantize_host  # noqa: PLC0415

    mesh = Mesh(np.array(jax.devices()), ("data",))
    kernel = NamedSharding(mesh, P(None, "data"))
    scale = NamedSharding(mesh, P("data"))
    if how == "init_from_checkpoint":  # the abstract int8 model: made before the timing
        with ps.abstract(), ps.device(mesh), ps.sharding.axis_rules(mesh, [("mlp", "data")]):
            model = ps.nn.Sequential(
                [
                    ps.nn.Dense(d, use_bias=False, kernel_partition=(None, "mlp"), name=f"l{i}")
                    for i in range(layers)
                ]  # fmt: skip
            )
            model.build((None, d))
        ps.nn.quantize(model, "int8")
    jax.block_until_ready(jax.device_put(np.zeros(8, np.int8), kernel.mesh.devices.flat[0]))
    before = rss_mib()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        if how == "init_from_checkpoint":
            ps.checkpoint.init_from_checkpoint(path, {"/": "/"}, allow_unverified=True)
            held = [v.value() for v in model.variables]
        else:
            tensors = load_file(path)
            held = []
            for name in sorted(tensors):
                q, s = quantize_host(tensors.pop(name), -2, "int8")
                held += [jax.device_put(q, kernel), jax.device_put(s, scale)]
            del tensors
        jax.block_until_ready(held)
        seconds = time.perf_counter() - t0
    model_mib = sum(x.nbytes for x in held) / 2**20
    return {"seconds": seconds, "growth_mib": peak.peak - before - model_mib, "model": model_mib}


def bench_load(mib: int) -> None:
    layers = 8
    d = int(math.sqrt(mib * 2**20 / 4 / layers)) // 8 * 8
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "model.safetensors")
    from safetensors.numpy import save_file  # noqa: PLC0415

    rng = np.random.default_rng(0)
    save_file(
        {f"l{i}/kernel": rng.standard_normal((d, d), np.float32) for i in range(layers)}, path
    )
    largest = d * d * 4 / 2**20
    rows = {}
    for how in ("load_file + quantize by hand [anchor]", "init_from_checkpoint"):
        out = subprocess.run(
            [sys.executable, __file__, "--child-load", path, str(d), str(layers), how],
            capture_output=True,
            text=True,
            check=True,
        )
        rows[how] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n## load: {layers} float32 kernels ({d}, {d}), {mib} MiB, into int8, FSDP over 8")
    print(f"{'variant':40s} {'seconds':>8s} {'RSS growth / largest tensor':>28s}")
    for how, r in rows.items():
        print(f"{how:40s} {r['seconds']:8.2f} {r['growth_mib'] / largest:28.2f}")
    ratio = rows["init_from_checkpoint"]["seconds"] / rows["load_file + quantize by hand [anchor]"]["seconds"]  # fmt: skip
    print(f"init_from_checkpoint / anchor: {ratio:.2f} (target <= 1.2)")
    growth = rows["init_from_checkpoint"]["growth_mib"] / largest
    print(f"peak RSS growth above the int8 model: {growth:.2f}x the largest tensor (target <= 1.2)")


# ------------------------------------------------------------------------------ ps.plan


def _plan_child(layers: int) -> dict[str, float]:
    from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    mesh = Mesh(np.array(jax.devices()), ("data",))
    cold = rss_mib()
    jax.jit(lambda a: a + 1).lower(jnp.zeros(1)).compile()  # XLA's compiler, started once
    before = rss_mib()
    peak = PeakRSS().__enter__()
    t0 = time.perf_counter()
    with ps.abstract(), ps.device(mesh), ps.sharding.axis_rules(mesh, [("mlp", "data")]):
        model = ps.nn.Sequential(
            [ps.nn.Dense(8192, kernel_partition=(None, "mlp")) for _ in range(layers)]
        )
        model.build((None, 8192))
        opt = ps.Optimizer(optax.adam(1e-4), model.trainable_variables)

    @ps.function
    def step(x: jax.Array) -> jax.Array:
        loss, g = ps.value_and_grad(lambda: jnp.mean(model(x) ** 2), model)()
        opt.apply_gradients(g)
        return loss

    x = jax.ShapeDtypeStruct((8, 8192), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    plan = ps.plan(step, x)
    seconds = time.perf_counter() - t0
    peak.__exit__()
    params = sum(v.size for v in model.variables)
    print(plan, file=sys.stderr)
    growth = peak.peak - before
    return {
        "seconds": seconds,
        "growth_mib": growth,
        "cold_mib": peak.peak - cold,
        "params": params,
    }


def bench_plan(layers: int) -> None:
    out = subprocess.run(
        [sys.executable, __file__, "--child-plan", str(layers)],
        capture_output=True,
        text=True,
        check=True,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n## plan: {r['params'] / 1e9:.2f} B parameters, Adam, FSDP over 8 devices")
    table = out.stderr[out.stderr.find("memory ") :].strip()
    print(table)
    print(f"ps.plan: {r['seconds']:.2f} s (target < 10 s), RSS growth {r['growth_mib']:.0f} MiB (target < 100 MiB; "  # fmt: skip
          f"{r['cold_mib']:.0f} MiB with XLA's compiler start in a cold process)")  # fmt: skip


def main() -> None:
    global RANK
    if len(sys.argv) > 1 and sys.argv[1] == "--child-load":
        path, d, layers, how = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        print(json.dumps(_load_child(path, d, layers, how)))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--child-plan":
        print(json.dumps(_plan_child(int(sys.argv[2]))))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rows", nargs="*", default=["step", "load", "plan"])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank of the step row")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--load-mib", type=int, default=256)
    p.add_argument("--plan-layers", type=int, default=16)
    a = p.parse_args()
    if a.quick:
        a.blocks, a.steps, a.load_mib, a.plan_layers = 2, 2, 8, 1
    RANK = a.rank
    print(
        f"# quantized.py, {datetime.date.today()}, {platform.machine()}, jax {jax.__version__}, "
        f"{len(jax.devices())} {jax.devices()[0].platform} devices"
    )
    if "step" in a.rows:
        bench_step(a.blocks, a.steps)
    if "load" in a.rows:
        bench_load(a.load_mib)
    if "plan" in a.rows:
        bench_plan(a.plan_layers)


if __name__ == "__main__":
    main()
