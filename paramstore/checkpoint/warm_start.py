"""``init_from_checkpoint``: TF1's warm start, from every checkpoint format paramstore reads.

Contract (docs/guides/pretrained.md, docs/api.md "Pretrained weights"):

* ``init_from_checkpoint(ckpt, assignment_map, *, transforms=None, cast=False,
  allow_unverified=False) -> {variable full name: checkpoint name}`` fills existing
  variables (plain, sharded or abstract) of the default store, or the Variables the map
  names, from checkpoint ``ckpt``: a paramstore file or sharded directory, a TensorFlow
  (TF1 or TF2) checkpoint, a Keras ``.weights.h5``, an Orbax directory, or Hugging Face
  safetensors (a file, a ``model.safetensors.index.json``, or a directory holding either;
  these need ``allow_unverified=True``).
* ``assignment_map`` (``paramstore.checkpoint.assignment``): TF1's dict forms, applied as
  ``tf.compat.v1.train.init_from_checkpoint`` applies them (``{'old/': 'new/'}``: every
  variable under ``new/`` from the same relative name under ``old/``, each of which must
  exist; ``{'old/v': 'new/v'}``, ``{'old/v': variable}``, ``'/'`` for the root), or a list
  of ``(pattern, replacement)`` pairs: each checkpoint name a pattern matches in full (first
  pair wins) goes to the variable ``re.sub`` names; a replacement may be a tuple (one value
  into several variables, each through its own transforms). A variable name ``name[i]`` is
  layer ``i`` of a stacked variable (``ps.nn.Repeat``): a stacked variable takes all its
  layers or none. Stricter than TF1: a key or pattern that matches no checkpoint name, a
  scope with no variable, or a transform pattern that matches no variable raises. A
  ``ps.checkpoint.NameMap`` reads as its ``(pattern, target)`` pairs, each value passed
  through its rule's forward transform (before any of ``transforms``).
* ``transforms`` ``{pattern: fn}``: every ``fn`` whose pattern ``re.search``-es a
  variable's name (``name[i]`` for a layer) is applied, in the dict's order, to the value
  read for it. ``cast=True`` allows float-to-float conversion; any other dtype or shape
  difference raises ValueError naming the checkpoint name, the variable, both shapes and
  dtypes.
* All or nothing: everything that can be checked from names, shapes and dtypes is checked
  before any value is read; then each value is read when it is placed (one at a time: a
  Hugging Face tensor through a memory map of its bytes, each device copying only its own
  shard of it; other formats through their reader, an Orbax directory reading only the
  shards of this process) and the variables are assigned together at the end, under the
  state lock. On any error (a transform raising, a corrupt file) no variable changes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paramstore.checkpoint.assignment import Target, compile_pattern, resolve
from paramstore.checkpoint.format import PathLike, Reader, dtype_name, is_string
from paramstore.checkpoint.io import aligned_empty
from paramstore.checkpoint.namemap import NameMap
from paramstore.checkpoint.readers import opened
from paramstore.checkpoint.saver import assign_all, check_assignable, outside_traces
from paramstore.nn._quant import QuantInfo, quantize_host, quantized_of
from paramstore.scope import default_store
from paramstore.variable import Variable

Transform = Callable[[Any], Any]

__all__ = ["init_from_checkpoint"]


def init_from_checkpoint(
    ckpt: PathLike,
    assignment_map: Mapping[str, str | Variable] | list[tuple[str, Any]] | NameMap,
    *,
    transforms: Mapping[str, Transform] | None = None,
    cast: bool = False,
    allow_unverified: bool = False,
) -> dict[str, str]:
    """Fill variables from checkpoint ``ckpt`` as ``assignment_map`` says (TF1's
    ``tf.compat.v1.train.init_from_checkpoint``; see the module docstring and
    docs/guides/pretrained.md). Returns ``{variable full name: checkpoint name}`` of what
    it assigned (``name[i]`` for layer ``i`` of a stacked variable). All or nothing: on any
    error (ValueError for a map, shape or dtype problem, CheckpointError for the file) no
    variable changes."""
    outside_traces("warm-start from")
    if not isinstance(cast, bool):
        raise TypeError(f"init_from_checkpoint: cast must be True or False, got {cast!r}.")
    patterns = _transforms(transforms)
    store = default_store()
    with opened(ckpt, allow_unverified) as r:
        entries = r.entries
        name_map = assignment_map if isinstance(assignment_map, NameMap) else None
        pairs = name_map.pairs() if name_map is not None else assignment_map
        targets = resolve(pairs, list(entries), store, r.path)
        for t in targets:
            check_assignable(t.ckpt, t.var)
        chains = {t.label: [fn for p, fn in patterns if p.search(t.label)] for t in targets}
        if name_map is not None:  # each rule's forward transform first, then transforms=
            for t in targets:
                fn = name_map.forward(t.ckpt, t.label)
                if fn is not None:
                    chains[t.label].insert(0, fn)
        unused = [p.pattern for p, _ in patterns if not any(p.search(t.label) for t in targets)]
        if unused:
            raise ValueError(
                f"init_from_checkpoint: transforms pattern '{unused[0]}' matches none of the "
                f"variables assigned ({', '.join(sorted(chains)[:5])}, ...)."
            )
        for t in targets:  # what can be checked before reading: untransformed values
            if not chains[t.label]:
                e = entries[t.ckpt]
                _check(r.path, t, tuple(e.shape), np.dtype(e.dtype), cast, None)
        groups: dict[int, list[Target]] = {}
        for t in targets:
            groups.setdefault(id(t.var), []).append(t)
        # keyed by position: two variables of one name (from two stores) stay apart
        present = {str(i): group[0].var for i, group in enumerate(groups.values())}
        quantizing = {i: _quantizing(r, group) for i, group in enumerate(groups.values())}
        _check_scales(groups, quantizing)
        values: dict[str, Any] = {}
        for i, group in enumerate(groups.values()):
            info = quantizing[i]
            if info is None:
                values[str(i)] = _value(r, group[0].var, group, chains, cast)
                continue
            # quantize while loading: one float tensor at a time, on the host
            values[str(i)], values[f"{i}/scale"] = _quantized(r, group, info, chains, cast)
            present[f"{i}/scale"] = info.scale
        assign_all(present, values, {})
    return {t.label: t.ckpt for t in sorted(targets, key=lambda t: t.label)}


def _transforms(transforms: Mapping[str, Transform] | None) -> list[tuple[re.Pattern[str], Any]]:
    if transforms is None:
        return []
    if not isinstance(transforms, Mapping):
        raise TypeError(
            "init_from_checkpoint: transforms must be a dict {pattern: fn}, got "
            f"{type(transforms).__name__}."
        )
    out = []
    for pattern, fn in transforms.items():
        if not isinstance(pattern, str) or not callable(fn):
            raise TypeError(
                "init_from_checkpoint: transforms maps a pattern (str) to a function "
                f"array -> array, got {pattern!r}: {fn!r}."
            )
        out.append((compile_pattern(pattern, "transforms"), fn))
    return out


def _check(
    path: str, t: Target, shape: tuple[int, ...], dtype: np.dtype, cast: bool, how: str | None
) -> None:
    """ValueError unless a value of ``shape`` and ``dtype`` fits ``t`` (``cast``: floats; a
    quantized variable: a float tensor of the float shape it stands for)."""
    want_dtype = np.dtype(t.var.dtype)
    info = quantized_of(t.var)
    if info is not None and dtype != want_dtype:
        want = info.float_shape(t.shape)
        if shape == want and _is_float(dtype):
            return
        raise ValueError(
            f"init_from_checkpoint: checkpoint '{path}' holds '{t.ckpt}' with shape {shape} "
            f"and dtype {dtype_name(dtype)}{how or ''}, which cannot be quantized into variable "
            f"'{t.label}' ({info.mode}, stored {t.shape} int8): quantizing while loading takes "
            f"a floating-point tensor of shape {want} (or the int8 values themselves, shape "
            f"{t.shape}). Give a transform that reshapes or transposes it."
        )
    floats = _is_float(dtype) and _is_float(want_dtype)
    if shape == t.shape and (dtype == want_dtype or (cast and floats)):
        return
    head = (
        f"init_from_checkpoint: checkpoint '{path}' holds '{t.ckpt}' with shape {shape} and "
        f"dtype {dtype_name(dtype)}{how or ''}, but variable '{t.label}' has shape {t.shape} "
        f"and dtype {dtype_name(want_dtype)}."
    )
    if shape != t.shape:
        fix = "Give a transform (transforms={pattern: fn}) that reshapes, transposes or splits it."
    elif floats:
        fix = "Pass cast=True to convert between floating-point dtypes."
    else:
        fix = (
            "cast=True converts only between floating-point dtypes; convert it yourself with a "
            "transform (transforms={pattern: lambda x: x.astype(...)}) if that is meant."
        )
    raise ValueError(f"{head} {fix}")


def _is_float(dtype: np.dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _value(
    r: Reader, v: Variable, group: list[Target], chains: Mapping[str, list[Any]], cast: bool
) -> Any:
    """The new value of ``v`` on its sharding, read from its target(s) now."""
    if is_string(np.dtype(v.dtype)):
        (t,) = group
        return r.load({t.ckpt: None})[t.ckpt]
    # an abstract variable made outside any ps.device block has no sharding: the default device
    sharding = v.sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    dtype = np.dtype(v.dtype)
    if len(group) == 1 and group[0].index is None and not chains[group[0].label]:
        t = group[0]
        view = _view(r, t.ckpt)
        if view is None and r.entries[t.ckpt].dtype == dtype:
            # The reader places it (an Orbax directory reads only this process's shards).
            return r.load({t.ckpt: sharding})[t.ckpt]
        sources = [view if view is not None else _whole(r, t.ckpt)]
    else:
        by_layer = sorted(group, key=lambda t: -1 if t.index is None else t.index)
        sources = [_source(r, t, chains[t.label], cast) for t in by_layer]
    stacked = group[0].index is not None

    def shard(index: Any) -> np.ndarray:
        # A new 64-byte-aligned buffer, which JAX on CPU adopts without another copy (and no
        # view of the file: a device buffer must not change if the file does).
        shape = tuple(len(range(*ix.indices(n))) for ix, n in zip(index, v.shape))
        out = aligned_empty(math.prod(shape) * dtype.itemsize).view(dtype).reshape(shape)
        if not stacked:
            read_into = getattr(sources[0], "read_into", None)  # a file's rows, read into out
            if read_into is None or not read_into(index, out):
                np.copyto(out, np.asarray(sources[0][index]), casting="unsafe")
        else:
            for j, s in enumerate(sources[index[0]]):
                np.copyto(out[j], np.asarray(s[index[1:]]), casting="unsafe")
        return out

    return jax.make_array_from_callback(tuple(v.shape), sharding, shard)


def _quantizing(r: Reader, group: list[Target]) -> QuantInfo | None:
    """The quantized variable's ``QuantInfo`` when ``group`` fills it from float tensors."""
    info = quantized_of(group[0].var)
    if info is None:
        return None
    return info if _is_float(np.dtype(r.entries[group[0].ckpt].dtype)) else None


