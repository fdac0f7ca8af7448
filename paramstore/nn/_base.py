"""The base of every ``ps.nn`` layer: check the input, build once, then call.

Contract (docs/api.md, "Layers"):

* A layer is a ``ps.Module``. Its variables do not exist until it is built: by its first
  call (eagerly, or during the first trace of a ``ps.function``) or by
  ``layer.build(input_shape)`` (a tuple whose first entry may be ``None``), which creates
  exactly what the first call would: the same names (``"<layer>/<variable>"``, inside the
  layer's name scope), shapes and scope, and sets ``layer.built``.
* A build happens once even when several threads make the first call together: one thread
  builds under the layer's lock, the others wait and then use the built variables.
* Every input is checked before anything is built or computed (``check_shape``): a bad
  input raises a ``ValueError``/``TypeError`` naming the layer, the shapes and the fix, and
  builds or changes nothing. A built layer given a shape it was not built for (its feature
  axis differs), by a call or by ``build``, raises the same way.
* Reading a variable attribute (``layer.kernel``) before the layer is built raises an
  ``AttributeError`` saying to call the layer or ``build`` it; read inside the layer's own
  ``__call__`` (a custom layer whose ``__call__`` does not start with
  ``self.ensure_built(x.shape)``), the error says to add that line (or to define ``build``).
* Subclasses override ``build(input_shape)`` (create the variables; the base wraps it with
  the scope, the lock and ``built``), ``check_shape(shape)`` and ``__call__``; they list
  their variable attributes in ``variable_names``.
* Dtype policy (``ps.mixed_precision``), the same for every layer: ``Layer.__init__``
  takes ``dtype=`` (a Policy, a policy name or a floating dtype; default: the global
  policy *when the layer is constructed*), kept as ``layer.dtype_policy``. A layer creates
  its variables with ``add_weight`` (in ``variable_dtype``), takes its inputs through
  ``as_float`` / ``autocast`` (floating inputs cast to ``compute_dtype``, as Keras 3's
  ``Layer.__call__``) and reads its variables with ``layer.cast(v)`` (the value in
  ``compute_dtype``, as Keras autocasts variables inside ``call``), so it computes and
  returns in the compute dtype. Where Keras 3 computes in float32 (normalization
  statistics, the attention softmax) the layer says so.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from paramstore import mixed_precision as _mp
from paramstore._core.layout import Partition
from paramstore._core.store import give_back, journal
from paramstore.module import PENDING, Module
from paramstore.nn._advice import read_in_own_call
from paramstore.nn._arguments import hooks
from paramstore.typing import Initializer, ValueLike
from paramstore.variable import Variable

__all__ = [
    "all_or_nothing",
    "Layer",
    "PolicyLike",
    "Shape",
    "as_float",
    "autocast",
    "is_statistic",
    "features",
    "keras_name",
]

_T = TypeVar("_T")
PolicyLike = _mp.Policy | DTypeLike | None
"""What a layer's ``dtype=`` takes: a Policy, a policy name, a floating dtype, or None."""
Shape = tuple[int | None, ...]


def as_float(x: ValueLike, layer: Layer | str = "this layer", *, keep: bool = False) -> jax.Array:
    """``x`` as a real floating array in ``layer``'s compute dtype (float32 when ``layer``
    is a name): floating inputs cast as Keras 3's ``Layer.__call__`` does, integers and
    bools converted. ``keep=True`` (a layer Keras does not autocast, such as
    ``LayerNormalization``) keeps a floating input's dtype and makes others float32. A
    complex input is refused (a layer's real weights would silently drop its imaginary
    part)."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        who = layer.describe() if isinstance(layer, Layer) else layer
        raise TypeError(
            f"{who} takes real inputs, got a {x.dtype} input of shape {tuple(x.shape)}. "
            "Split it first (jnp.real(x), jnp.imag(x), or jnp.concatenate of both on the "
            "last axis)."
        )
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    want: Any
    if isinstance(layer, Layer) and not keep:
        want = jnp.dtype(layer.compute_dtype)
    else:
        want = x.dtype if floating else jnp.dtype(jnp.float32)
    if x.dtype != want:
        x = x.astype(want)
    return x


def autocast(x: _T, layer: Layer) -> _T:
    """``x`` with a floating array cast to ``layer``'s compute dtype (Keras 3's
    ``DTypePolicy.convert_input``); integer, bool and non-array inputs unchanged."""
    arrays = (jax.Array, np.ndarray, np.generic)
    if (
        isinstance(x, arrays)
        and jnp.issubdtype(x.dtype, jnp.floating)
        and x.dtype != layer.compute_dtype
    ):
        return cast(_T, jnp.asarray(x).astype(layer.compute_dtype))
    return x


class _BuildLock:
    """A layer's build lock, held by the layer itself (``_ps_build_lock``); a deep copy of
    the layer gets a lock of its own."""

    __slots__ = ("lock",)

    def __init__(self) -> None:
        self.lock = threading.RLock()

    def __deepcopy__(self, memo: dict[int, Any]) -> _BuildLock:
        return _BuildLock()


def _lock_of(layer: Layer) -> threading.RLock:
    holder = layer.__dict__.get("_ps_build_lock")
    if holder is None:  # dict.setdefault is atomic: threads racing here get one lock
        holder = layer.__dict__.setdefault("_ps_build_lock", _BuildLock())
    return holder.lock  # type: ignore[no-any-return]


def _as_shape(shape: Any, who: str) -> Shape:
    try:
        dims = tuple(shape)
    except TypeError:
        dims = ()
        ok = False
    else:
        ok = all(
            d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 0) for d in dims
        )
    if not ok:
        raise TypeError(
            f"{who}.build expects an input shape: a tuple of ints whose first entry may be "
            f"None, such as (None, 28, 28, 1); got {shape!r}."
        )
    return dims


def _guarded(build: Callable[..., None]) -> Callable[..., None]:
    """``build`` run once, under the layer's lock and in its name scope; sets ``built``."""

    @functools.wraps(build)
    def wrapped(self: Layer, *shapes: Any) -> None:
        dims = tuple(_as_shape(s, self.describe()) if s is not None else None for s in shapes)
        if not self.__dict__.get("built", False):
            with _lock_of(self):
                if not self.built:
                    self.check_shape(*dims)
                    with all_or_nothing(self), self.name_scope:
                        build(self, *dims)
                    if not self.trainable:  # frozen before it was built: so are its variables
                        self.trainable = False
                    self._built_shapes = dims
                    self.built = True  # last: other threads read the variables after this
                    return
        self.check_shape(*dims)
        self.check_built(*dims)

    wrapped._ps_guarded = True  # type: ignore[attr-defined]
    return wrapped


