"""Llama in ``ps.nn``: warm-started from a Hugging Face checkpoint, LoRA fine-tuned in
mixed_bfloat16, exported back.

Run ``python examples/llama.py [MODEL_DIR]`` (or ``python -m examples.llama`` from the
repository's root) on a Hugging Face ``LlamaForCausalLM`` directory (``config.json`` and
``model.safetensors`` or shards). Without ``MODEL_DIR`` it makes a tiny random
``LlamaForCausalLM`` with ``transformers`` and ``save_pretrained`` (no download). It shows:

* the model written with Keras 3's blocks of today's language models:
  ``ps.nn.RMSNormalization``, ``ps.nn.GroupQueryAttention`` with
  ``rotary_embedding=ps.nn.RotaryEmbedding(...)`` (``transformers``' ``rotate_half``
  convention), a SwiGLU MLP of three ``Dense``; the decoder layers stacked by
  ``ps.nn.Repeat`` (one ``lax.scan``), built abstract (``ps.abstract()``: nothing allocated);
* ``ps.checkpoint.init_from_checkpoint`` alone filling every variable through one
  ``ps.checkpoint.NameMap`` (``hf_names``): torch's ``(out, in)`` weights transposed, the
  attention's ``q_proj``/``k_proj``/``v_proj``/``o_proj`` reshaped to Keras 3's per-head
  kernels, ``model.layers.<i>.…`` into layer ``i`` of the stacked variables;
* a line ``logits max abs diff vs transformers: X`` against ``LlamaForCausalLM``;
* LoRA fine-tuning on the attention's four projections and the MLP in ``mixed_bfloat16``
  (``examples/lora_recipe.py``: every pretrained variable frozen, Adam + EMA of the LoRA
  factors in one ``ps.function`` step, ``slot_memory_kind=`` for host-memory slots);
* padding to length buckets: each new sequence length compiles the step again, so the
  batches are right-padded to a few fixed lengths (``BUCKETS``) and the padding masked out
  of the loss; with a causal mask, right padding changes no logit of a real token;
* the merged model exported with the same ``NameMap`` turned around
  (``ps.checkpoint.export_safetensors(..., names=hf_names(model))``), which
  ``LlamaForCausalLM.from_pretrained`` loads with equal logits (printed the same way).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import paramstore as ps

try:  # imported from the package: ``from examples import llama``, ``python -m examples.llama``
    from examples import lora_recipe
except ImportError:  # run as a script, ``python examples/llama.py``: its directory is on sys.path
    import lora_recipe  # type: ignore[no-redef]

# ---------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class Config:
    """The fields of a Hugging Face Llama ``config.json`` this model uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    @classmethod
    def from_dir(cls, model_dir: str) -> Config:
        with open(os.path.join(model_dir, "config.json")) as f:
            raw = json.load(f)
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"only the default rotary embedding is implemented, not {rope}")
        if (
            raw.get("hidden_act", "silu") != "silu"
            or raw.get("attention_bias")
            or raw.get("mlp_bias")
        ):
            raise ValueError("only Llama's silu MLP without biases is implemented")
        heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
        )


# ----------------------------------------------------------------------- model


