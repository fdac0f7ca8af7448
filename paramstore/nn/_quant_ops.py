"""The arithmetic of quantized weights, Keras 3's: int8 and per-channel int4 scales, int4
packing, the int8 matmul with its custom gradient, and the host (NumPy) quantizer used while
loading. Bit-identical to Keras 3's ``abs_max_quantize``/``pack_int4``; see
``paramstore.nn._quant`` for the contract and the variables."""

from __future__ import annotations

import functools
import mmap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Axes",
    "EPSILON",
    "MODES",
    "abs_max_quantize",
    "axes_of",
    "check_mode",
    "dequantized",
    "int4_einsum",
    "int4_matmul",
    "int8_einsum",
    "int8_matmul",
    "pack_int4",
    "quantize_host",
    "quantize_inputs",
    "quantized_shape",
    "unpack_int4",
]

MODES = ("int8", "int4")
EPSILON = 1e-7  # Keras' backend.epsilon()
_RANGE = {"int8": (-127, 127), "int4": (-8, 7)}


def check_mode(mode: Any, who: str) -> str:
    """``mode`` if it is one of ``MODES``, else ``ValueError`` naming ``who`` and the modes."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(
            f"{who}: unknown quantization mode {mode!r}; the modes are "
            f"{', '.join(repr(m) for m in MODES)} (Keras 3's int8 and per-channel int4)."
        )
    return mode


# ------------------------------------------------------------------------ the arithmetic


Axes = int | tuple[int, ...]


def axes_of(axis: Axes, ndim: int) -> tuple[int, ...]:
    """``axis`` (one or several, negative counted from the end) as sorted positive axes."""
    return tuple(sorted(a % ndim for a in ((axis,) if isinstance(axis, int) else axis)))


def abs_max_quantize(w: Any, axis: Axes, mode: str) -> tuple[jax.Array, jax.Array]:
    """``(q, scale)``: ``w`` quantized over ``axis`` (one or several; int8 values, not
    packed) and the float32 scale without those axes, as Keras 3's ``abs_max_quantize``."""
    low, high = _RANGE[mode]
    w32 = jnp.asarray(w).astype(jnp.float32)
    axes = axes_of(axis, w32.ndim)
    scale = jnp.float32(high) / (
        jnp.max(jnp.abs(w32), axis=axes, keepdims=True) + jnp.float32(EPSILON)
    )
    q = jnp.clip(jnp.round(w32 * scale), low, high).astype(jnp.int8)
    return q, jnp.squeeze(scale, axes)


def pack_int4(q: jax.Array) -> jax.Array:
    """Int4 values (int8 in [-8, 7]) packed two per byte along the last axis, low nibble
    first (an odd axis is padded with 0), as Keras 3's ``pack_int4(q, axis=-1)``."""
    n = q.shape[-1]
    if n % 2:
        q = jnp.concatenate([q, jnp.zeros((*q.shape[:-1], 1), q.dtype)], axis=-1)
    u = jax.lax.bitcast_convert_type(q, jnp.uint8) & jnp.uint8(0x0F)
    packed = u[..., ::2] | (u[..., 1::2] << jnp.uint8(4))
    return jax.lax.bitcast_convert_type(packed, jnp.int8)


def unpack_int4(packed: jax.Array, n: int) -> jax.Array:
    """The int8 values in [-8, 7] that ``pack_int4`` packed (last axis of length ``n``)."""
    u = jax.lax.bitcast_convert_type(packed, jnp.uint8)
    nibbles = jnp.stack([u & jnp.uint8(0x0F), u >> jnp.uint8(4)], axis=-1)
    signed = nibbles.astype(jnp.int8)
    signed = jnp.where(signed >= 8, signed - jnp.int8(16), signed)
    return signed.reshape(*packed.shape[:-1], 2 * packed.shape[-1])[..., :n]