@contextlib.contextmanager
def all_or_nothing(layer: Module) -> Iterator[None]:
    """Run a block that creates ``layer``'s variables (a build, ``enable_lora``); if it
    raises, the layer is left as it was: its attributes are put back, the variables and
    modules the block created are untracked and their names given back (a retry creates
    ``dense/kernel`` again, never ``dense/kernel_1``: names key checkpoints), and saved
    values a deferred restore gave them are pending again."""
    before = dict(layer.__dict__)
    pending = before.get(PENDING)
    snapshot = pending.snapshot() if pending is not None else None
    with journal() as taken:
        try:
            yield
        except BaseException:
            now = layer.__dict__
            for key in [k for k in now if k not in before]:
                del now[key]
            now.update(before)
            if pending is not None:
                pending.restore(snapshot)
            keep = {id(v) for v in layer.variables}  # built sub-layers made before stay
            give_back(taken, {layer.scope_name}, keep)
            raise


def features(layer: Layer, shape: Shape) -> int:
    """The feature (last) axis of ``shape``, which must be known to build."""
    if not shape or shape[-1] is None:
        raise ValueError(
            f"{layer.describe()} cannot be built for input shape {shape}: its last axis (the "
            "features) must be known. Pass a shape such as (None, 16)."
        )
    return shape[-1]


def keras_name(cls_name: str) -> str:
    """Keras' default layer name: ``"MaxPooling2D"`` -> ``"max_pooling2d"``, ``"Conv1D"`` ->
    ``"conv1d"`` (the plain snake_case would give ``"max_pooling2_d"``)."""
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", cls_name)
    name = re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()
    return re.sub(r"(\d)_d\b", r"\1d", name)


_STATISTICS: weakref.WeakValueDictionary[int, Variable] = weakref.WeakValueDictionary()


def is_statistic(var: Variable) -> bool:
    """Whether a layer created ``var`` non-trainable (``add_weight(trainable=False)``: moving
    statistics), so it is state, not a weight (``ps.plan``'s ``other_state``)."""
    return _STATISTICS.get(id(var)) is var


