"""Shared fixtures: every test runs in a fresh default VariableStore with the seed reset."""

from __future__ import annotations

import gc
import os

import pytest

import paramstore as ps


@pytest.fixture(autouse=True)
def fresh_store():
    """A fresh default ``ps.VariableStore`` (names start over) and ``ps.random.set_seed(0)``."""
    ps.random.set_seed(0)
    with ps.VariableStore() as store:
        yield store


@pytest.fixture(scope="session")
def keras():
    """Keras 3, the oracle of the layer and metric tests (they skip without it)."""
    return pytest.importorskip("keras")


@pytest.fixture(scope="session")
def tf():
    """TensorFlow, the oracle of the tests marked ``tf`` (they skip without it).

    Imported once per process, then ``gc.freeze()``: TF's import adds ~330,000 long-lived
    objects that every later full collection would walk again (and JAX runs its own collection
    on each), slowing every test that follows in the same worker. Frozen, they are skipped.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # no C++ banner about CPU features
    module = pytest.importorskip("tensorflow")
    gc.collect()
    gc.freeze()
    return module