def _check_scales(groups: Mapping[int, list[Target]], quantizing: Mapping[int, Any]) -> None:
    """A scale computed while loading is not also read from the checkpoint."""
    for i, info in quantizing.items():
        if info is not None and id(info.scale) in groups:
            t = list(groups.values())[i][0]
            raise ValueError(
                f"init_from_checkpoint: variable '{t.label}' is quantized from the float "
                f"'{t.ckpt}', which also gives its scale '{info.scale.name}'; the map assigns "
                "that scale from the checkpoint too. Leave the scale out of the map (or load "
                "the int8 values with it)."
            )


def _quantized(
    r: Reader, group: list[Target], info: QuantInfo, chains: Mapping[str, list[Any]], cast: bool
) -> tuple[jax.Array, jax.Array]:
    """The quantized values and the scale of ``group``'s variable, from float tensors read and
    quantized one at a time on the host, each device copying only its shards."""
    by_layer = sorted(group, key=lambda t: -1 if t.index is None else t.index)
    parts = [quantize_host(_source(r, t, chains[t.label], cast), info.axis, info.mode) for t in by_layer]  # fmt: skip
    if group[0].index is None:
        q, s = parts[0]
    else:
        q, s = np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])
    return _placed(q, group[0].var), _placed(s, info.scale)