class Layer(Module):
    """A module that builds its variables once, from its first input's shape (see the
    module docstring)."""

    built: bool
    variable_names: ClassVar[tuple[str, ...]] = ()
    #: Whether ``training=`` may be a traced boolean scalar (paramstore/_core/training.py).
    traced_training: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        build = cls.__dict__.get("build")
        if build is not None and not getattr(build, "_ps_guarded", False):
            cls.build = _guarded(build)  # type: ignore[method-assign]

    def __init__(self, name: str | None = None, dtype: PolicyLike = None) -> None:
        super().__init__(name=name)
        self._dtype_policy = _mp.resolve(dtype, self.describe())
        self.built = False
        self._built_shapes: tuple[Shape | None, ...] = ()

    # ------------------------------------------------------------------ dtype policy
    @property
    def dtype_policy(self) -> _mp.Policy:
        """The layer's ``ps.mixed_precision.Policy`` (fixed at construction)."""
        return self._dtype_policy

    @property
    def compute_dtype(self) -> str:
        """The dtype the layer computes and returns in (``"bfloat16"``)."""
        return self._dtype_policy.compute_dtype

    @property
    def variable_dtype(self) -> str:
        """The dtype the layer's variables are created in (``"float32"``)."""
        return self._dtype_policy.variable_dtype

    def add_weight(
        self,
        name: str,
        shape: tuple[int, ...],
        initializer: Initializer,
        *,
        trainable: bool = True,
        dtype: DTypeLike | None = None,
        partition: Partition | None = None,
        hooks_from: str | None = None,
    ) -> Variable:
        """A new Variable ``name`` of ``shape`` from ``initializer(shape, dtype)``, in the
        layer's ``variable_dtype`` unless ``dtype`` is given (as Keras' ``add_weight``), with
        the layer's ``<name>_regularizer`` and ``<name>_constraint`` (``set_hooks``), or
        ``<hooks_from>_regularizer``/``_constraint`` when given (Keras' ``recurrent_kernel``
        takes ``recurrent_regularizer``); call it in ``build`` (inside the layer's name
        scope)."""
        dt = self.variable_dtype if dtype is None else dtype
        dims = tuple(shape)
        var = Variable(
            lambda: initializer(dims, dt),
            trainable=trainable,
            name=name,
            partition=partition,
            **hooks(self, hooks_from or name),  # <name>_regularizer / _constraint
        )
        if not trainable:  # state the layer keeps (moving statistics), not a weight
            _STATISTICS[id(var)] = var
        return var

    def cast(self, value: Variable | jax.Array) -> jax.Array:
        """A variable's value (or an array) in the compute dtype if it is floating, as
        Keras 3 autocasts a layer's variables inside its ``call``."""
        x = value.value() if isinstance(value, Variable) else value
        if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != self.compute_dtype:
            x = x.astype(self.compute_dtype)
        return x

    def __getattr__(self, name: str) -> Any:
        # Only reached when ``name`` is not set: a variable of a layer not built yet.
        if not self.__dict__.get("built", False) and not name.startswith("_"):
            advice = read_in_own_call(self, name, type(self).build is not Layer.build)
            if advice is not None:  # the user did call it: its __call__ never built it
                raise AttributeError(advice)
        if name in type(self).variable_names and not self.__dict__.get("built", False):
            raise AttributeError(
                f"{self.describe()} is not built yet, so it has no {name!r}: call the layer "
                f"on an input (layer(x)) or build it (layer.build(input_shape)) first."
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def build(self, input_shape: Shape) -> None:  # wrapped below
        """Create the variables for inputs of ``input_shape`` (as the first call would)."""

    def compute_output_shape(self, input_shape: Shape) -> Shape | None:
        """The output shape for inputs of ``input_shape`` when known without running the
        layer (None: ``Sequential.build`` finds it with ``jax.eval_shape``)."""
        return None

    def check_shape(self, *shapes: Shape | None) -> None:
        """Raise if an input of ``shape`` is wrong for this layer (before any build)."""
        shape = shapes[0] if shapes else None
        if shape is not None and len(shape) == 0:
            raise ValueError(
                f"{self.describe()} needs an input with at least one axis, got a scalar."
            )

    def check_built(self, *shapes: Shape | None) -> None:
        """Raise if a built layer cannot take ``shapes`` (by default: its feature axis)."""
        if not self._built_shapes or not shapes:
            return
        old, new = self._built_shapes[0], shapes[0]
        if old is None or new is None or not old or not new:
            return
        if old[-1] is not None and new[-1] is not None and old[-1] != new[-1]:
            raise ValueError(
                f"{self.describe()} was built for inputs whose last axis is {old[-1]}, but "
                f"got an input of shape {new} (last axis {new[-1]}; built from {old}). Pass "
                f"inputs with {old[-1]} features, or use a new layer."
            )

    def ensure_built(self, *shapes: Shape) -> None:
        """Check the input shapes, then build from them (``build(*shapes)``, once) or check
        them against the build. A layer's ``__call__`` starts with it, e.g.
        ``self.ensure_built(tuple(x.shape))``: a custom ``ps.nn.Layer`` must call it too
        before it reads its variables (Keras' ``__call__`` builds for you; here this line
        does)."""
        if self.__dict__.get("built", False):
            self.check_shape(*shapes)
            self.check_built(*shapes)
        else:
            self.build(*shapes)

    _ensure_built = ensure_built  # the name used before build() was public

    def describe(self) -> str:
        """``"Dense 'dense_1'"``: how error messages name this layer."""
        return f"{type(self).__name__} '{self.scope_name}'"

    def count_params(self) -> int:
        """The number of scalars in ``weights``; a layer not built yet raises ValueError (as
        Keras: its variables do not exist yet)."""
        if not self.built:
            raise ValueError(
                f"{self.describe()} is not built yet, so it has no parameters to count: call "
                "it on an input (layer(x)) or build it (layer.build(input_shape)) first."
            )
        return super().count_params()


Layer.build = _guarded(Layer.build)  # type: ignore[method-assign]
