"""Shared fixtures: every test runs in a fresh default VariableStore with the seed reset."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _lazy import oracle

# The suite's programs are tiny and each compiled once or twice, so compiling is most of its
# time (57% of a 284-test sample, at ~35 ms a program). XLA's CPU backend spends it in LLVM's
# optimization passes and in its MLIR fusion emitters, which buy nothing here: level 0 with
# LLVM's expensive passes off halves a compile, and the classic elemental emitters
# (`--xla_cpu_use_fusion_emitters=false`) halve it again (that sample: 34.5 s -> 14.6 s of
# backend compile, 60.6 s -> 39.7 s in all, 2026-11-24). What the tests check is unchanged: the
# HLO passes, and so op counts, flops and buffer sizes, are the same, and LLVM keeps IEEE
# semantics at every level. Set before JAX starts its backend; inherited by the subprocesses
# (benchmark smoke tests, examples, notebook kernels). PARAMSTORE_TEST_XLA_OPT=1 keeps XLA's
# defaults. jaxlib 0.11.1 and later abort the process on a flag their XLA does not know (the
# fusion-emitters flag is gone there), so each flag is first tried in a subprocess, once per
# run (the xdist workers inherit the result through the environment): ~1.5 s.
FAST_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
)


def _known_flags(flags: tuple[str, ...]) -> list[str]:
    """The ``flags`` this jaxlib's XLA accepts (one subprocess, more only if one fails)."""

    def accepted(group: tuple[str, ...]) -> bool:
        env = {**os.environ, "XLA_FLAGS": " ".join(group), "JAX_PLATFORMS": "cpu"}
        probe = "import jax; jax.devices()"
        return (
            subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode
            == 0
        )

    if accepted(flags):
        return list(flags)
    return [f for f in flags if accepted((f,))]


if (
    os.environ.get("PARAMSTORE_TEST_XLA_OPT") != "1"
    and "PARAMSTORE_TEST_FLAGS_SET" not in os.environ
):
    os.environ["PARAMSTORE_TEST_FLAGS_SET"] = "1"
    flags = " ".join(_known_flags(FAST_COMPILE))
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()

import paramstore as ps  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_store():
    """A fresh default ``ps.VariableStore`` (names start over) and ``ps.random.set_seed(0)``."""
    ps.random.set_seed(0)
    with ps.VariableStore() as store:
        yield store


@pytest.fixture(scope="session")
def keras():
    """Keras 3, the oracle of the layer and metric tests (in the test extra: never skipped).
    Imported once per process by ``_lazy.oracle``, its objects then frozen out of the
    garbage collector's walks (Keras imports TensorFlow, its backend by default)."""
    return oracle("keras")


@pytest.fixture(scope="session")
def tf():
    """TensorFlow, the oracle of the tests marked ``tf`` (in the test extra: never skipped).

    Imported once per process, then ``gc.freeze()`` (``_lazy.oracle``): TF's import adds
    ~330,000 long-lived objects that every later full collection would walk again (and JAX
    runs its own collection on each), slowing every test that follows in the same worker.
    """
    return oracle("tensorflow")
