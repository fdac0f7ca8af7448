"""Optax optimizers over Variables (being written)."""

__all__ = ["Optimizer"]


class Optimizer:  # placeholder until the optimizer issue lands
    pass
