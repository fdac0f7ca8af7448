"""Reading a variable: ``value()`` (the traced value inside a ``ps.function`` / ``ps.pure``
frame, else the array, handed out through ``_core.ownership``), ``numpy()``, the properties
(``name``, ``trainable``, ``dtype``, ``shape``, ``sharding``, ``device`` ...) and ``repr``.

``Reads`` is the bottom base class of ``ps.Variable`` (``Variable`` -> ``Writes`` ->
``Reads`` -> ``ArrayOps``); it declares the fields ``Variable.__init__`` sets and holds
no state of its own (``__slots__ = ()``). A base class adds no call to a read: attribute
lookup goes through the type's method cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from paramstore._core import frames as _trace
from paramstore._core import html as _html
from paramstore._core.context import TRACE_EPOCH
from paramstore._core.jax_api import EVAL, Tracer, current_trace
from paramstore._core.ownership import Owned, ownership
from paramstore._variable.initial import flag
from paramstore._variable.ops import ArrayOps

__all__ = ["Reads"]


class Reads(ArrayOps, Owned):
    """The reading half of ``ps.Variable`` (see the module docstring)."""

    __slots__ = ()
    # Variable's slots (set by Variable.__init__; _value/_given/_override: Owned's).
    _name: str
    _trainable: bool
    _frozen: bool
    _constraint: Any
    _regularizer: Any
    _dtype: np.dtype[Any]
    _shape: tuple[int, ...]
    _is_string: bool
    _is_key: bool
    _arith: bool
    _delta_aval: Any
    _warm: set[Any]
    _partition: tuple[Any, ...] | None

    def value(self) -> jax.Array:
        """The current array (inside ``ps.function`` / ``ps.pure``, the traced value). A
        string variable's is a NumPy ``StringDType`` array (host data)."""
        # (The ignores, not cast(): a cast is a call, on the hottest read path; `self` is
        # a Variable, of which this class is a base.)
        if _trace.depth:
            return _trace.read(self)  # type: ignore[no-any-return,arg-type]
        if current_trace() is not EVAL:
            return _trace.outside(self)  # type: ignore[no-any-return,arg-type]
        return ownership.hand_out(self)  # type: ignore[no-any-return]

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
        self._trainable = value  # type: ignore[misc]  # a slot of Variable
        if value:
            self._frozen = False  # type: ignore[misc]

    def _freeze(self, frozen: bool) -> None:
        """Freeze or unfreeze for a Module (``module.trainable = ...``), as Keras 3's
        ``layer.trainable`` sets its trainable variables' flags: a variable whose own flag
        is False (created non-trainable, or ``v.trainable = False``) stays non-trainable."""
        if frozen != self._frozen and self._trainable:
            TRACE_EPOCH.bump()
        self._frozen = frozen  # type: ignore[misc]

    @property
    def constraint(self) -> Callable[[jax.Array], jax.Array] | None:
        """The constraint an optimizer applies after each update (``constraint=``), or None."""
        return self._constraint  # type: ignore[no-any-return]

    @property
    def regularizer(self) -> Callable[[jax.Array], jax.Array] | None:
        """The penalty ``ps.regularization_loss`` adds for this variable, or None."""
        return self._regularizer  # type: ignore[no-any-return]

    @property
    def dtype(self) -> np.dtype[Any]:
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
