"""GPT-2 in ``ps.nn``, warm-started from a Hugging Face checkpoint, fine-tuned, exported back.

Run ``python examples/gpt2.py MODEL_DIR`` on a Hugging Face GPT-2 directory (``config.json``
and ``model.safetensors``, or shards with ``model.safetensors.index.json``: e.g. what
``GPT2LMHeadModel.save_pretrained(dir)`` writes, or a downloaded ``gpt2``). Without
``MODEL_DIR`` it makes a tiny random GPT-2 with ``transformers`` (no download). It shows:

* the model written with ``ps.nn`` layers, its blocks stacked by ``ps.nn.Repeat`` (one
  ``lax.scan``), built abstract (``ps.abstract()``: nothing allocated);
* ``ps.checkpoint.init_from_checkpoint`` alone filling every variable from the file's own
  names through one ``ps.checkpoint.NameMap`` (``hf_names``): its rules map
  ``transformer.h.<i>.…`` to layer ``i`` of a stacked variable (``…/kernel[<i>]``), a tuple
  target sends the fused ``c_attn`` matrix to the query, key and value kernels, split and
  reshaped by the rule's reversible transform (HF's ``Conv1D`` weights are ``(in, out)``
  like ``ps.nn.Dense`` kernels, so the MLP needs no transpose);
* logits equal to ``transformers``' ``GPT2LMHeadModel`` (``compare_with_transformers``);
* full fine-tuning for a few steps (``fine_tune``: a ``ps.function`` AdamW step);
* ``--lora``: LoRA fine-tuning in bfloat16 (``lora_fine_tune``, the recipe of
  ``examples/lora_recipe.py``): the model built under the ``mixed_bfloat16`` policy
  (variables float32, compute bfloat16; no loss scaling, which only float16 needs), every
  pretrained variable frozen, ``ps.nn.enable_lora`` on the MLP ``Dense`` layers of the
  ``Repeat``'s blocks (``c_fc``, ``c_proj``) and on the attention's ``query`` and ``value``
  projections,
  Adam and an EMA of the LoRA factors in one ``ps.function`` step, numbered checkpoints
  that a re-run resumes (``--checkpoint-dir``), evaluation under ``ema.swap``, then the
  averages merged into the float32 kernels (``ps.nn.merge_lora``) and exported;
* ``--qlora``: QLoRA (``qlora_fine_tune``): the model built abstract under
  ``mixed_bfloat16``, its blocks' MLP ``Dense`` kernels and the four attention projections
  quantized to int8 (``ps.nn.quantize``) *before* loading, so ``init_from_checkpoint``
  quantizes each float tensor on the host on its way in (the fused ``c_attn`` split into
  the query, key and value kernels first); LoRA on the quantized MLP layers and on the
  attention's query and value projections, Adam's slots in host memory, an EMA;
  ``ps.plan``'s table of the step's memory printed before training;
* ``ps.checkpoint.export_safetensors`` back to Hugging Face's names and layout with the same
  map turned around (``export``: no hand-written inverse), which
  ``GPT2LMHeadModel.from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import paramstore as ps

try:  # imported from the package: ``from examples import gpt2``, ``python -m examples.gpt2``
    from examples import lora_recipe
except ImportError:  # run as a script, ``python examples/gpt2.py``: its directory is on sys.path
    import lora_recipe  # type: ignore[no-redef]

# ---------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class Config:
    """The fields of a Hugging Face GPT-2 ``config.json`` this model uses."""

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    layer_norm_epsilon: float = 1e-5

    @classmethod
    def from_dir(cls, model_dir: str) -> Config:
        with open(os.path.join(model_dir, "config.json")) as f:
            raw = json.load(f)
        if raw.get("activation_function", "gelu_new") != "gelu_new":
            raise ValueError(f"only gelu_new is implemented, not {raw['activation_function']}")
        return cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw})


# ----------------------------------------------------------------------- model


class Block(ps.Module):
    """A pre-norm GPT-2 block: causal self-attention and a GELU MLP, each residual."""

    def __init__(self, c: Config, name: str | None = None) -> None:
        self.ln_1 = ps.nn.LayerNormalization(epsilon=c.layer_norm_epsilon)
        self.attn = ps.nn.MultiHeadAttention(c.n_head, c.n_embd // c.n_head)
        self.ln_2 = ps.nn.LayerNormalization(epsilon=c.layer_norm_epsilon)
        self.c_fc = ps.nn.Dense(4 * c.n_embd, name="c_fc")  # names for enable_lora's where=
        self.c_proj = ps.nn.Dense(c.n_embd, name="c_proj")

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.ln_1(x)
        x = x + self.attn(h, h, use_causal_mask=True)
        h = jax.nn.gelu(self.c_fc(self.ln_2(x)), approximate=True)  # gelu_new
        return x + self.c_proj(h)


class GPT2(ps.Module):
    """Token and position embeddings, ``n_layer`` stacked blocks, a final LayerNorm, and
    logits from the token embeddings (tied, as in GPT-2)."""

    def __init__(self, c: Config, name: str | None = None) -> None:
        self.config = c
        self.wte = ps.nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = ps.nn.Embedding(c.n_positions, c.n_embd)
        self.h = ps.nn.Repeat(lambda: Block(c), c.n_layer)
        self.ln_f = ps.nn.LayerNormalization(epsilon=c.layer_norm_epsilon)

    def build(self, seq_len: int) -> None:
        """Every layer's variables for inputs of ``seq_len`` tokens (abstract inside
        ``ps.abstract()``)."""
        e = self.config.n_embd
        self.wte.build((1, seq_len))
        self.wpe.build((seq_len,))
        self.h.build((1, seq_len, e))
        self.ln_f.build((1, seq_len, e))

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.wte(ids) + self.wpe(jnp.arange(ids.shape[-1]))
        x = self.ln_f(self.h(x))
        # under mixed_bfloat16, x is bfloat16 and the float32 embeddings promote the
        # logits (and the loss's softmax) to float32, as Keras keeps a model's head
        return x @ self.wte.embeddings.value().T


def build(c: Config, seq_len: int = 8, policy: str | None = None) -> GPT2:
    """The model, built abstract: names, shapes and dtypes, nothing allocated. ``policy``
    (e.g. ``"mixed_bfloat16"``): the layers' mixed-precision policy."""
    with ps.abstract(), lora_recipe.policy(policy):
        model = GPT2(c)
        model.build(seq_len)
    return model


