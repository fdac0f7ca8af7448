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
  the state lock (``STATE_LOCK``): ``write`` for an assign (``_write``/``_swap`` here),
  ``update`` for an eager ``assign_add``/``assign_sub``, ``write_many`` for a compiled
  step's outputs and ``ps.sharding.reshard``; a restore holds the lock over all its writes.
  So each assign and each compiled call is atomic, concurrent ``assign_add``s lose
  nothing, and a read never meets a buffer that a step donates.
* Ownership is ``_core.ownership``'s: it records every array it hands out (``value()``,
  ``np.asarray(v)``, a pytree flatten, a step's output...) by identity, and a compiled step
  donates a variable's array only if it came out of the variable's own computation and was
  never handed out; any other is copied first (once). No reference counts are used.
* A Variable is a registered pytree (one leaf, its value) so that ``jnp`` functions accept
  it. Unflattening makes a *detached* Variable (``_Detached``): it holds the leaf, is in no
  store, counts as no creation, and refuses assigns (they could never reach the original).
* ``copy.deepcopy(v)`` is an independent variable (same value, dtype, shape, trainable
  flag; a new unique name in the current default store); ``pickle`` raises ``TypeError``
  pointing to ``ps.Saver`` / ``ps.Checkpoint``.
* Where a new variable lives and how its initializer runs (docs/api.md, "Models larger than one
  device") is ``paramstore._variable.creation``'s: an initializer with a multi-device sharding runs
  compiled with it as output sharding; inside ``ps.abstract()`` a variable is an
  ``_Abstract`` one (shape, dtype, sharding, ``partition``; every use a ``ValueError``,
  except where an active frame binds it to a value: ``_core.frames.bound``, how a
  ``ps.nn.Repeat`` traces and scans an abstract template block).
  ``set_initial_value`` is the one way to make an abstract variable concrete with a given
  array (checkpoint restores call it, and ``ps.initialize``).

The class is built in three steps, one job each: ``_variable.read.Reads`` (reading, the
properties, ``repr``), ``_variable.write.Writes`` (assigns, conversions, the one write path)
and ``Variable`` here (creation, copies, the detached and abstract kinds, pytree registration).
"""

from __future__ import annotations

from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec, Sharding
from jax.typing import DTypeLike

from paramstore import constraints as _constraints
from paramstore import regularizers as _regularizers
from paramstore._core import frames as _trace
from paramstore._core.context import STATE_LOCK, prefixed
from paramstore._core.dtypes import STRING, is_key_dtype, shape_error
from paramstore._core.jax_api import Tracer, refuse_as_array
from paramstore._core.layout import Partition, check_partition
from paramstore._core.ownership import ownership
from paramstore._core.placement import place
from paramstore._core.store import default_store
from paramstore._variable import abstract as _abstract
from paramstore._variable.creation import abstract_value, created, shaped
from paramstore._variable.initial import flag, fresh
from paramstore._variable.slice import VariableSlice
from paramstore._variable.write import Writes
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

_MISSING: Any = object()  # initial_value's default: not given (a clear TypeError)


# ------------------------------------------------------------------------------ Variable


class Reference:
    """A hashable key for a Variable (``v.ref()``); ``ref.deref()`` gives it back."""

    __slots__ = ("_var",)

    def __init__(self, var: Variable) -> None:
        self._var = var

    def deref(self) -> Variable:
        """The Variable this reference points to."""
        return self._var

    def __hash__(self) -> int:
        return id(self._var)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Reference) and other._var is self._var

    def __repr__(self) -> str:
        return f"<Reference to {self._var!r}>"


class Variable(Writes):
    """A named, stateful array (see the module docstring for the contract)."""

    __slots__ = (
        # (_value, _given, _override: ownership's fields, from _core.ownership.Owned)
        "_name",
        "_store",  # the VariableStore it is registered in (a failed trace forgets it there)
        "_trainable",
        "_frozen",  # set by module.trainable = False (v.trainable: _trainable and not _frozen)
        "_constraint",
        "_regularizer",
        "_dtype",
        "_shape",
        "_is_string",
        "_is_key",
        "_arith",
        "_delta_aval",  # the aval of the last eager update's delta that passed every check
        "_warm",  # the kinds of delta an eager update of this variable ran with (issue 28)
        "_partition",
        "_initializer",  # an abstract variable's initializer (paramstore._variable.abstract)
        "__weakref__",
    )

    def __init__(
        self,
        initial_value: InitialValue = _MISSING,
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
        if initial_value is _MISSING or initial_value is None:
            raise TypeError(
                "ps.Variable() missing required argument 'initial_value': an array-like, a "
                "jax.Array, another Variable, or a zero-argument callable (e.g. lambda: "
                "init((3, 4)))."
            )
        if name is not None and not isinstance(name, str):
            raise TypeError(f"A variable's name must be a str, got {type(name).__name__}.")
        if trainable is not None:
            flag(trainable, "trainable", f"ps.Variable({name!r})" if name else "ps.Variable")
        who = f"ps.Variable({name!r})"
        constraint = _constraints.get(constraint, f"{who}: constraint")
        regularizer = _regularizers.get(regularizer, f"{who}: regularizer")
        _trace.check_create()
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
        if _abstract.creating() or isinstance(initial_value, jax.ShapeDtypeStruct):
            struct, make = abstract_value(initial_value, dtype, full_name, part, device, sharding)
            _check_hooks(constraint, regularizer, struct, full_name)
            self._set_fields(
                struct, not is_key_dtype(struct.dtype) if trainable is None else trainable, True
            )
            self._partition = part
            self._constraint, self._regularizer = constraint, regularizer
            self.__class__ = _Abstract
            _abstract.remember(self, make)
            self._store = store
            self._name = store.register(self, full_name, exact=_full_name is not None, base=base)
            return
        value, owned, placed = created(initial_value, dtype, full_name, part, device, sharding)
        _check_hooks(constraint, regularizer, value, full_name)
        traced = isinstance(value, Tracer)
        if not traced and not isinstance(value, np.ndarray) and placed is not None:
            value = place(value, placed, f"variable '{full_name}'")  # may share a buffer
        if trainable is None:
            trainable = not is_key_dtype(value.dtype)
        self._set_fields(value, trainable, owned)
        self._name = full_name
        self._partition = part
        self._constraint, self._regularizer = constraint, regularizer
        if traced:  # bound in the ps.function trace; its array comes after the trace, made
            _trace.create(self, value)  # by ps.function in a program with this sharding
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

    def ref(self) -> Reference:
        """A hashable reference to this variable."""
        return Reference(self)

    def __getitem__(self, index: Index) -> VariableSlice:
        return VariableSlice(self, index)

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
            _full_name=_copy_name(self._name),
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
        return bool(_trace.depth) and bool(_trace.bound(self)[0])

    def value(self) -> jax.Array:
        if _trace.depth:
            found, value = _trace.bound(self)
            if found:
                return value  # type: ignore[no-any-return]
        raise _abstract.error(self._name, "read")

    read_value = value

    def numpy(self) -> np.ndarray:
        raise _abstract.error(self._name, "read")

    def assign(self, value: ValueLike, read_value: bool = True) -> Self | None:
        if self._bound():
            return Variable.assign(self, value, read_value)
        raise _abstract.error(self._name, "assigned")

    def assign_add(self, delta: ValueLike, read_value: bool = True) -> Self | None:
        if self._bound():
            return Variable.assign_add(self, delta, read_value)
        raise _abstract.error(self._name, "assigned")

    def assign_sub(self, delta: ValueLike, read_value: bool = True) -> Self | None:
        if self._bound():
            return Variable.assign_sub(self, delta, read_value)
        raise _abstract.error(self._name, "assigned")

    def _coerce(self, value: Any, op: str, *, host: bool = False) -> Any:
        if self._bound():
            return Variable._coerce(self, value, op, host=host)
        raise _abstract.error(self._name, "assigned")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or not hasattr(jax.Array, name):
            raise AttributeError(f"'ps.Variable' object has no attribute {name!r}")
        raise _abstract.error(self._name, f"used (.{name})")

    def __deepcopy__(self, memo: dict[int, Any]) -> Variable:
        raise _abstract.error(self._name, "copied")

    __copy__ = __deepcopy__

    def __repr__(self) -> str:
        where = (
            ""
            if ownership.peek(self).sharding is None
            else f" sharding={ownership.peek(self).sharding}"
        )
        return (
            f"<ps.Variable '{self._name}' shape={self._shape} dtype={self._dtype_name()} "
            f"abstract{where}>"
        )

    def _write(self, new: Any, owned: bool = False) -> None:
        want = ownership.peek(self).sharding
        if want is not None and getattr(new, "sharding", want) != want:
            new = jax.device_put(new, want)
        with STATE_LOCK:
            self.__class__ = Variable  # type: ignore[assignment]
            _abstract.forget(self)
            Variable._write(self, new, owned)


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
    abstract = isinstance(var, _Abstract)
    coerce = Variable._coerce if abstract else type(var)._coerce
    with jax.ensure_compile_time_eval(), _trace.no_frames():
        new = coerce(var, value, "restore")
        if isinstance(new, np.ndarray) and not var._is_string:
            new = jax.device_put(new, var.sharding) if abstract else jnp.asarray(new)
    if tuple(new.shape) != var.shape:
        raise shape_error(var.name, var.shape, tuple(new.shape))
    if owned is None:
        owned = fresh(value, new)
    if not abstract and var._pending():
        ownership.initial(var, new)
    else:
        var._write(new, owned=owned)


def _check_hooks(constraint: Any, regularizer: Any, value: Any, name: str) -> None:
    """A constraint must keep the value's shape and dtype, a regularizer give a scalar:
    checked abstractly before the variable exists (so a bad one creates nothing)."""
    if constraint is None and regularizer is None:
        return
    shape, dtype = tuple(value.shape), value.dtype
    if is_key_dtype(dtype) or np.dtype(dtype) == STRING:
        raise TypeError(
            f"Variable '{name}' holds {'PRNG keys' if is_key_dtype(dtype) else 'strings'}: it "
            "cannot have a constraint or a regularizer (they apply to numbers)."
        )
    if constraint is not None:
        _constraints.check(constraint, shape, dtype, name)
    if regularizer is not None:
        _regularizers.check(regularizer, shape, dtype, name)


def _copy_name(name: str) -> str:
    return default_store().unique_name(name, reserve=False)


# ----------------------------------------------------------------------- pytree


def _flatten(v: Variable) -> tuple[tuple[Any], tuple[str, bool]]:
    return (v.value(),), (v.name, v.trainable)


def _unflatten(aux: tuple[str, bool], children: Any) -> Any:
    (leaf,) = children
    if leaf is None or not hasattr(leaf, "dtype"):
        return leaf  # jax sentinels (None, object()) pass through untouched
    self = object.__new__(_Detached)
    self._set_fields(leaf, aux[1], owned=False)
    self._arith = False  # every update goes through _coerce, which refuses it
    self._delta_aval = None
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
