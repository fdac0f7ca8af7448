"""ps.ExponentialMovingAverage's shadows keep their variable's sharding (8 forced CPU
devices, in one subprocess: see tests/_multidevice.py)."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the multi-device subprocess: before jax is imported
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from _multidevice import multi_device_tests, run_checks
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import paramstore as ps

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


@check
def check_shadows_have_the_variables_sharding_eagerly_and_in_a_function():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    w = ps.Variable(jnp.arange(64.0).reshape(8, 8), sharding=sharding, name="w")
    ema = ps.ExponentialMovingAverage(0.5)
    ema.apply([w])
    shadow = ema.average(w)
    assert shadow.sharding == sharding, shadow.sharding

    @ps.function
    def step():
        w.assign_add(jnp.ones((8, 8)))
        ema.apply([w])

    step()
    assert shadow.sharding == sharding and w.sharding == sharding
    np.testing.assert_allclose(shadow.numpy(), np.arange(64.0).reshape(8, 8) + 0.5)


averaging_results, test_multi_device = multi_device_tests(CHECKS, __file__, "averaging_results")

if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1])
