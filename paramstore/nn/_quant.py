"""Quantized weights, per layer: Keras 3's ``int8`` and per-channel ``int4`` math, and the
``quantize`` / ``dequantize`` of one ``Dense``, ``Embedding`` or attention ``Projection``
(``QuantLayer``).

Contract (docs/api.md, "Quantized weights"; the model-wide ``ps.nn.quantize`` is
``paramstore.nn.quantize``):

* ``int8``: ``q = clip(round(w * s), -127, 127)`` with ``s = 127 / (max|w| + 1e-7)`` over
  the *reduced* axis: a ``Dense`` kernel's input axis (one scale per output unit,
  ``kernel_scale`` ``(units,)``), an ``Embedding`` table's output axis (one scale per row,
  ``embeddings_scale`` ``(input_dim,)``), an attention ``Projection`` kernel's contracted
  axes (one scale per non-contracted kernel element, ``paramstore.nn.projection``). The
  arithmetic is float32 and bit-identical to Keras 3's ``abs_max_quantize`` (IEEE division,
  round half to even).
* ``int4``: the same with ``[-8, 7]`` and ``s = 7 / (max|w| + 1e-7)``, the values packed two
  per byte along the last axis (low nibble first, an odd axis padded with 0), as Keras 3's
  ``pack_int4(..., axis=-1)``: a kernel ``(in, units)`` is stored ``(in, ceil(units/2))``.
* The quantized variable keeps the float one's full name (``dense/kernel``), is int8 and
  non-trainable; the scale is float32 ``<name>_scale``, non-trainable. Both get the float
  variable's sharding (the scale: without the reduced axis) and ``partition``; an abstract
  float variable gives abstract quantized ones (their initializer quantizes the float one's).
  The float variable is *retired* (``TRACE_EPOCH.retire``): a ``ps.function`` traced before
  is traced anew at its next call.
* Call time (``Dense``): ``int8`` quantizes the inputs per row (over the last axis), multiplies
  in int8 with int32 accumulation, casts to the compute dtype and divides by both scales;
  the gradient of the inputs is that of the dequantized kernel (Keras' custom gradient); the
  kernel and its scale take none. ``int4`` computes ``x @ unpack(kernel) / kernel_scale`` in
  the compute dtype. ``Embedding``: the rows, cast to the compute dtype, divided by their
  scales. ``Projection``: the same with its einsum (``paramstore.nn.projection``). LoRA
  (QLoRA) adds ``(lora_alpha / rank) * x @ a @ b`` on the float inputs.
* ``dequantize`` puts back a float variable (``unpack(q) / scale`` in the layer's variable
  dtype) under the same name with the ``trainable`` flag it had before ``quantize``.
* Refused, with nothing changed (``ValueError`` naming the layer): an unknown mode (the
  message lists the modes), an unbuilt layer, a layer quantized already, a layer with LoRA
  enabled (merge it first: the adapter would no longer match the kernel it was trained on).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from paramstore._core.context import TRACE_EPOCH
from paramstore._variable import abstract as _abstract
from paramstore.nn._lora import LoRALayer
from paramstore.nn._quant_ops import (
    MODES,
    Axes,
    abs_max_quantize,
    axes_of,
    check_mode,
    dequantized,
    int4_einsum,
    int4_matmul,
    int8_einsum,
    int8_matmul,
    pack_int4,
    quantize_host,
    quantize_inputs,
    quantized_shape,
    unpack_int4,
)
from paramstore.variable import Variable

__all__ = [
    "MODES",
    "QuantInfo",
    "QuantLayer",
    "Slot",
    "abs_max_quantize",
    "check_mode",
    "dequantized",
    "int4_einsum",
    "int4_matmul",
    "int8_einsum",
    "int8_matmul",
    "is_scale",
    "pack_int4",
    "quantize_host",
    "quantize_inputs",
    "dequantize_slots",
    "quantize_slots",
    "quantized_of",
    "quantized_shape",
    "unpack_int4",
]

# -------------------------------------------------------------- variables of one layer


def _drop_axis(sharding: Sharding | None, ndim: int, axis: Axes) -> Sharding | None:
    """``sharding`` of an array of rank ``ndim`` without ``axis`` (a scale's sharding)."""
    if isinstance(sharding, NamedSharding):
        spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
        spec = [e for k, e in enumerate(spec) if k not in axes_of(axis, ndim)]
        return NamedSharding(sharding.mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind)
    return sharding if sharding is None or sharding.is_fully_replicated else None


def _packed_sharding(sharding: Sharding | None, shape: tuple[int, ...]) -> Sharding | None:
    """``sharding`` for a packed int4 value of ``shape`` (unsplit where it does not divide)."""
    if not isinstance(sharding, NamedSharding):
        return sharding if sharding is None or sharding.is_fully_replicated else None
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    for i, entry in enumerate(spec):
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        size = int(np.prod([sharding.mesh.shape[a] for a in names], dtype=np.int64))
        if shape[i] % size:
            spec[i] = None
    return NamedSharding(sharding.mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind)


def _drop_entry(partition: Any, ndim: int, axis: Axes) -> Any:
    if partition is None:
        return None
    entries = list(partition) + [None] * (ndim - len(partition))
    return tuple(e for k, e in enumerate(entries) if k not in axes_of(axis, ndim))


def new_variable(
    old: Variable,
    name: str,
    make: Callable[[], Any],
    shape: tuple[int, ...],
    dtype: Any,
    sharding: Sharding | None,
    partition: Any,
    trainable: bool,
) -> Variable:
    """A variable of full name ``name`` in ``old``'s store, abstract when ``old`` is (then
    ``make`` is its initializer), else holding ``make()``, with this sharding."""
    with old._store:
        if old.is_abstract:
            with _abstract.abstract():
                return Variable(
                    make,
                    trainable=trainable,
                    dtype=dtype,
                    sharding=sharding,
                    partition=partition,
                    _full_name=name,
                )
        value = make()
        if sharding is not None:
            value = jax.device_put(value, sharding)
        assert value.shape == shape, (value.shape, shape)
        return Variable(
            value,
            trainable=trainable,
            dtype=dtype,
            sharding=sharding,
            partition=partition,
            _full_name=name,
        )


def _float_maker(old: Variable) -> Callable[[], Any]:
    """The float value of ``old`` (its initializer when abstract)."""
    if old.is_abstract:
        _known, make = _abstract.initializer_of(old)
        if make is None:
            return lambda: jnp.zeros(old.shape, old.dtype)
        return make
    return old.value


@dataclass(frozen=True)
class QuantInfo:
    """What a quantized variable stands for: its ``scale`` variable, the reduced ``axis``,
    the ``mode`` and ``units`` (the float last axis; int4 packs it)."""

    scale: Variable
    axis: Axes
    mode: str
    units: int

    def float_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The float shape a quantized value of ``shape`` (or one layer of it) comes from."""
        return (*shape[:-1], self.units)


_QUANTIZED: dict[int, tuple[weakref.ref[Variable], weakref.ref[Variable], Axes, str, int]] = {}


def _remember(q: Variable, s: Variable, axis: Axes, mode: str, units: int) -> None:
    key = id(q)
    _SCALES[id(s)] = s
    _QUANTIZED[key] = (
        weakref.ref(q, lambda _r: _QUANTIZED.pop(key, None)), weakref.ref(s), axis, mode, units
    )  # fmt: skip


_SCALES: weakref.WeakValueDictionary[int, Variable] = weakref.WeakValueDictionary()


def is_scale(var: Variable) -> bool:
    """Whether ``var`` is the scale of a quantized variable (``quantize`` made it)."""
    return _SCALES.get(id(var)) is var


def quantized_of(var: Variable) -> QuantInfo | None:
    """The ``QuantInfo`` of a variable ``quantize`` made (None for any other)."""
    entry = _QUANTIZED.get(id(var))
    if entry is None or entry[0]() is not var:
        return None
    scale = entry[1]()
    return None if scale is None else QuantInfo(scale, entry[2], entry[3], entry[4])


def quantize_variable(
    old: Variable, axis: Axes, mode: str, scale_name: str
) -> tuple[Variable, Variable]:
    """The quantized variable (same full name; call ``replace`` to swap it in) and its
    scale for the float variable ``old`` reduced over ``axis``."""
    float_of = _float_maker(old)
    memo: dict[str, Any] = {}

    def quantized() -> tuple[jax.Array, jax.Array]:
        if "q" not in memo or old.is_abstract:
            q, s = abs_max_quantize(float_of(), axis, mode)
            memo["q"] = (pack_int4(q) if mode == "int4" else q, s)
        return memo["q"]  # type: ignore[no-any-return]

    shape = quantized_shape(old.shape, mode)
    sharding = old.sharding
    q_sharding = _packed_sharding(sharding, shape) if mode == "int4" else sharding
    s_shape = tuple(d for i, d in enumerate(old.shape) if i not in axes_of(axis, old.ndim))
    base = old.name.rsplit("/", 1)[0] + "/" if "/" in old.name else ""
    old._store._forget(old)  # the name is the quantized variable's from now on
    try:
        q = new_variable(
            old, old.name, lambda: quantized()[0], shape, jnp.int8, q_sharding,
            old.partition, False,
        )  # fmt: skip
        s = new_variable(
            old, base + scale_name, lambda: quantized()[1], s_shape, jnp.float32,
            _drop_axis(sharding, old.ndim, axis), _drop_entry(old.partition, old.ndim, axis),
            False,
        )  # fmt: skip
    except BaseException:
        old._store.register(old, old.name, exact=True)
        raise
    _remember(q, s, axis, mode, old.shape[-1])
    return q, s


def dequantize_variable(
    q: Variable, s: Variable, axis: Axes, mode: str, n: int, dtype: Any, trainable: bool
) -> Variable:
    """The float variable (``q``'s full name) that ``q`` and its scale ``s`` stand for."""
    shape = (*q.shape[:-1], n)

    def values() -> Any:
        if q.is_abstract:
            return jnp.zeros(shape, dtype)
        return dequantized(q.value(), s.value(), axis, mode, n, dtype)

    sharding = q.sharding
    if mode == "int4" and isinstance(s.sharding, NamedSharding) and sharding is not None:
        sharding = _packed_sharding(sharding, shape)
    q._store._forget(q)
    try:
        return new_variable(q, q.name, values, shape, dtype, sharding, q.partition, trainable)
    except BaseException:
        q._store.register(q, q.name, exact=True)
        raise


@dataclass
class Slot:
    """One quantizable variable of a layer: ``holder.key`` (an attribute, or a dict entry),
    its scale at ``holder.scale_key``, the reduced ``axis`` and the float last axis
    ``units`` (int4 packs it)."""

    holder: Any
    key: str
    scale_key: str
    axis: Axes
    units: int

    def _get(self, key: str) -> Any:
        h = self.holder
        return h.get(key) if isinstance(h, dict) else getattr(h, key, None)

    def _set(self, key: str, v: Variable | None) -> None:
        h = self.holder
        if isinstance(h, dict):
            h.pop(key, None) if v is None else h.__setitem__(key, v)
        elif v is None:
            delattr(h, key)
        else:
            setattr(h, key, v)

    @property
    def target(self) -> Variable:
        return self._get(self.key)  # type: ignore[no-any-return]

    @property
    def scale(self) -> Variable | None:
        return self._get(self.scale_key)  # type: ignore[no-any-return]

    def put(self, new: Variable) -> None:
        """``new`` in place of the target (same full name); the old one is retired."""
        old = self.target
        old._store._forget(old)
        self._set(self.key, new)
        TRACE_EPOCH.retire(old)

    def put_scale(self, scale: Variable | None) -> None:
        old = self.scale
        if old is not None and scale is None:
            old._store._forget(old)
            TRACE_EPOCH.retire(old)
        self._set(self.scale_key, scale)

    @property
    def leaf(self) -> str:
        """The scale variable's own name (``kernel_scale``)."""
        return self.scale_key.rsplit("/", 1)[-1]


def quantize_slots(slots: list[Slot], mode: str) -> list[bool]:
    """Quantize every slot's target; returns each target's ``trainable`` flag from before."""
    flags = []
    for slot in slots:
        old = slot.target
        q, s = quantize_variable(old, slot.axis, mode, slot.leaf)
        flags.append(old.trainable)
        slot.put(q)
        slot.put_scale(s)
    return flags


def dequantize_slots(slots: list[Slot], mode: str, dtype: Any, flags: list[bool]) -> None:
    """The float targets back (``flags``: their ``trainable``), the scales removed."""
    for slot, trainable in zip(slots, flags):
        s = slot.scale
        assert s is not None
        new = dequantize_variable(slot.target, s, slot.axis, mode, slot.units, dtype, trainable)
        slot.put(new)
        slot.put_scale(None)


class QuantLayer(LoRALayer):
    """A ``LoRALayer`` whose target can be quantized (see the module docstring):
    ``quantize(mode)``, ``dequantize()``, ``quantization_mode``."""

    #: The axis (axes) the scales are taken over, counted from the end (-2: a Dense kernel's
    #: input axis; a ``Projection``: its kernel's contracted axes).
    quant_axis: Axes = -2
    quantization_mode: str | None = None
    _quant_was_trainable: bool = True

    @property
    def scale_name(self) -> str:
        """``kernel_scale`` (``embeddings_scale``)."""
        return f"{self.lora_target}_scale"

    def check_quantize(self, mode: object) -> str:
        """The mode, or ``ValueError`` naming the layer if it cannot be quantized now."""
        me = self.describe()
        mode = check_mode(mode, me)
        if not self.built:
            raise ValueError(
                f"{me} is not built yet, so it has no {self.lora_target} to quantize: call "
                "the layer on an input (or layer.build(input_shape)) before quantize."
            )
        if self.quantization_mode is not None:
            raise ValueError(
                f"{me} is quantized already ({self.quantization_mode!r}); a layer is "
                "quantized once. ps.nn.dequantize it first to quantize it in another mode."
            )
        if self.lora_enabled:
            raise ValueError(
                f"{me} has LoRA enabled: merge it first (merge_lora()), then quantize and "
                "enable_lora again (QLoRA trains a new adapter on the quantized kernel)."
            )
        return str(mode)

    def quant_slots(self) -> list[Slot]:
        """The variable ``quantize`` replaces: the kernel (``embeddings``)."""
        units = getattr(self, "_quant_units", None) or getattr(self, self.lora_target).shape[-1]
        return [Slot(self, self.lora_target, self.scale_name, self.quant_axis, units)]

    def quantize(self, mode: str) -> None:
        """Quantize the kernel (``embeddings``) in ``mode`` (``"int8"`` or ``"int4"``), as
        Keras 3's ``layer.quantize(mode)`` (see ``paramstore.nn._quant``)."""
        mode = self.check_quantize(mode)
        slots = self.quant_slots()
        self._quant_units = slots[0].units
        (self._quant_was_trainable,) = quantize_slots(slots, mode)
        self.quantization_mode = mode

    def check_dequantize(self) -> None:
        """``ValueError`` naming the layer if it is not quantized."""
        if self.quantization_mode is None:
            raise ValueError(
                f"{self.describe()} is not quantized: nothing to dequantize (quantize it "
                "first, or leave it out of dequantize)."
            )

    def dequantize(self) -> None:
        """Put back the float kernel (``embeddings``) the quantized one stands for, in the
        variable dtype, with its ``trainable`` flag from before ``quantize``; the scale goes."""
        self.check_dequantize()
        assert self.quantization_mode is not None
        trainable = self._quant_was_trainable and not self.lora_enabled
        dequantize_slots(
            self.quant_slots(), self.quantization_mode, self.variable_dtype, [trainable]
        )
        self._lora_was_trainable = self._quant_was_trainable
        self.quantization_mode = None

    def check_lora_merge(self) -> None:
        """As ``LoRALayer``'s, and refused on a quantized layer (dequantize first)."""
        super().check_lora_merge()
        if self.quantization_mode is not None:
            raise ValueError(
                f"{self.describe()} is quantized ({self.quantization_mode!r}): LoRA cannot "
                "be merged into an integer kernel. Call ps.nn.dequantize on it first, then "
                "merge_lora (and quantize again if you want)."
            )
