"""Deep models: compile time and step time against depth, scanned vs unrolled (issue 18).

Run: ``python benchmarks/depth.py`` (``--quick`` for a smoke run: a tiny model, d_model 16,
2 heads, MLP 32, batch 2 x 8 tokens, at depth 2 only, 2 steps, no warm-up, no flops for the
remat row: every row and ratio line but the first-call ones, with the fewest compiles).

The model is ``n`` pre-LN transformer blocks of ``ps.nn`` layers (d_model 64, 4 heads, MLP
256, batch 8 x 32 tokens; LayerNormalization, MultiHeadAttention, Dense) on a random input,
loss ``mean(y**2)``, one Adam step per call. Rows, one process, each variant measured on its
own fresh model at each depth after a warm-up model of depth 2 (so no variant profits from
eager ops compiled by another):

* ``ps.nn.Repeat``: ``ps.nn.Repeat(Block, n)`` inside a ``ps.function`` step.
* ``ps.nn.Repeat(remat=True)``: the same, each block rematerialized.
* ``unrolled``: ``[Block() for _ in range(n)]`` applied by a Python loop.
* ``jax scan [reference]``: hand-written pure JAX, params stacked along a leading axis and
  applied by ``lax.scan``, ``jax.jit`` with donated params and optimizer state.
* ``nnx vmap+scan``: Flax NNX, blocks created by ``nnx.vmap`` (``nnx.split_rngs``) and
  applied by ``nnx.scan``, ``nnx.jit`` step with ``nnx.Optimizer``.

Columns: first call (model build + trace + compile + one step, seconds), the median and
the minimum step time over ``--steps`` steps (ms; the variants of one depth take turns, step
by step, so a shared machine's load hits them alike), for the Repeat rows the compiled
step's temporary memory (``compiled.memory_analysis().temp_size_in_bytes`` of the same step
as a pure function of the state), and the compiled step's flops (``cost_analysis()``) for
the Repeat and reference rows. Then the targets: first call at the deepest / at 2 layers,
Repeat step / reference step at every depth, remat temp memory / plain temp memory.
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

import paramstore as ps

D, HEADS, MLP, BATCH, TOKENS = 64, 4, 256, 8, 32
LR = 1e-3
EPS = 1e-3  # Keras' LayerNormalization epsilon, as ps.nn's


class Block(ps.Module):
    """Pre-LN transformer block: self-attention and an MLP, each residual."""

    def __init__(self, name: str | None = None) -> None:
        self.ln1 = ps.nn.LayerNormalization()
        self.attn = ps.nn.MultiHeadAttention(HEADS, D // HEADS)
        self.ln2 = ps.nn.LayerNormalization()
        self.fc1 = ps.nn.Dense(MLP, activation="gelu")
        self.fc2 = ps.nn.Dense(D)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.ln1(x)
        x = x + self.attn(h, h)
        return x + self.fc2(self.fc1(self.ln2(x)))


def data() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).standard_normal((BATCH, TOKENS, D)), jnp.float32)


# A variant: build(n) -> (step, extra) where step() runs one step and returns the loss.
Built = tuple[Callable[[], jax.Array], dict[str, Any]]


def _ps_variant(n: int, *, scanned: bool, remat: bool = False) -> Built:
    x = data()
    with ps.VariableStore():
        if scanned:
            model: Any = ps.nn.Repeat(Block, n, remat=remat)
            apply = model
        else:
            model = [Block() for _ in range(n)]

            def apply(h: jax.Array) -> jax.Array:
                for block in model:
                    h = block(h)
                return h

        holder: dict[str, Any] = {}

        def loss_fn() -> jax.Array:
            return jnp.mean(apply(x) ** 2)

        def update() -> jax.Array:
            params = holder["params"]
            loss, grads = ps.value_and_grad(loss_fn, params)()
            holder["opt"].apply_gradients(zip(grads, params))
            return loss

        @ps.function
        def step() -> jax.Array:
            if "opt" not in holder:  # first trace: the model builds itself, then the slots
                apply(x)
                blocks = [model] if scanned else model
                holder["params"] = [v for b in blocks for v in b.trainable_variables]
                holder["opt"] = ps.Optimizer(optax.adam(LR), holder["params"])
            return update()

    extra: dict[str, Any] = {}

    def temp_memory() -> int:
        """Temporary memory of the same step compiled as a pure function of the state."""
        variables = [*model.variables, *holder["opt"].variables]
        pure_step = ps.pure(update, variables)
        compiled = jax.jit(pure_step, donate_argnums=0).lower(ps.state(variables)).compile()
        return int(compiled.memory_analysis().temp_size_in_bytes)

    def flops() -> float:
        variables = [*model.variables, *holder["opt"].variables]
        compiled = jax.jit(ps.pure(update, variables)).lower(ps.state(variables)).compile()
        return float(compiled.cost_analysis()["flops"])

    if scanned:
        extra["temp_memory"] = temp_memory
        extra["flops"] = flops
    return step, extra


# ------------------------------------------------------------- hand-written JAX


def _glorot(key: jax.Array, shape: tuple[int, ...], fan_in: int, fan_out: int) -> jax.Array:
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return jax.random.uniform(key, shape, jnp.float32, -limit, limit)


def init_layer(key: jax.Array) -> dict[str, jax.Array]:
    k = jax.random.split(key, 6)
    hd = D // HEADS
    z = jnp.zeros
    return {
        "ln1_g": jnp.ones(D),
        "ln1_b": z(D),
        "q_k": _glorot(k[0], (D, HEADS, hd), D, HEADS * hd),
        "q_b": z((HEADS, hd)),
        "k_k": _glorot(k[1], (D, HEADS, hd), D, HEADS * hd),
        "k_b": z((HEADS, hd)),
        "v_k": _glorot(k[2], (D, HEADS, hd), D, HEADS * hd),
        "v_b": z((HEADS, hd)),
        "o_k": _glorot(k[3], (HEADS, hd, D), HEADS * hd, D),
        "o_b": z(D),
        "ln2_g": jnp.ones(D),
        "ln2_b": z(D),
        "fc1_k": _glorot(k[4], (D, MLP), D, MLP),
        "fc1_b": z(MLP),
        "fc2_k": _glorot(k[5], (MLP, D), MLP, D),
        "fc2_b": z(D),
    }


def _ln(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean(jnp.square(x - m), -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + EPS) * g + b


def block_fn(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    h = _ln(x, p["ln1_g"], p["ln1_b"])
    q = (jnp.einsum("bsd,dhk->bshk", h, p["q_k"]) + p["q_b"]) * (1.0 / math.sqrt(D // HEADS))
    k = jnp.einsum("bsd,dhk->bshk", h, p["k_k"]) + p["k_b"]
    v = jnp.einsum("bsd,dhk->bshk", h, p["v_k"]) + p["v_b"]
    scores = jax.nn.softmax(jnp.einsum("bshk,bthk->bhts", k, q), axis=-1)
    att = jnp.einsum("bhts,bshk->bthk", scores, v)
    x = x + jnp.einsum("bthk,hkd->btd", att, p["o_k"]) + p["o_b"]
    h = _ln(x, p["ln2_g"], p["ln2_b"])
    h = jax.nn.gelu(h @ p["fc1_k"] + p["fc1_b"])
    return x + h @ p["fc2_k"] + p["fc2_b"]


def _jax_variant(n: int) -> Built:
    x = data()
    params = jax.jit(jax.vmap(init_layer))(jax.random.split(jax.random.key(0), n))
    tx = optax.adam(LR)
    opt_state = tx.init(params)

    def loss_fn(p: Any) -> jax.Array:
        y, _ = jax.lax.scan(lambda h, lp: (block_fn(lp, h), None), x, p)
        return jnp.mean(y**2)

    @jax.jit
    def _step(p: Any, s: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    step_jit = jax.jit(_step, donate_argnums=(0, 1))
    state = [params, opt_state]

    def step() -> jax.Array:
        state[0], state[1], loss = step_jit(state[0], state[1])
        return loss

    def flops() -> float:
        compiled = _step.lower(state[0], state[1]).compile()
        return float(compiled.cost_analysis()["flops"])

    return step, {"flops": flops}


# ----------------------------------------------------------------- Flax NNX


def _nnx_variant(n: int) -> Built:
    from flax import nnx

    class NBlock(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.ln1 = nnx.LayerNorm(D, epsilon=EPS, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(
                num_heads=HEADS, in_features=D, qkv_features=D, decode=False, rngs=rngs
            )
            self.ln2 = nnx.LayerNorm(D, epsilon=EPS, rngs=rngs)
            self.fc1 = nnx.Linear(D, MLP, rngs=rngs)
            self.fc2 = nnx.Linear(MLP, D, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            h = self.ln1(x)
            x = x + self.attn(h)
            return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(rngs: nnx.Rngs) -> NBlock:
                return NBlock(rngs)

            self.blocks = create(rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def forward(h: jax.Array, block: NBlock) -> jax.Array:
                return block(h)

            return forward(x, self.blocks)

    x = data()
    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)

    @nnx.jit
    def _step(model: Model, opt: Any) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, grads)
        return loss

    return (lambda: _step(model, opt)), {}


VARIANTS: dict[str, Callable[[int], Built]] = {
    "ps.nn.Repeat": lambda n: _ps_variant(n, scanned=True),
    "ps.nn.Repeat(remat=True)": lambda n: _ps_variant(n, scanned=True, remat=True),
    "unrolled (Python loop)": lambda n: _ps_variant(n, scanned=False),
    "jax scan [reference]": _jax_variant,
    "nnx vmap+scan": _nnx_variant,
}
REFERENCE = "jax scan [reference]"


def first_call(name: str, n: int) -> tuple[Callable[[], jax.Array], dict[str, Any], float]:
    """Build the variant and run its first step: (step, extra, seconds)."""
    t0 = time.perf_counter()
    step, extra = VARIANTS[name](n)
    jax.block_until_ready(step())
    return step, extra, time.perf_counter() - t0


def step_times(steps: dict[str, Callable[[], jax.Array]], count: int) -> dict[str, list[float]]:
    """``count`` timed steps of each variant, the variants taking turns (a shared machine's
    load then hits them alike)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(count):
        for name, step in steps.items():
            t = time.perf_counter()
            jax.block_until_ready(step())
            times[name].append((time.perf_counter() - t) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="2,8,24,48")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--unrolled-max", type=int, default=24, help="skip deeper unrolled")
    parser.add_argument("--remat-min", type=int, default=48, help="remat row from this depth")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--quick", action="store_true", help="a tiny model at depth 2; 2 steps; no warm-up"
    )
    args = parser.parse_args()
    global D, HEADS, MLP, BATCH, TOKENS
    if args.quick:  # the smoke test's size: every row and ratio printed, in seconds
        D, HEADS, MLP, BATCH, TOKENS = 16, 2, 32, 2, 8
    depths = [2] if args.quick else [int(d) for d in args.depths.split(",")]
    steps = 2 if args.quick else args.steps
    names = [v for v in args.variants.split(",") if v]
    print(
        f"# depth.py {datetime.date.today()} {platform.machine()} "
        f"{jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}, "
        f"{steps} steps (median)"
    )
    for name in names:  # warm-up: every variant's eager ops compiled once
        if "remat" not in name and not args.quick:  # (a smoke run skips it: 2 compiles less)
            first_call(name, 2)
    results: dict[tuple[str, int], dict[str, float]] = {}
    print(
        "| variant | layers | first call s | step ms (median) | step ms (min) | temp MiB | flops |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n in depths:
        built: dict[str, Callable[[], jax.Array]] = {}
        for name in names:
            if name.startswith("unrolled") and n > args.unrolled_max:
                print(f"| {name} | {n} | skipped (> --unrolled-max) | | | | |")
                continue
            if "remat" in name and n < min(args.remat_min, depths[-1]):
                continue
            step, extra, first = first_call(name, n)
            built[name] = step
            r = results[(name, n)] = {"first": first}
            if "temp_memory" in extra:
                r["temp"] = extra["temp_memory"]() / 2**20
            if "flops" in extra and not (args.quick and "remat" in name):  # (no ratio uses it)
                r["flops"] = extra["flops"]()
        for name, ts in step_times(built, steps).items():
            r = results[(name, n)]
            r["step"], r["min"] = statistics.median(ts), min(ts)
            temp = f"{r['temp']:.2f}" if "temp" in r else ""
            flops = f"{r['flops']:.3g}" if "flops" in r else ""
            print(
                f"| {name} | {n} | {r['first']:.2f} | {r['step']:.2f} | {r['min']:.2f} | "
                f"{temp} | {flops} |",
                flush=True,
            )
    print()
    lo, hi = depths[0], depths[-1]
    for name in ("ps.nn.Repeat", "nnx vmap+scan", REFERENCE):
        if lo != hi and (name, lo) in results and (name, hi) in results:
            ratio = results[(name, hi)]["first"] / results[(name, lo)]["first"]
            print(f"first call at {hi} / at {lo} layers, {name}: {ratio:.2f}x (target <= 1.5x)")
    for n in depths:
        if ("ps.nn.Repeat", n) in results and (REFERENCE, n) in results:
            a, b = results[("ps.nn.Repeat", n)], results[(REFERENCE, n)]
            print(
                f"step at {n} layers, ps.nn.Repeat / reference: median {a['step'] / b['step']:.3f}x, "
                f"min {a['min'] / b['min']:.3f}x, flops {a['flops'] / b['flops']:.3f}x "
                "(target <= 1.05x)"
            )
    a, b = ("ps.nn.Repeat(remat=True)", hi), ("ps.nn.Repeat", hi)
    if a in results and b in results:
        ratio = results[a]["temp"] / results[b]["temp"]
        print(f"temp memory at {hi} layers, remat=True / plain: {ratio:.3f}x (target <= 0.5x)")


if __name__ == "__main__":
    main()
