"""Abstract variables and sharded initialization: shapes first, arrays only where they live.

What variable creation consults (so it sits below ``variable``). Contract (docs/api.md, "Models
larger than one device"):

* ``with abstract():`` variables created inside get their shape, dtype and sharding only:
  the initializer is traced for its shape (``jax.eval_shape``), not run, and nothing is
  allocated. ``remember`` keeps its initializer until ``ps.initialize`` runs it or a
  checkpoint restore gives the variable a value. Using an abstract variable in any way
  raises ``error(name)``: a ``ValueError`` naming it and saying to restore or initialize
  (where a binding frame gives it a value, ``paramstore._core.frames.bound``, it reads that).
* ``shape_of(make)`` is the ``jax.ShapeDtypeStruct`` an initializer would produce, or None
  when it cannot be traced on its own (it reads a variable, advances a generator, returns
  strings): the caller then runs it eagerly, as before.
* ``run_sharded(makes, shardings)`` runs initializers as ONE program compiled by
  ``jax.jit(..., out_shardings=shardings)``: XLA partitions the computation, so each device
  computes and holds only its own shard (a 8192x8192 float32 normal over 8 devices: 32 MiB
  of output and 96 MiB of temporaries per device, against 256 MiB for the whole array). The
  initializers run under their variables' names (``paramstore._core.seed.naming``), so each
  draws its own name-derived key: two variables never get equal values from one
  initializer, and a sharded variable gets exactly the values an unsharded one would.
* ``set_initial_value(var, value)`` (public as ``paramstore.variable.set_initial_value``) is
  the one way to make an abstract variable concrete (restores, ``ps.initialize``), and how a
  restore gives any variable its value outside a compiled step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from paramstore._core import frames
from paramstore._core.context import ctx
from paramstore._core.dtypes import shape_error
from paramstore._core.ownership import ownership
from paramstore._variable.convert import coerce
from paramstore._variable.initial import fresh

if TYPE_CHECKING:  # the class sits above this module: a name for annotations only
    from paramstore.variable import Variable

__all__ = [
    "AbstractUseError",
    "AbstractTraceError",
    "abstract",
    "creating",
    "error",
    "shape_of",
    "trace_shape",
    "run_sharded",
    "init_program",
    "remember",
    "initializer_of",
    "forget",
    "spread",
    "Joint",
    "set_initial_value",
]

Make = Callable[[], Any]


@contextlib.contextmanager
def abstract() -> Iterator[None]:
    """Create variables abstract inside this block: shape, dtype and sharding only
    (``v.is_abstract``); ``ps.initialize`` or a checkpoint restore makes them concrete."""
    ctx.abstract += 1
    try:
        yield
    finally:
        ctx.abstract -= 1


def creating() -> bool:
    """Whether variables created now are abstract (inside ``with ps.abstract():``)."""
    return ctx.abstract > 0


class AbstractUseError(ValueError):
    """An abstract variable's value was needed (read, copied, saved) before it had one."""


class AbstractTraceError(TypeError):
    """A variable created inside ``ps.abstract()`` has an initial value that cannot be traced
    for its shape (it reads another variable, draws random numbers, makes strings)."""


def error(name: str, what: str = "used") -> AbstractUseError:
    return AbstractUseError(
        f"Variable '{name}' is abstract (created inside ps.abstract(): it has a shape, dtype "
        f"and sharding but no value yet), so it cannot be {what}. Give it its value first: "
        "restore a checkpoint into it (ps.Checkpoint(...).restore, Saver.restore, "
        "CheckpointManager.restore_latest), or run its initializer with "
        "ps.initialize(model)."
    )


def spread(sharding: Sharding | None) -> bool:
    """Whether ``sharding`` splits a value over several devices (then creation runs a
    sharded program). A replicated value is whole on every device anyway: computing it
    eagerly and copying it costs no more memory and no compilation."""
    return (
        sharding is not None and len(sharding.device_set) > 1 and not sharding.is_fully_replicated
    )


def shape_of(make: Make) -> jax.ShapeDtypeStruct | None:
    """What ``make()`` would return, traced abstractly; None when it is not one array or
    cannot be traced on its own (the caller then runs it eagerly)."""
    return trace_shape(make)[0]


