"""Mixed precision and loss scaling against hand-written JAX (issue 24).

Run: ``python benchmarks/recipes_precision.py`` (``--quick`` for a smoke run).

The model is ``benchmarks/depth.py``'s: ``n`` (default 8) pre-LN transformer blocks of
``ps.nn`` layers (d_model 64, 4 heads, MLP 256, batch 8 x 32 tokens) in a ``ps.nn.Repeat``,
loss ``mean(y**2)``, one Adam step per call in a ``ps.function``. Rows, one process, the
variants taking turns step by step:

* ``ps float32``: the model under the default policy (the anchor of the memory target).
* ``ps mixed_bfloat16``: the same model built under
  ``ps.mixed_precision.set_global_policy("mixed_bfloat16")``: float32 variables and Adam
  slots, bfloat16 compute (LayerNormalization statistics and the attention softmax in
  float32, as Keras 3).
* ``jax bf16 [reference]``: the same step written by hand in pure JAX: float32 parameters
  stacked and scanned, each cast to bfloat16 where the layers cast it, the same float32
  islands, optax Adam, ``jax.jit`` with donated state.
* ``ps LossScaleOptimizer``: the mixed_bfloat16 model, its Adam wrapped in
  ``ps.LossScaleOptimizer`` (scale the loss, unscale, skip on non-finite gradients,
  update the scale).
* ``jax+optax loss scaling [reference]``: the hand-written bf16 step with the same loss
  scaling written with optax and ``jnp.where``.

Columns: first call (build + trace + compile + one step, s), median and minimum step time
(ms), the compiled step's temporary memory (``compiled.memory_analysis()``, MiB) and
flops (``cost_analysis()``). Then
the targets: ps mixed / hand bf16 step (<= 1.05x), ps mixed / ps float32 temporary memory
(<= 0.6x), ps LossScaleOptimizer / hand loss scaling step (<= 1.05x).
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from depth import BATCH, EPS, HEADS, LR, TOKENS, Block, D, init_layer, step_times

import paramstore as ps

BF16 = jnp.bfloat16
Built = tuple[Callable[[], jax.Array], Callable[[], Any]]  # (step, compiled step)
SIZE = {"batch": BATCH}  # --memory-batch changes it for the memory-only rows


def data() -> jax.Array:
    shape = (SIZE["batch"], TOKENS, D)
    return jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)


# ------------------------------------------------------------------ paramstore


def _ps_variant(n: int, policy: str, loss_scale: bool = False) -> Built:
    x = data()
    ps.mixed_precision.set_global_policy(policy)
    try:
        with ps.VariableStore():
            model = ps.nn.Repeat(Block, n)
    finally:
        ps.mixed_precision.set_global_policy("float32")
    holder: dict[str, Any] = {}

    def loss_fn() -> jax.Array:
        loss = jnp.mean(model(x).astype(jnp.float32) ** 2)
        return holder["opt"].scale_loss(loss) if loss_scale else loss

    def update() -> jax.Array:
        loss, grads = ps.value_and_grad(loss_fn, model)()
        holder["opt"].apply_gradients(grads)
        return loss

    @ps.function
    def step() -> jax.Array:
        if "opt" not in holder:  # first trace: build the model, then the optimizer
            model(x)
            opt = ps.Optimizer(optax.adam(LR), model)
            holder["opt"] = ps.LossScaleOptimizer(opt) if loss_scale else opt
        return update()

    def compiled() -> Any:
        """The same step compiled as a pure function of the state."""
        variables = [*model.variables, *holder["opt"].variables]
        return jax.jit(ps.pure(update, variables)).lower(ps.state(variables)).compile()

    return step, compiled


# ------------------------------------------------------------------ hand-written JAX


def _ln(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
    """Keras 3's LayerNormalization: no input cast, float32 statistics, compute-dtype out."""
    xw = x.astype(jnp.float32)
    m = jnp.mean(xw, -1, keepdims=True)
    v = jnp.mean(jnp.square(xw - m), -1, keepdims=True)
    return ((xw - m) * jax.lax.rsqrt(v + EPS) * g + b).astype(BF16)


