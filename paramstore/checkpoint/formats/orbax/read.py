"""Reading sharded checkpoints (the format is described in ``paramstore.checkpoint.formats.orbax.format``).

``ShardedCheckpoint`` is this format's ``checkpoint.format.Reader``: it verifies the metadata and
every process file, checks that the writers' shards tile each wanted array, reads the values
through Orbax straight into the target shardings (each process reading only the pieces its
shards need), and verifies them before returning any: the files' digests (the reading
processes share the files between them) and the restored values' shard sums, computed on
the devices holding them; shard by shard where the layout is the writer's, and as a total
(one small all-gather across processes) where it is not.
"""

from __future__ import annotations

import importlib
import math
import os
import threading
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from paramstore._core.interrupts import deferred
from paramstore.checkpoint.format import CheckpointError, Entry, PathLike, no_such_variable
from paramstore.checkpoint.formats.orbax import integrity, packed
from paramstore.checkpoint.formats.orbax.format import (
    ARRAYS,
    META,
    PROCESS_FORMAT,
    VERSION,
    FormatError,
    orbax,
    process_file,
    read_metadata,
)

_STRING = np.dtypes.StringDType()


class ShardedCheckpoint:
    """A sharded (Orbax) checkpoint directory: this format's ``checkpoint.format.Reader``."""

    def __init__(self, path: PathLike) -> None:
        self.path = os.fspath(path)
        try:
            self.processes, entries = read_metadata(self.path)
        except FormatError as e:
            raise CheckpointError(f"Checkpoint '{self.path}' is not readable: {e}.") from None
        self._meta = {e["name"]: e for e in entries}
        self.entries = {
            name: Entry(name, e["shape"], e["dtype"], _nbytes(e)) for name, e in self._meta.items()
        }
        self.description = f"sharded (Orbax), format version {VERSION}"

    def close(self) -> None:
        pass

    def load(self, wanted: Mapping[str, Any]) -> dict[str, Any]:
        """``{name: placement}`` -> ``{name: value}``, each value verified (see the module
        docstring) before any is returned (CheckpointError otherwise). Signal handlers'
        exceptions (Ctrl-C) are held back until it returns or raises: Orbax's threads and
        event loop cannot be stopped midway, and an interrupt inside them came back as a
        "corrupt checkpoint" or was lost (issue 36 item 10)."""
        with deferred():
            return self._load(wanted)

    def _load(self, wanted: Mapping[str, Any]) -> dict[str, Any]:
        for name in wanted:
            if name not in self._meta:
                raise no_such_variable(self.path, name, self._meta)
        parts = self._process_files()
        keys = {self._meta[n]["key"]: n for n in wanted if self._meta[n].get("key")}
        writer = self._writer_shards(parts, keys)
        files: dict[str, Any] = {}
        me, count = jax.process_index(), jax.process_count()
        for p, part in enumerate(parts):
            if p % count == me:  # the reading processes share the file checks
                files.update(part["files"])
        bad_files: list[str] = []
        checker = threading.Thread(
            target=lambda: bad_files.extend(integrity.bad_files(self.path, files)),
            name="paramstore-verify-files",
        )
        checker.start()
        try:
            out = load(self.path, {n: (self._meta[n], p) for n, p in wanted.items()})
        except ImportError:
            checker.join()
            raise
        except Exception as e:  # Orbax / TensorStore: missing or corrupt array data
            checker.join()
            self._combine(sorted(keys), {}, {}, True)  # the other processes raise too
            raise CheckpointError(
                f"Checkpoint '{self.path}' is corrupt or incomplete: its array data could not "
                f"be read ({type(e).__name__}: {e}). Restore another checkpoint."
            ) from None
        except BaseException:
            checker.join()
            raise
        problems: list[str] = []
        checkable: dict[str, Any] = {}
        for key, name in keys.items():
            value = out[name]
            meta = self._meta[name]
            stored = meta.get("stored", meta["dtype"])
            if tuple(value.shape) != meta["shape"] or np.dtype(value.dtype) != stored:
                problems.append(
                    f"variable '{name}' was read with shape {tuple(value.shape)} and dtype "
                    f"{value.dtype}, but its metadata says {meta['shape']} and {stored}"
                )
                continue
            checkable[key] = value
        pending = integrity.dispatch_sums(checkable)
        partial: dict[str, integrity.Sums] = {}
        is_global: dict[str, bool] = {}
        for key, started in pending.items():
            name = keys[key]
            got = integrity.fetch(started)
            by_box = {box: (sums, proc) for box, sums, proc in writer[key]}
            for box, sums in got:  # shard by shard, where the layout is the writer's
                if box in by_box and by_box[box][0] != sums:
                    problems.append(
                        f"shard {integrity.fmt_box(box)} of variable '{name}' (written by "
                        f"process {by_box[box][1]}) fails its checksum"
                    )
            value = out[name]
            is_global[key] = isinstance(value, jax.Array) and not value.is_fully_addressable
            partial[key] = integrity.total(s for _, s in got)
        checker.join()
        if bad_files:
            problems.append(f"{len(bad_files)} file(s) fail their digest: {bad_files[0]}")
        totals = self._combine(sorted(keys), partial, is_global, bool(problems))
        if totals is None and not problems:
            problems.append("another process found a damaged shard or file")
        for key, got_sums in (totals or {}).items():
            expected = integrity.total(s for _, s, _ in writer[key])
            if got_sums != expected:
                problems.append(
                    f"the data of variable '{keys[key]}' fails its checksum (sums "
                    f"{integrity.hexsums(got_sums)}, expected {integrity.hexsums(expected)})"
                )
        if problems:
            raise CheckpointError(
                f"Checkpoint '{self.path}' is corrupt: {problems[0]}"
                + (f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else "")
                + ". A flipped bit or an edited file; restore an older checkpoint."
            )
        for name in wanted:  # verified: the stored bytes back as their dtype
            if "stored" in self._meta[name] and self._meta[name].get("key"):
                out[name] = packed.unpack(out[name], self._meta[name]["dtype"])
        return out

    def _combine(
        self,
        keys: list[str],
        partial: dict[str, integrity.Sums],
        is_global: dict[str, bool],
        failed: bool,
    ) -> dict[str, integrity.Sums] | None:
        """Each array's sums: a global array's from every process's shards (one small
        all-gather, the same length on every process: one slot per wanted key), a local
        one's as read here. None when some process found a problem (every process then
        raises, so that none assigns a variable)."""
        if jax.process_count() == 1:
            return None if failed else partial
        vec = [int(failed)] + [s for k in keys for s in partial.get(k, (0, 0))]
        multihost_utils = importlib.import_module("jax.experimental.multihost_utils")
        gathered = np.asarray(multihost_utils.process_allgather(np.asarray(vec, np.uint32)))
        gathered = gathered.reshape(jax.process_count(), len(vec)).astype(np.int64)
        if gathered[:, 0].any():
            return None
        out = {}
        for i, k in enumerate(keys):
            if k not in partial:
                continue
            if is_global[k]:
                col = gathered[:, 1 + 2 * i : 3 + 2 * i]
                out[k] = (int(col[:, 0].sum() % 2**32), int(col[:, 1].sum() % 2**32))
            else:
                out[k] = partial[k]
        return out

    def _process_files(self) -> list[dict[str, Any]]:
        """The verified process files, one per writing process."""
        parts = []
        for p in range(self.processes):
            file = process_file(self.path, p)
            try:
                part = integrity.read_json(file, PROCESS_FORMAT)
                if not (
                    isinstance(part, dict)
                    and part.get("process") == p
                    and isinstance(part.get("shards"), dict)
                    and isinstance(part.get("files"), dict)
                ):
                    raise integrity.IntegrityError(f"{file} is malformed")
            except integrity.IntegrityError as e:
                raise CheckpointError(
                    f"Checkpoint '{self.path}' is corrupt or incomplete: it was written by "
                    f"{self.processes} process(es), and the part of process {p} is not "
                    f"readable ({e}). Restore another checkpoint."
                ) from None
            parts.append(part)
        return parts

    def _writer_shards(
        self, parts: list[dict[str, Any]], keys: Mapping[str, str]
    ) -> dict[str, list[tuple[integrity.Box, integrity.Sums, int]]]:
        """``{key: [(box, sums, writing process)]}`` for the wanted keys, checked to tile
        each array exactly."""
        out: dict[str, list[tuple[integrity.Box, integrity.Sums, int]]] = {k: [] for k in keys}
        try:
            for p, part in enumerate(parts):
                for key, shards in part["shards"].items():
                    if key not in out:
                        continue
                    for box, text in shards:
                        b = tuple((int(a), int(z)) for a, z in box)
                        out[key].append((b, integrity.parse_hexsums(text), p))
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"Checkpoint '{self.path}' is corrupt: a process file lists a bad shard ({e})."
            ) from None
        for key, shards in out.items():
            name = keys[key]
            why = integrity.uncovered(self._meta[name]["shape"], [b for b, _, _ in shards])
            if why is not None:
                raise CheckpointError(
                    f"Checkpoint '{self.path}' is incomplete: the shards of variable '{name}' "
                    f"do not cover it ({why}; listed in "
                    f"{META}/process_<i>.json of its {self.processes} writing process(es)). "
                    "Every process must take part in a save; restore another checkpoint or "
                    "save again from all processes."
                )
        return out


def _nbytes(e: Mapping[str, Any]) -> int:
    if "strings" in e:
        return sum(len(t.encode("utf-8", "surrogatepass")) for t in e["strings"])
    size: int = math.prod(e["shape"]) * e["dtype"].itemsize
    return size


def load(path: str, wanted: Mapping[str, tuple[dict[str, Any], Any]]) -> dict[str, Any]:
    """Read ``{name: (metadata entry, target sharding or None)}``: a ``jax.Array`` on the
    target sharding (NumPy where it is None), or the NumPy array of a string variable.
    Nothing is verified here (``ShardedCheckpoint.load`` does it)."""
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
        dtype = entry.get("stored", entry["dtype"])  # packed dtypes: their bytes
        if sharding is None:
            targets[key] = np.empty(0, dtype)
            args[key] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
        else:
            targets[key] = jax.ShapeDtypeStruct(entry["shape"], dtype, sharding=sharding)
            args[key] = ocp.ArrayRestoreArgs(
                sharding=sharding, global_shape=entry["shape"], dtype=dtype
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
