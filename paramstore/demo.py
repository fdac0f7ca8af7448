"""``python -m paramstore demo``: train an MLP on scikit-learn's digits, end to end.

What it shows, in about a hundred lines: a ``ps.Module`` of ``ps.nn.Dense`` layers that build
their Variables on the first call (reproducible through ``ps.random.set_seed``), an
``optax.adam`` optimizer whose state lives in Variables (``ps.Optimizer``), a compiled
``@ps.function`` training step that updates the model and Keras-style metrics
(``ps.metrics.Mean``, ``ps.metrics.SparseCategoricalAccuracy``) in place, evaluation, and a
checkpoint of model and optimizer (a ``ps.Checkpoint``) written with ``ps.CheckpointManager``.

The digits data set (1797 8x8 images) ships with scikit-learn, so nothing is downloaded.
scikit-learn and tqdm come with the ``demo`` extra: ``pip install 'paramstore[demo]'``.
The defaults train in a few seconds on a laptop CPU and reach about 97% test accuracy.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

import paramstore as ps

__all__ = ["main", "MLP"]

DEFAULT_OUTPUT_DIR = "./paramstore-demo"


class MLP(ps.Module):
    """A stack of ``ps.nn.Dense`` layers with ReLU between them; the layers build their
    variables (``mlp/dense/kernel``, ``mlp/dense/bias``, ...) on the first call."""

    def __init__(self, units: Sequence[int], name: str | None = None) -> None:
        last = len(units) - 1
        self.layers = [
            ps.nn.Dense(n, activation=None if i == last else "relu") for i, n in enumerate(units)
        ]

    def __call__(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m paramstore demo",
        description=(
            "Train a small MLP (64-128-64-10) on scikit-learn's bundled digits data set "
            "with optax Adam and a compiled ps.function step, print the test accuracy, "
            "and save a checkpoint of the model and optimizer state."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=_positive_int, default=600, help="number of training steps")
    parser.add_argument(
        "--batch-size", type=_positive_int, default=64, help="examples per training step"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed for the initial weights (ps.random.set_seed), the train/test split and "
        "the batch order; the same seed gives the same run",
    )
    parser.add_argument(
        "--learning-rate", type=_positive_float, default=3e-3, help="Adam's learning rate"
    )
    parser.add_argument(
        "--output-dir",
        default=DEFAULT_OUTPUT_DIR,
        help="directory for the checkpoint (a ps.CheckpointManager directory; inspect it "
        "with `python -m paramstore inspect DIR`)",
    )
    parser.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    return parser


def _load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    datasets = importlib.import_module("sklearn.datasets")
    train_test_split = importlib.import_module("sklearn.model_selection").train_test_split
    digits = datasets.load_digits()
    x = (digits.data / 16.0).astype(np.float32)  # pixels are 0..16
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y
    )
    return x_train, x_test, y_train, y_test


def _batches(n: int, batch_size: int, rng: np.random.Generator) -> Any:
    """Endless minibatch indices: a fresh permutation each epoch."""
    batch_size = min(batch_size, n)
    while True:
        order = rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        importlib.import_module("sklearn")  # optional (the demo extra): imported on use
        tqdm = importlib.import_module("tqdm.auto").tqdm
    except ImportError as e:
        print(
            f"error: the demo needs scikit-learn and tqdm ({e.name} is missing). Install them "
            "with: pip install 'paramstore[demo]'",
            file=sys.stderr,
        )
        return 1

    ps.random.set_seed(args.seed)
    x_train, x_test, y_train, y_test = _load_data(args.seed)
    print(
        f"digits: {len(x_train)} training and {len(x_test)} test images of 8x8 pixels; "
        f"jax {jax.__version__} on {jax.devices()[0].platform}"
    )

    with ps.VariableStore():  # a fresh namespace: main() can run twice in one process
        model = MLP([128, 64, 10])
        model(x_train[:1])  # the layers build their variables from the input's last axis
        opt = ps.Optimizer(optax.adam(args.learning_rate), model)
        n_params = sum(v.size for v in model.trainable_variables)
        n_opt = len(opt.variables)
        print(
            f"model: {len(model.trainable_variables)} variables, {n_params} parameters "
            f"(the checkpoint also holds the optimizer's {n_opt} variables)"
        )

        train_loss = ps.metrics.Mean(name="loss")
        train_accuracy = ps.metrics.SparseCategoricalAccuracy(name="accuracy")
        test_accuracy = ps.metrics.SparseCategoricalAccuracy(name="test_accuracy")

        @ps.function
        def train_step(x: jax.Array, y: jax.Array) -> jax.Array:
            def loss_fn() -> tuple[jax.Array, jax.Array]:
                logits = model(x)
                loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
                return loss, logits

            (loss, logits), grads = ps.value_and_grad(loss_fn, model, has_aux=True)()
            opt.apply_gradients(grads)
            train_loss.update_state(loss)
            train_accuracy.update_state(y, logits)
            return loss

        @ps.function
        def evaluate(x: jax.Array | np.ndarray, y: jax.Array | np.ndarray) -> jax.Array:
            test_accuracy.update_state(y, model(x))
            return test_accuracy.result()

        rng = np.random.default_rng(args.seed)
        batches = _batches(len(x_train), args.batch_size, rng)
        start = time.perf_counter()
        bar = tqdm(
            range(args.steps), desc="training", unit="step", disable=args.no_progress, leave=True
        )
        loss = None
        for step in bar:
            idx = next(batches)
            loss = train_step(x_train[idx], y_train[idx])
            if step % 25 == 0 or step == args.steps - 1:
                bar.set_postfix(
                    loss=f"{float(train_loss.result()):.4f}",
                    accuracy=f"{float(train_accuracy.result()):.3f}",
                    refresh=False,
                )
            if (step + 1) % 100 == 0:  # Keras' per-epoch reset, every 100 steps here
                train_loss.reset_state()
                train_accuracy.reset_state()
        final_loss = float(loss) if loss is not None else float("nan")
        seconds = time.perf_counter() - start
        bar.close()

        accuracy = float(evaluate(x_test, y_test))
        print(
            f"trained {args.steps} steps in {seconds:.1f}s "
            f"(including compilation); final batch loss {final_loss:.4f}"
        )
        print(f"test accuracy: {accuracy:.4f}")

        ckpt = ps.Checkpoint(model=model, optimizer=opt)
        manager = ps.CheckpointManager(args.output_dir, ckpt, max_to_keep=3)
        path = manager.save(int(opt.iterations.numpy()))
        count = len(ckpt.variables_by_path())
        print(
            f"checkpoint: saved {count} variables (model {len(model.variables)}, optimizer "
            f"{count - len(model.variables)}) to {os.path.abspath(path)}"
        )
        print(f"  inspect it with: python -m paramstore inspect {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
