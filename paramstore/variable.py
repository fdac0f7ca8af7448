"""``ps.Variable``: a stateful facade over an immutable ``jax.Array``.

Contract (see docs/api.md, "Variables"):

* A Variable holds one immutable array. ``assign`` builds a new array and swaps it in, so a
  value read before an assign keeps its old contents. Shape and dtype never change.
* dtype inference and the conversions an assign accepts are ``paramstore._core.dtypes``'s: TF's
  inference for Python values, lossless conversions only (``TypeError`` naming both dtypes
  otherwise). ``assign`` needs the exact shape; ``assign_add``/``assign_sub`` broadcast the
  delta to it. Bool variables only support ``assign``; typed PRNG key variables
  (``ps.Variable(jax.random.key(0))``, non-trainable by default) only ``assign`` keys. A
  sliced assign (``v[i].assign(x)``) checks its index (out of range: ``IndexError``). A
  failed assign leaves the variable exactly as it was.
* ``initial_value`` is array-like (Python numbers and nested lists, NumPy and JAX arrays,
  strings), another Variable (its value is copied) or a zero-argument callable returning
  one; anything else (an object, a dict, a generator, ``dtype=object``) is a ``TypeError``.
  Strings make a host-side variable on a NumPy ``StringDType`` array: it can be assigned
  (strings only), saved and restored, not used in ``ps.function``.
* Inside the first trace of a ``ps.function``, the initial value may be a traced value
  computed there (``ps.Variable(jnp.ones((x.shape[-1], 3)))``): the variable is bound in
  the trace and ``ps.function`` computes its concrete value once, right after the trace.
* One owner: every change of a variable's array goes through ``_core.ownership``, under
  the state lock: ``write`` for an assign (``_write``/``_swap`` here), ``update`` for an
  eager ``assign_add``/``assign_sub``, ``write_many`` for a compiled step's outputs, a
  restore and ``ps.sharding.reshard``. So each assign and each compiled call is atomic,
  concurrent ``assign_add``s lose nothing, and a read never meets a buffer that a step
  donates (ownership records every array it hands out; see its module).
* A Variable is a registered pytree (one leaf, its value) so that ``jnp`` functions accept
  it. Unflattening makes a *detached* Variable (``_Detached``): it holds the leaf, is in no
  store, counts as no creation, and refuses assigns (they could never reach the original).
* ``copy.deepcopy(v)`` is an independent variable (same value, dtype, shape, trainable
  flag; a new unique name in the current default store); ``pickle`` raises ``TypeError``
  pointing to ``ps.Saver`` / ``ps.Checkpoint``.
* Where a new variable lives and how its initializer runs is ``_variable.creation``'s
  (docs/api.md, "Models larger than one device"). Inside ``ps.abstract()`` a variable is an
  ``_Abstract`` one (shape, dtype, sharding, ``partition``; every use a ``ValueError``,
  except where an active frame binds it to a value: ``_core.frames.bound``, how a
  ``ps.nn.Repeat`` scans an abstract template block). ``set_initial_value`` is the one way
  to make it concrete (checkpoint restores, ``ps.initialize``).

The whole class is here: its fields (``__slots__``, each annotated once), creation, reads,
the properties, ``repr``, copies, the assigns and the one write path; the hot paths
(``value()``, ``assign``, the steady ``assign_add``) are written out in their methods, with
no call layer. Its two bases (see the class docstring): ``ArrayOps``, the operators it shares
with ``VariableSlice``, and ``Owned``, the three fields only ownership touches. Cold logic is
in free functions of ``_variable``: ``convert`` (checks and conversion of a new value or
delta), ``creation`` / ``initial`` (arguments, first value, placement), ``abstract``
(initializers; ``set_initial_value``), ``text`` (the ``repr``).

Kinds: ``Variable``, ``_Detached`` (made so by a pytree unflatten, for good) and ``_Abstract``
are classes here; the subclasses override what differs and add no slot, so a plain
``Variable`` never tests its kind on a hot path. A variable changes kind at exactly two
places, by assigning ``__class__``: in ``Variable.__init__``, a variable created abstract
becomes an ``_Abstract`` before its store registers it (nobody saw it before); in
``_Abstract._write`` (which ``set_initial_value`` calls) it becomes a plain
``Variable``, once, under the state lock, in the critical section that writes its first
value (no thread sees it concrete without a value). It never goes back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec, Sharding
from jax.typing import DTypeLike

from paramstore._core import frames
from paramstore._core import html as _html
from paramstore._core.context import STATE_LOCK, TRACE_EPOCH, prefixed
from paramstore._core.dtypes import STRING, is_key_dtype, shape_error
from paramstore._core.jax_api import (
    ARRAY_TYPE,
    EVAL,
    Tracer,
    current_trace,
    refuse_as_array,
    staging,
)
from paramstore._core.layout import Partition, check_partition
from paramstore._core.ownership import Owned, ownership
from paramstore._core.placement import place
from paramstore._core.store import VariableStore, default_store
from paramstore._variable import abstract as _abstract
from paramstore._variable import convert as _convert
from paramstore._variable import text as _text
from paramstore._variable.abstract import set_initial_value
from paramstore._variable.creation import (
    MISSING,
    abstract_value,
    check_arguments,
    check_hooks,
    created,
    shaped,
)
from paramstore._variable.initial import flag, fresh
from paramstore._variable.ops import ArrayOps
from paramstore._variable.reference import Reference
from paramstore._variable.slice import VariableSlice
from paramstore.typing import (
    ConstraintLike,
    DeviceLike,
    Index,
    InitialValue,
    RegularizerLike,
    ShapeLike,
    ValueLike,
)

__all__ = ["Variable", "VariableSlice", "Reference", "set_initial_value"]

# Eager updates call these directly: jit's C++ dispatch skips jnp's Python argument checks.
# An owned buffer that nobody else holds is donated into the update (issue figures: a
# donated add runs at 0.65-0.73x of `x = x + d`, a fresh one at 1.10-1.34x).
_EAGER = {
    "add": (jax.jit(jnp.add), jax.jit(jnp.add, donate_argnums=0)),
    "subtract": (jax.jit(jnp.subtract), jax.jit(jnp.subtract, donate_argnums=0)),
}


class Variable(ArrayOps, Owned):
    """A named, stateful array (see the module docstring for the contract).

    Bases: ``ArrayOps`` gives the operators, conversions and array methods (``v + 1``,
    ``np.asarray(v)``, ``v.sum()``), all computed on ``value()``, as ``VariableSlice`` has
    them (NumPy's ``NDArrayOperatorsMixin`` pattern); ``Owned`` holds the fields that only
    ``_core.ownership`` may touch (the array, what was handed out), so that ownership's
    module declares them and the layering test can guard them."""

    # The fields (Owned's: _value, _given, _override), set by __init__ (_unflatten for a
    # detached one); each annotated below, in this order.
    __slots__ = (
        "_name", "_store", "_trainable", "_frozen", "_constraint", "_regularizer", "_dtype",
        "_shape", "_is_string", "_is_key", "_arith", "_delta_aval", "_warm", "_partition",
        "_initializer", "__weakref__",
    )  # fmt: skip
    _name: str  # the unique full name in its store
    _store: VariableStore  # where it is registered (a failed trace forgets it there only)
    _trainable: bool  # its own flag (v.trainable: _trainable and not _frozen)
    _frozen: bool  # set by module.trainable = False
    _constraint: Callable[[jax.Array], jax.Array] | None
    _regularizer: Callable[[jax.Array], jax.Array] | None
    _dtype: np.dtype[Any]  # a JAX key dtype for a key variable
    _shape: tuple[int, ...]
    _is_string: bool  # the kind of value, fixed at creation (issubdtype costs ~1 us a call)
    _is_key: bool
    _arith: bool  # assign_add/assign_sub allowed: not a key, string or bool
    _delta_aval: Any  # the aval of the last eager update's delta that passed every check
    _warm: set[Any]  # the kinds of delta an eager update of this variable ran with (issue 28)
    _partition: Partition | None  # the logical axis names given as partition=
    _initializer: Any  # an abstract variable's initializer (paramstore._variable.abstract)

    def __init__(
        self,
        initial_value: InitialValue = MISSING,
        trainable: bool | None = None,
        name: str | None = None,
        dtype: DTypeLike | None = None,
        *,
        device: DeviceLike | Sharding | None = None,
        sharding: Sharding | Mesh | None = None,
        shape: ShapeLike | None = None,
        partition: Partition | PartitionSpec | None = None,
        constraint: ConstraintLike | None = None,
        regularizer: RegularizerLike | None = None,
        _full_name: str | None = None,
    ) -> None:
        hooks = check_arguments(initial_value, trainable, name, constraint, regularizer)
        store = default_store()
        base = None
        if _full_name is None:
            base = prefixed(name or "Variable")
            full_name = store.unique_name(base, reserve=False)
        else:  # get_variable and copies: the exact name
            full_name = _full_name
        part = check_partition(partition, full_name, None)
        if shape is not None:
            initial_value = shaped(initial_value, shape, dtype, full_name)
        abstract = _abstract.creating() or isinstance(initial_value, jax.ShapeDtypeStruct)
        value: Any
        make: Any = None
        if abstract:  # shape, dtype and sharding only
            value, make = abstract_value(initial_value, dtype, full_name, part, device, sharding)
            owned, placed = True, None
        else:
            value, owned, placed = created(initial_value, dtype, full_name, part, device, sharding)
        check_hooks(*hooks, value, full_name)
        traced = isinstance(value, Tracer)
        if placed is not None and not traced and not isinstance(value, np.ndarray):
            value = place(value, placed, f"variable '{full_name}'")  # may share a buffer
        if trainable is None:
            trainable = not is_key_dtype(value.dtype)
        self._set_fields(value, trainable, owned)
        self._name, self._partition = full_name, part
        self._constraint, self._regularizer = hooks
        if abstract:  # a change of kind (module docstring), before anyone can see it
            self.__class__ = _Abstract
            _abstract.remember(self, make)
        elif traced:  # bound in the ps.function trace; its array comes after the trace, made
            frames.create(self, value)  # by ps.function in a program with this sharding
            placeholder = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=placed)
            ownership.adopt(self, placeholder, owned=True)
        self._store = store
        self._name = store.register(self, full_name, exact=_full_name is not None, base=base)

    def _set_fields(self, value: Any, trainable: bool, owned: bool) -> None:
        ownership.adopt(self, value, owned)
        self._trainable = bool(trainable)
        self._frozen = False
        self._constraint = None
        self._regularizer = None
        self._is_key = is_key_dtype(value.dtype)  # once: issubdtype costs ~1 us a call
        self._dtype = value.dtype if self._is_key else np.dtype(value.dtype)
        self._shape = tuple(value.shape)
        self._is_string = self._dtype == STRING
        self._arith = not (self._is_key or self._is_string or self._dtype.kind == "b")
        self._delta_aval = None
        self._warm = set()

    # -- reading
    def value(self) -> jax.Array:
        """The current array (inside ``ps.function`` / ``ps.pure``, the traced value). A
        string variable's is a NumPy ``StringDType`` array (host data)."""
        if frames.depth:
            return frames.read(self)
        if current_trace() is not EVAL:
            return frames.outside(self)
        return ownership.hand_out(self)  # type: ignore[no-any-return]

    read_value = value

    def numpy(self) -> np.ndarray:
        """A NumPy copy of the current value (a key variable's key data)."""
        if self._host_read():  # no hand-out: the next step still donates the buffer
            return ownership.host(self)  # type: ignore[no-any-return]
        value = self.value()
        if self._is_key:
            value = jax.random.key_data(value)
        return np.array(value, copy=True)

    def _host_read(self) -> bool:
        """Whether a host read (``numpy()``, ``float(v)``...) copies the value without
        handing the buffer out: an eager read of a plain variable (``_core.ownership.host``)."""
        return (
            type(self) is Variable
            and not self._is_key
            and not frames.depth
            and (current_trace() is EVAL)
        )

    def __float__(self) -> float:
        return float(self.numpy() if self._host_read() else self.value())

    def __int__(self) -> int:
        return int(self.numpy() if self._host_read() else self.value())

    def __bool__(self) -> bool:
        return bool(self.numpy() if self._host_read() else self.value())

    def ref(self) -> Reference:
        """A hashable reference to this variable."""
        return Reference(self)

    def __getitem__(self, index: Index) -> VariableSlice:
        """``v[i]``: a slice that reads and assigns part of the value (``v[i].assign(x)``)."""
        return VariableSlice(self, index)

    @property
    def name(self) -> str:
        """The unique full name in its store (scopes included, e.g. ``"dense/kernel"``)."""
        return self._name

    @property
    def trainable(self) -> bool:
        """Whether the variable is trained: its own flag (``trainable=`` at creation,
        ``v.trainable = False``), unless a Module that holds it is frozen
        (``module.trainable = False``). Setting it takes effect everywhere at once: in
        ``m.trainable_variables``, ``ps.trainable``, ``ps.grad`` over Modules, every
        optimizer (even one built before) and the next call of a ``ps.function``.
        ``v.trainable = True`` also lifts a Module's freeze from this variable, as in
        Keras 3. Not a bool: ``TypeError``."""
        return self._trainable and not self._frozen

    @trainable.setter
    def trainable(self, value: bool) -> None:
        flag(value, "trainable", f"Variable '{self._name}'")
        value = bool(value)
        if value != self.trainable or (value and self._frozen):
            TRACE_EPOCH.bump()
        self._trainable = value
        if value:
            self._frozen = False

    def _freeze(self, frozen: bool) -> None:
        """Freeze or unfreeze for a Module (``module.trainable = ...``), as Keras 3's
        ``layer.trainable`` sets its trainable variables' flags: a variable whose own flag
        is False (created non-trainable, or ``v.trainable = False``) stays non-trainable."""
        if frozen != self._frozen and self._trainable:
            TRACE_EPOCH.bump()
        self._frozen = frozen

    @property
    def constraint(self) -> Callable[[jax.Array], jax.Array] | None:
        """The constraint an optimizer applies after each update (``constraint=``), or None."""
        return self._constraint

    @property
    def regularizer(self) -> Callable[[jax.Array], jax.Array] | None:
        """The penalty ``ps.regularization_loss`` adds for this variable, or None."""
        return self._regularizer

    @property
    def dtype(self) -> np.dtype[Any]:
        """A ``np.dtype`` (a JAX key dtype for a key variable)."""
        return self._dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The value's shape, a tuple of ints (fixed at creation)."""
        return self._shape

    @property
    def ndim(self) -> int:
        """The number of dimensions, ``len(v.shape)``."""
        return len(self._shape)

    @property
    def size(self) -> int:
        """The number of elements."""
        return int(np.prod(self._shape, dtype=np.int64))

    @property
    def partition(self) -> Partition | None:
        """The logical axis names given as ``partition=`` (one per dimension), or None."""
        return getattr(self, "_partition", None)  # a detached variable has none

    @property
    def is_abstract(self) -> bool:
        """Whether the variable has a shape, dtype and sharding but no value yet
        (created inside ``ps.abstract()``; restore or ``ps.initialize`` it)."""
        return False

    @property
    def sharding(self) -> Sharding | None:
        """The value's ``jax.sharding.Sharding`` (None for a string variable)."""
        return None if self._is_string else ownership.peek(self).sharding

    @property
    def device(self) -> jax.Device | None:
        """The ``jax.Device`` holding the value; None when sharded over several (or strings)."""
        sharding = None if self._is_string else ownership.peek(self).sharding
        if sharding is None:
            return None
        devices = sharding.device_set
        return next(iter(devices)) if len(devices) == 1 else None

    def _repr_html_(self) -> str:  # Jupyter's rendering (paramstore/_core/html.py)
        return _html.variable_html(self)

    def __repr__(self) -> str:
        return _text.describe(self)

    def _pending(self) -> bool:
        """Whether the initial value is still being computed (created inside the first
        trace of a ``ps.function`` from a traced value, until that trace completes)."""
        return isinstance(ownership.peek(self), jax.ShapeDtypeStruct)

    # -- writing (a failed assign leaves the variable exactly as it was)
    def assign(self, value: ValueLike, read_value: bool = True) -> Self | None:
        """Replace the value. Raises ValueError (shape) or TypeError (dtype); then no change."""
        new = self._coerce(value, "assign")
        if new.shape != self._shape:
            raise shape_error(self._name, self._shape, tuple(new.shape))
        self._swap(new, owned=fresh(value, new))
        return self if read_value else None

    def assign_add(self, delta: ValueLike, read_value: bool = True) -> Self | None:
        """``self += delta`` atomically (delta broadcasts to the variable's shape)."""
        self._update(delta, "add")
        return self if read_value else None

    def assign_sub(self, delta: ValueLike, read_value: bool = True) -> Self | None:
        """``self -= delta`` atomically (delta broadcasts to the variable's shape)."""
        self._update(delta, "subtract")
        return self if read_value else None

    def _update(self, delta: Any, how: str) -> None:
        if type(delta) is ARRAY_TYPE and delta.aval is self._delta_aval:
            # The steady eager case: an array with the very aval (an immutable object) of a
            # delta that passed every check of checked_delta and already ran an update, so of
            # this variable's dtype and exact shape and not weakly typed, and jit's C++
            # dispatch knows the update: one identity test instead of five attribute reads
            # (assign_add on 1,000 float32: 0.95x -> 0.85x of `x = x + d`, 2026-11-23).
            d, steady = delta, True
        else:
            d, steady = _convert.checked_delta(self, delta, how), False
        if frames.depth and frames.active():  # traced: plain jnp ops, no nested jit
            op = jnp.add if how == "add" else jnp.subtract
            self._swap(op(self.value(), d), update=f"assign_{how[:3]}")
            return
        if current_trace() is not EVAL:
            raise _convert.traced_context_error(self._name)
        if type(d) is not np.ndarray and d.committed:
            d = _convert.colocated(self, d)
        # The result lands where the variable's array is: no placement check.
        plain, donating = _EAGER[how]
        if steady:
            ownership.update(self, plain, donating, d)
            return
        # jit's own signature of the delta: the first update of each kind runs jit's Python
        # dispatch, maybe after the donation, so its interrupts are deferred (issue 28).
        kind = (type(d), d.dtype, d.shape, getattr(d, "weak_type", 0), getattr(d, "committed", 0))
        warm = kind in self._warm
        (ownership.update if warm else ownership.update_cold)(self, plain, donating, d)
        if not warm:
            if len(self._warm) > 16:  # deltas of ever new shapes: keep it small
                self._warm.clear()
            self._warm.add(kind)
        if d is delta and type(d) is ARRAY_TYPE and d.shape == self._shape and not d.weak_type:
            self._delta_aval = d.aval  # the next delta with this aval: the steady path

    # The package interface's checks (docs/architecture.md) are _variable.convert's free
    # functions, bound as methods (no call layer on assign); _Detached and _Abstract
    # override _coerce.
    _coerce = _convert.coerce
    _check_arithmetic = _convert.check_arithmetic
    _colocated = _convert.colocated

    def _swap(self, new: Any, placed: bool = False, owned: bool = True, update: str = "") -> None:
        """Make ``new`` (checked by the caller) the value: in the active frame, or for real
        (``update``: the op, e.g. ``assign_add``, when ``new`` is computed from the value)."""
        if frames.depth and frames.bind(self, new, update):
            return
        trace = current_trace()
        if isinstance(new, Tracer) or trace is not EVAL and staging(trace):
            raise _convert.traced_context_error(self._name)
        if not (placed or self._is_string):
            old = ownership.peek(self).sharding
            if new.sharding != old:
                new = jax.device_put(new, old)
        self._write(new, owned)

    def _write(self, new: Any, owned: bool = False) -> None:
        """The one write path of a variable's real array (callers checked dtype, shape and
        placement). ``owned``: nobody outside this variable holds ``new``'s buffer."""
        ownership.write(self, new, owned)

    # -- copies
    def __deepcopy__(self, memo: dict[int, Any]) -> Variable:
        """An independent copy: same value, dtype, shape and trainable flag; a new unique
        name (this one's, numbered) in the current default store."""
        value = ownership.copy(self)  # under the lock: copied before any step can donate it
        new = Variable(
            value,
            self._trainable,
            constraint=self._constraint,
            regularizer=self._regularizer,
            _full_name=default_store().unique_name(self._name, reserve=False),
        )
        new._frozen = self._frozen
        memo[id(self)] = new
        return new

    __copy__ = __deepcopy__  # a shallow copy sharing state would break ownership

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"ps.Variable '{self._name}' cannot be pickled (paramstore never pickles: loading "
            "a pickle runs code). Save values with ps.Saver or ps.Checkpoint, or copy a "
            "variable in memory with copy.deepcopy."
        )