def quantize_host(w: Any, axis: Axes, mode: str, rows: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """``abs_max_quantize`` in NumPy on the host, bit-identical to it (and to Keras 3's numpy
    path), packed when int4. ``w`` (a float array, or a view of a memory-mapped file) is read
    in blocks of ``rows`` along its first axis, so the float temporaries are a block's size;
    where the first axis is reduced, a first pass takes the running maximum. The pages of a
    memory-mapped ``w`` are released behind each block, so its bytes are never all resident."""
    low, high = _RANGE[mode]
    ndim = len(w.shape)
    axes = axes_of(axis, ndim)
    eps = np.float32(EPSILON)
    n = w.shape[0]
    scale_shape = [d for k, d in enumerate(w.shape) if k not in axes]

    def block(i: int) -> np.ndarray:
        out = np.array(w[i : i + rows], dtype=np.float32)  # a copy: the pages can go
        _release(w, i, min(i + rows, n))
        return out

    if 0 in axes:  # the scale reduces over the blocked axis: a running maximum first
        amax = np.zeros(scale_shape, np.float32)
        for i in range(0, n, rows):
            np.maximum(amax, np.abs(block(i)).max(axis=axes), out=amax)
        scale = np.float32(high) / (amax + eps)
    else:
        scale = np.empty(scale_shape, np.float32)
    q = np.empty(w.shape, np.int8)
    for i in range(0, n, rows):
        b = block(i)
        if 0 in axes:
            s = np.expand_dims(scale, axes)
        else:
            s_rows = np.float32(high) / (np.abs(b).max(axis=axes) + eps)
            scale[i : i + rows] = s_rows
            s = np.expand_dims(s_rows, axes)
        q[i : i + rows] = np.clip(np.round(b * s), low, high)
    if mode == "int4":
        q = _pack_host(q)
    return q, scale


def _release(w: Any, start: int, stop: int) -> None:
    """Drop the resident pages of rows ``[start, stop)`` of an array over a read-only memory
    map (they are read again from the file if touched); anything else: nothing."""
    base = getattr(w, "base", None)
    while isinstance(base, (np.ndarray, memoryview)):  # a view's base's base ...
        base = base.obj if isinstance(base, memoryview) else base.base
    if not isinstance(base, mmap.mmap) or not w.flags.c_contiguous or not w.size:
        return
    origin: int = np.frombuffer(base, np.uint8).__array_interface__["data"][0]
    row = w.nbytes // w.shape[0]
    first = w.__array_interface__["data"][0] - origin + start * row
    aligned = first - first % mmap.PAGESIZE
    length = (stop - start) * row + (first - aligned)
    try:
        base.madvise(mmap.MADV_DONTNEED, aligned, length - length % mmap.PAGESIZE)
    except (OSError, ValueError, AttributeError):  # a platform without madvise: keep them
        pass


def _pack_host(q: np.ndarray) -> np.ndarray:
    """``pack_int4`` in NumPy (the same bytes)."""
    if q.shape[-1] % 2:
        q = np.concatenate([q, np.zeros((*q.shape[:-1], 1), np.int8)], axis=-1)
    u = q.view(np.uint8) & np.uint8(0x0F)
    return (u[..., ::2] | (u[..., 1::2] << np.uint8(4))).view(np.int8)


def quantized_shape(shape: tuple[int, ...], mode: str) -> tuple[int, ...]:
    """The stored shape of a quantized variable of float ``shape`` (int4: last axis halved,
    rounded up)."""
    if mode == "int4":
        return (*shape[:-1], (shape[-1] + 1) // 2)
    return tuple(shape)


def dequantized(q: jax.Array, scale: jax.Array, axis: Axes, mode: str, n: int, dtype: Any) -> Any:
    """The float values ``q`` (packed when int4, last axis ``n``) stand for, in ``dtype``."""
    values = unpack_int4(q, n) if mode == "int4" else q
    axes = axes_of(axis, values.ndim)
    return (values.astype(jnp.float32) / jnp.expand_dims(scale, axes)).astype(dtype)


def quantize_inputs(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(int8 x, scale)`` per row (over the last axis), in ``x``'s dtype, as Keras 3's
    ``AbsMaxQuantizer(axis=-1)`` at call time."""
    scale = 127.0 / (jnp.max(jnp.abs(x), axis=-1, keepdims=True) + EPSILON)
    scale = scale.astype(x.dtype)
    return jnp.clip(jnp.round(x * scale), -127, 127).astype(jnp.int8), scale


@jax.custom_vjp
def int8_matmul(x: jax.Array, kernel: jax.Array, scale: jax.Array) -> jax.Array:
    """``x @ kernel`` for an int8 ``kernel`` with ``scale`` (``x``'s dtype): ``x`` quantized
    per row, int8 x int8 with int32 accumulation, cast to ``x``'s dtype, divided by both
    scales (Keras 3's ``Dense._int8_call``)."""
    xq, xs = quantize_inputs(x)
    y = jnp.matmul(xq, kernel, preferred_element_type=jnp.int32).astype(x.dtype)
    return y / (scale * xs)


def _int8_fwd(x: jax.Array, kernel: jax.Array, scale: jax.Array) -> Any:
    return int8_matmul(x, kernel, scale.astype(x.dtype)), (kernel, scale.astype(x.dtype))


def _int8_bwd(res: Any, g: jax.Array) -> tuple[Any, ...]:
    kernel, scale = res
    dtype = scale.dtype  # x's
    float_kernel = kernel.astype(dtype) / scale
    dx = jnp.matmul(g, float_kernel.T).astype(dtype)
    return dx, np.zeros(kernel.shape, jax.dtypes.float0), jnp.zeros_like(scale)


int8_matmul.defvjp(_int8_fwd, _int8_bwd)


def int4_matmul(x: jax.Array, packed: jax.Array, scale: jax.Array, units: int) -> jax.Array:
    """``x @ unpack(packed) / scale`` in ``x``'s dtype (inputs not quantized; Keras 3's
    per-channel int4 ``Dense``)."""
    kernel = unpack_int4(packed, units).astype(x.dtype)
    return jnp.matmul(x, kernel).astype(x.dtype) / scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def int8_einsum(
    equation: str, x: jax.Array, kernel: jax.Array, scale: jax.Array, x_axes: tuple[int, ...]
) -> jax.Array:
    """``einsum(equation, x, kernel)`` for an int8 ``kernel`` whose ``scale`` (``x``'s dtype)
    has the kernel's non-contracted axes, as Keras 3's ``EinsumDense._int8_call``: ``x``
    quantized over its contracted axes ``x_axes`` (trailing), int8 x int8 with int32
    accumulation, cast to ``x``'s dtype, divided by both scales. The output's axes are ``x``'s
    other axes then the kernel's non-contracted ones (its contracted axes lead)."""
    axes = axes_of(x_axes, x.ndim)
    xs = (127.0 / (jnp.max(jnp.abs(x), axis=axes, keepdims=True) + EPSILON)).astype(x.dtype)
    xq = jnp.clip(jnp.round(x * xs), -127, 127).astype(jnp.int8)
    y = jnp.einsum(equation, xq, kernel, preferred_element_type=jnp.int32).astype(x.dtype)
    keep = x.ndim - len(axes)
    xs = xs.reshape(xs.shape[:keep] + (1,) * (y.ndim - keep))
    return y / (scale * xs)


def _einsum_fwd(eq: str, x: jax.Array, kernel: jax.Array, scale: jax.Array, axes: Any) -> Any:
    return int8_einsum(eq, x, kernel, scale, axes), (x, kernel, scale)


def _einsum_bwd(eq: str, axes: Any, res: Any, g: jax.Array) -> tuple[Any, ...]:
    x, kernel, scale = res
    contracted = kernel.ndim - scale.ndim  # the kernel's leading axes are contracted
    float_kernel = kernel.astype(x.dtype) / scale.reshape((1,) * contracted + scale.shape)
    _, vjp = jax.vjp(lambda x: jnp.einsum(eq, x, float_kernel), x)
    (dx,) = vjp(g)
    return dx, np.zeros(kernel.shape, jax.dtypes.float0), jnp.zeros_like(scale)


int8_einsum.defvjp(_einsum_fwd, _einsum_bwd)


def int4_einsum(
    equation: str, x: jax.Array, packed: jax.Array, scale: jax.Array, units: int
) -> jax.Array:
    """``einsum(equation, x, unpack(packed) / scale)`` in ``x``'s dtype, as Keras 3's
    per-channel int4 ``EinsumDense._int4_call``: the kernel dequantized first (``scale``, in
    ``x``'s dtype, has the kernel's non-contracted axes, which trail), the inputs not
    quantized. ``units``: the kernel's last axis before packing."""
    kernel = unpack_int4(packed, units).astype(x.dtype) / scale
    return jnp.einsum(equation, x, kernel)
