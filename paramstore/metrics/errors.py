"""``MeanSquaredError`` and ``MeanAbsoluteError`` (Keras 3's regression metrics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paramstore.metrics.base import MeanOf

Array = jax.Array

__all__ = ["MeanSquaredError", "MeanAbsoluteError"]


class _MeanError(MeanOf):
    """``mean(error(y_true - y_pred))`` over the last axis, then over samples (in float32 at
    least), as Keras' ``MeanSquaredError`` / ``MeanAbsoluteError``."""

    @staticmethod
    def _error(diff: Array) -> Array:
        raise NotImplementedError

    def _values(self, y_true: Array, y_pred: Array) -> Array:
        y_pred = y_pred.astype(jnp.result_type(y_pred.dtype, jnp.float32))
        y_true, y_pred = self._paired(y_true.astype(y_pred.dtype), y_pred)
        return jnp.mean(self._error(y_true - y_pred), axis=-1)


class MeanSquaredError(_MeanError):
    """``mean((y_true - y_pred) ** 2)`` over the last axis, then over samples, as
    ``keras.metrics.MeanSquaredError``."""

    @staticmethod
    def _error(diff: Array) -> Array:
        return jnp.square(diff)


class MeanAbsoluteError(_MeanError):
    """``mean(|y_true - y_pred|)`` over the last axis, then over samples, as
    ``keras.metrics.MeanAbsoluteError``."""

    @staticmethod
    def _error(diff: Array) -> Array:
        return jnp.abs(diff)
