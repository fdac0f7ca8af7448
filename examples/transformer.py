"""Train a small transformer language model on the Python standard library's own source.

Run ``python examples/transformer.py`` (about a minute on a 2-core CPU). It shows:

* a model made of ``ps.nn`` layers (Embedding, MultiHeadAttention with a causal mask,
  LayerNormalization, Dropout, Dense) that builds its variables on its first call;
* ``ps.Optimizer(optax.adamw(..., mask=...))`` with weight decay off for biases, LayerNorm
  and embeddings, said by variable name;
* the blocks stacked by ``ps.nn.Repeat`` (one ``lax.scan``: compile time does not grow with
  ``--layers``); ``--unrolled`` holds them in a Python list applied by a loop instead
  (see docs/guides/repeat.md for when each is better);
* K training steps fused into one ``ps.function`` call by a plain ``jax.lax.scan`` whose body
  calls ``opt.apply_gradients`` (``--fuse K``; ``--fuse 0`` runs one call per step);
* a tqdm progress bar, a checkpoint of model and optimizer saved and restored, and text
  sampled from the trained model;
* ``--lora``: then fine-tunes that model as a pretrained one (``fine_tune_lora``, the recipe
  of ``examples/lora_recipe.py`` that ``examples/gpt2.py --lora`` uses too): rebuilt under the
  ``mixed_bfloat16`` policy (float32 variables, bfloat16 compute, no loss scaling needed),
  restored from the checkpoint, frozen, LoRA on the MLP ``Dense`` layers of the ``Repeat``'s
  blocks, Adam and an EMA of the LoRA factors in one ``ps.function`` step, numbered
  checkpoints (a second call resumes from them), evaluated with and without the averages.

The text is the ``.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``): on every machine, no download. Tokens are bytes
(non-ASCII bytes become ``?``), a vocabulary of 128.

A larger configuration for a GPU (a few minutes on one H100)::

    python examples/transformer.py --steps 3000 --fuse 100 --batch-size 64 --seq-len 256 \
        --d-model 384 --heads 6 --layers 6 --corpus-mb 16 --learning-rate 6e-4
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import paramstore as ps

try:  # imported from the package: ``from examples import transformer``
    from examples import lora_recipe
except ImportError:  # run as a script (python examples/transformer.py): its directory is on path
    import lora_recipe  # type: ignore[no-redef]

VOCAB = 128


@dataclasses.dataclass
class Config:
    """Everything that defines a run (the CLI flags)."""

    steps: int = 300
    fuse: int = 25  # steps per ps.function call (lax.scan); 0 = one call per step
    batch_size: int = 16
    seq_len: int = 64
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    unrolled: bool = False  # blocks in a Python list (True) or stacked by ps.nn.Repeat
    dropout: float = 0.1
    learning_rate: float = 3e-3
    weight_decay: float = 0.01
    corpus_mb: float = 2.0
    seed: int = 0
    sample_chars: int = 300
    prompt: str = "def "
    output_dir: str | None = None  # checkpoint directory (a temporary one by default)
    progress: bool = True
    lora: bool = False  # then fine-tune the trained model with LoRA in mixed_bfloat16
    lora_rank: int = 4
    lora_steps: int = 60


# ------------------------------------------------------------------------ data


def load_corpus(megabytes: float) -> np.ndarray:
    """The first ``megabytes`` of the stdlib's ``.py`` files (sorted by path) as tokens."""
    root = Path(sysconfig.get_paths()["stdlib"])
    limit = int(megabytes * 2**20)
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    tokens = np.frombuffer(b"".join(chunks)[:limit], np.uint8).astype(np.int32)
    return np.where(tokens < VOCAB, tokens, ord("?")).astype(np.int32)


def batches(
    tokens: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """``k`` stacked batches of random windows: inputs and next-token targets, (k, B, T)."""
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=(k, batch))
    idx = starts[..., None] + np.arange(seq_len + 1)
    windows = tokens[idx]
    return windows[..., :-1], windows[..., 1:]


def decode(ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids).decode("ascii", errors="replace")


# ----------------------------------------------------------------------- model


