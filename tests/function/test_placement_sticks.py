"""A new placement sticks (issue 33): after a restore onto a new sharding (or a reshard), a
``ps.function`` compiled before computes and writes back on the new placement, and no call
moves a variable back. Each write that moves a variable goes through ownership's one write
path, which moves ``TRACE_EPOCH``, so no path can forget to.

The checks run on a mesh of 8 forced CPU devices in this file's subprocess
(``python tests/function/test_placement_sticks.py OUT.json``, as ``tests/sharding``)."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the multi-device subprocess: before jax is imported
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _multidevice import multi_device_tests, run_checks
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import paramstore as ps

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("x",))


def _spec(v: ps.Variable) -> P:
    sh = v.value().sharding
    assert isinstance(sh, NamedSharding), sh
    return sh.spec


@check
def check_a_restore_onto_a_new_sharding_sticks_across_calls_compiled_before():
    mesh = _mesh()
    v = ps.Variable(jnp.arange(16.0), sharding=NamedSharding(mesh, P()))
    step = ps.function(lambda: v.assign_add(jnp.ones(16)))
    step()  # compiled while v is replicated
    saver = ps.Saver([v])
    with tempfile.TemporaryDirectory() as d:
        path = saver.save(os.path.join(d, "ckpt"))
        saver.restore(path, sharding=NamedSharding(mesh, P("x")))
    assert _spec(v) == P("x")
    for _ in range(2):
        step()
        # Old code: the program pinned P() and the restore did not move the trace epoch,
        # so the call wrote v back replicated.
        assert _spec(v) == P("x"), _spec(v)
    np.testing.assert_array_equal(v.numpy(), np.arange(16.0) + 3.0)


@check
def check_an_optimizer_step_keeps_restored_shardings_of_parameters_and_slots():
    mesh = _mesh()
    w = ps.Variable(jnp.ones((8, 4)), sharding=NamedSharding(mesh, P()))
    opt = ps.Optimizer(optax.adam(0.1), [w])

    @ps.function
    def train(x):
        loss, grads = ps.value_and_grad(lambda: jnp.sum((x @ w.value().T) ** 2), [w])()
        opt.apply_gradients(grads)
        return loss

    x = jnp.ones((2, 4))
    train(x)  # compiled on P()
    state = [w, *opt.variables]
    saver = ps.Saver(state)
    targets = {v.name: NamedSharding(mesh, P("x")) for v in state if v.shape[:1] == (8,)}
    assert len(targets) == 3  # w and its two Adam slots
    with tempfile.TemporaryDirectory() as d:
        path = saver.save(os.path.join(d, "ckpt"))
        saver.restore(path, sharding=targets)
    before = w.numpy()
    train(x)
    for v in state:
        if v.name in targets:
            assert _spec(v) == P("x"), (v.name, _spec(v))
    assert not np.array_equal(w.numpy(), before)


@check
def check_a_reshard_then_host_updates_keep_the_new_sharding():
    mesh = _mesh()
    v = ps.Variable(jnp.zeros(16), sharding=NamedSharding(mesh, P()))
    step = ps.function(lambda: v.assign_add(jnp.ones(16)))
    step()
    ps.sharding.reshard(v, NamedSharding(mesh, P("x")))
    step()
    assert _spec(v) == P("x")
    ps.update([v], {v.name: np.full(16, 5.0, np.float32)})  # a value from the host: kept on P("x")
    step()
    assert _spec(v) == P("x")
    np.testing.assert_array_equal(v.numpy(), np.full(16, 6.0))


placement_results, test_multi_device = multi_device_tests(
    CHECKS, __file__, "placement_sticks_results"
)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        run_checks(CHECKS, sys.argv[1])