def _placed(value: np.ndarray, v: Variable) -> jax.Array:
    sharding = v.sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _view(r: Reader, name: str) -> np.ndarray | None:
    view: Callable[[str], np.ndarray | None] | None = getattr(r, "view", None)
    return None if view is None else view(name)


def _whole(r: Reader, name: str) -> np.ndarray:
    value: np.ndarray = r.load({name: None})[name]
    return value


def _source(r: Reader, t: Target, chain: list[Any], cast: bool) -> Any:
    """The value of ``t`` as an array (a view of the file where the reader has one),
    transformed and checked."""
    view = _view(r, t.ckpt)
    value: Any = view if view is not None else _whole(r, t.ckpt)
    if not chain:
        return value
    value = np.asarray(value)  # a transform gets an array (a view is read whole here)
    for fn in chain:
        shape, dtype = tuple(np.shape(value)), np.dtype(value.dtype)
        try:
            value = fn(value)
        except Exception as e:
            raise ValueError(
                f"init_from_checkpoint: the transform {_fn_name(fn)} for variable '{t.label}' "
                f"raised {type(e).__name__}: {e} (on '{t.ckpt}', shape {shape}, dtype "
                f"{dtype_name(dtype)})."
            ) from e
        if not isinstance(value, (np.ndarray, jax.Array)):
            value = np.asarray(value)
    _check(r.path, t, tuple(value.shape), np.dtype(value.dtype), cast, " after its transforms")
    return value


def _fn_name(fn: Any) -> str:
    return f"'{getattr(fn, '__qualname__', None) or repr(fn)}'"
