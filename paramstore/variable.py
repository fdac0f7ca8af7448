"""``ps.Variable``: a stateful facade over an immutable ``jax.Array``.

Contract (see API.md, "Variables"):

* A Variable holds one immutable array. ``assign`` builds a new array and swaps it in, so a
  value read before an assign keeps its old contents. Shape and dtype never change.
* dtype inference follows TensorFlow for Python values (``3.14`` -> float32, ``[1, 2]`` ->
  int32, ``[True]`` -> bool, ``5+4j`` -> complex64); NumPy and JAX arrays keep their dtype
  (64-bit types become 32-bit unless ``jax_enable_x64`` is on, as everywhere in JAX); an
  explicit ``dtype`` casts. The array a variable holds is never weakly typed.
* Assigned values convert to the variable's dtype only without loss: Python numbers and
  lists (and weakly typed JAX values) may convert within their kind or upward (an int into
  a float variable or any integer one in range, a float into float16); typed arrays must
  cast safely (int8 into int32, not float64 into float32). Anything else raises
  ``TypeError`` naming both dtypes. ``assign`` needs the exact shape;
  ``assign_add``/``assign_sub`` broadcast the delta to it. As in TensorFlow, bool variables
  only support ``assign``. A sliced assign (``v[i].assign(x)``) checks its index against
  the shape (out of range: ``IndexError``, where JAX would clamp). A failed assign leaves
  the variable exactly as it was.
* Strings (``dtype=str`` or ``['abc']``) make a host-side variable on a NumPy
  ``StringDType`` array: it can be assigned (strings only), saved and restored, not used in
  ``ps.function``.
* Thread safety: ``assign_add``/``assign_sub`` hold a per-variable lock across their
  read-modify-write, so concurrent updates are never lost.
* A Variable is a registered pytree (one leaf, its value) so that ``jnp`` functions accept
  it. Unflattening makes a *detached* Variable: it holds the leaf, is in no store, counts as
  no creation, and refuses assigns (they could never reach the original).
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paramstore import _trace
from paramstore import random as _psrandom
from paramstore import scope as _scope
from paramstore import sharding as _sharding

__all__ = ["Variable", "VariableSlice", "Reference"]

_STRING = np.dtypes.StringDType()
# Eager updates call these directly: jit's C++ dispatch skips jnp's Python argument checks.
_EAGER_ADD = jax.jit(jnp.add)
_EAGER_SUB = jax.jit(jnp.subtract)
_Tracer = jax.core.Tracer


# ----------------------------------------------------------------------------- dtypes


def _canonical_dtype(dtype: Any, what: str) -> np.dtype:
    if dtype is str or dtype is np.str_:
        return _STRING
    try:
        dt = np.dtype(jnp.dtype(dtype))
    except TypeError as e:
        raise TypeError(f"Unknown dtype {dtype!r} for {what}: {e}.") from None
    if dt.kind in "USOT":
        return _STRING
    canonical = np.dtype(jax.dtypes.canonicalize_dtype(dt))
    if canonical != dt:
        raise TypeError(
            f"dtype {dt.name} for {what} needs 64-bit JAX; enable it with "
            "jax.config.update('jax_enable_x64', True) or use a 32-bit dtype."
        )
    return dt


_PY_KIND = {bool: np.dtype(bool), int: np.dtype(np.int64), float: np.dtype(np.float64)}


def _tf_infer(value: Any) -> np.ndarray:
    """A NumPy array for a Python value, with TensorFlow's dtype inference."""
    arr = np.asarray(value)
    kind = arr.dtype.kind
    if kind == "f":
        return arr.astype(np.float32)
    if kind == "c":
        return arr.astype(np.complex64)
    if kind in "iu":
        if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
            if jax.config.read("jax_enable_x64"):
                return arr.astype(np.int64)
            raise ValueError(
                f"Integer value {value!r} does not fit in int32; enable 64-bit JAX "
                "(jax.config.update('jax_enable_x64', True)) for int64 variables."
            )
        return arr.astype(np.int32)
    if kind in "USOT":
        return _to_strings(arr)
    return arr