class DecoderLayer(ps.Module):
    """A pre-norm Llama layer: grouped-query self-attention with rotary embeddings, then a
    SwiGLU MLP, each residual."""

    def __init__(self, c: Config, name: str | None = None) -> None:
        eps = c.rms_norm_eps
        self.input_layernorm = ps.nn.RMSNormalization(epsilon=eps, name="input_layernorm")
        self.attn = ps.nn.GroupQueryAttention(
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
            use_bias=False,
            rotary_embedding=ps.nn.RotaryEmbedding(max_wavelength=c.rope_theta),
            name="attn",
        )
        self.post_attention_layernorm = ps.nn.RMSNormalization(
            epsilon=eps, name="post_attention_layernorm"
        )
        self.gate = ps.nn.Dense(c.intermediate_size, use_bias=False, name="gate")
        self.up = ps.nn.Dense(c.intermediate_size, use_bias=False, name="up")
        self.down = ps.nn.Dense(c.hidden_size, use_bias=False, name="down")

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.input_layernorm(x)
        x = x + self.attn(h, h, use_causal_mask=True)
        h = self.post_attention_layernorm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Llama(ps.Module):
    """Token embeddings, ``num_hidden_layers`` stacked decoder layers, a final RMSNorm and
    the output projection ``lm_head`` (the embeddings, transposed, when tied)."""

    def __init__(self, c: Config, name: str | None = None) -> None:
        self.config = c
        self.embed_tokens = ps.nn.Embedding(c.vocab_size, c.hidden_size, name="embed_tokens")
        self.layers = ps.nn.Repeat(lambda: DecoderLayer(c, name="layer"), c.num_hidden_layers)
        self.norm = ps.nn.RMSNormalization(epsilon=c.rms_norm_eps, name="norm")
        if not c.tie_word_embeddings:
            self.lm_head = ps.nn.Dense(c.vocab_size, use_bias=False, name="lm_head")

    def build(self, seq_len: int) -> None:
        """Every layer's variables for inputs of ``seq_len`` tokens (abstract inside
        ``ps.abstract()``)."""
        d = self.config.hidden_size
        self.embed_tokens.build((1, seq_len))
        self.layers.build((1, seq_len, d))
        self.norm.build((1, seq_len, d))
        if not self.config.tie_word_embeddings:
            self.lm_head.build((1, seq_len, d))

    def __call__(self, ids: jax.Array) -> jax.Array:
        """Float32 logits ``(batch, len, vocab)`` (the computation in the compute dtype)."""
        x = self.norm(self.layers(self.embed_tokens(ids)))
        if self.config.tie_word_embeddings:
            return x.astype(jnp.float32) @ self.embed_tokens.embeddings.value().T
        return self.lm_head(x).astype(jnp.float32)


def build(c: Config, seq_len: int = 8, policy: str | None = None) -> Llama:
    """The model, built abstract: names, shapes and dtypes, nothing allocated. ``policy``
    (e.g. ``"mixed_bfloat16"``): the layers' mixed-precision policy."""
    with ps.abstract(), lora_recipe.policy(policy):
        model = Llama(c)
        model.build(seq_len)
    return model


# -------------------------------------------------- Hugging Face names, both ways


def hf_names(model: Llama) -> ps.checkpoint.NameMap:
    """Hugging Face name <-> this model's variables: one map, read by ``load`` and turned
    around by ``export``. Torch's ``Linear`` weights are ``(out, in)``; the attention's are
    reshaped to Keras 3's per-head kernels (``(hidden, heads, head_dim)``, and
    ``(heads, head_dim, hidden)`` for the output)."""
    c = model.config
    d, hd = c.hidden_size, c.head_dim
    stacked = {path: v.name for path, v in model.layers.stacked.items()}

    def layer(path: str) -> str:
        return stacked[path] + r"[\1]"

    def heads(n: int) -> ps.checkpoint.Transform:  # (n*hd, d) <-> (d, n, hd)
        return ps.checkpoint.Transform(
            lambda w: w.T.reshape(d, n, hd), lambda k: k.reshape(d, n * hd).T
        )

    out_heads = ps.checkpoint.Transform(  # (d, nq*hd) <-> (nq, hd, d)
        lambda w: w.T.reshape(c.num_attention_heads, hd, d),
        lambda k: k.reshape(c.num_attention_heads * hd, d).T,
    )
    t = ps.checkpoint.transpose()
    blk = r"model\.layers\.(\d+)\."
    attn = "attn/weights/"
    rules: list[tuple[Any, ...]] = [
        (r"model\.embed_tokens\.weight", model.embed_tokens.embeddings.name),
        (r"model\.norm\.weight", model.norm.scale.name),
        (blk + r"input_layernorm\.weight", layer("input_layernorm/scale")),
        (blk + r"post_attention_layernorm\.weight", layer("post_attention_layernorm/scale")),
        (blk + r"self_attn\.q_proj\.weight", layer(attn + "query/kernel"), heads(c.num_attention_heads)),
        (blk + r"self_attn\.k_proj\.weight", layer(attn + "key/kernel"), heads(c.num_key_value_heads)),
        (blk + r"self_attn\.v_proj\.weight", layer(attn + "value/kernel"), heads(c.num_key_value_heads)),
        (blk + r"self_attn\.o_proj\.weight", layer(attn + "attention_output/kernel"), out_heads),
        (blk + r"mlp\.gate_proj\.weight", layer("gate/kernel"), t),
        (blk + r"mlp\.up_proj\.weight", layer("up/kernel"), t),
        (blk + r"mlp\.down_proj\.weight", layer("down/kernel"), t),
    ]  # fmt: skip
    if not c.tie_word_embeddings:
        rules.append((r"lm_head\.weight", model.lm_head.kernel.name, t))
    return ps.checkpoint.NameMap(rules)


