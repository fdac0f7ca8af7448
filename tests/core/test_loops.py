"""Variables in loop bodies that JAX has cached (issue 38, item 1), and the rewrite of
``while_loop`` conditions that read a variable (``_core.loops``).

JAX caches a traced body by the function object: a module-level body traced inside one
``ps.function`` trace closed over that trace's refs, and any later trace with the very same
body failed ("a Ref from an earlier trace escaped"). Each body below is defined ONCE, at
module level, and each program is traced again for each cause of a second trace; the
result must equal the same program written with a fresh body each time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paramstore as ps
from paramstore._core import loops

W = {}  # the variable the module-level bodies use, made fresh per test


def _w():
    return W["w"]


def scan_body(carry, x):
    _w().assign(_w() * x)
    return carry + _w().value().sum(), None


def fori_body(i, carry):
    _w().assign_add(jnp.full(3, 1.0) * i)
    return carry + 1.0


def while_cond(carry):
    return _w().value()[0] < carry  # reads the variable its body assigns


def while_body(carry):
    _w().assign(_w() * 2.0)
    return carry


def cond_true(x):
    _w().assign(_w() + x)
    return x.sum()


def cond_false(x):
    _w().assign(_w() - x)
    return -x.sum()


def checkpointed(x):
    _w().assign(jnp.sin(_w() * x))
    return _w().value().sum()


def per_row(x):
    return (x * _w().value()).sum()


BODIES = {
    f.__name__: f
    for f in (scan_body, fori_body, while_cond, while_body, cond_true, cond_false, checkpointed)
}
BODIES["per_row"] = per_row


def fresh_bodies():
    """New function objects for the same bodies (JAX cannot have cached these)."""
    return {name: _wrapped(f) for name, f in BODIES.items()}


def _wrapped(f):
    return lambda *a: f(*a)


def program(name, b, xs):
    if name == "scan":
        return jax.lax.scan(b["scan_body"], 0.0, xs)[0]
    if name == "fori_loop":
        return jax.lax.fori_loop(0, xs.shape[0], b["fori_body"], 0.0)
    if name == "while_loop":
        return jax.lax.while_loop(b["while_cond"], b["while_body"], xs.sum() * 10)
    if name == "cond":
        return jax.lax.cond(xs.sum() > 0, b["cond_true"], b["cond_false"], xs[0])
    if name == "switch":
        return jax.lax.switch(1, [b["cond_false"], b["cond_true"]], xs[0])
    if name == "checkpoint":
        return jax.checkpoint(b["checkpointed"])(xs[0])
    assert name == "vmap"
    return jax.vmap(b["per_row"])(xs).sum() + jax.lax.scan(b["scan_body"], 0.0, xs)[0]


NAMES = ["scan", "fori_loop", "while_loop", "cond", "switch", "checkpoint", "vmap"]
CAUSES = ["new signature", "clear_cache", "a second ps.function", "a trainable change"]


def _run(name, cause, bodies):
    """Two traces of one program by ``cause``; the outputs and values seen."""
    W["w"] = w = ps.Variable(jnp.array([1.0, 2.0, 3.0]), name="w")
    other = ps.Variable(1.0, name="other")

    def step(xs):
        return program(name, bodies(), xs) + 0.0 * other.value()

    f = ps.function(step)
    xs = jnp.full((2, 3), 1.5)
    seen = [f(xs), w.numpy().copy()]
    if cause == "new signature":
        seen.append(f(jnp.full((4, 3), 1.25)))
    elif cause == "clear_cache":
        f.clear_cache()
        seen.append(f(xs))
    elif cause == "a second ps.function":
        seen.append(ps.function(step)(xs))
    else:
        other.trainable = False
        seen.append(f(xs))
    if cause != "a second ps.function":
        assert f.trace_count == 2, "the cause did not trace the program again"
    return [np.asarray(x) for x in [*seen, w.numpy()]]


@pytest.mark.parametrize("cause", CAUSES)
@pytest.mark.parametrize("name", NAMES)
def test_module_level_bodies_keep_working_when_a_function_traces_again(name, cause):
    cached = _run(name, cause, lambda: BODIES)
    fresh = _run(name, cause, fresh_bodies)
    for a, b in zip(cached, fresh):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_an_inner_jit_of_a_module_level_function_traces_again_too():
    W["w"] = w = ps.Variable(jnp.ones(3), name="w")
    inner = jax.jit(lambda x: checkpointed(x))  # one object, cached by jax.jit

    @ps.function
    def f(x):
        return inner(x)

    f(jnp.ones(3) * 0.5)
    f.clear_cache()
    f(jnp.ones(3) * 0.5)
    np.testing.assert_allclose(w.numpy(), np.sin(np.sin(np.ones(3) * 0.5) * 0.5), rtol=1e-6)


# -------------------------------------------- while_loop conditions reading a variable


def _counting(where):
    c = ps.Variable(0.0, name="c")

    def loop(n):
        def body(i):
            c.assign_add(1.0)
            return i + 1

        # bounded by a counter: a stale condition would end at 50, not n
        jax.lax.while_loop(lambda i: (c.value() < n) & (i < 50), body, 0)
        return c.value()

    wrappers = {
        "top": loop,
        "scan": lambda n: jax.lax.scan(lambda k, _: (k + loop(n), None), 0.0, None, 2)[0],
        "cond": lambda n: jax.lax.cond(n > 0, loop, lambda n: n * 0.0, n),
        "checkpoint": jax.checkpoint(loop),
        "inner jit": jax.jit(loop),
    }
    return c, ps.function(wrappers[where])


@pytest.mark.parametrize("where", ["top", "scan", "cond", "checkpoint", "inner jit"])
def test_a_condition_sees_the_body_assigns_wherever_the_loop_is(where):
    c, f = _counting(where)
    f(jnp.asarray(5.0))
    assert float(c.numpy()) == 5.0  # in a scan: the second loop starts at 5, ends there


def test_a_program_without_such_a_loop_is_not_rewritten():
    closed = jax.make_jaxpr(lambda x: jax.lax.while_loop(lambda i: i < x, lambda i: i + 1, 0))(3)
    assert not loops.needs_fix(closed.jaxpr)
    assert loops.fix_while(closed) is closed


def _count_program(c):
    def count(n):
        def body(i):
            c.assign_add(1.0)
            return i + 1

        jax.lax.while_loop(lambda i: (c.value() < n) & (i < 50), body, 0)
        return c.value() * 2.0

    return count


def test_an_eager_pure_whose_condition_reads_what_the_body_assigns_equals_a_ps_function():
    """Issue 38, item 2: JAX runs such a loop eagerly with a stale condition (or refuses the
    ref passed twice); paramstore runs that ps.pure as a compiled program instead."""
    c = ps.Variable(0.0, name="c")
    count = _count_program(c)
    eager = ps.pure(count, [c])
    compiled = ps.function(ps.pure(count, [c]))
    for start, n in [(1.0, 5.0), (2.0, 7.0), (9.0, 4.0)]:
        values = {"c": jnp.asarray(start)}
        out, new = eager(values, n)
        want_out, want_new = compiled(values, n)
        assert float(out) == float(want_out) == 2 * max(start, n)
        assert float(new["c"]) == float(want_new["c"]) == max(start, n)
    assert float(c.numpy()) == 0.0  # ps.pure never touches the real variable


def test_an_eager_pure_nested_in_another_is_staged_as_a_whole():
    c = ps.Variable(0.0, name="c")
    d = ps.Variable(1.0, name="d")
    inner = ps.pure(_count_program(c), [c])

    def outer(n):
        out, new = inner({"c": d.value()}, n)
        d.assign(new["c"] + 1.0)
        return out

    out, new = ps.pure(outer, [d])({"d": jnp.asarray(3.0)}, 6.0)
    assert float(out) == 12.0 and float(new["d"]) == 7.0


def test_under_a_plain_jit_the_same_pure_is_still_a_clear_error():
    c = ps.Variable(0.0, name="c")
    jitted = jax.jit(ps.pure(_count_program(c), [c]))
    with pytest.raises(TypeError, match="'c' is read in a jax.lax.while_loop condition"):
        jitted({"c": jnp.asarray(0.0)}, 3.0)
    assert float(c.numpy()) == 0.0
