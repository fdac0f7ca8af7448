"""Reading Hugging Face safetensors checkpoints (private; docs/guides/pretrained.md).

A Hugging Face checkpoint is a plain safetensors file (no paramstore checksums), a
``model.safetensors.index.json`` naming shard files beside it, or a directory holding
either (``model.safetensors`` is preferred, as ``transformers`` prefers it). Both readers
implement ``checkpoint.format.Reader`` and add ``view(name)``: the tensor as a read-only
NumPy array over a memory map of just its bytes, so a caller reads only the slices it
copies (``init_from_checkpoint`` copies each device's shard) and never the whole file.

Everything is checked before a value is read: each shard's header against its file (sizes,
offsets, dtypes; ``checkpoint.formats.safetensors.header``), the index's JSON, that every
shard it names is a plain file name inside its directory, that the shards hold exactly the
tensors the index assigns them, and that no tensor is in two shards.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from paramstore.checkpoint.format import CheckpointError, PathLike, is_string
from paramstore.checkpoint.formats.safetensors.file import SafetensorsFile
from paramstore.checkpoint.formats.safetensors.format import Entry, parse_json
from paramstore.checkpoint.io import open_regular

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
INDEX_SUFFIX = ".safetensors.index.json"
MAX_INDEX = 64 * 2**20  # an index of ~500,000 tensors

_UNVERIFIED = (
    "Hugging Face safetensors files carry no paramstore checksums, so their values cannot be "
    "verified; pass allow_unverified=True to read them"
)


def find(path: str) -> str | None:
    """The Hugging Face checkpoint file at ``path``: ``path`` itself if it is an index
    file, the ``model.safetensors`` (else the index) of a directory, or None."""
    if os.path.isdir(path):
        for name in (SINGLE, INDEX):
            candidate = os.path.join(path, name)
            if os.path.isfile(candidate):
                return candidate
        return None
    return path if is_index(path) else None


def is_index(path: str) -> bool:
    return path.endswith(INDEX_SUFFIX)


class PlainSafetensors(SafetensorsFile):
    """A safetensors file (paramstore's own or a foreign one) with ``view``."""

    def view(self, name: str) -> np.ndarray | None:
        """The tensor over a memory map of its bytes (read as it is sliced), or None where
        the file is verified (its checksums need the whole tensor: use ``load``) or the
        tensor is not a plain array (strings)."""
        e = self.entry(name)
        if e.checksum is not None or is_string(e.dtype) or e.code == "U8" and e.dtype != np.uint8:
            return None
        return map_tensor(self._f.fileno(), e, self.path)


def map_tensor(fileno: int, e: Entry, path: str) -> np.ndarray:
    """A read-only array over a memory map of ``e``'s bytes only (unmapped when the last
    view of it is gone)."""
    count = math.prod(e.shape)
    if not count:
        return np.zeros(e.shape, e.dtype)
    start = e.start - e.start % mmap.ALLOCATIONGRANULARITY
    try:
        m = mmap.mmap(fileno, e.end - start, access=mmap.ACCESS_READ, offset=start)
    except (OSError, ValueError) as err:  # the file shrank since its header was checked
        raise CheckpointError(
            f"Checkpoint '{path}': cannot map the data of '{e.name}' ({err}); the file changed "
            "while it was read."
        ) from None
    arr = np.frombuffer(m, e.dtype.newbyteorder("<"), count, e.start - start).reshape(e.shape)
    if e.code == "BOOL" and int(np.max(arr.view(np.uint8), initial=0)) > 1:
        raise CheckpointError(
            f"Checkpoint '{path}' is corrupt: bool tensor '{e.name}' holds bytes other than 0 "
            "and 1."
        )
    return arr


class ShardedSafetensors:
    """A ``model.safetensors.index.json`` and its shard files (a ``checkpoint.format.Reader``)."""

    def __init__(self, path: PathLike, allow_unverified: bool = False) -> None:
        self.path = os.fspath(path)
        if not allow_unverified:
            raise CheckpointError(f"'{self.path}' is a Hugging Face checkpoint: {_UNVERIFIED}.")
        weight_map = _weight_map(self.path)
        directory = os.path.dirname(self.path)
        self._shards: dict[str, PlainSafetensors] = {}
        try:
            for file in sorted(set(weight_map.values())):
                self._shards[file] = _open_shard(self.path, directory, file)
            self._shard_of = _check_shards(self.path, weight_map, self._shards)
        except BaseException:
            self.close()
            raise
        self.entries: dict[str, Entry] = {
            name: shard.entries[name] for name, shard in self._shard_of.items()
        }
        self.description = f"Hugging Face safetensors, {len(self._shards)} shard(s), unverified"

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()

    def load(self, wanted: Mapping[str, Any]) -> dict[str, Any]:
        """``{name: placement}`` -> ``{name: value}`` (``checkpoint.format.Reader``)."""
        by_shard: dict[str, dict[str, Any]] = {}
        for name, placement in wanted.items():
            if name not in self._shard_of:
                raise CheckpointError(f"Checkpoint '{self.path}' has no tensor '{name}'.")
            by_shard.setdefault(self._shard_of[name].path, {})[name] = placement
        out: dict[str, Any] = {}
        for shard in self._shards.values():
            if shard.path in by_shard:
                out.update(shard.load(by_shard[shard.path]))
        return out

    def view(self, name: str) -> np.ndarray | None:
        return self._shard_of[name].view(name)


def _weight_map(path: str) -> dict[str, str]:
    """The index's ``weight_map``, checked: JSON, a map of tensor names to file names."""
    with open_regular(path, "Hugging Face index") as f:
        raw = f.read(MAX_INDEX + 1)
    if len(raw) > MAX_INDEX:
        raise CheckpointError(
            f"Hugging Face index '{path}' is larger than {MAX_INDEX // 2**20} MiB; it is not an "
            "index (or not one paramstore reads)."
        )
    try:
        index = parse_json(raw, "it")
    except ValueError as e:
        raise CheckpointError(
            f"Hugging Face index '{path}' is corrupt: {e}. Write it again (export_safetensors "
            "or save_pretrained) or point at a shard file instead."
        ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"Hugging Face index '{path}' is corrupt: it lacks a 'weight_map' object of "
            "{tensor name: shard file name}."
        )
    return weight_map


def _open_shard(index: str, directory: str, file: str) -> PlainSafetensors:
    """The shard ``file`` of ``index``: a plain relative name inside the index's directory."""
    parts = file.replace("\\", "/").split("/")
    if not file or os.path.isabs(file) or ".." in parts or "" in parts:
        raise CheckpointError(
            f"Hugging Face index '{index}' names shard file '{file}', which is not a file name "
            "inside its directory (absolute paths and '..' are refused); fix the index."
        )
    path = os.path.join(directory, file)
    real = os.path.realpath(path)
    if os.path.commonpath([real, os.path.realpath(directory or ".")]) != os.path.realpath(
        directory or "."
    ):
        raise CheckpointError(
            f"Hugging Face index '{index}' names shard file '{file}', a link to '{real}' outside "
            "its directory; copy the shard into the directory."
        )
    if not os.path.exists(path):
        raise CheckpointError(
            f"Hugging Face index '{index}' names shard file '{file}', which does not exist; the "
            "checkpoint is incomplete (download or copy every shard)."
        )
    return PlainSafetensors(path, allow_unverified=True)


def _check_shards(
    index: str, weight_map: Mapping[str, str], shards: Mapping[str, PlainSafetensors]
) -> dict[str, PlainSafetensors]:
    """``{tensor name: its shard}``: each shard holds exactly what the index assigns it."""
    shard_of: dict[str, PlainSafetensors] = {}
    file_of: dict[str, str] = {}
    for file, shard in shards.items():
        for name in shard.entries:
            if name in file_of:
                raise CheckpointError(
                    f"Hugging Face checkpoint '{index}' is corrupt: tensor '{name}' is in two "
                    f"shards, '{file_of[name]}' and '{file}'."
                )
            file_of[name] = file
            shard_of[name] = shard
    for name, file in file_of.items():
        if weight_map.get(name) != file:
            where = f"to '{weight_map[name]}'" if name in weight_map else "to no shard at all"
            raise CheckpointError(
                f"Hugging Face checkpoint '{index}' is corrupt: shard '{file}' holds tensor "
                f"'{name}', which the index assigns {where}."
            )
    for name, file in weight_map.items():
        if name not in shard_of:
            raise CheckpointError(
                f"Hugging Face checkpoint '{index}' is corrupt: the index puts tensor '{name}' in "
                f"shard '{file}', which does not hold it."
            )
    return shard_of
