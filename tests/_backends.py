"""What differs between JAX's backends, for tests that run on each of them (the suite runs on
CPU, and on a GPU and that machine's CPU with ``tools/gpu_suite.sh``).

XLA:CPU computes a value to the same bits eagerly (one small program per operation) and
inside a compiled program, in this process and in another. XLA:GPU promises neither: it
fuses and rounds a program's arithmetic differently from the same operations run one by
one (measured on an H200: initial values eager against compiled 5.96e-8 apart, the last
bit of float32 values below 1), its autotuner picks convolution algorithms in each
process, and it computes float32 matrix products in TensorFloat-32 by default. So a test comparing two
computations of the same numbers asserts bit equality on CPU and, elsewhere, closeness
within a tolerance it states (``assert_same_numbers``); integers and booleans stay exact
on every backend. (A test of something only one backend has is skipped elsewhere with
``pytest.mark.skipif(jax.default_backend() != "cpu", reason=...)``, the reason saying what.)
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

ON_CPU = jax.default_backend() == "cpu"

# Two computations of float32 values below ~1 that differ only in how XLA fuses and rounds
# them (eager against compiled, one program against another): a few roundings apart.
ROUNDING = {"rtol": 1e-6, "atol": 1e-6}


def assert_same_numbers(
    actual: Any, expected: Any, *, rtol: float, atol: float, err_msg: str = ""
) -> None:
    """``actual`` equals ``expected`` bit for bit on CPU; elsewhere floating-point values are
    within ``rtol``/``atol`` of it (and integers, booleans, shapes and dtypes are equal)."""
    a, e = np.asarray(actual), np.asarray(expected)
    if ON_CPU or not (np.issubdtype(e.dtype, np.inexact) or e.dtype.kind == "V"):
        np.testing.assert_array_equal(a, e, err_msg=err_msg, strict=True)
        return
    assert a.shape == e.shape and a.dtype == e.dtype, (err_msg, a.shape, a.dtype, e.shape, e.dtype)
    np.testing.assert_allclose(
        a.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol, err_msg=err_msg
    )


def device_names() -> str:
    """This process's devices of the default backend as paramstore names them in messages
    (``"cpu:0, cpu:1"``, ``"gpu:0"``)."""
    return ", ".join(f"{d.platform}:{i}" for i, d in enumerate(jax.local_devices()))


def same_backend_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) for a subprocess that must run on this
    process's backend: ``JAX_PLATFORMS=cpu`` when that is the CPU, else the environment as
    it is (which gave this process its backend)."""
    out = dict(os.environ if env is None else env)
    if ON_CPU:
        out["JAX_PLATFORMS"] = "cpu"
    return out


def float32_matmuls() -> Any:
    """A context in which JAX computes float32 matrix products and convolutions in float32 on
    every backend. XLA:GPU's default is TensorFloat-32 (10 mantissa bits; CPU has none), so
    there two computations whose inputs are a rounding apart can differ by ~2**-11 relative,
    and a float32 reference (transformers, a concrete model) is met only to ~1e-3."""
    return jax.default_matmul_precision("float32")
