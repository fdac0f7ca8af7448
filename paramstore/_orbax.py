"""Sharded checkpoints through Orbax: the format behind ``ps.Saver(..., sharded=...)``.

A sharded checkpoint is a directory written by one Orbax ``Checkpointer`` with a
``CompositeCheckpointHandler`` and two items:

* ``arrays``: a flat Orbax pytree ``{"v0": array, "v1": ...}`` (positional keys, so that no
  variable name has to be escaped). Each process writes only the shards it holds
  (TensorStore, one OCDBT store per process); restoring reads, for each device, only the
  pieces its shard needs, so the checkpoint restores onto any mesh and process count.
* ``paramstore``: JSON (``paramstore/metadata``) with the format name and version and, per
  variable, its name, key, shape and dtype; string variables keep their values here, and
  empty arrays (which Orbax cannot store) need nothing more.

paramstore reads the JSON itself (``list_variables`` needs no Orbax) and checks names,
shapes and dtypes before Orbax reads any array. Orbax writes into a temporary directory and
renames it once every process has finished, so a crash never leaves a half-written
checkpoint under the final name. Orbax is imported only here, lazily.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

FORMAT = "paramstore-sharded"
VERSION = 1
ARRAYS = "arrays"
META = "paramstore"
_META_FILE = "metadata"  # Orbax's JsonCheckpointHandler default file name
_STRING = np.dtypes.StringDType()


class FormatError(ValueError):
    """The metadata of a sharded checkpoint is missing or malformed."""


def orbax() -> Any:
    """``orbax.checkpoint``, or ImportError saying how to get it."""
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            "Sharded checkpoints need Orbax: pip install 'paramstore[sharded]' (or "
            "orbax-checkpoint). It is used when jax.process_count() > 1 or with "
            f"Saver(..., sharded=True). ({e})"
        ) from e
    return ocp


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` is a sharded (Orbax) paramstore checkpoint directory."""
    return os.path.isfile(os.path.join(path, META, _META_FILE))


# ----------------------------------------------------------------------------- metadata


def _dtype(name: Any) -> np.dtype:
    if name == "string":
        return _STRING
    if not isinstance(name, str) or not name.isidentifier():
        raise FormatError(f"unknown dtype {name!r}")
    import ml_dtypes

    try:
        dt = np.dtype(getattr(ml_dtypes, name, name))
    except TypeError:
        raise FormatError(f"unknown dtype {name!r}") from None
    if dt.name != name:
        raise FormatError(f"unknown dtype {name!r}")
    return dt


def _dtype_name(dt: np.dtype) -> str:
    return "string" if dt == _STRING else dt.name


