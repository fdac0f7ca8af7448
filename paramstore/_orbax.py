"""Sharded checkpoints through Orbax: the format behind ``ps.Saver(..., sharded=...)``.

A sharded checkpoint is a directory written by one Orbax ``Checkpointer`` with a
``CompositeCheckpointHandler`` and two items:

* ``arrays``: a flat Orbax pytree ``{"v0": array, "v1": ...}`` (positional keys, so that no
  variable name has to be escaped). Each process writes only the shards it holds
  (TensorStore, one OCDBT store per process); restoring reads, for each device, only the
  pieces its shard needs, so the checkpoint restores onto any mesh and process count.
* ``paramstore``: JSON (``paramstore/metadata``) with the format name and version and, per
  variable, its name, key, shape, dtype and ``checksum`` (the manifest); string variables
  keep their values here, and empty arrays (which Orbax cannot store) need nothing more.

The checksum (``sum64``) of an array is computed by JAX over the global array, whatever its
sharding and however many processes hold it: two sums over the array's little-endian bytes
``b[i]``, ``sum(b[i] * (2i + 1))`` and ``sum((b[i] + 1) * (i * 0x9E3779B1 | 1))``, each mod
2**32. Every single flipped bit changes the first; random damage passes both with odds of
about 2**-64. Every array entry must carry one (format version 2; version 1 directories,
written without checksums, are refused). Restoring recomputes it on the restored value
(after any cast: an edited dtype fails it) and raises before any variable is assigned.

paramstore reads the JSON itself (``list_variables`` needs no Orbax) and checks names,
shapes and dtypes before Orbax reads any array. Orbax writes into a temporary directory and
renames it once every process has finished, so a crash never leaves a half-written
checkpoint under the final name. Orbax is imported only here, lazily (``importlib``).
``ShardedCheckpoint`` is this format's ``_format.Reader``.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from paramstore._format import CheckpointError, Entry, PathLike, no_such_variable
from paramstore._safetensors import MAX_DEPTH, json_depth

FORMAT = "paramstore-sharded"
VERSION = 2
MAX_METADATA = 256 * 2**20  # the JSON holds string values too
ARRAYS = "arrays"
META = "paramstore"
_META_FILE = "metadata"  # Orbax's JsonCheckpointHandler default file name
_STRING = np.dtypes.StringDType()


class FormatError(ValueError):
    """The metadata of a sharded checkpoint is missing or malformed."""


def orbax() -> Any:
    """``orbax.checkpoint``, or ImportError saying how to get it."""
    try:
        ocp = importlib.import_module("orbax.checkpoint")
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
        if os.path.getsize(file) > MAX_METADATA:
            raise ValueError(f"it exceeds {MAX_METADATA // 2**20} MiB")
        with open(file, "rb") as f:
            raw = f.read()
        depth = json_depth(raw)
        if depth > MAX_DEPTH:
            raise ValueError(f"it nests {depth} levels deep, more than {MAX_DEPTH}")
        meta = json.loads(raw)
    except FileNotFoundError:
        raise FormatError(f"'{path}' is not a sharded paramstore checkpoint (no {file})") from None
    except (OSError, ValueError, RecursionError) as e:
        raise FormatError(f"its metadata {file} cannot be read: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise FormatError(f"{file} is not paramstore metadata")
    if meta.get("version") != VERSION:
        old = meta.get("version") == 1
        raise FormatError(
            f"format version {meta.get('version')!r} is not one this paramstore reads "
            f"({VERSION}); "
            + (
                "version 1 has no checksums: load it with paramstore 0.1 and save it again"
                if old
                else "upgrade paramstore"
            )
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
        elif math.prod(shape) != 0:
            digest = entry.get("checksum")
            if not isinstance(key, str):
                raise FormatError(f"variable '{name}' has no array key")
            if not (isinstance(digest, str) and len(digest) == 16):
                raise FormatError(f"variable '{name}' has no checksum in the manifest")
            item["checksum"] = digest
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
            entry["checksum"] = checksum(x)
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


_GOLDEN = 0x9E3779B1
_SUM_CHUNK = 2**22


def checksum(x: Any) -> str:
    """The ``sum64`` of an array (see the module docstring), as 16 hex digits. Computed on
    the host when the value is all here, else by JAX over the global (sharded) array."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        s1, s2 = _device_sums(x)
        return f"{int(s1):08x}{int(s2):08x}"
    arr = np.asarray(x)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    b = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    s1 = s2 = 0
    for start in range(0, b.size, _SUM_CHUNK):
        chunk = b[start : start + _SUM_CHUNK].astype(np.uint64)
        i = np.arange(start, start + chunk.size, dtype=np.uint64)
        s1 += int(np.sum(chunk * (2 * i + 1), dtype=np.uint64))
        w = ((i * np.uint64(_GOLDEN)) & np.uint64(0xFFFFFFFF)) | np.uint64(1)
        s2 += int(np.sum((chunk + 1) * w, dtype=np.uint64))
    return f"{s1 % 2**32:08x}{s2 % 2**32:08x}"