def trace_shape(make: Make) -> tuple[jax.ShapeDtypeStruct | None, Exception | None]:
    """``shape_of``, and the exception that stopped the trace (None if it did not fail)."""
    try:
        out = jax.eval_shape(make)
    except Exception as e:  # reads a variable, advances a generator, strings ...
        return None, e
    return (out if isinstance(out, jax.ShapeDtypeStruct) else None), None


def init_program(makes: Sequence[Make], shardings: Sequence[Sharding | None]) -> Any:
    """The jitted program computing ``[make() for make in makes]`` with these output
    shardings (tests lower and compile it to read its memory analysis)."""

    def program() -> list[Any]:
        return [make() for make in makes]

    return jax.jit(program, out_shardings=list(shardings))


def run_sharded(makes: Sequence[Make], shardings: Sequence[Sharding | None]) -> list[Any]:
    """``[make() for make in makes]`` computed by one program compiled with these output
    shardings; see the module docstring."""
    return list(init_program(makes, shardings)())


# ----------------------------------------------- initializers of abstract variables


class Joint:
    """The initializer of one of several variables whose values are computed together
    from other variables' values (an optimizer's slots: ``tx.init(params)``).

    ``compute()`` returns the values of all of them (a list); this variable's is
    ``compute()[index]``. ``reads`` are the variables ``compute`` reads: they must be
    concrete when it runs, so ``ps.initialize`` runs joint initializers last, once per
    ``compute``, after the plain ones of the same call.
    """

    __slots__ = ("compute", "index", "reads")

    def __init__(self, compute: Callable[[], list[Any]], index: int, reads: Sequence[Any]):
        self.compute = compute
        self.index = index
        self.reads = list(reads)

    def __call__(self) -> Any:
        return self.compute()[self.index]


# An abstract variable holds its initializer in its own ``_initializer`` slot (``_NONE``:
# none recorded; None: there is none, the variable must be restored).
_NONE: Any = object()


def remember(var: Any, make: Make | None) -> None:
    """Keep ``make`` (None: there is none, the variable must be restored) for ``var``."""
    var._initializer = make


def initializer_of(var: Any) -> tuple[bool, Make | None]:
    """``(known, make)``: whether ``var`` has an entry, and its initializer."""
    make = getattr(var, "_initializer", _NONE)
    return (False, None) if make is _NONE else (True, make)


def forget(var: Any) -> None:
    """Drop ``var``'s initializer (it became concrete)."""
    var._initializer = _NONE


def set_initial_value(var: Variable, value: Any, *, owned: bool | None = None) -> None:
    """Give ``var`` the value ``value`` as its state, not as a step of a compiled program:
    for a variable created in a ``ps.function`` trace whose initial value is still being
    computed, ``value`` replaces that initial value when the trace completes; otherwise it
    is written now (also while a trace is active). Used by deferred restoration.

    The entry point that makes an ABSTRACT variable concrete (checkpoint restores,
    ``ps.initialize``): ``value`` (a ``jax.Array``, ideally already on ``var.sharding``, or
    a NumPy array, then put straight onto ``var.sharding``: each device receives only its
    shard) is checked for dtype (lossless conversions only) and shape, placed on the
    variable's sharding, and becomes its value; ``var.is_abstract`` is then False.
    ``owned=True`` says nobody else holds ``value``'s buffer (default: worked out)."""
    abstract = var.is_abstract
    with jax.ensure_compile_time_eval(), frames.no_frames():
        # An abstract variable's own _coerce refuses every value: the plain conversion.
        new = coerce(var, value, "restore") if abstract else var._coerce(value, "restore")
        if isinstance(new, np.ndarray) and not var._is_string:
            new = jax.device_put(new, var.sharding) if abstract else jnp.asarray(new)
    if tuple(new.shape) != var.shape:
        raise shape_error(var.name, var.shape, tuple(new.shape))
    if owned is None:
        owned = fresh(value, new)
    if not abstract and var._pending():
        ownership.initial(var, new)
    else:
        var._write(new, owned=owned)  # an abstract variable becomes concrete there