class _Detached(Variable):
    """What unflattening a Variable pytree makes: it holds the leaf (often a tracer of the
    transformation), is in no store, counts as no creation, and refuses assigns."""

    __slots__ = ()

    def value(self) -> jax.Array:
        return ownership.leaf(self)  # type: ignore[no-any-return]  # a pytree leaf, never donated

    read_value = value

    def _coerce(self, value: Any, op: str, *, host: bool = False) -> Any:
        raise TypeError(
            f"Variable '{self._name}' was passed through a JAX transformation as a pytree "
            "(jax.jit, jax.vmap, jax.tree_util ...), so assigning it cannot reach the "
            "original variable. Use ps.function or ps.pure to update variables."
        )


class _Abstract(Variable):
    """A variable with a shape, dtype and sharding but no value (``ps.abstract()``): every
    use raises ``_variable.abstract.error``; ``_write`` (through ``set_initial_value``) gives it its
    value and turns it into a plain ``Variable``. The one exception: where an active frame
    binds it (``_core.frames.bound``: a ``ps.nn.Repeat``'s template inside its scan, or its
    abstract build), reads and assigns see that binding, as for any variable."""

    __slots__ = ()

    @property
    def is_abstract(self) -> bool:
        return True

    def _bound(self) -> bool:
        return bool(frames.depth) and frames.bound(self) is not None

    def value(self) -> jax.Array:
        if frames.depth:
            value = frames.bound(self)
            if value is not None:
                return value
        raise _abstract.error(self._name, "read")

    read_value = value

    def numpy(self) -> np.ndarray:
        raise _abstract.error(self._name, "read")

    def _update(self, delta: Any, how: str) -> None:  # assign_add, assign_sub
        if not self._bound():
            raise _abstract.error(self._name, "assigned")
        Variable._update(self, delta, how)

    def _coerce(self, value: Any, op: str, *, host: bool = False) -> Any:  # assign
        if self._bound():
            return _convert.coerce(self, value, op, host=host)
        raise _abstract.error(self._name, "assigned")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or not hasattr(jax.Array, name):
            raise AttributeError(f"'ps.Variable' object has no attribute {name!r}")
        raise _abstract.error(self._name, f"used (.{name})")

    def __deepcopy__(self, memo: dict[int, Any]) -> Variable:
        raise _abstract.error(self._name, "copied")

    __copy__ = __deepcopy__

    def __repr__(self) -> str:
        return _text.describe_abstract(self)

    def _write(self, new: Any, owned: bool = False) -> None:
        want = ownership.peek(self).sharding
        if want is not None and getattr(new, "sharding", want) != want:
            new = jax.device_put(new, want)
        with STATE_LOCK:
            self.__class__ = Variable  # type: ignore[assignment]
            _abstract.forget(self)
            Variable._write(self, new, owned)


# A Variable is a pytree of one leaf, its value; unflattening makes a detached one.
def _flatten(v: Variable) -> tuple[tuple[Any], tuple[str, bool]]:
    return (v.value(),), (v.name, v.trainable)


def _unflatten(aux: tuple[str, bool], children: Any) -> Any:
    (leaf,) = children
    if leaf is None or not hasattr(leaf, "dtype"):
        return leaf  # jax sentinels (None, object()) pass through untouched
    self = object.__new__(_Detached)
    self._set_fields(leaf, aux[1], owned=False)
    self._arith = False  # every update goes through _coerce, which refuses it
    self._name = aux[0]
    return self


jax.tree_util.register_pytree_node(Variable, _flatten, _unflatten)
jax.tree_util.register_pytree_node(_Detached, _flatten, _unflatten)
jax.tree_util.register_pytree_node(_Abstract, _flatten, _unflatten)
refuse_as_array(
    Variable,
    lambda v: (
        f"ps.Variable {v.name!r} was given to a JAX primitive (a jax.lax function, or "
        "another API that takes arrays only): those do not convert a Variable. Pass its "
        f"array instead: `{v.name.rsplit('/', 1)[-1]}.value()` (jnp functions and "
        "operators accept the Variable itself)."
    ),
)
