"""Shared fixtures: every test runs in a fresh default VariableStore with the seed reset."""

from __future__ import annotations

import pytest

import paramstore as ps


@pytest.fixture(autouse=True)
def fresh_store():
    """A fresh default ``ps.VariableStore`` (names start over) and ``ps.random.set_seed(0)``."""
    ps.random.set_seed(0)
    with ps.VariableStore() as store:
        yield store