def read_metadata(path: str) -> list[dict[str, Any]]:
    """The variables of a sharded checkpoint: ``[{"name", "key", "shape", "dtype",
    "strings"?}]`` in save order, validated (FormatError if malformed)."""
    file = os.path.join(path, META, _META_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise FormatError(f"'{path}' is not a sharded paramstore checkpoint (no {file})") from None
    except (OSError, ValueError) as e:
        raise FormatError(f"its metadata {file} cannot be read: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise FormatError(f"{file} is not paramstore metadata")
    if meta.get("version") != VERSION:
        raise FormatError(
            f"format version {meta.get('version')!r} is not one this paramstore reads "
            f"({VERSION}); upgrade paramstore"
        )
    out = []
    seen: set[str] = set()
    for entry in meta.get("variables", ()):
        if not isinstance(entry, dict):
            raise FormatError("a variable entry is not an object")
        name, key, shape = entry.get("name"), entry.get("key"), entry.get("shape")
        if not isinstance(name, str) or name in seen:
            raise FormatError(f"bad or duplicate variable name {name!r}")
        seen.add(name)
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise FormatError(f"variable '{name}' has a bad shape {shape!r}")
        dtype = _dtype(entry.get("dtype"))
        item = {"name": name, "key": key, "shape": tuple(shape), "dtype": dtype}
        if dtype == _STRING:
            values = entry.get("strings")
            if not (
                isinstance(values, list)
                and len(values) == math.prod(shape)
                and all(isinstance(s, str) for s in values)
            ):
                raise FormatError(f"string variable '{name}' has bad values")
            item["strings"] = values
        elif not isinstance(key, str) and math.prod(shape) != 0:
            raise FormatError(f"variable '{name}' has no array key")
        out.append(item)
    return out


# ------------------------------------------------------------------------------- saving


def host_value(x: Any) -> Any:
    """What goes into the Orbax tree for one variable's array: the ``jax.Array`` itself,
    except a process-local one in a multi-process run (a variable not placed over the
    global devices), which is saved from process 0 as NumPy."""
    if jax.process_count() > 1 and x.is_fully_addressable:
        return np.asarray(x)
    return x


def save(path: str, values: Mapping[str, Any], checkpointer: Any = None) -> str:
    """Write ``{name: jax.Array | NumPy string array}`` as a sharded checkpoint at ``path``
    (replacing one there). Every process must call it with the same names. With an Orbax
    ``AsyncCheckpointer`` as ``checkpointer`` it returns once the values are copied to host;
    the checkpointer's ``wait_until_finished`` completes it."""
    ocp = orbax()
    path = os.path.abspath(path)
    entries: list[dict[str, Any]] = []
    arrays: dict[str, Any] = {}
    for i, (name, x) in enumerate(values.items()):
        dtype = np.dtype(x.dtype)
        entry: dict[str, Any] = {
            "name": name,
            "key": None,
            "shape": [int(d) for d in x.shape],
            "dtype": _dtype_name(dtype),
        }
        if dtype == _STRING:
            entry["strings"] = [str(s) for s in np.asarray(x).reshape(-1).tolist()]
        elif math.prod(x.shape) == 0:
            pass  # Orbax cannot store an empty array; its shape and dtype say it all
        else:
            entry["key"] = key = f"v{i}"
            arrays[key] = host_value(x)
        entries.append(entry)
    meta = {"format": FORMAT, "version": VERSION, "variables": entries}
    items: dict[str, Any] = {META: ocp.args.JsonSave(meta)}
    if arrays:
        items[ARRAYS] = ocp.args.PyTreeSave(arrays)
    if checkpointer is None:
        checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    parent = os.path.dirname(path)
    if parent and jax.process_index() == 0:
        os.makedirs(parent, exist_ok=True)
    checkpointer.save(path, ocp.args.Composite(**items), force=True)
    return path


def async_checkpointer() -> Any:
    ocp = orbax()
    return ocp.AsyncCheckpointer(ocp.CompositeCheckpointHandler())


# ---------------------------------------------------------------------------- restoring


def load(path: str, wanted: Mapping[str, tuple[dict[str, Any], Any]]) -> dict[str, Any]:
    """Read ``{name: (metadata entry, target sharding or None)}``: a ``jax.Array`` on the
    target sharding (NumPy where it is None), or the NumPy array of a string variable."""
    out: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    args: dict[str, Any] = {}
    names: dict[str, str] = {}
    ocp = None
    for name, (entry, sharding) in wanted.items():
        if entry["dtype"] == _STRING:
            arr = np.asarray(entry["strings"], dtype=_STRING).reshape(entry["shape"])
            arr.flags.writeable = False
            out[name] = arr
            continue
        if entry["key"] is None:  # empty: stored as metadata only
            empty = np.zeros(entry["shape"], entry["dtype"])
            out[name] = empty if sharding is None else jax.device_put(empty, sharding)
            continue
        ocp = ocp or orbax()
        key = entry["key"]
        names[key] = name
        if sharding is None:
            targets[key] = np.empty(0, entry["dtype"])
            args[key] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=entry["dtype"])
        else:
            targets[key] = jax.ShapeDtypeStruct(entry["shape"], entry["dtype"], sharding=sharding)
            args[key] = ocp.ArrayRestoreArgs(
                sharding=sharding, global_shape=entry["shape"], dtype=entry["dtype"]
            )
    if targets:
        assert ocp is not None
        checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
        restored = checkpointer.restore(
            os.path.abspath(path),
            ocp.args.Composite(
                **{
                    ARRAYS: ocp.args.PyTreeRestore(
                        item=targets, restore_args=args, partial_restore=True
                    )
                }
            ),
        )[ARRAYS]
        for key, name in names.items():
            out[name] = restored[key]
    return out
