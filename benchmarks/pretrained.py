"""Pretrained weights in and out: ``init_from_checkpoint`` and ``export_safetensors`` against
the ``safetensors`` library, and the GPT-2 example against ``transformers``.

Run: ``python benchmarks/pretrained.py`` (``--quick``: a 16 MiB checkpoint and a tiny GPT-2,
for the smoke test). One process with 8 forced CPU devices; medians over ``--runs`` runs
after one untimed warm-up (page cache warm, programs compiled).

* The checkpoint: ``--gib`` GiB of safetensors written by ``safetensors.numpy.save_file``,
  3/4 of the bytes float32 and 1/4 bfloat16, tensors of ``(width, width)`` (the largest
  tensor: ``width**2 * 4`` bytes).
* ``load_file + device_put [reference]``: ``safetensors.numpy.load_file`` (the whole file
  in host memory) then one ``jax.device_put`` onto the FSDP shardings (``P("fsdp", None)``
  over the 8 devices).
* ``init_from_checkpoint``: an abstract model of the same names, shapes and dtypes with
  those shardings (``ps.abstract()`` + a ``LayoutMap``) filled by
  ``ps.checkpoint.init_from_checkpoint(path, {"/": "/"}, allow_unverified=True)``.
  Target: time <= 1.2x the reference.
* Memory: the peak RSS growth during each load beyond the loaded arrays themselves (the
  CPU devices' buffers are host memory; ``clear_refs`` resets the peak), as a multiple of
  the largest tensor. Target for init_from_checkpoint: <= 1.2x (the reference holds the file).
* ``export_safetensors`` of the loaded model against ``safetensors.numpy.save_file`` of the
  host arrays. Target: <= 1.2x.
* GPT-2 (``examples/gpt2.py``; a random one written by ``transformers``, ``--gpt2-layers`` x
  ``--gpt2-width``): load + first logits through the example (build abstract,
  ``init_from_checkpoint``, compile and run the forward pass) against
  ``GPT2LMHeadModel.from_pretrained`` + its first logits, on the same directory.
* Llama (``examples/llama.py``; a random ``LlamaForCausalLM`` written by ``transformers``,
  ``--llama-layers`` x ``--llama-width``, grouped-query attention, rotary embeddings): load +
  first logits through the example against ``LlamaForCausalLM.from_pretrained`` + its first
  logits; and a full fine-tuning step (Adam, float32, masked next-token loss, ``--llama-batch``
  x ``--llama-seq`` tokens) of the example's model in a ``ps.function`` against the same
  model written by hand in JAX (a params pytree, ``lax.scan`` over the layers, ``jax.jit``
  with donation), both started from the same weights (their first losses printed).
  Target: step time <= 1.05x the hand-written one.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from sharded import _peak_rss_reset as _peak_reset  # noqa: E402 - the same memory probes
from sharded import _rss  # noqa: E402

import paramstore as ps  # noqa: E402

MiB = 2**20


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _measure(fn: Callable[[], Any], runs: int, kept: int) -> tuple[float, float]:
    """(median seconds, median peak RSS growth beyond ``kept`` bytes) of ``fn()`` (whose
    result, dropped after each run, holds ``kept`` bytes)."""
    times, extra = [], []
    for i in range(runs + 1):
        _trim()
        base = _peak_reset()
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        peak = _rss("VmHWM") - base
        del out
        if i:  # the first run warms the page cache and compiles
            times.append(dt)
            extra.append(max(0, peak - kept))
    return statistics.median(times), statistics.median(extra)


def make_checkpoint(path: str, gib: float, width: int) -> dict[str, tuple[tuple[int, int], Any]]:
    """``{name: (shape, dtype)}`` of a checkpoint of ``gib`` GiB written by save_file."""
    f32 = width * width * 4
    n32 = max(1, round(gib * 2**30 * 3 / 4 / f32))
    n16 = max(1, round(gib * 2**30 / 4 / (f32 // 2)))
    rng = np.random.default_rng(0)
    specs = {}
    tensors = {}
    for i in range(n32 + n16):
        dtype = np.float32 if i < n32 else ml_dtypes.bfloat16
        name = f"layers.{i}.weight"
        tensors[name] = rng.standard_normal((width, width), np.float32).astype(dtype)
        specs[name] = ((width, width), np.dtype(dtype))
    save_file(tensors, path)
    return specs


def checkpoint_rows(args: argparse.Namespace, work: str) -> list[tuple[str, float, str]]:
    path = os.path.join(work, "model.safetensors")
    specs = make_checkpoint(path, args.gib, args.width)
    total = os.path.getsize(path)
    largest = max(int(np.prod(s)) * d.itemsize for s, d in specs.values())
    print(
        f"checkpoint: {len(specs)} tensors, {total / MiB:.0f} MiB, largest "
        f"{largest / MiB:.0f} MiB, 8 devices, P('fsdp', None)"
    )
    mesh = jax.make_mesh((8,), ("fsdp",))
    sharding = NamedSharding(mesh, P("fsdp", None))
    names = list(specs)

    def reference() -> list[Any]:
        arrays = load_file(path)
        placed = jax.device_put([arrays[n] for n in names], [sharding] * len(names))
        jax.block_until_ready(placed)
        return placed

    layout = ps.sharding.LayoutMap(mesh)
    layout[r".*"] = ("fsdp", None)

    def ours() -> list[Any]:
        with ps.VariableStore():
            with ps.abstract(), ps.device(layout):
                model = [
                    ps.Variable(jax.ShapeDtypeStruct(s, d), name=n) for n, (s, d) in specs.items()
                ]
            ps.checkpoint.init_from_checkpoint(path, {"/": "/"}, allow_unverified=True)
        values = [v.value() for v in model]
        jax.block_until_ready(values)
        return values

    kept = sum(int(np.prod(s)) * d.itemsize for s, d in specs.values())
    t_ref, m_ref = _measure(reference, args.runs, kept)
    t_ps, m_ps = _measure(ours, args.runs, kept)

    host = load_file(path)
    with ps.VariableStore():
        model = {n: ps.Variable(jax.device_put(host[n], sharding), name=n) for n in names}
        out_ref = os.path.join(work, "ref.safetensors")
        out_ps = os.path.join(work, "ps.safetensors")
        t_save, _ = _measure(lambda: save_file(host, out_ref), args.runs, 0)
        t_export, m_export = _measure(
            lambda: ps.checkpoint.export_safetensors(out_ps, model), args.runs, 0
        )
    return [
        ("load_file + device_put [reference]", t_ref, f"{m_ref / largest:.2f}"),
        ("init_from_checkpoint (abstract, FSDP)", t_ps, f"{m_ps / largest:.2f}"),
        ("  ratio to the reference (target <= 1.2)", t_ps / t_ref, ""),
        ("safetensors.numpy.save_file [reference]", t_save, ""),
        ("export_safetensors (sharded variables)", t_export, f"{m_export / largest:.2f}"),
        ("  ratio to the reference (target <= 1.2)", t_export / t_save, ""),
    ]


def _example(name: str = "gpt2") -> Any:
    """``examples.<name>`` (the examples are a package of the checkout)."""
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"examples.{name}")


def gpt2_rows(args: argparse.Namespace, work: str) -> list[tuple[str, float, str]]:
    import torch  # the oracle, only for these rows
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    ex = _example()
    model_dir = os.path.join(work, "gpt2")
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=args.gpt2_layers,
        n_embd=args.gpt2_width,
        n_head=max(1, args.gpt2_width // 64),
        vocab_size=args.gpt2_vocab,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
    )
    GPT2LMHeadModel(config).save_pretrained(model_dir, safe_serialization=True)
    size = os.path.getsize(os.path.join(model_dir, "model.safetensors"))
    print(
        f"GPT-2: {args.gpt2_layers} layers, width {args.gpt2_width}, vocab {args.gpt2_vocab}, "
        f"{size / MiB:.0f} MiB"
    )
    ids = np.random.default_rng(0).integers(0, args.gpt2_vocab, (1, 16))

    loads: list[float] = []

    def ours() -> Any:
        with ps.VariableStore():
            t0 = time.perf_counter()
            model, _ = ex.load(model_dir, seq_len=16)
            loads.append(time.perf_counter() - t0)
            return np.asarray(model(jax.numpy.asarray(ids)))

    def theirs() -> Any:
        hf = GPT2LMHeadModel.from_pretrained(model_dir).eval()
        with torch.no_grad():
            return hf(torch.as_tensor(ids)).logits.numpy()

    diff = float(np.abs(ours() - theirs()).max())
    t_hf, _ = _measure(theirs, args.runs, 0)
    loads.clear()
    t_ps, _ = _measure(ours, args.runs, 0)
    t_load = statistics.median(loads[1:])
    return [
        ("transformers from_pretrained + logits [reference]", t_hf, ""),
        ("examples/gpt2.py load + first logits", t_ps, f"max |diff| {diff:.1e}"),
        ("  of which load (abstract build + init_from_ckpt)", t_load, ""),
        ("  ratio to the reference", t_ps / t_hf, ""),
    ]


def _llama_by_hand(c: Any, model: Any) -> tuple[Any, Callable[..., Any]]:
    """``(params, loss(params, ids, mask))``: the example's Llama written by hand in JAX,
    its parameters taken from ``model`` (the same values)."""
    import jax.numpy as jnp
    import optax

    st = model.layers.stacked
    w = "attn/weights/"
    params = {
        "embed": model.embed_tokens.embeddings.value(),
        "norm": model.norm.scale.value(),
        "head": model.lm_head.kernel.value(),
        "layers": {
            "ln1": st["input_layernorm/scale"].value(),
            "ln2": st["post_attention_layernorm/scale"].value(),
            "q": st[w + "query/kernel"].value(),
            "k": st[w + "key/kernel"].value(),
            "v": st[w + "value/kernel"].value(),
            "o": st[w + "attention_output/kernel"].value(),
            "gate": st["gate/kernel"].value(),
            "up": st["up/kernel"].value(),
            "down": st["down/kernel"].value(),
        },
    }
    params = jax.tree.map(jnp.array, params)  # copies: the step donates its own
    eps, hd, r = c.rms_norm_eps, c.head_dim, c.num_attention_heads // c.num_key_value_heads

    def rms(x: Any, scale: Any) -> Any:
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale

    def rope(x: Any) -> Any:
        t = x.shape[1]
        inv = 1.0 / (c.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
        ang = jnp.outer(jnp.arange(t, dtype=jnp.float32), inv)
        ang = jnp.concatenate([ang, ang], -1)[None, :, None, :]
        x1, x2 = jnp.split(x, 2, -1)
        return x * jnp.cos(ang) + jnp.concatenate([-x2, x1], -1) * jnp.sin(ang)

    def block(x: Any, p: Any) -> tuple[Any, None]:
        h = rms(x, p["ln1"])
        q = rope(jnp.einsum("btd,dhk->bthk", h, p["q"]))
        k = jnp.repeat(rope(jnp.einsum("btd,dhk->bthk", h, p["k"])), r, axis=2)
        v = jnp.repeat(jnp.einsum("btd,dhk->bthk", h, p["v"]), r, axis=2)
        logits = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(hd)
        t = x.shape[1]
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
        out = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(logits, -1), v)
        x = x + jnp.einsum("bthk,hkd->btd", out, p["o"])
        h = rms(x, p["ln2"])
        return x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"], None

    def loss(params: Any, ids: Any, mask: Any) -> Any:
        x = params["embed"][ids[:, :-1]]
        x, _ = jax.lax.scan(block, x, params["layers"])
        logits = rms(x, params["norm"]) @ params["head"]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
        return jnp.sum(ce * mask[:, 1:]) / jnp.maximum(jnp.sum(mask[:, 1:]), 1.0)

    return params, loss


def llama_rows(args: argparse.Namespace, work: str) -> list[tuple[str, float, str]]:
    import jax.numpy as jnp
    import optax
    import torch  # the oracle, only for these rows
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    ex = _example("llama")
    model_dir = os.path.join(work, "llama")
    torch.manual_seed(0)
    width = args.llama_width
    heads = max(2, width // 64)
    config = LlamaConfig(
        vocab_size=args.llama_vocab,
        hidden_size=width,
        intermediate_size=width * 8 // 3 // 16 * 16,
        num_hidden_layers=args.llama_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=max(256, args.llama_seq),
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(model_dir)
    size = os.path.getsize(os.path.join(model_dir, "model.safetensors"))
    print(
        f"Llama: {args.llama_layers} layers, width {width}, {heads} query / {heads // 2} "
        f"key-value heads, vocab {args.llama_vocab}, {size / MiB:.0f} MiB"
    )
    ids = np.random.default_rng(0).integers(3, args.llama_vocab, (1, 16))

    loads: list[float] = []

    def ours() -> Any:
        with ps.VariableStore():
            t0 = time.perf_counter()
            model, _ = ex.load(model_dir, seq_len=16)
            loads.append(time.perf_counter() - t0)
            return np.asarray(model(jnp.asarray(ids)))

    def theirs() -> Any:
        hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            return hf(torch.as_tensor(ids)).logits.numpy()

    diff = float(np.abs(ours() - theirs()).max())
    t_hf, _ = _measure(theirs, args.runs, 0)
    loads.clear()
    t_ps, _ = _measure(ours, args.runs, 0)
    t_load = statistics.median(loads[1:])

    # one full fine-tuning step: ps.function over the example's model vs by hand in JAX
    rng = np.random.default_rng(1)
    batch = jnp.asarray(rng.integers(3, args.llama_vocab, (args.llama_batch, args.llama_seq)))
    mask = jnp.ones(batch.shape, jnp.float32)
    with ps.VariableStore():
        model, _ = ex.load(model_dir, seq_len=args.llama_seq)
        params, loss = _llama_by_hand(model.config, model)
        opt = ps.Optimizer(optax.adam(1e-4), model)

        @ps.function
        def step(ids: Any, m: Any) -> Any:
            value, grads = ps.value_and_grad(lambda: ex.lm_loss(model, ids, m), model)()
            opt.apply_gradients(grads)
            return value

        tx = optax.adam(1e-4)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def by_hand(p: Any, s: Any, ids: Any, m: Any) -> Any:
            value, grads = jax.value_and_grad(loss)(p, ids, m)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, value

        state = tx.init(params)
        first_ps = float(step(batch, mask))
        params, state, first_jax = by_hand(params, state, batch, mask)
        for _ in range(2):  # warm: the outputs' placement may differ from the inputs' once
            step(batch, mask).block_until_ready()
            params, state, value = by_hand(params, state, batch, mask)
            value.block_until_ready()
        n = args.llama_steps
        t_ps_step, t_jax_step = [], []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            for _ in range(n):
                value = step(batch, mask)
            value.block_until_ready()
            t_ps_step.append((time.perf_counter() - t0) / n)
            t0 = time.perf_counter()
            for _ in range(n):
                params, state, value = by_hand(params, state, batch, mask)
            value.block_until_ready()
            t_jax_step.append((time.perf_counter() - t0) / n)
    t_step, t_hand = statistics.median(t_ps_step), statistics.median(t_jax_step)
    return [
        ("transformers from_pretrained + logits [reference]", t_hf, ""),
        ("examples/llama.py load + first logits", t_ps, f"max |diff| {diff:.1e}"),
        ("  of which load (abstract build + init_from_ckpt)", t_load, ""),
        ("  ratio to the reference", t_ps / t_hf, ""),
        ("Llama step by hand in JAX [reference]", t_hand, f"first loss {float(first_jax):.5f}"),
        ("Llama step, ps.function + ps.Optimizer", t_step, f"first loss {first_ps:.5f}"),
        ("  ratio to the reference (target <= 1.05)", t_step / t_hand, ""),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 MiB and a tiny GPT-2")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gpt2-layers", type=int, default=6)
    parser.add_argument("--gpt2-width", type=int, default=512)
    parser.add_argument("--gpt2-vocab", type=int, default=50257)
    parser.add_argument("--skip-gpt2", action="store_true")
    parser.add_argument("--llama-layers", type=int, default=4)
    parser.add_argument("--llama-width", type=int, default=256)
    parser.add_argument("--llama-vocab", type=int, default=8192)
    parser.add_argument("--llama-batch", type=int, default=4)
    parser.add_argument("--llama-seq", type=int, default=128)
    parser.add_argument("--llama-steps", type=int, default=10, help="steps per timed run")
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--only-llama", action="store_true", help="the Llama rows alone")
    args = parser.parse_args()
    if args.quick:
        args.gib, args.width, args.runs = 1 / 64, 512, 1
        args.gpt2_layers, args.gpt2_width, args.gpt2_vocab = 2, 64, 100
        args.llama_layers, args.llama_width, args.llama_vocab = 2, 64, 128
        args.llama_batch, args.llama_seq, args.llama_steps = 2, 16, 2
    print(
        f"# benchmarks/pretrained.py, {datetime.date.today()}, {platform.machine()} "
        f"{os.cpu_count()} CPUs, jax {jax.__version__}, {len(jax.devices())} devices, "
        f"median of {args.runs}"
    )
    work = tempfile.mkdtemp()
    try:
        rows = [] if args.only_llama else checkpoint_rows(args, work)
        if not args.skip_gpt2 and not args.only_llama:
            rows += gpt2_rows(args, work)
        if not args.skip_llama:
            rows += llama_rows(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"| {'row':52} | {'seconds / ratio':>15} | {'extra peak RSS / largest tensor':>31} |")
    print(f"|{'-' * 54}|{'-' * 17}|{'-' * 33}|")
    for name, value, note in rows:
        print(f"| {name:52} | {value:15.3f} | {note:>31} |")


if __name__ == "__main__":
    main()