class Block(ps.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each residual."""

    def __init__(self, d_model: int, heads: int, dropout: float, name: str | None = None) -> None:
        self.ln1 = ps.nn.LayerNormalization()
        self.attn = ps.nn.MultiHeadAttention(heads, d_model // heads)
        self.ln2 = ps.nn.LayerNormalization()
        self.mlp_in = ps.nn.Dense(4 * d_model, activation="gelu", name="mlp_in")
        self.mlp_out = ps.nn.Dense(d_model, name="mlp_out")  # names for LoRA's where=
        self.drop = ps.nn.Dropout(dropout)

    def __call__(self, x: jax.Array, training: bool = False) -> jax.Array:
        h = self.ln1(x)
        x = x + self.drop(self.attn(h, h, use_causal_mask=True), training=training)
        h = self.mlp_out(self.mlp_in(self.ln2(x)))
        return x + self.drop(h, training=training)


class TransformerLM(ps.Module):
    """Token and position embeddings, ``layers`` blocks, a final LayerNorm and the logits."""

    def __init__(self, config: Config, name: str | None = None) -> None:
        c = config
        self.tokens = ps.nn.Embedding(VOCAB, c.d_model)
        self.positions = ps.nn.Embedding(c.seq_len, c.d_model)
        self.drop = ps.nn.Dropout(c.dropout)
        make_block = lambda: Block(c.d_model, c.heads, c.dropout)  # noqa: E731
        # ps.nn.Repeat stores each variable once with a leading axis of `layers` and applies
        # the blocks with one lax.scan; the Python list traces and compiles every block.
        self.blocks: Any = (
            [make_block() for _ in range(c.layers)]
            if c.unrolled
            else ps.nn.Repeat(make_block, c.layers)
        )
        self.ln = ps.nn.LayerNormalization()
        self.head = ps.nn.Dense(VOCAB)

    def __call__(self, ids: jax.Array, training: bool = False) -> jax.Array:
        x = self.tokens(ids) + self.positions(jnp.arange(ids.shape[-1]))
        x = self.drop(x, training=training)
        if isinstance(self.blocks, ps.nn.Repeat):
            x = self.blocks(x, training=training)
        else:
            for block in self.blocks:
                x = block(x, training=training)
        return self.head(self.ln(x))


def loss_fn(logits: jax.Array, targets: jax.Array) -> jax.Array:
    # in float32 also when the model computes in bfloat16 (mixed_bfloat16)
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def decays(name: str) -> bool:
    """Weight decay on the kernels only (not biases, LayerNorm or embeddings)."""
    return name.endswith("kernel")


def build(config: Config) -> tuple[TransformerLM, ps.Optimizer]:
    """The model (built on a dummy batch) and its AdamW optimizer."""
    model = TransformerLM(config)
    model(jnp.zeros((1, config.seq_len), jnp.int32))
    tx = optax.adamw(
        config.learning_rate,
        weight_decay=config.weight_decay,
        mask=ps.Optimizer.by_name(decays),
    )
    return model, ps.Optimizer(optax.chain(optax.clip_by_global_norm(1.0), tx), model)


def train_steps(
    model: TransformerLM, opt: ps.Optimizer
) -> tuple[Callable[..., jax.Array], Callable[..., jax.Array]]:
    """``(step, fused)``: one step per call, and K steps per call over (K, B, T) batches."""

    def one_step(x: jax.Array, y: jax.Array) -> jax.Array:
        loss, grads = ps.value_and_grad(lambda: loss_fn(model(x, training=True), y), model)()
        opt.apply_gradients(grads)
        return loss

    def k_steps(xs: jax.Array, ys: jax.Array) -> jax.Array:
        def body(carry: None, batch: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
            return carry, one_step(*batch)

        return jax.lax.scan(body, None, (xs, ys))[1]

    return ps.function(one_step), ps.function(k_steps)


# ------------------------------------------------------------------- sampling


def sample(model: TransformerLM, config: Config, prompt: str, n: int, seed: int) -> str:
    """``n`` characters after ``prompt``, sampled at temperature 0.8 (one compiled call per
    character over a fixed window, so it traces once)."""
    rng = np.random.default_rng(seed)
    logits_at = ps.function(lambda ids, pos: model(ids)[0, pos])
    ids = [min(ord(c), VOCAB - 1) for c in prompt] or [ord("\n")]
    for _ in range(n):
        window = ids[-config.seq_len :]
        padded = np.zeros((1, config.seq_len), np.int32)
        padded[0, : len(window)] = window
        logits = np.asarray(logits_at(padded, jnp.int32(len(window) - 1)), np.float64) / 0.8
        p = np.exp(logits - logits.max())
        ids.append(int(rng.choice(VOCAB, p=p / p.sum())))
    return decode(ids)


# ------------------------------------------------------------------ checkpoints


def save_and_restore(
    model: TransformerLM, opt: ps.Optimizer, config: Config, directory: Path, eval_batch: Any
) -> tuple[str, float, float]:
    """Save model and optimizer, rebuild both in a fresh store, restore, and return
    ``(path, eval loss before, eval loss of the restored model)``."""
    evaluate = ps.function(lambda x, y: loss_fn(model(x), y))
    before = float(evaluate(*eval_batch))
    path = ps.Checkpoint(model=model, optimizer=opt).save(str(directory / "ckpt"))
    with ps.VariableStore():  # "a new process": fresh values, keyed by attribute path
        model2, opt2 = build(config)
        ps.Checkpoint(model=model2, optimizer=opt2).restore(path).assert_consumed()
        assert int(opt2.iterations.numpy()) == int(opt.iterations.numpy())
        after = float(ps.function(lambda x, y: loss_fn(model2(x), y))(*eval_batch))
    return str(path), before, after


# ------------------------------------------------------------------ fine-tuning

LORA_WHERE = r"block/mlp_(in|out)$"  # the MLP Dense layers of every block


def pretrained(config: Config, path: str, policy: str | None = "mixed_bfloat16") -> TransformerLM:
    """The model built under ``policy`` (its variables float32 all the same) with the model
    values of checkpoint ``path`` (``save_and_restore``'s, whose optimizer part is left)."""
    with lora_recipe.policy(policy):
        model = TransformerLM(config)
        model(jnp.zeros((1, config.seq_len), jnp.int32))
    ps.Checkpoint(model=model).restore(path).assert_existing_objects_matched()
    return model


def lora_tuner(
    model: TransformerLM, config: Config, directory: str | None = None
) -> lora_recipe.LoRATuner:
    """Freeze, LoRA on the blocks' MLP, Adam + EMA step, checkpoints in ``directory``.
    Dropout is off (``training=False``) so that a resumed run repeats an uninterrupted one
    without checkpointing a random state."""
    return lora_recipe.LoRATuner(
        model,
        lambda x, y: loss_fn(model(x), y),
        rank=config.lora_rank,
        where=LORA_WHERE,
        learning_rate=config.learning_rate,
        ema_decay=0.99,
        directory=directory,
    )


def lora_data(config: Config) -> tuple[list[tuple[np.ndarray, np.ndarray]], tuple[Any, Any]]:
    """``config.lora_steps`` batches ``(x, y)`` drawn from the corpus with another seed than
    the pretraining's, and one held-out batch."""
    tokens = load_corpus(config.corpus_mb)
    rng = np.random.default_rng(config.seed + 1)
    n = config.lora_steps
    xs, ys = batches(tokens, config.batch_size, config.seq_len, rng, n + 1)
    return [(xs[i], ys[i]) for i in range(n)], (xs[n], ys[n])


def fine_tune_lora(
    config: Config,
    path: str,
    directory: str,
    out: TextIO = sys.stdout,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Fine-tune the model of checkpoint ``path`` with LoRA in ``mixed_bfloat16`` for
    ``config.lora_steps`` steps on batches drawn from the corpus with another seed, resuming
    from ``directory``'s newest checkpoint (``stop_after``: steps at most, an interruption
    for the demonstration). Returns the losses, the step resumed from and the
    evaluation losses (trained LoRA values, and their averages)."""
    data, held_out = lora_data(config)
    n = config.lora_steps
    with ps.VariableStore():
        model = pretrained(config, path)
        tuner = lora_tuner(model, config, directory)
        before = tuner.evaluate(*held_out)[0]
        resumed_at = tuner.resume()
        losses = tuner.train(data, save_every=max(1, n // 4), stop_after=stop_after)
        raw, averaged = tuner.evaluate(*held_out)
        lora_params = sum(v.size for v in tuner.lora)
    print(
        f"LoRA rank {config.lora_rank} in mixed_bfloat16 ({lora_params:,} trainable parameters), "
        f"steps {resumed_at}..{n}: eval loss {before:.4f} -> {raw:.4f}, with the EMA "
        f"{averaged:.4f}; checkpoints in {directory}",
        file=out,
    )
    return {
        "losses": losses,
        "resumed_at": resumed_at,
        "eval_loss_before": before,
        "eval_loss": raw,
        "ema_eval_loss": averaged,
        "lora_parameters": lora_params,
    }


# ------------------------------------------------------------------------ run


def train(
    config: Config, out: TextIO = sys.stdout, bar_file: TextIO | None = None
) -> dict[str, Any]:
    """Train, checkpoint, restore, sample. Returns the losses, timings, checkpoint and text."""
    ps.random.set_seed(config.seed)
    tokens = load_corpus(config.corpus_mb)
    rng = np.random.default_rng(config.seed)
    print(
        f"corpus: {len(tokens):,} bytes of the standard library's .py files; "
        f"jax {jax.__version__} on {jax.devices()[0].platform}",
        file=out,
    )
    with ps.VariableStore():
        model, opt = build(config)
        n_params = sum(v.size for v in model.trainable_variables)
        print(
            f"model: {len(model.trainable_variables)} variables, {n_params:,} parameters", file=out
        )
        step, fused = train_steps(model, opt)
        k = config.fuse
        losses: list[float] = []
        start = time.perf_counter()
        bar = tqdm(
            total=config.steps,
            desc="training",
            unit="step",
            disable=not config.progress,
            mininterval=2.0,
            file=bar_file if bar_file is not None else sys.stderr,
        )
        done = 0
        while done < config.steps:
            n = min(k, config.steps - done) if k else 1
            xs, ys = batches(tokens, config.batch_size, config.seq_len, rng, n)
            if k:
                chunk = np.asarray(fused(xs, ys)).tolist()
            else:
                chunk = [float(step(xs[0], ys[0]))]
            losses.extend(chunk)
            done += n
            bar.update(n)
            bar.set_postfix(loss=f"{np.mean(chunk):.3f}", refresh=False)
        bar.close()
        seconds = time.perf_counter() - start
        tokens_per_s = config.steps * config.batch_size * config.seq_len / seconds
        print(
            f"trained {config.steps} steps in {seconds:.1f}s ({tokens_per_s:,.0f} tokens/s, "
            f"including compilation; {'fused ' + str(k) + ' steps per call' if k else 'one call per step'}); "
            f"loss {np.mean(losses[:10]):.3f} -> {np.mean(losses[-10:]):.3f} "
            f"(uniform guess: {math.log(VOCAB):.3f})",
            file=out,
        )
        eval_batch = tuple(a[0] for a in batches(tokens, 64, config.seq_len, rng, 1))
        directory = Path(config.output_dir or tempfile.mkdtemp(prefix="transformer-"))
        directory.mkdir(parents=True, exist_ok=True)
        path, before, after = save_and_restore(model, opt, config, directory, eval_batch)
        print(f"checkpoint: {path}; eval loss {before:.4f}, restored model {after:.4f}", file=out)
        text = sample(model, config, config.prompt, config.sample_chars, config.seed)
        print("sample:\n" + text, file=out)
    lora = fine_tune_lora(config, path, str(directory / "lora"), out) if config.lora else None
    return {
        "lora": lora,
        "losses": losses,
        "seconds": seconds,
        "fused": k,
        "checkpoint": path,
        "eval_loss": before,
        "restored_eval_loss": after,
        "sample": text,
        "parameters": n_params,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for field in dataclasses.fields(Config):
        if field.name == "progress":
            continue
        if field.name in ("unrolled", "lora"):
            parser.add_argument(
                "--" + field.name,
                action="store_true",
                help="blocks in a Python list applied by a loop, instead of ps.nn.Repeat"
                if field.name == "unrolled"
                else "then fine-tune with LoRA in mixed_bfloat16 with an EMA (lora_recipe.py)",
            )
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = str if field.name in ("prompt", "output_dir") else type(field.default)
        parser.add_argument(flag, type=kind, default=field.default)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    progress = not args.pop("no_progress")
    train(Config(**args, progress=progress))
    return 0


if __name__ == "__main__":
    sys.exit(main())
