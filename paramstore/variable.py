"""``ps.Variable``: a stateful facade over an immutable ``jax.Array``.

Contract (see docs/api.md, "Variables"):

* A Variable holds one immutable array. ``assign`` builds a new array and swaps it in, so a
  value read before an assign keeps its old contents. Shape and dtype never change.
* dtype inference and the conversions an assign accepts are ``paramstore._dtypes``'s: TF's
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
* One write path: every change of a variable's array goes through ``_write`` under the
  state lock (``STATE_LOCK``), which ``ps.function`` calls also hold while they gather,
  dispatch and swap. So each assign and each compiled call is atomic, concurrent
  ``assign_add``s lose nothing, and a read never meets a buffer that a step donates.
* Ownership: ``_owned`` says the array came out of this variable's own computation (a
  compiled update, a private copy) and nobody was handed it by us except through
  ``value()``, whose callers the reference count shows. Only an owned array whose reference
  count shows no other holder is donated; any other is copied first (once).
* A Variable is a registered pytree (one leaf, its value) so that ``jnp`` functions accept
  it. Unflattening makes a *detached* Variable (``_Detached``): it holds the leaf, is in no
  store, counts as no creation, and refuses assigns (they could never reach the original).
* ``copy.deepcopy(v)`` is an independent variable (same value, dtype, shape, trainable
  flag; a new unique name in the current default store); ``pickle`` raises ``TypeError``
  pointing to ``ps.Saver`` / ``ps.Checkpoint``.
* Where a new variable lives and how its initializer runs (docs/api.md, "Models larger than one
  device") is ``paramstore._creation``'s: an initializer with a multi-device sharding runs
  compiled with it as output sharding; inside ``ps.abstract()`` a variable is an
  ``_Abstract`` one (shape, dtype, sharding, ``partition``; every use a ``ValueError``).
  ``set_initial_value`` is the one way to make an abstract variable concrete with a given
  array (checkpoint restores call it, and ``ps.initialize``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paramstore import _abstract, _html, _trace
from paramstore._array_ops import ArrayOps, unwrap
from paramstore._context import STATE_LOCK, prefixed
from paramstore._creation import abstract_value, created, shaped
from paramstore._dtypes import (
    STRING,
    dtype_error,
    is_key_dtype,
    is_text,
    lossless,
    shape_error,
    strong,
    to_strings,
)
from paramstore._initial import broadcasts, flag, fresh, utf8
from paramstore._jax import ARRAY_TYPE, EVAL, Tracer, current_trace, staging
from paramstore._layout import check_partition
from paramstore._ownership import ownership
from paramstore._placement import place
from paramstore._slice import VariableSlice
from paramstore._store import default_store

__all__ = ["Variable", "VariableSlice", "Reference", "set_initial_value"]

# Eager updates call these directly: jit's C++ dispatch skips jnp's Python argument checks.
# An owned buffer that nobody else holds is donated into the update (issue figures: a
# donated add runs at 0.65-0.73x of `x = x + d`, a fresh one at 1.10-1.34x).
_EAGER = {
    "add": (jax.jit(jnp.add), jax.jit(jnp.add, donate_argnums=0)),
    "subtract": (jax.jit(jnp.subtract), jax.jit(jnp.subtract, donate_argnums=0)),
}
_MISSING = object()


def _traced_context_error(name: str) -> TypeError:
    return TypeError(
        f"Cannot assign to variable '{name}' from inside a plain JAX transformation "
        "(jax.jit, jax.grad, jax.vmap, lax control flow ...): the variable would hold a "
        "leaked tracer, or the assign would run once at trace time only. Decorate the "
        "function with @ps.function, or make it pure with ps.pure(fn, variables)."
    )


# ------------------------------------------------------------------------------ Variable


class Reference:
    """A hashable key for a Variable (``v.ref()``); ``ref.deref()`` gives it back."""

    __slots__ = ("_var",)

    def __init__(self, var: Variable) -> None:
        self._var = var

    def deref(self) -> Variable:
        return self._var

    def __hash__(self) -> int:
        return id(self._var)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Reference) and other._var is self._var

    def __repr__(self) -> str:
        return f"<Reference to {self._var!r}>"


class Variable(ArrayOps):
    """A named, stateful array (see the module docstring for the contract)."""

    __slots__ = (
        "_value",  # the array: read and written by paramstore._ownership only
        "_given",  # id() of the array last handed out (ownership's record)
        "_name",
        "_trainable",
        "_dtype",
        "_shape",
        "_is_string",
        "_is_key",
        "_arith",
        "_partition",
        "__weakref__",
    )

    def __init__(
        self,
        initial_value: Any = _MISSING,
        trainable: bool | None = None,
        name: str | None = None,
        dtype: Any = None,
        *,
        device: Any = None,
        sharding: Any = None,
        shape: Any = None,
        partition: Any = None,
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
            self._set_fields(
                struct, not is_key_dtype(struct.dtype) if trainable is None else trainable, True
            )
            self._partition = part
            self.__class__ = _Abstract
            _abstract.remember(self, make)
            self._name = store.register(self, full_name, exact=_full_name is not None, base=base)
            return
        value, owned, placed = created(initial_value, dtype, full_name, part, device, sharding)
        traced = isinstance(value, Tracer)
        if not traced and not isinstance(value, np.ndarray) and placed is not None:
            value = place(value, placed, f"variable '{full_name}'")  # may share a buffer
        if trainable is None:
            trainable = not is_key_dtype(value.dtype)
        self._set_fields(value, trainable, owned)
        self._name = full_name
        self._partition = part
        if traced:  # bound in the ps.function trace; its array comes after the trace, made
            _trace.create(self, value)  # by ps.function in a program with this sharding
            placeholder = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=placed)  # type: ignore[no-untyped-call]
            ownership.adopt(self, placeholder, owned=True)
        self._name = store.register(self, full_name, exact=_full_name is not None, base=base)

    def _set_fields(self, value: Any, trainable: bool, owned: bool) -> None:
        ownership.adopt(self, value, owned)
        self._trainable = bool(trainable)
        self._is_key = is_key_dtype(value.dtype)  # once: issubdtype costs ~1 us a call
        self._dtype = value.dtype if self._is_key else np.dtype(value.dtype)
        self._shape = tuple(value.shape)
        self._is_string = self._dtype == STRING
        self._arith = not (self._is_key or self._is_string or self._dtype.kind == "b")

    # -- reading
    def value(self) -> Any:
        """The current array (inside ``ps.function`` / ``ps.pure``, the traced value)."""
        if _trace.depth:
            return _trace.read(self)
        if current_trace() is not EVAL:
            return _trace.outside(self)
        return ownership.hand_out(self)

    read_value = value

    def numpy(self) -> np.ndarray:
        """A NumPy copy of the current value (a key variable's key data)."""
        value = self.value()
        if self._is_key:
            value = jax.random.key_data(value)
        return np.array(value, copy=True)

    @property
    def name(self) -> str:
        return self._name

    @property
    def trainable(self) -> bool:
        return self._trainable

    @property
    def dtype(self) -> Any:
        """A ``np.dtype`` (a JAX key dtype for a key variable)."""
        return self._dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._shape, dtype=np.int64))

    @property
    def partition(self) -> tuple[Any, ...] | None:
        """The logical axis names given as ``partition=`` (one per dimension), or None."""
        return getattr(self, "_partition", None)

    @property
    def is_abstract(self) -> bool:
        """Whether the variable has a shape, dtype and sharding but no value yet
        (created inside ``ps.abstract()``; restore or ``ps.initialize`` it)."""
        return False

    @property
    def sharding(self) -> Any:
        """The value's ``jax.sharding.Sharding`` (None for a string variable)."""
        return None if self._is_string else ownership.peek(self).sharding

    @property
    def device(self) -> Any:
        """The ``jax.Device`` holding the value; None when sharded over several (or strings)."""
        sharding = None if self._is_string else ownership.peek(self).sharding
        if sharding is None:
            return None
        devices = sharding.device_set
        return next(iter(devices)) if len(devices) == 1 else None

    def ref(self) -> Reference:
        """A hashable reference to this variable."""
        return Reference(self)

    def __getitem__(self, index: Any) -> VariableSlice:
        return VariableSlice(self, index)

    def _repr_html_(self) -> str:  # Jupyter's rendering (paramstore/_html.py)
        return _html.variable_html(self)

    def __repr__(self) -> str:
        head = f"<ps.Variable '{self._name}' shape={self._shape} dtype={self._dtype_name()}"
        if self._pending():
            return f"{head} (initial value being computed)>"
        value = self.value()
        if isinstance(value, Tracer):
            return f"{head} (traced)>"
        if not getattr(value, "is_fully_addressable", True) and not value.is_fully_replicated:
            # sharded over several processes: no process can show the whole value
            return f"{head}, sharded over {len(value.sharding.device_set)} devices>"
        if self._is_key:
            return f"{head}, key_data={np.asarray(jax.random.key_data(value))!r}>"
        array = np.asarray(value)
        # As TensorFlow: a 0-d value prints as the Python scalar (numpy=1.5, not array(1.5, ...)).
        text = repr(array.item()) if array.ndim == 0 and not self._is_string else repr(array)
        return f"{head}, numpy={text}>"

    def _pending(self) -> bool:
        """Whether the initial value is still being computed (created inside the first
        trace of a ``ps.function`` from a traced value, until that trace completes)."""
        return isinstance(ownership.peek(self), jax.ShapeDtypeStruct)

    def _dtype_name(self) -> str:
        return "string" if self._is_string else str(self._dtype)

    # -- copies
    def __deepcopy__(self, memo: dict[int, Any]) -> Variable:
        """An independent copy: same value, dtype, shape and trainable flag; a new unique
        name (this one's, numbered) in the current default store."""
        with STATE_LOCK:  # copied before any step can donate it
            value = ownership.peek(self)
            if not self._is_string:
                value = jnp.array(value, copy=True)
        new = Variable(value, self._trainable, _full_name=_copy_name(self._name))
        memo[id(self)] = new
        return new

    __copy__ = __deepcopy__  # a shallow copy sharing state would break ownership

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"ps.Variable '{self._name}' cannot be pickled (paramstore never pickles: loading "
            "a pickle runs code). Save values with ps.Saver or ps.Checkpoint, or copy a "
            "variable in memory with copy.deepcopy."
        )

    # -- writing
    def assign(self, value: Any, read_value: bool = True) -> Variable | None:
        """Replace the value. Raises ValueError (shape) or TypeError (dtype); then no change."""
        new = self._coerce(value, "assign")
        if new.shape != self._shape:
            raise shape_error(self._name, self._shape, tuple(new.shape))
        self._swap(new, owned=fresh(value, new))
        return self if read_value else None

    def assign_add(self, delta: Any, read_value: bool = True) -> Variable | None:
        """``self += delta`` atomically (delta broadcasts to the variable's shape)."""
        self._update(delta, "add")
        return self if read_value else None

    def assign_sub(self, delta: Any, read_value: bool = True) -> Variable | None:
        """``self -= delta`` atomically (delta broadcasts to the variable's shape)."""
        self._update(delta, "subtract")
        return self if read_value else None

    def _update(self, delta: Any, how: str) -> None:
        if self._arith and type(delta) is ARRAY_TYPE and delta.dtype == self._dtype:
            # The common eager case, a strong jax.Array of the variable's dtype: the checks
            # that apply are below (its shape; weak types and other dtypes take _coerce).
            # Measured: assign_add on 1,000 float32 13.4 -> 11.x us (2026-11-22).
            d = delta if not delta.weak_type else self._coerce(delta, how, host=True)
        else:
            self._check_arithmetic(how)
            d = self._coerce(delta, how, host=True)
        if d.shape != self._shape and not broadcasts(d.shape, self._shape):
            raise shape_error(self._name, self._shape, tuple(d.shape))
        if _trace.depth and _trace.active():  # traced: plain jnp ops, no nested jit
            op = jnp.add if how == "add" else jnp.subtract
            self._swap(op(self.value(), d), update=f"assign_{how[:3]}")
            return
        if current_trace() is not EVAL:
            raise _traced_context_error(self._name)
        if type(d) is not np.ndarray and d.committed:
            d = self._colocated(d)
        # The result lands where the variable's array is: no placement check.
        fresh, donating = _EAGER[how]
        ownership.update(self, fresh, donating, d)

    def _check_arithmetic(self, what: str) -> None:
        if self._is_string:
            raise TypeError(f"Cannot {what} on string variable '{self._name}'.")
        if self._is_key:
            raise TypeError(
                f"Cannot {what} on PRNG key variable '{self._name}': key variables only "
                "support assign (of a key of the same type)."
            )
        if self._dtype.kind == "b":
            raise TypeError(
                f"Cannot {what} on bool variable '{self._name}' (as in TensorFlow, bool "
                "variables only support assign)."
            )

    def _colocated(self, x: Any) -> Any:
        """``x`` usable with this variable's array in one eager op: an array committed to
        other devices goes through the host (jit would refuse to mix the two)."""
        if (
            isinstance(x, jax.Array)
            and not isinstance(x, Tracer)
            and x.committed  # an uncommitted array goes wherever the variable's is
            and x.sharding.device_set != ownership.peek(self).sharding.device_set
        ):
            return np.asarray(x)
        return x

    def _coerce(self, value: Any, op: str, *, host: bool = False) -> Any:
        """``value`` as an array of this variable's dtype, or TypeError (no change made).

        A jax.Array (or tracer) stays one, without a weak type. Python and NumPy values
        become a jax.Array or, with ``host``, a private NumPy copy (for an update op, which
        moves it to the device itself, and more cheaply)."""
        value = unwrap(value)
        dst = self._dtype
        if self._is_string:
            arr = value if isinstance(value, np.ndarray) else np.asarray(value)
            if not is_text(arr):
                raise TypeError(
                    f"Cannot {op} a value of dtype {arr.dtype.name} to string variable "
                    f"'{self._name}': a variable's dtype never changes; convert the values "
                    "to str explicitly."
                )
            return to_strings(utf8(arr, self._name))
        if self._is_key:
            if not (isinstance(value, jax.Array) and value.dtype == dst):
                got = getattr(value, "dtype", type(value).__name__)
                raise TypeError(
                    f"Cannot {op} a value of dtype {got} to PRNG key variable '{self._name}' "
                    f"of dtype {dst}: assign a key array of the same type (jax.random.key)."
                )
            return value
        if isinstance(value, jax.Array):  # also tracers
            if value.dtype != dst and is_key_dtype(value.dtype):
                raise TypeError(
                    f"Cannot {op} a PRNG key array (dtype {value.dtype}) to variable "
                    f"'{self._name}' of dtype {dst.name}: store its key data "
                    "(jax.random.key_data(key)), or hold keys in a key variable "
                    "(ps.Variable(jax.random.key(0)))."
                )
            if value.dtype != dst and not lossless(np.dtype(value.dtype), dst, value.weak_type):
                raise dtype_error(self._name, value.dtype, dst, op)
            return value.astype(dst) if value.dtype != dst else strong(value)
        if isinstance(value, (np.ndarray, np.generic)):
            if value.dtype != dst and not lossless(value.dtype, dst, weak=False):
                raise dtype_error(self._name, value.dtype, dst, op)
            arr = np.array(value, dtype=dst, copy=True)
            return arr if host else jnp.asarray(arr)
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"Cannot {op} {type(value).__name__} to variable '{self._name}': {e}."
            ) from None
        src = arr.dtype if arr.dtype.kind not in "iu" else np.dtype(np.int64)
        if arr.dtype.kind in "USOT" or not lossless(src, dst, weak=True):
            raise dtype_error(self._name, arr.dtype, dst, op, python_value=value)
        if dst.kind in "iu" and arr.size:
            info = np.iinfo(dst)
            if arr.min() < info.min or arr.max() > info.max:
                raise TypeError(
                    f"Cannot {op} {value!r} to variable '{self._name}' of dtype {dst.name}: "
                    f"out of range [{info.min}, {info.max}]."
                )
        arr = arr.astype(dst)  # a copy, converted by NumPy the same way on every path
        return arr if host else jnp.asarray(arr)

    def _swap(self, new: Any, placed: bool = False, owned: bool = True, update: str = "") -> None:
        """Make ``new`` (checked by the caller) the value: in the active frame, or for real
        (``update``: the op, e.g. ``assign_add``, when ``new`` is computed from the value)."""
        if _trace.depth and _trace.bind(self, new, update):
            return
        trace = current_trace()
        if isinstance(new, Tracer) or trace is not EVAL and staging(trace):
            raise _traced_context_error(self._name)
        if not (placed or self._is_string):
            old = ownership.peek(self).sharding
            if new.sharding != old:
                new = jax.device_put(new, old)
        self._write(new, owned)

    def _write(self, new: Any, owned: bool = False) -> None:
        """The one write path of a variable's real array (callers checked dtype, shape and
        placement). ``owned``: nobody outside this variable holds ``new``'s buffer."""
        ownership.write(self, new, owned)


