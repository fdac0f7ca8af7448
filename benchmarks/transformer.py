"""The transformer LM training step: ``ps.function`` + ``ps.nn`` against hand-written JAX.

Run: ``python benchmarks/transformer.py`` (``--quick`` for a short run, ``--config gpu``
for a compute-bound model on an accelerator, ``--unrolled`` for the example's blocks in a
Python list instead of its default ``ps.nn.Repeat``).

Rows, all measured in one run, variants taking turns within each repeat (medians of
``--repeats`` repeats of ``--steps`` steps, blocking on the last loss of each repeat):

* ``jax.jit`` (reference): the same model (examples/transformer.py) written by hand in pure
  JAX over a params pytree, the same optax chain, ``donate_argnums`` on params and state,
  dropout keys passed in; same initial weights and data. Its blocks are stacked and applied
  by one ``lax.scan`` where the example stacks them in a ``ps.nn.Repeat``, a Python loop
  over per-block weights with ``--unrolled``.
* ``ps.function``: ``examples/transformer.py``'s own step (ps.nn model, ``ps.Optimizer``).
* fused rows: K steps in one call, by ``jax.lax.scan`` (hand-written, and the example's
  ``ps.function`` whose scan body calls ``opt.apply_gradients``); tokens/s.
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import paramstore as ps

_ROOT = str(Path(__file__).resolve().parent.parent)  # examples/ is a package of the checkout
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
ex = importlib.import_module("examples.transformer")

CONFIGS = {
    "cpu": dict(batch_size=16, seq_len=64, d_model=64, heads=4, layers=2),
    "tiny": dict(batch_size=8, seq_len=32, d_model=32, heads=2, layers=1),
    "gpu": dict(batch_size=64, seq_len=256, d_model=384, heads=6, layers=6),
}


# ------------------------------------------------------------------ pure JAX model


def params_of(model: Any) -> dict[str, Any]:
    """The ps model's weights as a plain pytree (copies: the reference donates them). The
    blocks, when the model stacks them in a ``ps.nn.Repeat`` (the example's default), are one
    dict of stacked arrays (a leading axis of ``layers``, the Repeat's own names, e.g.
    ``"mlp_in/kernel"``), which the reference applies with one ``lax.scan`` as the Repeat
    does; with ``unrolled=True`` a list of per-block dicts under the same names, applied by a
    Python loop."""

    def c(v: ps.Variable) -> jax.Array:
        return jnp.array(v.value(), copy=True)

    def ln(n: Any) -> dict[str, jax.Array]:
        return {"gamma": c(n.gamma), "beta": c(n.beta)}

    def block(b: Any) -> dict[str, jax.Array]:
        out = {f"attn/weights/{'/'.join(v.name.split('/')[-2:])}": c(v) for v in b.attn.weights}
        for layer in ("ln1", "ln2"):
            out |= {f"{layer}/{k}": v for k, v in ln(getattr(b, layer)).items()}
        for layer in ("mlp_in", "mlp_out"):
            out |= {f"{layer}/{k}": c(getattr(getattr(b, layer), k)) for k in ("kernel", "bias")}
        return out

    blocks = model.blocks
    return {
        "tokens": c(model.tokens.embeddings),
        "positions": c(model.positions.embeddings),
        "blocks": (
            {name: c(v) for name, v in blocks.stacked.items()}
            if isinstance(blocks, ps.nn.Repeat)
            else [block(b) for b in blocks]
        ),
        "ln": ln(model.ln),
        "head": {"kernel": c(model.head.kernel), "bias": c(model.head.bias)},
    }


def _ln(gamma: jax.Array, beta: jax.Array, x: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-3) * gamma + beta


def _drop(key: jax.Array, x: jax.Array, rate: float) -> jax.Array:
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def _attn(w: dict[str, jax.Array], x: jax.Array, key_dim: int) -> jax.Array:
    def proj(name: str) -> jax.Array:
        return jnp.einsum("bsd,dhk->bshk", x, w[f"{name}/kernel"]) + w[f"{name}/bias"]

    q, k, v = proj("query") / math.sqrt(key_dim), proj("key"), proj("value")
    logits = jnp.einsum("bshk,bthk->bhts", k, q)
    t = x.shape[1]
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
    out = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(logits, -1), v)
    return (
        jnp.einsum("bthk,hkd->btd", out, w["attention_output/kernel"]) + w["attention_output/bias"]
    )


def _block(b: dict[str, jax.Array], x: jax.Array, keys: jax.Array, cfg: Any) -> jax.Array:
    """One pre-norm block; ``keys``: its two dropout keys."""
    attn = {k.removeprefix("attn/weights/"): v for k, v in b.items() if k.startswith("attn/")}
    h = _ln(b["ln1/gamma"], b["ln1/beta"], x)
    x = x + _drop(keys[0], _attn(attn, h, cfg.d_model // cfg.heads), cfg.dropout)
    h = jax.nn.gelu(_ln(b["ln2/gamma"], b["ln2/beta"], x) @ b["mlp_in/kernel"] + b["mlp_in/bias"])
    h = h @ b["mlp_out/kernel"] + b["mlp_out/bias"]
    return x + _drop(keys[1], h, cfg.dropout)


def forward(params: Any, ids: jax.Array, key: jax.Array, cfg: Any) -> jax.Array:
    first, rest = jax.random.split(key)
    block_keys = jax.random.split(rest, (cfg.layers, 2))
    x = params["tokens"][ids] + params["positions"][jnp.arange(ids.shape[-1])]
    x = _drop(first, x, cfg.dropout)
    blocks = params["blocks"]
    if isinstance(blocks, list):  # unrolled: each block traced and compiled on its own
        for b, keys in zip(blocks, block_keys):
            x = _block(b, x, keys, cfg)
    else:  # stacked: one lax.scan over the blocks' leading axis, as ps.nn.Repeat
        x, _ = jax.lax.scan(
            lambda x, bk: (_block(bk[0], x, bk[1], cfg), None), x, (blocks, block_keys)
        )
    x = _ln(params["ln"]["gamma"], params["ln"]["beta"], x)
    return x @ params["head"]["kernel"] + params["head"]["bias"]


def reference_tx(cfg: Any, params: Any) -> optax.GradientTransformation:
    mask = jax.tree_util.tree_map_with_path(
        lambda path, _: str(path[-1]).strip("[]'\"").endswith("kernel"), params
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(cfg.learning_rate, weight_decay=cfg.weight_decay, mask=mask),
    )


# ---------------------------------------------------------------------- variants


def variants(cfg: Any, k: int, data: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    """name -> (run(n) -> last loss, steps per call)."""
    xs, ys = (jnp.asarray(a) for a in data)  # (k, B, T)
    out: dict[str, Any] = {}
    with ps.VariableStore():
        model, opt = ex.build(cfg)
        params = params_of(model)
        tx = reference_tx(cfg, params)
        state = [params, tx.init(params), jax.random.key(0)]

        def loss(p: Any, x: jax.Array, y: jax.Array, key: jax.Array) -> jax.Array:
            return ex.loss_fn(forward(p, x, key, cfg), y)

        def jstep(p: Any, s: Any, key: jax.Array, x: jax.Array, y: jax.Array) -> Any:
            key, sub = jax.random.split(key)
            value, grads = jax.value_and_grad(loss)(p, x, y, sub)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, key, value

        jit_step = jax.jit(jstep, donate_argnums=(0, 1))

        def jfused(p: Any, s: Any, key: jax.Array, xs: jax.Array, ys: jax.Array) -> Any:
            def body(carry: Any, batch: Any) -> Any:
                p, s, key, value = jstep(*carry, *batch)
                return (p, s, key), value

            (p, s, key), losses = jax.lax.scan(body, (p, s, key), (xs, ys))
            return p, s, key, losses[-1]

        jit_fused = jax.jit(jfused, donate_argnums=(0, 1))

        def run_jit(n: int) -> Any:
            value = None
            for i in range(n):
                state[0], state[1], state[2], value = jit_step(*state, xs[i % k], ys[i % k])
            return value

        def run_jit_fused(n: int) -> Any:
            value = None
            for _ in range(n):
                state[0], state[1], state[2], value = jit_fused(*state, xs, ys)
            return value

        step, fused = ex.train_steps(model, opt)

        def run_ps(n: int) -> Any:
            value = None
            for i in range(n):
                value = step(xs[i % k], ys[i % k])
            return value

        def run_ps_fused(n: int) -> Any:
            value = None
            for _ in range(n):
                value = fused(xs, ys)[-1]
            return value

        out["jax.jit, donated (reference)"] = (run_jit, 1)
        out["ps.function + ps.nn"] = (run_ps, 1)
        out[f"jax.jit, {k} steps fused (lax.scan)"] = (run_jit_fused, k)
        out[f"ps.function, {k} steps fused (lax.scan)"] = (run_ps_fused, k)
        # keep the model alive with the closures
        out["_keep"] = (model, opt)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="cpu")
    parser.add_argument("--steps", type=int, default=40, help="steps per repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--fuse", type=int, default=20, help="K, steps per fused call")
    parser.add_argument("--quick", action="store_true", help="--steps 10 --repeats 3 --fuse 5")
    parser.add_argument(
        "--unrolled", action="store_true", help="blocks in a Python list, not ps.nn.Repeat"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.fuse = 10, 3, 5
    k = args.fuse
    steps = max(k, args.steps // k * k)
    cfg = ex.Config(**CONFIGS[args.config], dropout=0.1, unrolled=args.unrolled)
    ps.random.set_seed(0)
    tokens = ex.load_corpus(0.5)
    data = ex.batches(tokens, cfg.batch_size, cfg.seq_len, np.random.default_rng(0), k)
    found = variants(cfg, k, data)
    found.pop("_keep")
    times: dict[str, list[float]] = {name: [] for name in found}
    for run, _ in found.values():  # warm up: compile
        jax.block_until_ready(run(1))
    for _ in range(args.repeats):
        for name, (run, per_call) in found.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run(steps // per_call))
            times[name].append((time.perf_counter() - t0) / steps)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    ref = statistics.median(times["jax.jit, donated (reference)"])
    print(
        f"transformer LM ({args.config}: batch {cfg.batch_size}, seq {cfg.seq_len}, "
        f"d_model {cfg.d_model}, {cfg.heads} heads, {cfg.layers} layers "
        f"{'in a Python list' if cfg.unrolled else 'in a ps.nn.Repeat (lax.scan)'}); "
        f"median of {args.repeats} x {steps} steps; jax {jax.__version__} on "
        f"{jax.devices()[0].device_kind}"
    )
    print(f"| {'variant':<40} | ms/step | ratio | tokens/s |")
    print(f"|{'-' * 42}|--------:|------:|---------:|")
    for name in found:
        t = statistics.median(times[name])
        print(f"| {name:<40} | {t * 1e3:7.2f} | {t / ref:5.2f} | {tokens_per_step / t:8,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