def _strong(x: Any) -> Any:
    """``x`` without JAX's weak type: a variable's array always has a definite dtype."""
    return x.astype(x.dtype) if getattr(x, "weak_type", False) else x


def _is_text(arr: np.ndarray) -> bool:
    kind = arr.dtype.kind
    if kind == "O":
        return all(isinstance(x, (str, bytes)) for x in arr.flat)
    return kind in "UST"


def _to_strings(arr: np.ndarray) -> np.ndarray:
    try:
        out = np.asarray(arr, dtype=_STRING)
    except (TypeError, ValueError) as e:
        raise TypeError(f"Cannot make a string variable from {arr!r}: {e}.") from None
    out.flags.writeable = False
    return out


def _lossless(src: np.dtype, dst: np.dtype, weak: bool) -> bool:
    if src == dst:
        return True
    if dst.kind == "b":
        return False
    if weak:
        # Python ints go into any integer variable, signed or not (range checked separately).
        if src.kind in "iu" and dst.kind in "iu":
            return True
        return bool(np.can_cast(src, dst, "same_kind"))
    return bool(np.can_cast(src, dst, "safe"))


def _dtype_error(
    var_name: str, src: Any, dst: np.dtype, op: str, python_value: Any = None
) -> TypeError:
    what = f"dtype {np.dtype(src).name}"
    if python_value is not None:  # say what the user wrote, not NumPy's default width
        what = f"Python {type(python_value).__name__} {python_value!r:.40} ({what})"
    return TypeError(
        f"Cannot {op} a value of {what} to variable '{var_name}' of dtype "
        f"{dst.name}: the conversion would lose information. A variable's dtype never "
        f"changes; cast explicitly, e.g. value.astype({dst.name!r})."
    )


def _shape_error(var_name: str, want: tuple, got: tuple, what: str = "variable") -> ValueError:
    return ValueError(
        f"Shapes {want} and {got} are incompatible: cannot assign a value of shape {got} to "
        f"{what} '{var_name}' of shape {want}. A variable's shape never changes."
    )


# ----------------------------------------------------------------------- array behaviour


def _unwrap(x: Any) -> Any:
    return x.value() if isinstance(x, (Variable, VariableSlice)) else x


def _binary(op: Callable[[Any, Any], Any]) -> tuple[Callable, Callable]:
    def forward(self: Any, other: Any) -> Any:
        return op(self.value(), _unwrap(other))

    def reflected(self: Any, other: Any) -> Any:
        return op(_unwrap(other), self.value())

    return forward, reflected