# -------------------------------------------------- Hugging Face names and values


def hf_names(model: GPT2) -> ps.checkpoint.NameMap:
    """Hugging Face name <-> this model's variables, one map for both directions
    (``name[i]``: layer ``i`` of a stacked variable, ``i`` taken from the file's name; the
    fused ``c_attn`` split into query, key and value on the way in, joined on the way out)."""
    c = model.config
    e, h = c.n_embd, c.n_head
    d = e // h
    stacked = {path: v.name for path, v in model.h.stacked.items()}  # by attribute path

    def layer(path: str) -> str:
        return stacked[path] + r"[\1]"

    def reshape(checkpoint: tuple[int, ...], variable: tuple[int, ...]) -> ps.checkpoint.Transform:
        return ps.checkpoint.Transform(
            lambda x: x.reshape(variable), lambda x: x.reshape(checkpoint)
        )

    blk = r"transformer\.h\.(\d+)\."
    qkv = ("query", "key", "value")
    attn = "attn/weights/"
    split = ps.checkpoint.split
    return ps.checkpoint.NameMap(
        [
            (r"transformer\.wte\.weight", model.wte.embeddings.name),
            (r"transformer\.wpe\.weight", model.wpe.embeddings.name),
            (r"transformer\.ln_f\.weight", model.ln_f.gamma.name),
            (r"transformer\.ln_f\.bias", model.ln_f.beta.name),
            (blk + r"ln_1\.weight", layer("ln_1/gamma")),
            (blk + r"ln_1\.bias", layer("ln_1/beta")),
            (blk + r"ln_2\.weight", layer("ln_2/gamma")),
            (blk + r"ln_2\.bias", layer("ln_2/beta")),
            # one fused matrix into three variables: split, then heads made an axis
            (
                blk + r"attn\.c_attn\.weight",
                tuple(layer(f"{attn}{p}/kernel") for p in qkv),
                ps.checkpoint.chain(split(1), reshape((e, e), (e, h, d))),
            ),
            (
                blk + r"attn\.c_attn\.bias",
                tuple(layer(f"{attn}{p}/bias") for p in qkv),
                ps.checkpoint.chain(split(0), reshape((e,), (h, d))),
            ),
            (
                blk + r"attn\.c_proj\.weight",
                layer(f"{attn}attention_output/kernel"),
                reshape((e, e), (h, d, e)),
            ),
            (blk + r"attn\.c_proj\.bias", layer(f"{attn}attention_output/bias")),
            (blk + r"mlp\.c_fc\.weight", layer("c_fc/kernel")),  # Conv1D (in, out) = kernel
            (blk + r"mlp\.c_fc\.bias", layer("c_fc/bias")),
            (blk + r"mlp\.c_proj\.weight", layer("c_proj/kernel")),
            (blk + r"mlp\.c_proj\.bias", layer("c_proj/bias")),
        ]
    )


