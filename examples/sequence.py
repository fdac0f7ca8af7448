"""A recurrent classifier: scikit-learn's digits read row by row by a bidirectional GRU.

Run ``python examples/sequence.py`` (about half a minute on a 2-core CPU). Each 8x8 digit is
a sequence of 8 rows of 8 pixels, the classic "row-by-row MNIST" task at a small scale. It
shows:

* ``ps.nn.Bidirectional(ps.nn.GRU(...))`` and ``ps.nn.LSTM`` (Keras 3's variables and
  results; the time loop is one ``lax.scan``) in a ``ps.nn.Sequential``, built up front with
  ``model.build((None, 8, 8))`` and shown by ``model.summary()``;
* a training step compiled by ``ps.function`` (optax's Adam through ``ps.Optimizer``) and
  ``ps.metrics`` called Keras-style, ``metric(y_true, y_pred)``;
* a ``ps.Checkpoint`` of the model and optimizer saved every epoch by a
  ``ps.CheckpointManager``, and restored into a fresh model to check it predicts the same;
* a plot of the loss and accuracy per epoch, saved to ``OUTPUT_DIR/history.png``.

The digits data set (1797 images) ships with scikit-learn: nothing is downloaded.
Needs ``pip install 'paramstore[demo]' matplotlib``.
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
import optax

import paramstore as ps

COLUMNS = ("loss", "accuracy", "val_accuracy", "val_top2")


def make_model(units: int) -> ps.nn.Sequential:
    """Bidirectional GRU over the rows, an LSTM over its sequence, then the classes."""
    return ps.nn.Sequential(
        [
            ps.nn.Bidirectional(ps.nn.GRU(units, return_sequences=True)),
            ps.nn.LSTM(units),
            ps.nn.Dense(10),
        ],
        name="rnn",
    )


def load_digits(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Train/test split of the digits as (N, 8 rows, 8 pixels) in [0, 1], labels int32."""
    datasets = importlib.import_module("sklearn.datasets")
    split = importlib.import_module("sklearn.model_selection").train_test_split
    digits = datasets.load_digits()
    x = (digits.images / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    return tuple(split(x, y, test_size=0.25, random_state=seed, stratify=y))  # type: ignore[return-value]


def plot(history: np.ndarray, path: Path) -> None:
    """Training loss, and training and validation accuracy, per epoch, to a PNG."""
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    epochs = np.arange(1, len(history) + 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(epochs, history[:, 0], "o-")
    left.set_title("training loss")
    for col, label in ((1, "training"), (2, "validation"), (3, "validation, top 2")):
        right.plot(epochs, history[:, col], "o-", label=label)
    right.set_title("accuracy")
    right.legend()
    for ax in (left, right):
        ax.set_xlabel("epoch")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--units", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", type=Path, default=Path("sequence-example"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    x_train, x_test, y_train, y_test = load_digits(args.seed)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    ps.random.set_seed(args.seed)
    with ps.VariableStore():
        model = make_model(args.units)
        model.build((None, 8, 8))
        model.summary()
        opt = ps.Optimizer(optax.adam(args.learning_rate), model)
        loss_metric = ps.metrics.Mean(name="loss")
        accuracy = ps.metrics.SparseCategoricalAccuracy(name="accuracy")
        val_accuracy = ps.metrics.SparseCategoricalAccuracy(name="val_accuracy")
        val_top2 = ps.metrics.SparseTopKCategoricalAccuracy(k=2, name="val_top2")

        @ps.function
        def train_step(x: jax.Array, y: jax.Array) -> None:
            def loss_fn() -> tuple[jax.Array, jax.Array]:
                logits = model(x)
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

            (loss, logits), grads = ps.value_and_grad(loss_fn, model, has_aux=True)()
            opt.apply_gradients(grads)
            loss_metric(loss)
            accuracy(y, logits)

        @ps.function
        def test_step(x: jax.Array, y: jax.Array) -> None:
            logits = model(x)
            val_accuracy(y, logits)
            val_top2(y, logits)

        manager = ps.CheckpointManager(
            args.output_dir / "checkpoints", ps.Checkpoint(model=model, optimizer=opt), 2
        )
        history = []
        rng = np.random.default_rng(args.seed)
        start = time.perf_counter()
        for epoch in range(args.epochs):
            for m in (loss_metric, accuracy, val_accuracy, val_top2):
                m.reset_state()
            order = rng.permutation(len(x_train))
            for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
                idx = order[i : i + args.batch_size]
                train_step(x_train[idx], y_train[idx])
            test_step(x_test, y_test)
            row = [float(m.result()) for m in (loss_metric, accuracy, val_accuracy, val_top2)]
            history.append(row)
            manager.save(epoch + 1)
            print(
                f"epoch {epoch + 1}/{args.epochs}: loss {row[0]:.4f}, accuracy {row[1]:.3f}, "
                f"val_accuracy {row[2]:.3f}, val_top2 {row[3]:.3f}"
            )
        seconds = time.perf_counter() - start
        predictions = np.asarray(model(x_test[:16]))

    # A fresh model (a new store, as a new process would have) restored from the last save.
    with ps.VariableStore():
        fresh = make_model(args.units)
        fresh.build((None, 8, 8))
        status = ps.Checkpoint(model=fresh).restore(manager.latest_checkpoint)
        status.expect_partial()  # the optimizer's state is in the file too; not restored here
        same = np.allclose(np.asarray(fresh(x_test[:16])), predictions, atol=1e-5)
    plot(np.asarray(history), args.output_dir / "history.png")
    print(f"trained {args.epochs} epochs in {seconds:.1f}s (including compilation)")
    print(f"restored from {manager.latest_checkpoint}: same predictions: {same}")
    print(f"plot: {args.output_dir / 'history.png'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
