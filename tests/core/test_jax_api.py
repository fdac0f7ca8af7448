"""paramstore changes nothing in JAX for code that does not use it (issue 23): its
``while_loop`` discharge rule is in force only while paramstore discharges its own
programs or runs a binding frame."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from jax._src.lax.control_flow import loops
from jax._src.state import discharge

from paramstore._core import jax_api

ROOT = Path(__file__).resolve().parents[2]

# A plain JAX program whose while_loop condition reads a ref its body writes (the case the
# rule handles differently); with "paramstore" in argv, paramstore is imported and used
# (a ps.function with such a loop) first.
PROGRAM = """
import sys
import jax
from jax._src.lax.control_flow import loops
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

    def body(_):
        r[...] = r[...] + 1

    jax.lax.while_loop(lambda _: r[...] < n, body, None)
    return r[...]


print(discharge._partial_discharge_rules[loops.while_p] is loops._while_partial_discharge_rule)
print(discharge.discharge_state(jax.make_jaxpr(plain)(5), should_discharge=False))
print(jax.jit(plain).lower(5).as_text())
"""


def _outputs(*argvs: tuple[str, ...]) -> list[str]:
    """The program's output for each argv, the processes run side by side."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROGRAM, *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        outs.append(out)
    return outs


def test_plain_while_loops_are_lowered_as_without_paramstore():
    without, with_ps = _outputs((), ("paramstore",))
    assert without.splitlines()[0] == "True"  # JAX's own rule
    assert with_ps == without


def test_the_fixed_rule_is_in_force_only_inside_while_fix():
    rules = discharge._partial_discharge_rules
    assert rules[loops.while_p] is loops._while_partial_discharge_rule
    with jax_api.while_fix():
        with jax_api.while_fix():
            assert rules[loops.while_p] is not loops._while_partial_discharge_rule
        assert rules[loops.while_p] is not loops._while_partial_discharge_rule
    assert rules[loops.while_p] is loops._while_partial_discharge_rule
    try:  # restored after an error too
        with jax_api.while_fix():
            raise KeyError("x")
    except KeyError:
        pass
    assert rules[loops.while_p] is loops._while_partial_discharge_rule
