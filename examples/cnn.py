"""A Keras-style CNN on scikit-learn's digits, checkpointed every epoch, resumable exactly.

Run ``python examples/cnn.py`` (about half a minute on a 2-core CPU). It shows:

* a ``ps.nn.Sequential`` of Conv2D, MaxPooling2D, Flatten, Dropout and Dense, built up front
  with ``model.build((None, 8, 8, 1))`` (as Keras' ``model.build``) and shown by
  ``ps.summary``;
* ``ps.metrics`` (``Mean`` for the loss, ``SparseCategoricalAccuracy``) updated inside the
  compiled ``ps.function`` step, reset every epoch, as Keras' ``fit`` does;
* ``training=True`` given once to the model and passed down to its Dropout;
* a ``ps.Checkpoint`` of the model, the optimizer, the Dropout's ``ps.random.Generator``, the
  epoch counter and the history, saved every epoch by a ``ps.CheckpointManager``. Rerunning
  the same command after a kill resumes from the last epoch saved and ends with exactly the
  weights and history an uninterrupted run gives (the batch order of epoch ``e`` comes from
  ``(seed, e)``, the Dropout masks from the checkpointed generator). Bit for bit on CPU; on a
  GPU to ~1e-3 (XLA:GPU does not promise one process the bits of another: its autotuner
  picks each convolution's algorithm in each process).
  ``--stop-after-epoch K`` simulates the kill (the process exits at once after saving K);
* a plot of the loss and accuracy per epoch, saved to ``OUTPUT_DIR/history.png``.

The digits data set (1797 8x8 images) ships with scikit-learn: nothing is downloaded.
Needs ``pip install 'paramstore[demo]' matplotlib``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import paramstore as ps

COLUMNS = ("loss", "accuracy", "val_loss", "val_accuracy")


def make_model(generator: ps.random.Generator) -> ps.nn.Sequential:
    """Keras' classic MNIST CNN, scaled to 8x8 digits."""
    return ps.nn.Sequential(
        [
            ps.nn.Conv2D(32, 3, padding="same", activation="relu"),
            ps.nn.MaxPooling2D(),
            ps.nn.Conv2D(64, 3, padding="same", activation="relu"),
            ps.nn.MaxPooling2D(),
            ps.nn.Flatten(),
            ps.nn.Dropout(0.5, generator=generator),
            ps.nn.Dense(10),
        ],
        name="cnn",
    )


def load_digits(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    datasets = importlib.import_module("sklearn.datasets")
    split = importlib.import_module("sklearn.model_selection").train_test_split
    digits = datasets.load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]  # (1797, 8, 8, 1), 0..1
    y = digits.target.astype(np.int32)
    return tuple(split(x, y, test_size=0.25, random_state=seed, stratify=y))  # type: ignore[return-value]


def plot(history: np.ndarray, path: Path) -> None:
    """Loss and accuracy per epoch, training and validation, to a PNG."""
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    epochs = np.arange(1, len(history) + 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, col in ((left, 0), (right, 1)):
        ax.plot(epochs, history[:, col], "o-", label="training")
        ax.plot(epochs, history[:, col + 2], "s-", label="validation")
        ax.set_xlabel("epoch")
        ax.set_title(COLUMNS[col])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="./cnn-digits")
    p.add_argument(
        "--stop-after-epoch",
        type=int,
        default=None,
        help="exit at once after saving this epoch, as a kill would (then rerun to resume)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.output_dir)
    x_train, x_test, y_train, y_test = load_digits(args.seed)
    ps.random.set_seed(args.seed)
    with ps.VariableStore():
        generator = ps.random.Generator(args.seed + 1)  # the Dropout masks' stream
        model = make_model(generator)
        model.build((None, 8, 8, 1))
        opt = ps.Optimizer(optax.adam(args.learning_rate), model)
        epoch = ps.Variable(0, dtype=jnp.int32, trainable=False, name="epoch")
        history = ps.Variable(
            np.zeros((args.epochs, len(COLUMNS)), np.float32), trainable=False, name="history"
        )
        ckpt = ps.Checkpoint(
            model=model, optimizer=opt, generator=generator, epoch=epoch, history=history
        )
        manager = ps.CheckpointManager(out, ckpt, max_to_keep=2)
        if manager.latest_checkpoint is not None:
            ckpt.restore(manager.latest_checkpoint).assert_consumed()
            print(f"resumed from epoch {int(epoch.numpy())} ({manager.latest_checkpoint})")
        else:
            print(ps.summary(model))

        loss_m, acc_m = ps.metrics.Mean(name="loss"), ps.metrics.SparseCategoricalAccuracy()
        val_loss_m = ps.metrics.Mean(name="val_loss")
        val_acc_m = ps.metrics.SparseCategoricalAccuracy(name="val_accuracy")

        @ps.function
        def train_step(x: jax.Array, y: jax.Array) -> None:
            def loss_fn() -> tuple[jax.Array, jax.Array]:
                logits = model(x, training=True)  # reaches the Dropout
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

            (loss, logits), grads = ps.value_and_grad(loss_fn, model, has_aux=True)()
            opt.apply_gradients(grads)
            loss_m.update_state(loss, sample_weight=jnp.asarray(len(y), jnp.float32))
            acc_m.update_state(y, logits)

        @ps.function
        def test_step(x: jax.Array, y: jax.Array) -> None:
            logits = model(x)
            val_loss_m.update_state(optax.softmax_cross_entropy_with_integer_labels(logits, y))
            val_acc_m.update_state(y, logits)

        metrics = (loss_m, acc_m, val_loss_m, val_acc_m)
        for e in range(int(epoch.numpy()), args.epochs):
            start = time.perf_counter()
            for m in metrics:
                m.reset_state()
            order = np.random.default_rng([args.seed, e]).permutation(len(x_train))
            for i in range(0, len(order), args.batch_size):
                idx = order[i : i + args.batch_size]
                train_step(x_train[idx], y_train[idx])
            test_step(x_test, y_test)
            row = np.array([float(m.result()) for m in metrics], np.float32)
            history[e].assign(row)
            epoch.assign(e + 1)
            manager.save(e + 1)
            cells = "  ".join(f"{c} {v:.4f}" for c, v in zip(COLUMNS, row))
            print(f"epoch {e + 1}/{args.epochs}  {cells}  ({time.perf_counter() - start:.1f}s)")
            if args.stop_after_epoch == e + 1:
                print(f"stopping after epoch {e + 1} (--stop-after-epoch)", flush=True)
                sys.stderr.flush()
                os._exit(3)  # as a kill: no cleanup runs
        plot(np.asarray(history.numpy()), out / "history.png")
        print(f"history plot: {out / 'history.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