class _Detached(Variable):
    """What unflattening a Variable pytree makes: it holds the leaf (often a tracer of the
    transformation), is in no store, counts as no creation, and refuses assigns."""

    __slots__ = ()

    def value(self) -> Any:
        return ownership.peek(self)  # a pytree leaf (often a tracer), never donated

    read_value = value

    def _coerce(self, value: Any, op: str, *, host: bool = False) -> Any:
        raise TypeError(
            f"Variable '{self._name}' was passed through a JAX transformation as a pytree "
            "(jax.jit, jax.vmap, jax.tree_util ...), so assigning it cannot reach the "
            "original variable. Use ps.function or ps.pure to update variables."
        )


class _Abstract(Variable):
    """A variable with a shape, dtype and sharding but no value (``ps.abstract()``): every
    use raises ``_abstract.error``; ``_write`` (through ``set_initial_value``) gives it its
    value and turns it into a plain ``Variable``."""

    __slots__ = ()

    @property
    def is_abstract(self) -> bool:
        return True

    def value(self) -> Any:
        raise _abstract.error(self._name, "read")

    read_value = value

    def numpy(self) -> np.ndarray:
        raise _abstract.error(self._name, "read")

    def assign(self, value: Any, read_value: bool = True) -> Variable | None:
        raise _abstract.error(self._name, "assigned")

    def assign_add(self, delta: Any, read_value: bool = True) -> Variable | None:
        raise _abstract.error(self._name, "assigned")

    assign_sub = assign_add

    def _coerce(self, value: Any, op: str, *, host: bool = False) -> Any:
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
    self._name = aux[0]
    return self


jax.tree_util.register_pytree_node(Variable, _flatten, _unflatten)
jax.tree_util.register_pytree_node(_Detached, _flatten, _unflatten)
jax.tree_util.register_pytree_node(_Abstract, _flatten, _unflatten)