class _ArrayOps:
    """Operators, conversions and array methods, all computed on ``self.value()``."""

    __slots__ = ()
    # Higher than NumPy's, as jax.Array's: `np_array @ v` defers to our reflected operator
    # (a JAX op that sees the traced value) instead of converting v through __array__.
    __array_priority__ = 100

    def value(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    __add__, __radd__ = _binary(operator.add)
    __sub__, __rsub__ = _binary(operator.sub)
    __mul__, __rmul__ = _binary(operator.mul)
    __truediv__, __rtruediv__ = _binary(operator.truediv)
    __floordiv__, __rfloordiv__ = _binary(operator.floordiv)
    __mod__, __rmod__ = _binary(operator.mod)
    __pow__, __rpow__ = _binary(operator.pow)
    __matmul__, __rmatmul__ = _binary(operator.matmul)
    __and__, __rand__ = _binary(operator.and_)
    __or__, __ror__ = _binary(operator.or_)
    __xor__, __rxor__ = _binary(operator.xor)
    __lshift__, __rlshift__ = _binary(operator.lshift)
    __rshift__, __rrshift__ = _binary(operator.rshift)
    __lt__, _ = _binary(operator.lt)
    __le__, _ = _binary(operator.le)
    __gt__, _ = _binary(operator.gt)
    __ge__, _ = _binary(operator.ge)
    __eq__, _ = _binary(operator.eq)  # type: ignore[assignment]
    __ne__, _ = _binary(operator.ne)  # type: ignore[assignment]
    del _

    def __neg__(self) -> Any:
        return -self.value()

    def __pos__(self) -> Any:
        return +self.value()

    def __abs__(self) -> Any:
        return abs(self.value())

    def __invert__(self) -> Any:
        return ~self.value()

    def __bool__(self) -> bool:
        return bool(self.value())

    def __float__(self) -> float:
        return float(self.value())

    def __int__(self) -> int:
        return int(self.value())

    def __index__(self) -> int:
        return operator.index(self.value())

    def __complex__(self) -> complex:
        return complex(self.value())

    def __len__(self) -> int:
        return len(self.value())

    def __iter__(self) -> Iterator[Any]:
        return iter(self.value())

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = np.asarray(self.value())
        if dtype is not None:
            arr = arr.astype(dtype)
        return arr.copy() if copy else arr

    def __jax_array__(self) -> Any:
        return self.value()

    def __hash__(self) -> int:
        raise TypeError(
            f"{type(self).__name__} is unhashable: it compares elementwise like an array. "
            "Use variable.ref() as a dict key or set member."
        )

    def __getattr__(self, name: str) -> Any:
        # Array methods and properties: v.sum(), v.reshape(...), v.T, v.astype(...).
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.value(), name)


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


