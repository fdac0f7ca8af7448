"""LoRA fine-tuning in bfloat16 with an EMA, checkpointed and resumable: the recipe that
``examples/gpt2.py --lora`` and ``examples/transformer.py --lora`` share (imported by both, and by
``examples/llama.py``; not a script of its own: ``from examples import lora_recipe``).

``LoRATuner(model, loss, rank=..., where=...)`` on a built (pretrained) model:

* freezes every variable of the model (``v.trainable = False``: the pretrained weights keep
  their values, bit for bit), then ``ps.nn.enable_lora(model, rank, where=...)`` adds the
  trainable ``lora_kernel_a``/``lora_kernel_b`` to each matching ``Dense`` or attention
  projection (those of a ``ps.nn.Repeat``'s blocks are stacked, ``(n, in, rank)``): they are
  the only trainable variables; ``merge_lora`` at the end leaves the kernels frozen;
* trains them with Adam in one ``ps.function`` step that also updates a
  ``ps.ExponentialMovingAverage`` of them (``num_updates=opt.iterations``, TF's warm-up);
  ``slot_memory_kind="pinned_host"`` keeps Adam's slots in host memory (``ps.Optimizer``'s
  ``slot_memory_kind``: moved to the device for each update, inside the step);
* checkpoints model, optimizer and averages with ``ps.CheckpointManager`` over a
  ``ps.Checkpoint`` every ``save_every`` steps; ``resume()`` restores the newest (or a given)
  checkpoint, and ``train(batches)`` goes on from batch ``opt.iterations``, so an interrupted
  and resumed run ends with the same values as an uninterrupted one;
* ``finalize()`` puts the averages in place of the trained LoRA values (as Keras'
  ``use_ema`` does at the end of ``fit``) and ``ps.nn.merge_lora`` folds them into the kernels,
  leaving a plain model to export.

Mixed precision: build the model inside ``policy("mixed_bfloat16")`` (the layers take the
global policy when they are constructed): variables, LoRA ones and EMA shadows included, stay
float32, the layers compute in bfloat16, and gradients of float32 variables are float32. No
loss scaling is needed in bfloat16 (float32's exponent range); only ``mixed_float16`` wants
``ps.LossScaleOptimizer`` around the optimizer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import optax

import paramstore as ps


@contextlib.contextmanager
def policy(name: str | None) -> Iterator[None]:
    """Layers constructed inside use the mixed-precision policy ``name`` (None: unchanged);
    the previous global policy comes back on exit."""
    if name is None:
        yield
        return
    before = ps.mixed_precision.global_policy()
    try:  # set inside the try: Ctrl-C right after it still puts the previous one back
        ps.mixed_precision.set_global_policy(name)
        yield
    finally:
        ps.mixed_precision.set_global_policy(before)


class LoRATuner:
    """Freeze ``model``, add LoRA where ``where`` matches, train, average, checkpoint, resume.

    ``loss(*batch)`` computes the loss of one batch by calling ``model``. ``directory``
    (optional) holds the numbered checkpoints. ``slot_memory_kind="pinned_host"`` keeps
    Adam's slots in host memory (QLoRA's recipe). A quantized model (``ps.nn.quantize``
    first) is QLoRA: the adapters train on the frozen int8 kernels.
    """

    def __init__(
        self,
        model: ps.Module,
        loss: Callable[..., jax.Array],
        *,
        rank: int,
        where: str,
        learning_rate: float = 1e-3,
        ema_decay: float = 0.99,
        directory: str | os.PathLike[str] | None = None,
        max_to_keep: int | None = 3,
        slot_memory_kind: str | None = None,
    ) -> None:
        self.model = model
        self.loss = loss
        for v in model.variables:  # the pretrained weights, LayerNorms and embeddings
            v.trainable = False
        self.layers = ps.nn.enable_lora(model, rank, where=where)
        self.lora = list(model.trainable_variables)  # the LoRA factors, nothing else
        self.opt = ps.Optimizer(
            optax.adam(learning_rate), self.lora, slot_memory_kind=slot_memory_kind
        )
        self.ema = ps.ExponentialMovingAverage(ema_decay, num_updates=self.opt.iterations)
        self.ema.apply(self.lora)  # the shadows exist before a restore (a first update is a no-op)
        self.checkpoint = ps.Checkpoint(model=model, optimizer=self.opt, ema=self.ema)
        self.manager = (
            None
            if directory is None
            else ps.CheckpointManager(directory, self.checkpoint, max_to_keep=max_to_keep)
        )
        self.step = ps.function(self._step)
        self._loss = ps.function(loss)  # one compiled loss for both sides of evaluate

    def _step(self, *batch: jax.Array) -> jax.Array:
        loss, grads = ps.value_and_grad(lambda: self.loss(*batch), self.model)()
        self.opt.apply_gradients(grads)  # the frozen variables get no gradient
        self.ema.apply(self.lora)
        return loss

    @property
    def steps_done(self) -> int:
        return int(self.opt.iterations.numpy())

    def resume(self, path: str | None = None) -> int:
        """Restore ``path`` (default: the newest checkpoint of ``directory``, if any) and
        return the number of steps done."""
        if path is None and self.manager is not None:
            path = self.manager.latest_checkpoint
        if path is not None:
            self.checkpoint.restore(path).assert_consumed()
        return self.steps_done

    def train(
        self,
        batches: Sequence[Any],
        *,
        save_every: int | None = None,
        stop_after: int | None = None,
    ) -> list[float]:
        """Run the step on ``batches[steps_done:]`` (a batch is a tuple of ``loss``'s
        arguments or one array), saving every ``save_every`` steps; ``stop_after`` steps
        at most (an interruption). Returns the losses of the steps run."""
        losses: list[float] = []
        for i in range(self.steps_done, len(batches)):
            if stop_after is not None and len(losses) >= stop_after:
                break
            batch = batches[i] if isinstance(batches[i], tuple) else (batches[i],)
            losses.append(float(self.step(*(np.asarray(b) for b in batch))))
            if self.manager is not None and save_every and (i + 1) % save_every == 0:
                self.manager.save(i + 1)
        return losses

    def evaluate(self, *batch: jax.Array) -> tuple[float, float]:
        """``(loss with the trained values, loss with their averages)`` on one batch."""
        raw = float(self._loss(*batch))
        with self.ema.swap(self.lora):
            averaged = float(self._loss(*batch))
        return raw, averaged

    def finalize(self) -> None:
        """The averages become the LoRA values, then LoRA is merged into the kernels."""
        for v in self.lora:
            v.assign(self.ema.average(v).value(), read_value=False)
        ps.nn.merge_lora(self.model)
