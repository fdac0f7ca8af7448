"""Shared helpers of the layer tests (tests/nn): random float32 inputs, float32 views of
results, and snapshots of a module's variables to check that nothing changed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np


def random_source(seed: int | np.random.Generator) -> Callable[..., np.ndarray]:
    """``rand(*shape)``: standard normal float32 arrays from ``seed`` (or that generator)."""
    rng = np.random.default_rng(seed)
    return lambda *shape: rng.standard_normal(shape).astype(np.float32)


def f32(x: Any) -> np.ndarray:
    """``x`` as a float32 NumPy array (a bfloat16 result compared with an oracle's)."""
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def snapshot(module: Any) -> dict[str, tuple[np.ndarray, Any, bool]]:
    """Every variable of ``module``: a copy of its value, its dtype and trainable flag."""
    return {v.name: (v.numpy().copy(), v.dtype, v.trainable) for v in module.variables}


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two snapshots are equal: the same names, values, dtypes and flags."""
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k][0], b[k][0])
        assert a[k][1:] == b[k][1:], k