def block_bf16(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    c = {k: v.astype(BF16) for k, v in p.items() if not k.startswith("ln")}
    h = _ln(x, p["ln1_g"], p["ln1_b"])
    q = jnp.einsum("bsd,dhk->bshk", h, c["q_k"]) + c["q_b"]
    k = jnp.einsum("bsd,dhk->bshk", h, c["k_k"]) + c["k_b"]
    v = jnp.einsum("bsd,dhk->bshk", h, c["v_k"]) + c["v_b"]
    logits = jnp.einsum("bthk,bshk->bhts", q, k, preferred_element_type=jnp.float32)
    logits = logits * (1.0 / math.sqrt(D // HEADS))
    probs = jax.nn.softmax(logits, axis=-1).astype(BF16)
    att = jnp.einsum("bhts,bshk->bthk", probs, v)
    x = x + jnp.einsum("bthk,hkd->btd", att, c["o_k"]) + c["o_b"]
    h = _ln(x, p["ln2_g"], p["ln2_b"])
    h = jax.nn.gelu(h @ c["fc1_k"] + c["fc1_b"], approximate=False)
    return x + h @ c["fc2_k"] + c["fc2_b"]


def _jax_variant(n: int, loss_scale: bool = False, growth: int = 2000) -> Built:
    x = data().astype(BF16)
    params = jax.jit(jax.vmap(init_layer))(jax.random.split(jax.random.key(0), n))
    tx = optax.adam(LR)
    state: list[Any] = [params, tx.init(params), jnp.float32(2.0**15), jnp.int32(0), jnp.int32(0)]

    def loss_fn(p: Any, scale: Any) -> jax.Array:
        y, _ = jax.lax.scan(lambda h, lp: (block_bf16(lp, h), None), x, p)
        loss = jnp.mean(y.astype(jnp.float32) ** 2)
        return loss * scale if loss_scale else loss

    def _step(p: Any, s: Any, scale: Any, counter: Any, it: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(p, scale)
        if not loss_scale:
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, scale, counter, it + 1, loss
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        grads = jax.tree.map(lambda g: g / scale, grads)
        updates, new_s = tx.update(grads, s, p)
        new_p = optax.apply_updates(p, updates)
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        p, s = jax.tree.map(keep, new_p, p), jax.tree.map(keep, new_s, s)
        grow = finite & (counter == growth - 1)
        scale = scale * jnp.where(finite, jnp.where(grow, 2.0, 1.0), 0.5)
        counter = jnp.where(finite & ~grow, counter + 1, 0)
        return p, s, scale, counter, it + finite.astype(jnp.int32), loss

    step_jit = jax.jit(_step, donate_argnums=(0, 1))

    def step() -> jax.Array:
        *new, loss = step_jit(*state)
        state[:] = new
        return loss

    def compiled() -> Any:
        return jax.jit(_step).lower(*state).compile()

    return step, compiled


VARIANTS: dict[str, Callable[[int], Built]] = {
    "ps float32": lambda n: _ps_variant(n, "float32"),
    "ps mixed_bfloat16": lambda n: _ps_variant(n, "mixed_bfloat16"),
    "jax bf16 [reference]": _jax_variant,
    "ps LossScaleOptimizer": lambda n: _ps_variant(n, "mixed_bfloat16", loss_scale=True),
    "jax+optax loss scaling [reference]": lambda n: _jax_variant(n, loss_scale=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--memory-batch", type=int, default=128, help="batch of the memory-only rows (0: none)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 block, 3 steps; memory rows at the table's batch"
    )
    args = parser.parse_args()
    n, count = (1, 3) if args.quick else (args.blocks, args.steps)
    print(
        f"# recipes_precision.py {datetime.date.today()} {platform.machine()} "
        f"{jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}, "
        f"{n} blocks, batch {BATCH}, {count} steps (median)"
    )
    steps: dict[str, Callable[[], jax.Array]] = {}
    rows: dict[str, dict[str, float]] = {}
    for name, make in VARIANTS.items():
        t0 = time.perf_counter()
        step, compile_step = make(n)
        jax.block_until_ready(step())
        first = time.perf_counter() - t0
        program = compile_step()
        rows[name] = {
            "first": first,
            "temp": program.memory_analysis().temp_size_in_bytes / 2**20,
            "flops": float(program.cost_analysis()["flops"]),
        }
        steps[name] = step
    times = step_times(steps, count)
    print("| variant | first call s | step ms (median) | step ms (min) | temp MiB | flops |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        r["step"], r["min"] = statistics.median(times[name]), min(times[name])
        print(
            f"| {name} | {r['first']:.2f} | {r['step']:.2f} | {r['min']:.2f} | "
            f"{r['temp']:.2f} | {r['flops']:.4g} |"
        )
    print()

    def ratio(a: str, b: str, what: str) -> str:
        return f"{rows[a][what] / rows[b][what]:.3f}x"

    print(
        "step, ps mixed_bfloat16 / jax bf16: median "
        f"{ratio('ps mixed_bfloat16', 'jax bf16 [reference]', 'step')}, min "
        f"{ratio('ps mixed_bfloat16', 'jax bf16 [reference]', 'min')}, flops "
        f"{ratio('ps mixed_bfloat16', 'jax bf16 [reference]', 'flops')} (target <= 1.05x)"
    )
    print(
        "temp memory, ps mixed_bfloat16 / ps float32: "
        f"{ratio('ps mixed_bfloat16', 'ps float32', 'temp')} (target <= 0.6x)"
    )
    ls, ref = "ps LossScaleOptimizer", "jax+optax loss scaling [reference]"
    print(
        f"step, ps LossScaleOptimizer / jax+optax loss scaling: median "
        f"{ratio(ls, ref, 'step')}, min {ratio(ls, ref, 'min')}, flops "
        f"{ratio(ls, ref, 'flops')} (target <= 1.05x)"
    )
    mem_batch = BATCH if args.quick else args.memory_batch
    if mem_batch:
        # At depth.py's batch the step's temporaries are mostly the optimizer update's
        # (parameter-sized, float32 either way); activations dominate at a larger batch.
        # (--quick: at the table's batch, its figures; the smoke test's time goes to compiles)
        SIZE["batch"] = mem_batch
        temps = {}
        for name in ("ps float32", "ps mixed_bfloat16", "jax bf16 [reference]"):
            if mem_batch == BATCH:
                temps[name] = rows[name]["temp"]
                continue
            step, compile_step = VARIANTS[name](n)
            jax.block_until_ready(step())  # a ps step builds its model and optimizer
            temps[name] = compile_step().memory_analysis().temp_size_in_bytes / 2**20
        print()
        print(f"compiled temporary memory at batch {mem_batch} (MiB, compile only):")
        for name, mib in temps.items():
            print(f"  {name}: {mib:.2f}")
        print(
            f"temp memory at batch {mem_batch}, ps mixed_bfloat16 / ps float32: "
            f"{temps['ps mixed_bfloat16'] / temps['ps float32']:.3f}x (target <= 0.6x)"
        )


if __name__ == "__main__":
    main()
