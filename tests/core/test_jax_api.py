"""paramstore on the JAX its users have (issue 32): no version number is compared, the
internals it needs are checked at import by what they do, no JAX rule is ever replaced
(not even while paramstore traces), and a current trace an interrupt inside JAX left unset
is mended."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.state import discharge

import paramstore as ps
from paramstore._core import jax_api
from paramstore._core.interrupts import deferred

ROOT = Path(__file__).resolve().parents[2]

# A plain JAX program whose while_loop condition reads a ref its body writes (the case
# paramstore rewrites in its own programs); with "paramstore" in argv, paramstore is
# imported and used (a ps.function with such a loop) first. It prints JAX's while_loop
# discharge rules (by name), the discharged jaxpr and the lowering: all as without paramstore.
PROGRAM = """
import sys
import jax
from jax._src.state import discharge

if "paramstore" in sys.argv:
    import paramstore as ps

    c = ps.Variable(0)

    @ps.function
    def count_to(n):
        jax.lax.while_loop(lambda _: c < n, lambda _: c.assign_add(1, read_value=False), None)
        return c.value()

    assert int(count_to(3)) == 3


def plain(n):
    r = jax.new_ref(0)

    def body(i):
        r[...] = r[...] + 1
        return i + 1

    jax.lax.while_loop(lambda i: (r[...] < n) & (i < 50), body, 0)
    return r[...]


from jax.extend.core.primitives import while_p

tables = {k: v for k, v in vars(discharge).items() if isinstance(v, dict) and "rule" in k}
for name, table in sorted(tables.items()):  # the while_loop rule of each table
    rule = table.get(while_p)
    print(name, getattr(getattr(rule, "func", rule), "__qualname__", rule))
print(discharge.discharge_state(jax.make_jaxpr(plain)(5), should_discharge=False))
print(jax.jit(plain).lower(5).as_text())
"""


def _run(code: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=120
    )


def test_plain_while_loops_are_discharged_and_lowered_as_without_paramstore():
    without, with_ps = _run(PROGRAM), _run(PROGRAM, "paramstore")
    assert without.returncode == 0, without.stderr[-3000:]
    assert with_ps.returncode == 0, with_ps.stderr[-3000:]
    assert "while" in without.stdout
    assert with_ps.stdout == without.stdout


def _rule_tables() -> dict[str, dict[object, int]]:
    """Every discharge rule table of JAX, by the identity of each rule."""
    return {
        name: {prim: id(rule) for prim, rule in table.items()}
        for name, table in vars(discharge).items()
        if isinstance(table, dict) and "rule" in name
    }


def test_no_jax_rule_is_replaced_even_while_paramstore_traces():
    before = _rule_tables()
    assert before, "found no discharge rule table to compare"
    seen: list[dict[str, dict[object, int]]] = []
    stop = threading.Event()

    def watch() -> None:  # another thread running plain JAX meanwhile sees JAX's own rules
        while not stop.is_set():
            seen.append(_rule_tables())

    c = ps.Variable(0, name="c")

    def cond(_):
        seen.append(_rule_tables())  # inside paramstore's trace
        return c < 4

    @ps.function
    def count(x):
        jax.lax.while_loop(cond, lambda _: c.assign_add(1, read_value=False), None)
        return c.value() + x

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for i in range(3):
            c.assign(0)
            count.clear_cache()
            assert int(count(i)) == 4 + i
    finally:
        stop.set()
        watcher.join(timeout=30)
    assert not watcher.is_alive()
    assert len(seen) > 3
    assert all(tables == before for tables in seen)
    assert _rule_tables() == before


def _import_with(patch: str) -> subprocess.CompletedProcess[str]:
    return _run(patch + "\nimport paramstore\nprint('imported')\n")


def test_a_jax_missing_an_internal_is_an_import_error_naming_it():
    done = _import_with("import jax._src.core as c\ndel c.eval_trace")
    assert done.returncode != 0
    err = done.stderr
    assert "ImportError: paramstore cannot run on the installed jax" in err
    assert "the eager trace (core.eval_trace)" in err
    assert jax.__version__ in err
    assert f"newest JAX known to work is {jax_api.NEWEST_KNOWN}" in err
    assert "AttributeError" not in err.split("ImportError")[0]  # no traceback from inside


def test_a_jax_whose_refs_behave_otherwise_is_an_import_error():
    # a JAX whose jax.new_ref no longer makes a mutable ref: the probe program fails
    done = _import_with("import jax, jax.numpy as jnp\njax.new_ref = jnp.asarray")
    assert done.returncode != 0
    assert "it relies on JAX features this version lacks or changed: tracing a small" in done.stderr
    assert "pip install" in done.stderr


@pytest.mark.parametrize("version", ["0.9.2", "0.11.0", "99.1.0", "dev"])
def test_no_version_number_is_compared(version):
    done = _import_with(f"import jax\njax.__version__ = {version!r}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "imported"


# ---------------------------------------- a current trace an interrupt inside JAX left unset


def _region() -> None:
    with deferred():
        pass


def _ops() -> dict[str, object]:
    v = ps.Variable(1.0, name="v")

    @ps.function
    def step(x):
        v.assign_add(x)
        return v.value() * 2

    step(1.0)
    return {
        "create": lambda: ps.Variable(2.0),
        "value": v.value,
        "numpy": v.numpy,
        "assign": lambda: v.assign(3.0),
        "assign_add": lambda: v.assign_add(1.0),
        "assign of an expression": lambda: v.assign(v * 2),
        "compiled step": lambda: step(1.0),
        "first call": lambda: ps.function(lambda x: v.assign_add(x))(2.0),
        "ps.pure": lambda: ps.pure(lambda: v.assign_add(1.0), [v])(ps.state([v])),
        "deferred region": _region,
    }


@pytest.mark.parametrize(
    "name",
    [
        "create",
        "value",
        "numpy",
        "assign",
        "assign_add",
        "assign of an expression",
        "compiled step",
        "first call",
        "ps.pure",
        "deferred region",
    ],
)
def test_an_unset_trace_is_mended_by_the_next_operation(name):
    """jax >= 0.11: a KeyboardInterrupt inside ``Primitive.bind`` can leave the thread's
    current trace at None (simulated here); the next paramstore operation works and leaves
    the eager trace current, so plain JAX works again too."""
    op = _ops()[name]
    jax_api._TRACE_CTX(None)
    try:
        op()
    finally:
        broken = jax_api._STRONG.value is None
        jax_api.repair_trace()
    assert not broken
    assert float(jnp.ones(()) + 1) == 2.0


def test_a_deferred_region_puts_back_the_trace_it_began_with():
    with deferred():
        jax_api._TRACE_CTX(None)  # what an interrupt inside bind leaves
    assert jax_api._STRONG.value is jax_api.EVAL
    np.testing.assert_array_equal(np.asarray(jnp.arange(3) * 2), [0, 2, 4])