class Variable(_ArrayOps):
    """A named, stateful array (see the module docstring for the contract)."""

    __slots__ = (
        "_value",
        "_name",
        "_trainable",
        "_dtype",
        "_shape",
        "_is_string",
        "_detached",
        "_lock",
        "__weakref__",
    )

    def __init__(
        self,
        initial_value: Any = None,
        trainable: bool = True,
        name: str | None = None,
        dtype: Any = None,
        *,
        device: Any = None,
        sharding: Any = None,
        _full_name: str | None = None,
    ) -> None:
        if initial_value is None:
            raise ValueError(
                "ps.Variable needs an initial_value: an array-like, a jax.Array, another "
                "Variable, or a zero-argument callable (e.g. lambda: init((3, 4)))."
            )
        if name is not None and not isinstance(name, str):
            raise TypeError(f"A variable's name must be a str, got {type(name).__name__}.")
        _trace.check_create()
        store = _scope.default_store()
        base = None
        if _full_name is None:
            base = _scope.prefixed(name or "Variable")
            full_name = store.unique_name(base, reserve=False)
        else:  # get_variable: the exact name, scoped by variable scopes only
            full_name = _full_name
        placed = _sharding.placement(device, sharding)
        value = _initial_value(initial_value, dtype, full_name)
        if not isinstance(value, np.ndarray):
            value = _sharding.place(value, placed, f"variable '{full_name}'")
        self._set_fields(value, trainable)
        self._name = store.register(self, full_name, exact=_full_name is not None, base=base)

    def _set_fields(self, value: Any, trainable: bool) -> None:
        self._value = value
        self._trainable = bool(trainable)
        self._dtype = np.dtype(value.dtype)
        self._shape = tuple(value.shape)
        self._is_string = self._dtype == _STRING
        self._detached = False
        self._lock = threading.Lock()

    @classmethod
    def _detached_from(cls, leaf: Any, name: str, trainable: bool) -> Variable:
        """The Variable that unflattening a pytree makes: no store, no creation, no assign."""
        self = object.__new__(cls)
        self._set_fields(leaf, trainable)
        self._name = name
        self._detached = True
        return self

    # -- reading
    def value(self) -> Any:
        """The current array (inside ``ps.function`` / ``ps.pure``, the traced value)."""
        if _trace.depth:
            return _trace.read(self)
        return self._value

    read_value = value

    def numpy(self) -> np.ndarray:
        """A NumPy copy of the current value."""
        return np.array(self.value(), copy=True)

    @property
    def name(self) -> str:
        return self._name

    @property
    def trainable(self) -> bool:
        return self._trainable

    @property
    def dtype(self) -> np.dtype:
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
    def sharding(self) -> Any:
        """The value's ``jax.sharding.Sharding`` (None for a string variable)."""
        return None if self._is_string else self._value.sharding

    @property
    def device(self) -> Any:
        """The ``jax.Device`` holding the value; None when sharded over several (or strings)."""
        if self._is_string:
            return None
        devices = self._value.sharding.device_set
        return next(iter(devices)) if len(devices) == 1 else None

    def ref(self) -> Reference:
        """A hashable reference to this variable."""
        return Reference(self)

    def __getitem__(self, index: Any) -> VariableSlice:
        return VariableSlice(self, index)

    def __repr__(self) -> str:
        head = f"<ps.Variable '{self._name}' shape={self._shape} dtype={self._dtype_name()}"
        value = self.value()
        if isinstance(value, _Tracer):
            return f"{head} (traced)>"
        if not getattr(value, "is_fully_addressable", True) and not value.is_fully_replicated:
            # sharded over several processes: no process can show the whole value
            return f"{head}, sharded over {len(value.sharding.device_set)} devices>"
        array = np.asarray(value)
        # As TensorFlow: a 0-d value prints as the Python scalar (numpy=1.5, not array(1.5, ...)).
        text = repr(array.item()) if array.ndim == 0 else repr(array)
        return f"{head}, numpy={text}>"

    def _dtype_name(self) -> str:
        return "string" if self._is_string else self._dtype.name

    # -- writing
    def assign(self, value: Any, read_value: bool = True) -> Variable | None:
        """Replace the value. Raises ValueError (shape) or TypeError (dtype); then no change."""
        new = self._coerce(value, "assign")
        if new.shape != self._shape:
            raise _shape_error(self._name, self._shape, tuple(new.shape))
        self._swap(new)
        return self if read_value else None

    def assign_add(self, delta: Any, read_value: bool = True) -> Variable | None:
        """``self += delta`` atomically (delta broadcasts to the variable's shape)."""
        self._update(delta, _EAGER_ADD, "add")
        return self if read_value else None

    def assign_sub(self, delta: Any, read_value: bool = True) -> Variable | None:
        """``self -= delta`` atomically (delta broadcasts to the variable's shape)."""
        self._update(delta, _EAGER_SUB, "subtract")
        return self if read_value else None

    def _update(self, delta: Any, eager_op: Callable[[Any, Any], Any], what: str) -> None:
        self._check_arithmetic(what)
        d = self._coerce(delta, what, host=True)
        if d.shape != self._shape and not _broadcasts(d.shape, self._shape):
            raise _shape_error(self._name, self._shape, tuple(d.shape))
        with self._lock:
            if _trace.depth:  # maybe traced: plain jnp ops, no nested jit
                op = jnp.add if eager_op is _EAGER_ADD else jnp.subtract
                self._swap(op(self.value(), d))
            else:
                # The result lands where the variable's array is: no placement check.
                self._swap(eager_op(self._value, self._colocated(d)), placed=True)

    def _check_arithmetic(self, what: str) -> None:
        if self._is_string:
            raise TypeError(f"Cannot {what} on string variable '{self._name}'.")
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
            and not isinstance(x, _Tracer)
            and x.committed  # an uncommitted array goes wherever the variable's is
            and x.sharding.device_set != self._value.sharding.device_set
        ):
            return np.asarray(x)
        return x

    def _coerce(self, value: Any, op: str, *, host: bool = False) -> Any:
        """``value`` as an array of this variable's dtype, or TypeError (no change made).

        A jax.Array (or tracer) stays one, without a weak type. Python and NumPy values
        become a jax.Array or, with ``host``, a private NumPy copy (for an update op, which
        moves it to the device itself, and more cheaply)."""
        if self._detached:
            raise TypeError(
                f"Variable '{self._name}' was passed through a JAX transformation as a pytree "
                "(jax.jit, jax.vmap, jax.tree_util ...), so assigning it cannot reach the "
                "original variable. Use ps.function or ps.pure to update variables."
            )
        value = _unwrap(value)
        dst = self._dtype
        if self._is_string:
            arr = value if isinstance(value, np.ndarray) else np.asarray(value)
            if not _is_text(arr):
                raise TypeError(
                    f"Cannot {op} a value of dtype {arr.dtype.name} to string variable "
                    f"'{self._name}': a variable's dtype never changes; convert the values "
                    "to str explicitly."
                )
            return _to_strings(arr)
        if isinstance(value, jax.Array):  # also tracers
            if value.dtype != dst and not _lossless(np.dtype(value.dtype), dst, value.weak_type):
                raise _dtype_error(self._name, value.dtype, dst, op)
            return value.astype(dst) if value.dtype != dst else _strong(value)
        if isinstance(value, (np.ndarray, np.generic)):
            if value.dtype != dst and not _lossless(value.dtype, dst, weak=False):
                raise _dtype_error(self._name, value.dtype, dst, op)
            arr = np.array(value, dtype=dst, copy=True)
            return arr if host else jnp.asarray(arr)
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"Cannot {op} {type(value).__name__} to variable '{self._name}': {e}."
            ) from None
        src = arr.dtype if arr.dtype.kind not in "iu" else np.dtype(np.int64)
        if arr.dtype.kind in "USOT" or not _lossless(src, dst, weak=True):
            raise _dtype_error(self._name, arr.dtype, dst, op, python_value=value)
        if dst.kind in "iu" and arr.size:
            info = np.iinfo(dst)
            if arr.min() < info.min or arr.max() > info.max:
                raise TypeError(
                    f"Cannot {op} {value!r} to variable '{self._name}' of dtype {dst.name}: "
                    f"out of range [{info.min}, {info.max}]."
                )
        arr = arr.astype(dst)  # a copy, converted by NumPy the same way on every path
        return arr if host else jnp.asarray(arr)

    def _swap(self, new: Any, placed: bool = False) -> None:
        if _trace.depth and _trace.bind(self, new):
            return
        if isinstance(new, _Tracer):
            raise TypeError(
                f"Cannot assign a traced value to variable '{self._name}' from inside a "
                "plain JAX transformation (jax.jit, jax.grad, jax.vmap, ...): the variable "
                "would hold a leaked tracer. Decorate the function with @ps.function, or "
                "make it pure with ps.pure(fn, variables)."
            )
        if not (placed or self._is_string):
            old = self._value.sharding
            if new.sharding != old:
                new = jax.device_put(new, old)
        self._value = new


