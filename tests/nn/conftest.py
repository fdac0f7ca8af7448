"""Every layer test leaves the global mixed precision policy at float32."""

from __future__ import annotations

import pytest

import paramstore as ps


@pytest.fixture(autouse=True)
def float32_policy():
    yield
    ps.mixed_precision.set_global_policy("float32")
