"""``ps.nn``: Keras-style layers on ``ps.Module`` and ``ps.Variable``.

Every layer builds its variables on its first call, from the input's shape, eagerly or
during the first trace of a ``ps.function`` (no ``in_features`` up front), or when
``layer.build(input_shape)`` is called. Names, arguments, defaults and output shapes
follow Keras 3; see ``docs/api.md`` and ``docs/layers.md``.
"""

from paramstore.nn._arguments import ACTIVATIONS
from paramstore.nn._base import Layer
from paramstore.nn.attention import MultiHeadAttention
from paramstore.nn.conv import Conv1D, Conv2D
from paramstore.nn.core import Dense, Dropout, Embedding, Sequential
from paramstore.nn.grouped_attention import GroupQueryAttention
from paramstore.nn.lora import enable_lora, merge_lora
from paramstore.nn.normalization import BatchNormalization, LayerNormalization, RMSNormalization
from paramstore.nn.pooling import (
    AveragePooling2D,
    GlobalAveragePooling2D,
    GlobalMaxPooling2D,
    MaxPooling2D,
)
from paramstore.nn.quantize import dequantize, quantize
from paramstore.nn.recurrent import GRU, LSTM, Bidirectional
from paramstore.nn.repeat import Repeat
from paramstore.nn.reshaping import Activation, Flatten, Reshape
from paramstore.nn.rotary import RotaryEmbedding

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "AveragePooling2D",
    "BatchNormalization",
    "Bidirectional",
    "Conv1D",
    "Conv2D",
    "Dense",
    "Dropout",
    "Embedding",
    "Flatten",
    "GRU",
    "GlobalAveragePooling2D",
    "GlobalMaxPooling2D",
    "GroupQueryAttention",
    "Layer",
    "LSTM",
    "LayerNormalization",
    "MaxPooling2D",
    "MultiHeadAttention",
    "RMSNormalization",
    "Repeat",
    "Reshape",
    "RotaryEmbedding",
    "Sequential",
    "dequantize",
    "enable_lora",
    "merge_lora",
    "quantize",
]
