"""``python -m paramstore doctor``: what paramstore runs on, and a self-test of a few seconds.

It prints paramstore's, Python's, JAX's and jaxlib's versions, the default backend and its
devices, then one line per check, ``ok`` or ``FAILED`` with the reason:

* a donated compiled step updates its variables in place (``ps.function``, the old buffer
  deleted where the backend donates);
* a variable read and assigned in ``while_loop`` (condition included), ``scan`` and
  ``vmap`` bodies inside a ``ps.function`` equals the same program run eagerly, step by
  step, in Python;
* a checkpoint round trip (``ps.Checkpoint`` save and restore) in a directory made by
  ``tempfile`` (so ``TMPDIR`` picks where).

The exit status is 0 when every check passes, 1 otherwise; the last line names the
failing checks. A check that raises is a failure with the exception as its reason, never a
traceback.
"""

from __future__ import annotations

import importlib.metadata
import platform
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import paramstore as ps
from paramstore import __version__

__all__ = ["CHECKS", "main"]


def _donated_step() -> str:
    w = ps.Variable(jnp.zeros(1024), name="doctor_w")

    @ps.function
    def step(x: jax.Array) -> jax.Array:
        w.assign_add(x)
        return w.value().sum()

    x = jnp.ones(1024)
    text = step.lower(x).as_text()
    if "aliasing_output" not in text and "buffer_donor" not in text:
        raise AssertionError("the compiled step does not donate the variable's buffer")
    step(x)
    held = w.value()  # the user holds this array: the next step may not donate it
    step(x)
    step(x)
    if held.is_deleted() or not np.allclose(np.asarray(held), 1.0):
        raise AssertionError("an array handed out before a step was deleted or changed")
    if not np.allclose(w.numpy(), 3.0):
        raise AssertionError(f"after 3 steps the variable holds {w.numpy()[:3]}, not 3.0")
    return "donated in place, 3 steps right, a handed-out array kept valid"


def _control_flow() -> str:
    c = ps.Variable(jnp.zeros(()), name="doctor_count")
    acc = ps.Variable(jnp.zeros(3), name="doctor_acc")
    xs = jnp.arange(12.0).reshape(4, 3)

    def program(n: jax.Array) -> tuple[jax.Array, jax.Array]:
        def step(i: jax.Array) -> jax.Array:
            c.assign_add(1.0)
            return i + 1

        # bounded by a counter: a condition that never saw the body's assigns ends at 50
        jax.lax.while_loop(lambda i: (c < n) & (i < 50), step, jnp.asarray(0))

        def body(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
            acc.assign(acc * 0.5 + x)
            return carry + c.value(), None

        total = jax.lax.scan(body, jnp.zeros(()), xs)[0]
        rows = jax.vmap(lambda x: (x * acc).sum())(xs)
        return total, rows

    compiled = ps.function(program)(jnp.asarray(5.0))
    got: tuple[object, ...] = (float(c.numpy()), acc.numpy().copy(), *map(np.asarray, compiled))
    c.assign(0.0)
    acc.assign(jnp.zeros(3))
    # the same program eagerly, step by step, in Python
    while float(c.numpy()) < 5.0:
        c.assign_add(1.0)
    total = 0.0
    for x in np.asarray(xs):
        acc.assign(acc.numpy() * 0.5 + x)
        total += float(c.numpy())
    rows = np.asarray(xs) @ acc.numpy()
    want = (float(c.numpy()), acc.numpy(), np.asarray(total), rows)
    for name, a, b in zip(("while_loop", "scan", "scan output", "vmap"), got, want):
        if not np.allclose(np.asarray(a), b, rtol=1e-5):
            raise AssertionError(f"{name}: the compiled program gave {a}, eager code {b}")
    return "while_loop (condition and body), scan and vmap equal eager code"


def _checkpoint() -> str:
    v = ps.Variable(jnp.arange(6.0).reshape(2, 3), name="doctor_v")
    with tempfile.TemporaryDirectory(prefix="paramstore-doctor-") as tmp:
        path = ps.Checkpoint(v=v).save(f"{tmp}/ckpt")
        want = v.numpy().copy()
        v.assign(jnp.zeros((2, 3)))
        ps.Checkpoint(v=v).restore(path)
        if not np.array_equal(v.numpy(), want):
            raise AssertionError(f"restored {v.numpy()}, saved {want}")
        return f"saved and restored under {tempfile.gettempdir()}"


CHECKS: dict[str, Callable[[], str]] = {
    "donated compiled step": _donated_step,
    "variables in while_loop/scan/vmap": _control_flow,
    "checkpoint round trip": _checkpoint,
}


def main(argv: list[str] | None = None) -> int:
    """Print the versions and run ``CHECKS``; the exit status (module docstring)."""
    del argv
    backend = jax.default_backend()
    devices = jax.devices()
    print(f"paramstore {__version__}")
    print(f"python     {platform.python_version()}")
    print(f"jax        {jax.__version__}")
    print(f"jaxlib     {importlib.metadata.version('jaxlib')}")
    print(f"backend    {backend}: {len(devices)} device(s): {', '.join(map(str, devices))}")
    failed = []
    for name, check in CHECKS.items():
        start = time.perf_counter()
        try:
            with ps.VariableStore():
                detail = check()
            status = f"ok      {detail}"
        except Exception as e:
            failed.append(name)
            status = f"FAILED  {type(e).__name__}: {e}"
        print(f"{name:36s} {status} ({time.perf_counter() - start:.1f} s)")
    if failed:
        print(f"doctor: {len(failed)} check(s) FAILED: {', '.join(failed)}")
        return 1
    print(f"doctor: all {len(CHECKS)} checks passed")
    return 0