def _broadcasts(src: tuple, dst: tuple) -> bool:
    try:
        return np.broadcast_shapes(src, dst) == tuple(dst)
    except ValueError:
        return False


def _initial_value(initial_value: Any, dtype: Any, full_name: str) -> Any:
    """The first value of a variable named ``full_name``, concrete even inside a trace."""
    want = None if dtype is None else _canonical_dtype(dtype, f"variable '{full_name}'")
    with jax.ensure_compile_time_eval():
        if callable(initial_value) and not isinstance(initial_value, (Variable, jax.Array)):
            with _psrandom.naming(full_name):
                initial_value = initial_value()
        value = _unwrap(initial_value)
        if isinstance(value, _Tracer):
            raise ValueError(
                f"The initial value of variable '{full_name}' is a traced value: it was "
                "computed inside a jit-compiled trace. Initial values are computed once, "
                "outside the trace: pass a callable, e.g. ps.Variable(lambda: "
                "jnp.zeros(shape)), or an initializer's result, or create the variable "
                "outside the function. It may not depend on the function's arguments."
            )
        if want is not None and want == _STRING:
            return _to_strings(np.asarray(value))
        if isinstance(value, (jax.Array, np.ndarray, np.generic)):
            if np.dtype(value.dtype).kind in "USOT":
                return _to_strings(np.asarray(value))
            return _strong(jnp.asarray(value, dtype=want))
        arr = _tf_infer(value)
        if arr.dtype == _STRING:
            return arr
        return _strong(jnp.asarray(arr, dtype=want))


