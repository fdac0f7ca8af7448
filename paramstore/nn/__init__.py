"""``ps.nn``: Keras-style layers on ``ps.Module`` and ``ps.Variable``.

Every layer builds its variables on its first call, from the input's last axis, eagerly or
during the first trace of a ``ps.function`` (no ``in_features`` up front). Names,
arguments and defaults follow Keras; see ``docs/api.md``.
"""

from paramstore.nn._base import Layer
from paramstore.nn.attention import MultiHeadAttention
from paramstore.nn.conv import Conv2D
from paramstore.nn.core import Dense, Dropout, Embedding, Sequential
from paramstore.nn.normalization import BatchNormalization, LayerNormalization
from paramstore.nn.repeat import Repeat

__all__ = [
    "BatchNormalization",
    "Conv2D",
    "Dense",
    "Dropout",
    "Embedding",
    "Layer",
    "LayerNormalization",
    "MultiHeadAttention",
    "Repeat",
    "Sequential",
]