@jax.jit
def _device_sums(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1)
    b = jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1).astype(jnp.uint32)
    i = jax.lax.iota(jnp.uint32, b.size)
    s1 = jnp.sum(b * (2 * i + 1), dtype=jnp.uint32)
    s2 = jnp.sum((b + 1) * ((i * jnp.uint32(_GOLDEN)) | 1), dtype=jnp.uint32)
    return s1, s2


class ShardedCheckpoint:
    """A sharded (Orbax) checkpoint directory: this format's ``_format.Reader``."""

    def __init__(self, path: PathLike) -> None:
        self.path = os.fspath(path)
        try:
            self._meta = {e["name"]: e for e in read_metadata(self.path)}
        except FormatError as e:
            raise CheckpointError(f"Checkpoint '{self.path}' is not readable: {e}.") from None
        self.entries = {
            name: Entry(name, e["shape"], e["dtype"], _nbytes(e)) for name, e in self._meta.items()
        }
        self.description = f"sharded (Orbax), format version {VERSION}"

    def close(self) -> None:
        pass

    def load(self, wanted: Mapping[str, Any]) -> dict[str, Any]:
        """``{name: placement}`` -> ``{name: value}``, each value checked against the
        manifest before any is returned (CheckpointError otherwise)."""
        for name in wanted:
            if name not in self._meta:
                raise no_such_variable(self.path, name, self._meta)
        try:
            out = load(self.path, {n: (self._meta[n], p) for n, p in wanted.items()})
        except ImportError:
            raise
        except Exception as e:  # Orbax / TensorStore: missing or corrupt array data
            raise CheckpointError(
                f"Checkpoint '{self.path}' is corrupt or incomplete: its array data could not "
                f"be read ({type(e).__name__}: {e}). Restore another checkpoint."
            ) from None
        for name, value in out.items():
            meta = self._meta[name]
            if "checksum" not in meta:
                continue
            if not isinstance(value, (jax.Array, np.ndarray)):
                raise CheckpointError(
                    f"Checkpoint '{self.path}' is corrupt or incomplete: its array data has no "
                    f"value for variable '{name}' (key {meta['key']!r}). Restore another "
                    "checkpoint."
                )
            if tuple(value.shape) != meta["shape"] or np.dtype(value.dtype) != meta["dtype"]:
                raise CheckpointError(
                    f"Checkpoint '{self.path}' is corrupt: variable '{name}' was read with "
                    f"shape {tuple(value.shape)} and dtype {value.dtype}, but its metadata says "
                    f"{meta['shape']} and {meta['dtype']}."
                )
            got = checksum(value)
            if got != meta["checksum"]:
                raise CheckpointError(
                    f"Checkpoint '{self.path}' is corrupt: the data of variable '{name}' fails "
                    f"its checksum (sum64 {got}, expected {meta['checksum']}; a flipped bit, or "
                    "metadata edited to another dtype). Restore an older checkpoint."
                )
        return out


def _nbytes(e: Mapping[str, Any]) -> int:
    if "strings" in e:
        return sum(len(t.encode("utf-8", "surrogatepass")) for t in e["strings"])
    return math.prod(e["shape"]) * e["dtype"].itemsize


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
            if key not in restored:
                raise FormatError(f"the array data lacks '{key}' (variable '{name}')")
            out[name] = restored[key]
    return out