def load(
    model_dir: str, seq_len: int = 8, policy: str | None = None
) -> tuple[Llama, dict[str, str]]:
    """The model from a Hugging Face directory, through ``init_from_checkpoint`` alone
    (``policy``: as ``build``'s; ``cast=True``: a bfloat16 file fills float32 variables)."""
    model = build(Config.from_dir(model_dir), seq_len, policy)
    assigned = ps.checkpoint.init_from_checkpoint(
        model_dir, hf_names(model), cast=True, allow_unverified=True
    )
    left = [v.name for v in model.variables if v.is_abstract]
    assert not left, f"not in the checkpoint: {left}"
    return model, assigned


def export(model: Llama, model_dir: str, max_shard_size: int | None = None) -> str:
    """Write the model's weights into a Hugging Face directory (its ``config.json`` kept)
    under Hugging Face's names: ``hf_names`` turned around, no hand-written inverse."""
    return ps.checkpoint.export_safetensors(
        model_dir, model, names=hf_names(model), max_shard_size=max_shard_size
    )


# ------------------------------------------------ length buckets and fine-tuning

BUCKETS = (16, 32, 64, 128)
"""Sequence lengths batches are padded to: one compiled step per bucket, not per length."""


def bucket(length: int, buckets: Sequence[int] = BUCKETS) -> int:
    """The smallest bucket that holds ``length`` tokens."""
    for b in buckets:
        if length <= b:
            return b
    raise ValueError(f"a sequence of {length} tokens is longer than the largest bucket {buckets}")