# ------------------------------------------------------------------------- slices


class VariableSlice(_ArrayOps):
    """``v[index]``: reads like an array; ``assign``/``assign_add``/``assign_sub`` update
    that part of ``v`` (a value that does not fit the slice raises ValueError)."""

    __slots__ = ("_var", "_index")

    def __init__(self, var: Variable, index: Any) -> None:
        self._var = var
        self._index = _unwrap(index)

    def value(self) -> Any:
        return self._var.value()[self._index]

    read_value = value

    def numpy(self) -> np.ndarray:
        return np.array(self.value(), copy=True)

    @property
    def shape(self) -> tuple[int, ...]:
        """The slice's shape; IndexError for an index out of range (JAX would clamp it)."""
        probe = np.broadcast_to(np.empty((), dtype=bool), self._var.shape)  # no memory
        try:
            return probe[self._index].shape
        except IndexError as e:
            raise IndexError(
                f"Index {self._index!r} is out of range for variable '{self._var.name}' of "
                f"shape {self._var.shape}: {e}."
            ) from None
        except Exception:  # e.g. a traced index: only JAX knows
            return tuple(self.value().shape)

    def __getitem__(self, index: Any) -> Any:
        return self.value()[_unwrap(index)]

    def __repr__(self) -> str:
        return f"<ps.Variable '{self._var.name}'[{self._index!r}] value={self.value()!r}>"

    def assign(self, value: Any, read_value: bool = True) -> Variable | None:
        return self._scatter(value, "set", exact=True, read_value=read_value)

    def assign_add(self, delta: Any, read_value: bool = True) -> Variable | None:
        return self._scatter(delta, "add", exact=False, read_value=read_value)

    def assign_sub(self, delta: Any, read_value: bool = True) -> Variable | None:
        return self._scatter(delta, "subtract", exact=False, read_value=read_value)

    def _scatter(self, value: Any, how: str, exact: bool, read_value: bool) -> Variable | None:
        var = self._var
        if var._is_string:
            raise TypeError(f"Sliced assigns are not supported on string variable '{var.name}'.")
        if how != "set":
            var._check_arithmetic(how)
        x = var._coerce(value, "assign" if how == "set" else how, host=True)
        want = self.shape
        fits = x.shape == want if exact else _broadcasts(tuple(x.shape), want)
        if not fits:
            raise _shape_error(f"{var.name}[{self._index!r}]", want, tuple(x.shape), "slice")
        with var._lock:
            x = var._colocated(x)
            ref = var.value().at[self._index]
            new = ref.set(x) if how == "set" else (ref.add(x) if how == "add" else ref.add(-x))
            var._swap(new)
        return var if read_value else None


# ----------------------------------------------------------------------- pytree


def _flatten(v: Variable) -> tuple[tuple[Any], tuple[str, bool]]:
    return (v.value(),), (v.name, v.trainable)


def _unflatten(aux: tuple[str, bool], children: Any) -> Any:
    (leaf,) = children
    if leaf is None or not hasattr(leaf, "dtype"):
        return leaf  # jax sentinels (None, object()) pass through untouched
    return Variable._detached_from(leaf, *aux)


def _flatten_slice(s: VariableSlice) -> tuple[tuple[Any], None]:
    return (s.value(),), None


jax.tree_util.register_pytree_node(Variable, _flatten, _unflatten)
jax.tree_util.register_pytree_node(VariableSlice, _flatten_slice, lambda _, c: c[0])