def load(
    model_dir: str, seq_len: int = 8, policy: str | None = None
) -> tuple[GPT2, dict[str, str]]:
    """The model from a Hugging Face directory, through ``init_from_checkpoint`` alone
    (``policy``: as ``build``'s; the variables are float32 under every ``mixed_`` one)."""
    c = Config.from_dir(model_dir)
    model = build(c, seq_len, policy)
    assigned = ps.checkpoint.init_from_checkpoint(
        model_dir, hf_names(model), cast=True, allow_unverified=True
    )
    left = [v.name for v in model.variables if v.is_abstract]
    assert not left, f"not in the checkpoint: {left}"
    return model, assigned


def export(model: GPT2, model_dir: str, max_shard_size: int | None = None) -> str:
    """Write the model into a Hugging Face directory (its ``config.json`` kept): the
    weights under Hugging Face's names (the same map as ``load``'s, turned around), one
    file or shards."""
    return ps.checkpoint.export_safetensors(
        model_dir, model, names=hf_names(model), max_shard_size=max_shard_size
    )


# ------------------------------------------------------------------ fine-tuning


def lm_loss(model: GPT2, ids: jax.Array) -> jax.Array:
    logits = model(ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def fine_tune(model: GPT2, batches: list[np.ndarray], learning_rate: float = 1e-3) -> list[float]:
    """Full fine-tuning: every variable trained by AdamW, one ``ps.function`` step a batch.
    (LoRA, mixed precision and EMA variants replace this function.)"""
    opt = ps.Optimizer(optax.adamw(learning_rate, weight_decay=0.0), model)

    @ps.function
    def step(ids: jax.Array) -> jax.Array:
        loss, grads = ps.value_and_grad(lambda: lm_loss(model, ids), model)()
        opt.apply_gradients(grads)
        return loss

    return [float(step(jnp.asarray(b))) for b in batches]


# the MLP Dense layers of every block, and its attention's query and value projections
LORA_WHERE = r"block/(c_fc|c_proj|multi_head_attention/(query|value))$"
# --qlora: the MLP kernels and the attention's four projections quantized to int8
QUANT_WHERE = r"block/(c_fc|c_proj|multi_head_attention/(query|key|value|attention_output))$"


def lora_tuner(
    model: GPT2,
    *,
    rank: int = 4,
    learning_rate: float = 1e-2,
    ema_decay: float = 0.9,
    directory: str | None = None,
) -> lora_recipe.LoRATuner:
    """Freeze ``model``, LoRA on its blocks' MLP and attention, Adam + EMA step, checkpoints in
    ``directory`` (see ``examples/lora_recipe.py``)."""
    return lora_recipe.LoRATuner(
        model,
        lambda ids: lm_loss(model, ids),
        rank=rank,
        where=LORA_WHERE,
        learning_rate=learning_rate,
        ema_decay=ema_decay,
        directory=directory,
    )


def lora_fine_tune(
    model_dir: str,
    batches: list[np.ndarray],
    out: str,
    *,
    rank: int = 4,
    directory: str | None = None,
    save_every: int = 2,
) -> dict[str, Any]:
    """The recipe end to end: load under ``mixed_bfloat16``, LoRA, train on ``batches``
    (resuming from the newest checkpoint of ``directory``), evaluate with and without the
    averages, merge the averages and export the float32 weights to ``out``."""
    model, _ = load(model_dir, policy="mixed_bfloat16")
    tuner = lora_tuner(model, rank=rank, directory=directory)
    resumed_at = tuner.resume()
    losses = tuner.train(batches, save_every=save_every)
    raw, averaged = tuner.evaluate(jnp.asarray(batches[-1]))
    tuner.finalize()
    export(model, out)
    return {
        "model": model,
        "resumed_at": resumed_at,
        "losses": losses,
        "eval_loss": raw,
        "ema_eval_loss": averaged,
    }


def qlora_fine_tune(
    model_dir: str, batches: list[np.ndarray], *, rank: int = 4, seq_len: int = 8
) -> dict[str, Any]:
    """QLoRA: an int8 base (the MLP and attention kernels quantized while loading), LoRA
    adapters (MLP, query, value), Adam with slots in host memory and an EMA; prints
    ``ps.plan``'s table of the step, then trains on ``batches``."""
    c = Config.from_dir(model_dir)
    model = build(c, seq_len, "mixed_bfloat16")
    quantized = ps.nn.quantize(model, "int8", where=QUANT_WHERE)  # abstract: nothing allocated
    ps.checkpoint.init_from_checkpoint(
        model_dir, hf_names(model), cast=True, allow_unverified=True
    )  # each float MLP and attention tensor quantized on the host as it is read
    tuner = lora_recipe.LoRATuner(
        model,
        lambda ids: lm_loss(model, ids),
        rank=rank,
        where=LORA_WHERE,
        learning_rate=1e-2,
        ema_decay=0.9,
        slot_memory_kind="pinned_host",
    )
    batch = jax.ShapeDtypeStruct(np.shape(batches[0]), jnp.int32)
    plan = ps.plan(tuner.step, batch)
    print(plan)
    losses = tuner.train([b.astype(np.int32) for b in batches])
    raw, averaged = tuner.evaluate(jnp.asarray(batches[-1], jnp.int32))
    return {
        "model": model,
        "plan": plan,
        "quantized": quantized,
        "losses": losses,
        "eval_loss": raw,
        "ema_eval_loss": averaged,
    }


# ------------------------------------------------------------------- transformers


def _quiet_transformers() -> None:
    """No progress bars or advice on stderr."""
    from transformers.utils import logging  # noqa: PLC0415 - the example's optional oracle

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def tiny_checkpoint(model_dir: str, seed: int = 0) -> str:
    """A tiny random GPT-2 written by ``transformers`` (no download)."""
    import torch  # noqa: PLC0415 - the example's optional oracle
    from transformers import GPT2Config, GPT2LMHeadModel  # noqa: PLC0415

    _quiet_transformers()
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=100,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    GPT2LMHeadModel(config).save_pretrained(model_dir, safe_serialization=True)
    return model_dir


def transformers_logits(model_dir: str, ids: np.ndarray) -> np.ndarray:
    """``GPT2LMHeadModel.from_pretrained(model_dir)``'s logits (eval mode)."""
    import torch  # noqa: PLC0415
    from transformers import GPT2LMHeadModel  # noqa: PLC0415

    _quiet_transformers()
    hf = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return hf(torch.as_tensor(ids)).logits.numpy()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?", help="a Hugging Face GPT-2 directory")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", help="where to export the fine-tuned model")
    parser.add_argument(
        "--lora", action="store_true", help="LoRA in mixed_bfloat16 with EMA instead of full"
    )
    parser.add_argument(
        "--qlora",
        action="store_true",
        help="QLoRA: int8 MLP and attention kernels quantized while loading, LoRA, host-memory slots",
    )
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank (--lora, --qlora)")
    parser.add_argument(
        "--checkpoint-dir", help="--lora: numbered checkpoints here; a re-run resumes from them"
    )
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp()
    try:
        model_dir = args.model_dir or tiny_checkpoint(os.path.join(work, "tiny"))
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        model, assigned = load(model_dir)
        c = model.config
        ids = rng.integers(0, c.vocab_size, (2, 8))
        logits = np.asarray(model(jnp.asarray(ids)))
        print(f"loaded {len(assigned)} values in {time.perf_counter() - t0:.2f} s")
        ref = transformers_logits(model_dir, ids)
        print(f"max |logits - transformers| = {np.abs(logits - ref).max():.2e}")
        batches = [rng.integers(0, c.vocab_size, (4, 9))] * args.steps  # memorize one batch
        out = args.out or os.path.join(work, "tuned")
        if out != model_dir:
            os.makedirs(out, exist_ok=True)
            shutil.copy(os.path.join(model_dir, "config.json"), out)
        if args.qlora:
            with ps.VariableStore():
                run = qlora_fine_tune(model_dir, batches, rank=args.rank)
            losses = run["losses"]
            print(f"QLoRA (int8 base, rank {args.rank}, mixed_bfloat16)")
            print("fine-tuning losses:", " ".join(f"{x:.3f}" for x in losses))
            print(f"eval loss {run['eval_loss']:.4f}, with the EMA {run['ema_eval_loss']:.4f}")
            return {"losses": losses, "logits": logits, "reference": ref, "plan": run["plan"]}
        if args.lora:
            with ps.VariableStore():
                run = lora_fine_tune(
                    model_dir, batches, out, rank=args.rank, directory=args.checkpoint_dir
                )
                bf16 = np.asarray(run["model"](jnp.asarray(ids)))
            print(f"LoRA (rank {args.rank}, mixed_bfloat16) from step {run['resumed_at']}")
            losses = run["losses"]
            print("fine-tuning losses:", " ".join(f"{x:.3f}" for x in losses))
            print(f"eval loss {run['eval_loss']:.4f}, with the EMA {run['ema_eval_loss']:.4f}")
            with ps.VariableStore():  # the export, computed in float32
                tuned = np.asarray(load(out)[0](jnp.asarray(ids)))
            print(f"max |bfloat16 - float32 logits| = {np.abs(bf16 - tuned).max():.2e}")
        else:
            losses = fine_tune(model, batches)
            print("fine-tuning losses:", " ".join(f"{x:.3f}" for x in losses))
            export(model, out)
            tuned = np.asarray(model(jnp.asarray(ids)))
        exported = transformers_logits(out, ids)
        print(
            f"exported to {out}: max |logits - transformers| = {np.abs(tuned - exported).max():.2e}"
        )
        return {
            "losses": losses,
            "logits": logits,
            "reference": ref,
            "tuned": tuned,
            "exported": exported,
        }
    finally:
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
