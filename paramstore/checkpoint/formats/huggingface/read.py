"""Reading Hugging Face safetensors checkpoints (private; docs/guides/pretrained.md).

A Hugging Face checkpoint is a plain safetensors file (no paramstore checksums), a
``model.safetensors.index.json`` naming shard files beside it, or a directory holding
either (``model.safetensors`` is preferred, as ``transformers`` prefers it). Both readers
implement ``checkpoint.format.Reader`` and add ``view(name)``: the tensor as a
``FileTensor``, read with explicit reads as it is sliced, so a caller reads only the rows it
copies (``init_from_checkpoint`` copies each device's shard) and never the whole file; never
a memory map, so a file truncated while it is read is a CheckpointError, not SIGBUS.

Everything is checked before a value is read: each shard's header against its file (sizes,
offsets, dtypes; ``checkpoint.formats.safetensors.header``), the index's JSON, that every
shard it names is a plain file name inside its directory, that the shards hold exactly the
tensors the index assigns them, and that no tensor is in two shards.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from paramstore.checkpoint.format import CheckpointError, PathLike, is_string
from paramstore.checkpoint.formats.safetensors.file import SafetensorsFile
from paramstore.checkpoint.formats.safetensors.format import Entry, parse_json
from paramstore.checkpoint.io import CHUNK, aligned_empty, open_regular

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

    def view(self, name: str) -> FileTensor | None:
        """The tensor as a ``FileTensor`` (read as it is sliced), or None where the file is
        verified (its checksums need the whole tensor: use ``load``) or the tensor is not a
        plain array (strings)."""
        e = self.entry(name)
        if e.checksum is not None or is_string(e.dtype) or e.code == "U8" and e.dtype != np.uint8:
            return None
        return FileTensor(self._f.fileno(), e, self.path)


class FileTensor:
    """One tensor of an open safetensors file, read with explicit reads (``os.preadv``) as
    it is sliced: ``t[index]`` reads only the rows (first-axis range) the index selects, and
    ``np.asarray(t)`` the whole tensor. The last rows read are kept, so the devices of a
    layout split along later axes share one read.

    Not a memory map (issue 36 item 6): a mapped file truncated in place (a re-download,
    ``cp`` over it) kills the interpreter with SIGBUS at the first access past its new end;
    a read sees a short file instead, a CheckpointError, and a file rewritten in place
    gives other values, never a crash. From the page cache the read costs what the copy
    out of a mapping cost (benchmarks/pretrained.py, ``init_from_checkpoint`` rows)."""

    def __init__(self, fileno: int, e: Entry, path: str) -> None:
        self._fileno, self._e, self._path = fileno, e, path
        self.shape: tuple[int, ...] = e.shape
        self.dtype: np.dtype = e.dtype
        self.ndim = len(e.shape)
        self._kept: tuple[int, int, np.ndarray] | None = None  # rows [a, b) as read

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self._rows(0, self.shape[0]) if self.ndim else self._read(0, 1)
        return whole if dtype is None else whole.astype(dtype)

    def __getitem__(self, index: Any) -> np.ndarray:
        parts = index if isinstance(index, tuple) else (index,)
        if self.ndim and parts and isinstance(parts[0], slice):
            start, stop, step = parts[0].indices(self.shape[0])
            if step == 1 and stop > start:  # only the rows selected are read
                picked: np.ndarray = self._rows(start, stop)[(slice(None), *parts[1:])]
                return picked
        chosen: np.ndarray = np.asarray(self)[index]
        return chosen

    def read_into(self, index: Any, out: np.ndarray) -> bool:
        """Read ``self[index]`` straight into ``out`` (one copy, from the page cache into
        ``out``) where ``index`` selects whole rows (a step-1 range of the first axis, all
        of the others) and ``out`` is a C-contiguous array of the tensor's dtype; False
        (nothing read) otherwise."""
        parts = index if isinstance(index, tuple) else (index,)
        if not self.ndim or not parts or not isinstance(parts[0], slice):
            return False
        start, stop, step = parts[0].indices(self.shape[0])
        whole = all(
            isinstance(p, slice) and p.indices(n) == (0, n, 1)
            for p, n in zip(parts[1:], self.shape[1:])
        )
        if (
            step != 1
            or stop <= start
            or not whole
            or out.dtype != self.dtype.newbyteorder("<")
            or not out.flags.c_contiguous
            or out.shape != (stop - start, *self.shape[1:])
        ):
            return False
        self._fill(out.reshape(-1).view(np.uint8), start)
        return True

    def _rows(self, start: int, stop: int) -> np.ndarray:
        kept = self._kept
        if kept is not None and kept[0] <= start and stop <= kept[1]:
            return kept[2][start - kept[0] : stop - kept[0]]
        arr = self._read(start, stop)
        self._kept = (start, stop, arr)
        return arr

    def _read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` (all of a 0-d tensor) in a new array."""
        e = self._e
        shape = (stop - start, *e.shape[1:]) if e.shape else ()
        buf = aligned_empty(math.prod(shape) * e.dtype.itemsize)
        self._fill(buf, start)
        return buf.view(e.dtype.newbyteorder("<")).reshape(shape)

    def _fill(self, buf: np.ndarray, start: int) -> None:
        """``buf`` (uint8) filled with the tensor's bytes from row ``start`` on."""
        e = self._e
        row = math.prod(e.shape[1:]) * e.dtype.itemsize if e.shape else 0
        view, got, offset = buf.data, 0, e.start + start * row
        while got < buf.size:
            n = os.preadv(self._fileno, [view[got : got + CHUNK]], offset + got)
            if not n:
                raise CheckpointError(
                    f"Checkpoint '{self._path}' is truncated inside tensor '{e.name}': the "
                    "file shrank while it was read (replaced in place, e.g. by a download "
                    "or cp). Read it again once it is complete."
                )
            got += n
        if e.code == "BOOL" and buf.size and buf.max() > 1:
            raise CheckpointError(
                f"Checkpoint '{self._path}' is corrupt: bool tensor '{e.name}' holds bytes "
                "other than 0 and 1."
            )


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

    def view(self, name: str) -> FileTensor | None:
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
    """The shard ``file`` of ``index``: a plain file name in the index's directory (no path
    separator, no ``..``, no NUL byte), which may be a symbolic link, followed wherever it
    points: Hugging Face's cache keeps each shard as a link into ``../../blobs`` (issue 36
    item 14), and a single file that is a link is followed too. The index is text anyone
    can edit, so its names never leave the directory; a link there was made by whoever
    made the directory, as for any file a user points paramstore at. What the link
    reaches is still refused unless it is a regular file (``open_regular``)."""
    separators = {"/", "\\", os.sep, os.altsep or "/"}
    if (
        not file
        or file in (".", "..")
        or "\0" in file
        or any(sep in file for sep in separators)
        or os.path.isabs(file)
    ):
        raise CheckpointError(
            f"Hugging Face index '{index}' names shard file {file!r}, which is not a file name "
            "inside its directory (a path separator, '..' and a NUL byte are refused); fix "
            "the index."
        )
    path = os.path.join(directory, file)
    if not os.path.exists(path):
        raise CheckpointError(
            f"Hugging Face index '{index}' names shard file '{file}', which does not exist"
            f"{' (a link to nothing)' if os.path.islink(path) else ''}; the checkpoint is "
            "incomplete (download or copy every shard)."
        )
    try:
        return PlainSafetensors(path, allow_unverified=True)
    except OSError as e:  # e.g. a link loop, or a permission
        raise CheckpointError(
            f"Hugging Face index '{index}' names shard file '{file}', which cannot be read "
            f"({e.strerror or e})."
        ) from None


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