def pad_batch(
    sequences: Sequence[Sequence[int]], buckets: Sequence[int] = BUCKETS, pad_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` of shape ``(batch, bucket)``: each sequence right-padded with
    ``pad_id`` to the bucket of the longest; ``mask`` is 1 on real tokens. Under a causal
    mask a real token never attends to the padding after it, so its logits are unchanged."""
    n = bucket(max(len(s) for s in sequences), buckets)
    ids = np.full((len(sequences), n), pad_id, np.int32)
    mask = np.zeros((len(sequences), n), np.float32)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1.0
    return ids, mask


def lm_loss(model: Llama, ids: jax.Array, mask: jax.Array) -> jax.Array:
    """Next-token cross-entropy over the real tokens (``mask``), in float32."""
    logits = model(ids[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
    weights = mask[:, 1:]
    return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


# the attention's four projections and the MLP of every decoder layer
LORA_WHERE = r"layer/(attn/(query|key|value|attention_output)|gate|up|down)$"


def lora_tuner(
    model: Llama,
    *,
    rank: int = 4,
    learning_rate: float = 1e-2,
    ema_decay: float = 0.9,
    directory: str | None = None,
    slot_memory_kind: str | None = None,
) -> lora_recipe.LoRATuner:
    """Freeze ``model``, LoRA on attention and MLP, Adam + EMA step (see
    ``examples/lora_recipe.py``)."""
    return lora_recipe.LoRATuner(
        model,
        lambda ids, mask: lm_loss(model, ids, mask),
        rank=rank,
        where=LORA_WHERE,
        learning_rate=learning_rate,
        ema_decay=ema_decay,
        directory=directory,
        slot_memory_kind=slot_memory_kind,
    )


# ------------------------------------------------------------------- transformers


def _quiet_transformers() -> None:
    from transformers.utils import logging  # noqa: PLC0415 - the example's optional oracle

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def tiny_checkpoint(model_dir: str, seed: int = 0) -> str:
    """A tiny random ``LlamaForCausalLM`` saved by ``save_pretrained`` (no download): 2
    layers, width 64, 4 query heads sharing 2 key/value heads."""
    import torch  # noqa: PLC0415 - the example's optional oracle
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    _quiet_transformers()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(model_dir)
    return model_dir


def transformers_logits(model_dir: str, ids: np.ndarray) -> np.ndarray:
    """``LlamaForCausalLM.from_pretrained(model_dir)``'s logits (eval mode, float32)."""
    import torch  # noqa: PLC0415
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    _quiet_transformers()
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.as_tensor(ids)).logits.numpy()


def max_diff(ours: Any, theirs: np.ndarray) -> float:
    return float(np.abs(np.asarray(ours, np.float32) - theirs).max())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?", help="a Hugging Face LlamaForCausalLM directory")
    parser.add_argument("--steps", type=int, default=6, help="LoRA steps")
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank")
    parser.add_argument("--out", help="where to export the fine-tuned model")
    parser.add_argument("--slot-memory-kind", help="e.g. pinned_host: Adam's slots in host memory")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp()
    try:
        model_dir = args.model_dir or tiny_checkpoint(os.path.join(work, "tiny-llama"))
        rng = np.random.default_rng(0)
        model, assigned = load(model_dir)
        c = model.config
        ids = rng.integers(3, c.vocab_size, (2, 12))
        logits = model(jnp.asarray(ids))
        reference = transformers_logits(model_dir, ids)
        print(f"loaded {len(assigned)} tensors into {len(model.variables)} variables")
        print(f"logits max abs diff vs transformers: {max_diff(logits, reference):.2e}")

        # LoRA in mixed_bfloat16, batches of several lengths padded to two buckets
        lengths = [9, 14, 20, 27, 11, 30][: max(args.steps, 1)]
        batches = []
        for n in (lengths * ((args.steps + len(lengths) - 1) // len(lengths)))[: args.steps]:
            seqs = [rng.integers(3, c.vocab_size, n - k).tolist() for k in range(2)]
            batches.append(pad_batch(seqs))
        print("bucketed lengths:", sorted({b[0].shape[1] for b in batches}), "for", lengths)
        with ps.VariableStore():
            tuned_model, _ = load(model_dir, policy="mixed_bfloat16")
            tuner = lora_tuner(tuned_model, rank=args.rank, slot_memory_kind=args.slot_memory_kind)
            losses = tuner.train(batches)
            print(
                f"LoRA rank {args.rank} on {len(tuner.layers)} layers (mixed_bfloat16), "
                "losses: " + " ".join(f"{x:.3f}" for x in losses)
            )
            lengths_seen = len({len(b[0][0]) for b in batches})
            print(
                f"the step compiled {tuner.step.trace_count} times for {len(batches)} batches "
                f"({len(set(lengths[: len(batches)]))} lengths, {lengths_seen} buckets)"
            )
            tuner.finalize()  # the averages merged into the float32 kernels
            out = args.out or os.path.join(work, "tuned")
            os.makedirs(out, exist_ok=True)
            for f in ("config.json", "generation_config.json"):
                if os.path.exists(os.path.join(model_dir, f)):
                    shutil.copy(os.path.join(model_dir, f), out)
            export(tuned_model, out)
        with ps.VariableStore():  # the export, computed in float32
            exported, _ = load(out)
            tuned = exported(jnp.asarray(ids))
        exported_reference = transformers_logits(out, ids)
        print(f"exported to {out}")
        print(
            "exported logits max abs diff vs transformers: "
            f"{max_diff(tuned, exported_reference):.2e}"
        )
        return {
            "logits": np.asarray(logits),
            "reference": reference,
            "losses": losses,
            "tuned": np.asarray(tuned),
            "exported_reference": exported_reference,
        }
    finally:
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
