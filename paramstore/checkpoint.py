"""Checkpoints: ``Saver``, ``CheckpointManager``, ``list_variables``, ``load_variable``.

Contract (the file format is described in docs/checkpoints.md):

* A checkpoint is one standard safetensors file (readable by ``safetensors.safe_open``):
  an 8-byte little-endian header length, a JSON header, then the raw little-endian bytes
  of each tensor. paramstore adds, in the header's ``__metadata__``, a format version and,
  per tensor, a CRC-32 of its bytes (checked on every load) and the true dtype and shape of
  the tensors that safetensors cannot describe (strings, complex128, ...). Nothing is ever
  pickled or executed on load; every size in the header is checked against the file.
* ``Saver(var_list)`` saves and restores a fixed set of variables under fixed names: ``None``
  is every live variable of the store that was the default when the Saver was made (listed
  at each call), a dict maps checkpoint names to variables, a list or Module uses each
  variable's full name.
* Saving is atomic: the file is written under a temporary name in the same directory,
  fsynced, renamed over the target and the directory fsynced. A crash leaves either the old
  file or the new one, never a half-written file under the checkpoint's name. Tensors are
  streamed to the file one at a time (no second in-memory copy of the state).
* Restoring validates everything (names present, shapes, dtypes, file sizes, checksums)
  and loads every tensor before it assigns any variable: on any error no variable changes.
  Each value is ``jax.device_put`` onto the variable's current sharding.
* ``CheckpointManager`` keeps the newest ``max_to_keep`` checkpoints ``ckpt-<step>.safetensors``
  of a directory. The directory itself is the index (it is scanned, temporary files are
  ignored and stale ones removed), so a new manager continues where an old one stopped.
  With ``async_save=True`` the host copy is taken inside ``save`` and the file written by a
  background thread; ``wait()`` (also run at interpreter exit) flushes it and re-raises
  the error of a failed background write, as does the next ``save``.
* Sharded checkpoints (docs/sharding.md): where ``jax.process_count() > 1``, or with
  ``Saver(..., sharded=True)``, a checkpoint is instead an Orbax directory (see
  ``paramstore._orbax``) in which each process writes only its own shards; the same
  ``Saver``/``CheckpointManager``/``list_variables``/``load_variable`` API reads and writes
  it, and restoring recognises the format from what is on disk. ``restore(...,
  sharding=...)`` restores onto new shardings (another mesh), checked before anything is
  read.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import math
import operator
import os
import queue
import re
import secrets
import shutil
import struct
import sys
import threading
import weakref
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO

import jax
import ml_dtypes
import numpy as np

from paramstore import _orbax, _trace
from paramstore import sharding as _sharding
from paramstore.module import Module
from paramstore.scope import VariableStore, default_store
from paramstore.variable import Variable

__all__ = [
    "Saver",
    "CheckpointManager",
    "CheckpointError",
    "list_variables",
    "load_variable",
    "inspect_main",
    "write_arrays",
    "read_arrays",
    "FORMAT_VERSION",
]

FORMAT_VERSION = 1
"""The paramstore layout version written in ``__metadata__["paramstore.format_version"]``."""

_KEY_VERSION = "paramstore.format_version"
_KEY_TENSORS = "paramstore.tensors"
_MAX_HEADER = 100 * 2**20  # the safetensors library's own limit
_CHUNK = 16 * 2**20  # bytes per write/read call and checksum job
_PARALLEL_MIN = 2**20  # smaller buffers are checksummed inline
_BUFFER = 2**20  # write buffer, for many small tensors
_STRING = np.dtypes.StringDType()
_NO_CRC = "00000000"

PathLike = str | os.PathLike[str]


class CheckpointError(ValueError):
    """A checkpoint file is malformed, corrupt, or does not fit the variables."""


# ------------------------------------------------------------------------------- dtypes

# safetensors dtype codes with a NumPy equivalent. Any other fixed-size dtype (complex128,
# int4, the other float8 types...) is stored as raw bytes ("U8") with its true dtype in the
# metadata; so are strings (see _encode_strings).
_CODES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "C64": np.dtype(np.complex64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_CODE_OF = {dt: code for code, dt in _CODES.items()}


def _dtype_from_name(name: Any) -> np.dtype:
    """The dtype a metadata entry names: ``"string"`` or a fixed-size numeric dtype name."""
    if name == "string":
        return _STRING
    dt: np.dtype | None = None
    if isinstance(name, str) and name.isidentifier():
        with contextlib.suppress(TypeError):
            dt = np.dtype(getattr(ml_dtypes, name, name))
    if dt is None or dt.name != name or not _storable(dt):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _storable(dt: np.dtype) -> bool:
    """A fixed-size numeric dtype: NumPy's bool/int/uint/float/complex, or an ml_dtypes type."""
    return (dt.kind in "biufc" and dt.shape == () and dt.names is None) or _is_ml_dtype(dt)


def _is_ml_dtype(dt: np.dtype) -> bool:
    return dt.type.__module__.startswith("ml_dtypes")


def _is_string(dt: np.dtype) -> bool:
    return isinstance(dt, np.dtypes.StringDType)


def _dtype_name(dt: np.dtype) -> str:
    return "string" if _is_string(dt) else dt.name


def _little_endian(arr: np.ndarray) -> np.ndarray:
    """``arr`` as C-contiguous little-endian bytes' owner (a view when it already is)."""
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and sys.byteorder == "big"):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr)


# ----------------------------------------------------------------------------- encoding


@dataclasses.dataclass
class _Tensor:
    """One tensor as stored: safetensors code and shape, its bytes, and for raw or string
    data (``special``) the logical dtype name and shape that go in the metadata."""

    name: str
    code: str
    stored_shape: tuple[int, ...]
    data: memoryview  # flat, format "B"
    special: tuple[str, tuple[int, ...]] | None
    itemsize: int


def _encode(name: str, arr: np.ndarray) -> _Tensor:
    """The stored form of ``arr``: itself if safetensors has its dtype, else its raw bytes."""
    shape = tuple(map(int, arr.shape))
    dtype = arr.dtype
    if _is_string(dtype):
        blob = _encode_strings(arr)
        return _Tensor(name, "U8", (blob.size,), blob.data, ("string", shape), 1)
    if not _storable(dtype):
        raise CheckpointError(
            f"Cannot save '{name}': dtype {dtype} is not a numeric or string dtype."
        )
    flat = _little_endian(arr).reshape(-1).view(np.uint8)
    code = _CODE_OF.get(dtype if dtype.isnative else dtype.newbyteorder("="))
    if code is None:
        special = (dtype.name, shape)
        return _Tensor(name, "U8", (flat.size,), flat.data, special, dtype.itemsize)
    return _Tensor(name, code, shape, flat.data, None, dtype.itemsize)


def _encode_strings(arr: np.ndarray) -> np.ndarray:
    """n little-endian int64 end offsets, then the n strings' UTF-8 bytes (n = arr.size)."""
    encoded = [s.encode("utf-8") for s in arr.reshape(-1).tolist()]
    ends = np.cumsum([len(b) for b in encoded], dtype="<i8")
    return np.frombuffer(ends.tobytes() + b"".join(encoded), dtype=np.uint8)


def _decode_strings(blob: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    n = math.prod(shape)
    if blob.size < 8 * n:
        raise ValueError(f"string data of {blob.size} bytes cannot hold {n} offsets")
    ends = blob[: 8 * n].view("<i8").astype(np.int64)
    text = blob[8 * n :].tobytes()
    starts = np.concatenate([np.zeros(1, np.int64), ends[:-1]])[:n]
    if (ends[-1] if n else 0) != len(text) or np.any(ends < starts):
        raise ValueError("string offsets are not increasing or do not cover the data")
    try:
        items = [text[s:e].decode("utf-8") for s, e in zip(starts.tolist(), ends.tolist())]
    except UnicodeDecodeError as e:
        raise ValueError(f"string data is not UTF-8 ({e})") from None
    out = np.array(items, dtype=_STRING).reshape(shape)
    out.flags.writeable = False
    return out


# ---------------------------------------------------------------------------- checksums


class _Checksums:
    """CRC-32s computed beside the file I/O. Buffers of at least ``_PARALLEL_MIN`` bytes go
    to one worker thread (zlib releases the GIL); smaller ones are computed inline, where a
    thread hand-off would cost more. The worker starts with the first big buffer, or with
    ``deferred`` only at ``start()``: a writer starts it when its data goes to disk, so the
    checksums use the CPU while the disk flushes rather than competing with the copies into
    the page cache."""

    def __init__(self, deferred: bool = False) -> None:
        self._deferred = deferred
        self._crcs: dict[Any, int] = {}
        self._jobs: queue.SimpleQueue[tuple[Any, memoryview] | None] = queue.SimpleQueue()
        self._queued = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def __enter__(self) -> _Checksums:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    @property
    def queued(self) -> bool:
        """Whether some buffers are (or were) left to the worker thread."""
        return self._queued

    def add(self, key: Any, data: memoryview) -> None:
        """Checksum ``data`` (appending to earlier data of the same ``key``)."""
        if data.nbytes < _PARALLEL_MIN:
            self._crcs[key] = zlib.crc32(data, self._crcs.get(key, 0))
            return
        self._jobs.put((key, data))
        self._queued = True
        if not self._deferred:
            self.start()

    def start(self) -> None:
        """Start the worker on the queued buffers (once)."""
        if self._queued and self._thread is None:
            self._thread = threading.Thread(target=self._work, name="paramstore-crc32", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            key, data = job
            try:
                self._crcs[key] = zlib.crc32(data, self._crcs.get(key, 0))
            except BaseException as e:  # pragma: no cover - zlib does not fail on buffers
                self._error = e

    def _stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def result(self) -> dict[Any, str]:
        """``{key: 8 hex digits}`` once every checksum is done."""
        self.start()
        self._stop()
        if self._error is not None:
            raise self._error
        return {k: f"{c:08x}" for k, c in self._crcs.items()}


# ------------------------------------------------------------------------------- header


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One tensor of a file's header, checked against the file's size."""

    name: str
    code: str
    start: int  # absolute file offsets
    end: int
    dtype: np.dtype  # logical
    shape: tuple[int, ...]  # logical
    crc: str | None

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _build_header(tensors: Sequence[_Tensor], crcs: Mapping[str, str]) -> bytes:
    """The padded header (8-byte length + JSON); its length does not depend on ``crcs``."""
    header: dict[str, Any] = {}
    extra: dict[str, dict[str, Any]] = {}
    offset = 0
    for t in tensors:
        end = offset + t.data.nbytes
        header[t.name] = {"dtype": t.code, "shape": t.stored_shape, "data_offsets": (offset, end)}
        offset = end
        info: dict[str, Any] = {"crc32": crcs.get(t.name, _NO_CRC)}
        if t.special is not None:
            info["dtype"], info["shape"] = t.special
        extra[t.name] = info
    meta = {
        _KEY_VERSION: str(FORMAT_VERSION),
        _KEY_TENSORS: json.dumps(extra, separators=(",", ":")),
    }
    text = json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the header names {key!r} twice")
        out[key] = value
    return out


def _read_header(f: BinaryIO, size: int) -> tuple[dict[str, _Entry], dict[str, str]]:
    """Parse and bounds-check the header of an open file of ``size`` bytes (ValueError)."""
    if size < 8:
        raise ValueError(f"the file has {size} bytes, less than the 8-byte header length")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > min(_MAX_HEADER, size - 8):
        raise ValueError(f"the header length {n} exceeds the file ({size} bytes) or 100 MiB")
    raw = f.read(n)
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("__metadata__ is not a map of strings")
    extra = _paramstore_metadata(meta)
    base = 8 + n
    entries = {name: _parse_entry(name, e, base, extra.get(name)) for name, e in header.items()}
    _check_layout(entries, base, size)
    return entries, meta


def _paramstore_metadata(meta: Mapping[str, str]) -> dict[str, Any]:
    """The per-tensor paramstore metadata ({} for a plain safetensors file)."""
    version = meta.get(_KEY_VERSION)
    if version is None:
        return {}
    if version != str(FORMAT_VERSION):
        raise ValueError(
            f"paramstore format version {version} is not supported (this paramstore reads "
            f"version {FORMAT_VERSION}); upgrade paramstore"
        )
    try:
        extra = json.loads(meta.get(_KEY_TENSORS, "{}"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{_KEY_TENSORS} is not valid JSON ({e})") from None
    if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
        raise ValueError(f"{_KEY_TENSORS} is not a map of objects")
    return extra


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(d) is int and 0 <= d < 2**62 for d in value):
        raise ValueError(f"{what} {value!r} is not a list of non-negative integers")
    return tuple(value)


def _parse_entry(name: str, e: Any, base: int, extra: dict[str, Any] | None) -> _Entry:
    if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
        raise ValueError(f"the entry of '{name}' lacks dtype, shape or data_offsets")
    code = e["dtype"]
    if not isinstance(code, str) or code not in _CODES:
        raise ValueError(f"'{name}' has dtype {code!r}, which paramstore cannot read")
    stored_shape = _shape(e["shape"], f"the shape of '{name}'")
    offsets = e["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
    ):
        raise ValueError(f"the data_offsets of '{name}' are not two non-negative integers")
    start, end = offsets
    want = math.prod(stored_shape) * _CODES[code].itemsize
    if end - start != want:
        raise ValueError(
            f"'{name}' has data_offsets {offsets} ({end - start} bytes) but dtype {code} and "
            f"shape {list(stored_shape)} need {want} bytes"
        )
    extra = extra or {}
    dtype, shape = _CODES[code], stored_shape
    if "dtype" in extra:
        dtype, shape = _logical(name, code, stored_shape, extra)
    crc = extra.get("crc32")
    if crc is not None and not (isinstance(crc, str) and _HEX8.fullmatch(crc)):
        raise ValueError(f"the crc32 of '{name}' is not 8 hex digits: {crc!r}")
    return _Entry(name, code, base + start, base + end, dtype, shape, crc)


_HEX8 = re.compile(r"[0-9a-f]{8}")


def _logical(
    name: str, code: str, stored_shape: tuple[int, ...], extra: dict[str, Any]
) -> tuple[np.dtype, tuple[int, ...]]:
    """The true dtype and shape of a tensor stored as raw bytes or string data."""
    try:
        dtype = _dtype_from_name(extra["dtype"])
    except ValueError as e:
        raise ValueError(f"'{name}': {e}") from None
    shape = _shape(extra.get("shape"), f"the logical shape of '{name}'")
    if code != "U8" or len(stored_shape) != 1:
        raise ValueError(f"'{name}' is {extra['dtype']} data but not stored as 1-D U8")
    if not _is_string(dtype):
        want = math.prod(shape) * dtype.itemsize
        if want != stored_shape[0]:
            raise ValueError(
                f"'{name}' of dtype {dtype.name} and shape {list(shape)} needs {want} bytes, "
                f"but {stored_shape[0]} are stored"
            )
    return dtype, shape


def _check_layout(entries: Mapping[str, _Entry], base: int, size: int) -> None:
    """Tensors must tile the data section exactly: no gap, overlap, or byte past the end."""
    pos = base
    for e in sorted(entries.values(), key=lambda e: (e.start, e.end)):
        if e.start != pos:
            raise ValueError(
                f"'{e.name}' starts at byte {e.start - base} of the data, expected {pos - base} "
                "(tensors overlap or leave a gap)"
            )
        pos = e.end
    if pos != size:
        what = "truncated" if pos > size else "longer than its header says"
        raise ValueError(f"the file is {what}: the header needs {pos} bytes, the file has {size}")


# ------------------------------------------------------------------------------ writing


def _temp_path(path: str) -> str:
    head, base = os.path.split(path)
    return os.path.join(head, f".{base}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


_TEMP_RE = re.compile(r"^\.(?P<base>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}$")


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_arrays(path: PathLike, arrays: Mapping[str, np.ndarray]) -> str:
    """Atomically write ``arrays`` ({name: NumPy array}) as a checkpoint file at ``path``.

    Streams: the header (with placeholder checksums of the same length) goes first, then
    each tensor's bytes while their CRC-32s are computed beside the writes, then the final
    header over the placeholder; fsync, rename over ``path``, fsync the directory. Only a
    string tensor is ever encoded into a new buffer. Returns ``path`` as a string.
    """
    path = os.fspath(path)
    for name in arrays:
        _check_name(name)
    tensors = [_encode(name, np.asarray(a)) for name, a in arrays.items()]
    tensors.sort(key=lambda t: -t.itemsize)  # so each tensor starts aligned to its itemsize
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = _temp_path(path)
    try:
        with open(tmp, "xb", buffering=_BUFFER) as f:
            f.write(_build_header(tensors, {}))
            with _Checksums(deferred=True) as checksums:
                for t in tensors:
                    _write_tensor(f, t, checksums)
                if checksums.queued:  # checksum the big tensors while the data goes to disk
                    checksums.start()
                    f.flush()
                    _datasync(f.fileno())
                crcs = checksums.result()
            f.seek(0)
            f.write(_build_header(tensors, crcs))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)
    return path


def _datasync(fd: int) -> None:
    getattr(os, "fdatasync", os.fsync)(fd)


def _write_tensor(f: BinaryIO, t: _Tensor, checksums: _Checksums) -> None:
    if not t.data.nbytes:
        checksums.add(t.name, t.data)
    for i in range(0, t.data.nbytes, _CHUNK):
        chunk = t.data[i : i + _CHUNK]
        checksums.add(t.name, chunk)
        f.write(chunk)


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"A checkpoint name must be a non-empty str, got {name!r}.")
    if name == "__metadata__":
        raise CheckpointError("'__metadata__' is reserved by safetensors; rename the variable.")


# ------------------------------------------------------------------------------ reading


def _aligned_empty(nbytes: int) -> np.ndarray:
    """A new uint8 buffer aligned to 64 bytes, which jax on CPU can adopt without a copy."""
    raw = np.empty(nbytes + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + nbytes]


class _Reader:
    """An open checkpoint file with its checked header; ``load``/``load_many`` read tensors
    and verify their checksums."""

    def __init__(self, path: PathLike) -> None:
        self.path = _resolve(path)
        self._f: BinaryIO = open(self.path, "rb", buffering=0)  # noqa: SIM115 - see close()
        try:
            size = os.fstat(self._f.fileno()).st_size
            self.entries, self.metadata = _read_header(self._f, size)
        except ValueError as e:
            self._f.close()
            raise CheckpointError(f"Checkpoint '{self.path}' is corrupt: {e}.") from None
        except BaseException:
            self._f.close()
            raise

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    def entry(self, name: str) -> _Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise CheckpointError(
                f"Checkpoint '{self.path}' has no variable '{name}'"
                f"{_suggest(name, self.entries)}. Its variables: "
                f"{_preview(sorted(self.entries))}."
            ) from None

    def load(self, name: str) -> np.ndarray:
        """The verified value of tensor ``name`` (CheckpointError if absent or corrupt)."""
        return dict(self.load_many([name]))[name]

    def load_many(self, names: Iterable[str]) -> Iterator[tuple[str, np.ndarray]]:
        """``(name, value)`` for each name, in file order, as soon as each is read.

        Checksums are computed beside the reads and verified after the last item: the
        iterator raises CheckpointError instead of finishing if any fails, so a consumer
        must not act on the values before the iteration ends (``Saver.restore`` assigns
        only then). ``load`` and ``dict(load_many(...))`` are always verified.
        """
        entries = sorted((self.entry(n) for n in names), key=lambda e: e.start)
        with _Checksums() as checksums:
            for e in entries:
                yield self._decoded(e, self._read(e, checksums))
            crcs = checksums.result()
        for e in entries:
            if e.crc is not None and crcs[e.name] != e.crc:
                raise CheckpointError(
                    f"Checkpoint '{self.path}' is corrupt: the data of variable '{e.name}' "
                    f"fails its checksum (crc32 {crcs[e.name]}, expected {e.crc}). "
                    "Restore an older checkpoint."
                )

    def _read(self, e: _Entry, checksums: _Checksums) -> np.ndarray:
        buf = _aligned_empty(e.nbytes)
        view = buf.data
        self._f.seek(e.start)
        got = 0
        if not e.nbytes:
            checksums.add(e.name, view)
        while got < e.nbytes:
            n = self._f.readinto(view[got : got + _CHUNK])  # type: ignore[attr-defined]
            if not n:
                raise CheckpointError(
                    f"Checkpoint '{self.path}' is truncated inside variable '{e.name}'."
                )
            checksums.add(e.name, view[got : got + n])
            got += n
        return buf

    def _decoded(self, e: _Entry, buf: np.ndarray) -> tuple[str, np.ndarray]:
        try:
            return e.name, _decode(e, buf)
        except ValueError as err:
            raise CheckpointError(
                f"Checkpoint '{self.path}' is corrupt: variable '{e.name}': {err}."
            ) from None


def _decode(e: _Entry, buf: np.ndarray) -> np.ndarray:
    if _is_string(e.dtype):
        return _decode_strings(buf, e.shape)
    if e.code == "BOOL" and buf.size and buf.max() > 1:
        raise ValueError("bool data holds bytes other than 0 and 1")
    if sys.byteorder == "little":
        return buf.view(e.dtype).reshape(e.shape)
    return buf.view(e.dtype.newbyteorder("<")).reshape(e.shape).astype(e.dtype)


def _suggest(name: str, names: Iterable[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _preview(names: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "") or "none"


def _resolve(path: PathLike) -> str:
    """A checkpoint file: ``path`` itself, or the latest checkpoint of a manager directory."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if _orbax.is_checkpoint(path):
            return path
        found = _scan(path)
        if not found:
            raise FileNotFoundError(
                f"No checkpoint in directory '{path}' (expected ckpt-<step>.safetensors files "
                "or ckpt-<step> sharded checkpoint directories written by a "
                "CheckpointManager)."
            )
        return found[-1][1]
    if not os.path.exists(path):
        raise FileNotFoundError(f"No checkpoint file or directory '{path}'.")
    return path


def list_variables(path: PathLike) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """``[(name, shape, dtype)]`` of a checkpoint, sorted by name, read from its header only.

    ``path`` is a checkpoint file or a CheckpointManager directory (its latest checkpoint).
    String variables have dtype ``np.dtypes.StringDType()``. Works on sharded (Orbax)
    checkpoints too, from their metadata alone.
    """
    resolved = _resolve(path)
    if os.path.isdir(resolved):
        entries = _sharded_entries(resolved)
        return sorted((e["name"], e["shape"], e["dtype"]) for e in entries.values())
    with _Reader(resolved) as r:
        return [(e.name, e.shape, e.dtype) for e in sorted(r.entries.values(), key=_by_name)]


def _by_name(e: _Entry) -> str:
    return e.name


def load_variable(path: PathLike, name: str) -> np.ndarray:
    """The value of variable ``name`` in a checkpoint (file or manager directory), checked
    against its checksum. Raises CheckpointError if absent or corrupt."""
    resolved = _resolve(path)
    if os.path.isdir(resolved):
        entries = _sharded_entries(resolved)
        if name not in entries:
            raise CheckpointError(
                f"Checkpoint '{resolved}' has no variable '{name}'{_suggest(name, entries)}. "
                f"Its variables: {_preview(sorted(entries))}."
            )
        return _sharded_load(resolved, {name: (entries[name], None)})[name]
    with _Reader(resolved) as r:
        return r.load(name)


def read_arrays(path: PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint as ``{name: NumPy array}`` (checksums verified)."""
    resolved = _resolve(path)
    if os.path.isdir(resolved):
        entries = _sharded_entries(resolved)
        return _sharded_load(resolved, {n: (e, None) for n, e in entries.items()})
    with _Reader(resolved) as r:
        return dict(r.load_many(r.entries))


# -------------------------------------------------------------------------------- Saver


class Saver:
    """Saves and restores variables as safetensors checkpoints (see the module docstring).

    ``var_list``: None (every live variable of the current default store, listed at each
    save/restore), a ``{checkpoint_name: Variable}`` dict, a list of Variables, or a Module
    (both keyed by ``v.name``).

    ``sharded``: the format ``save`` writes. None (the default) picks a sharded Orbax
    checkpoint (a directory; each process writes its own shards) when
    ``jax.process_count() > 1`` and a single safetensors file otherwise; True always
    writes the sharded format, False always the single file (an error with several
    processes). ``restore`` reads either.
    """

    def __init__(self, var_list: Any = None, *, sharded: bool | None = None) -> None:
        if sharded is not None and not isinstance(sharded, bool):
            raise TypeError(f"Saver: sharded must be None, True or False, got {sharded!r}.")
        self.sharded = sharded
        self._store: VariableStore | None = None
        self._module: Module | None = None
        self._fixed: dict[str, Variable] | None = None
        if var_list is None:
            self._store = default_store()
        elif isinstance(var_list, Module):
            self._module = var_list
        elif isinstance(var_list, Mapping):
            self._fixed = dict(var_list)
        elif isinstance(var_list, (list, tuple)):
            self._fixed = _by_full_name(var_list)
        else:
            raise TypeError(
                "Saver(var_list) takes None, a dict {name: Variable}, a list of Variables or "
                f"a ps.Module, got {type(var_list).__name__}."
            )
        self._mapping()  # validate now

    def _mapping(self) -> dict[str, Variable]:
        """``{checkpoint_name: Variable}`` as it stands now."""
        if self._store is not None:
            out = _by_full_name(self._store.variables())
        elif self._module is not None:
            out = _by_full_name(self._module.variables)
        else:
            assert self._fixed is not None
            out = self._fixed
        for name, v in out.items():
            _check_name(name)
            if not isinstance(v, Variable):
                raise TypeError(f"Saver: '{name}' maps to a {type(v).__name__}, not a ps.Variable.")
        return out

    # -- saving
    def save(self, path: PathLike, step: int | None = None) -> str:
        """Write the variables to ``path`` (``f"{path}-{step}"`` with ``step``) atomically:
        a file, or a directory for a sharded checkpoint (see ``sharded``). Every process
        of a multi-process run must call it. Returns the path written."""
        path = os.fspath(path)
        if step is not None:
            path = f"{path}-{operator.index(step)}"
        if self._writes_sharded():
            return _orbax.save(path, self._device_values())
        return write_arrays(path, self._snapshot(copy=False))

    def _writes_sharded(self) -> bool:
        """Whether ``save`` writes the sharded (Orbax) format now."""
        if self.sharded is None:
            return jax.process_count() > 1
        if not self.sharded and jax.process_count() > 1:
            raise CheckpointError(
                f"Saver(sharded=False) writes one file, which {jax.process_count()} "
                "processes cannot share; use sharded=True (or None, the default), in which "
                "each process writes its own shards."
            )
        return self.sharded

    def _device_values(self) -> dict[str, Any]:
        """``{checkpoint_name: jax.Array or NumPy string array}``, for a sharded save."""
        _outside_traces("save")
        return {name: _current(name, v, sharded=True) for name, v in self._mapping().items()}

    def _snapshot(self, copy: bool) -> dict[str, np.ndarray]:
        """Host copies of the values, ``{checkpoint_name: np.ndarray}``. With ``copy=False``
        an array may still share the device buffer (CPU); ``copy=True`` makes it independent."""
        _outside_traces("save")
        mapping = self._mapping()
        values = {name: _current(name, v) for name, v in mapping.items()}
        if jax.default_backend() != "cpu":  # start every transfer before waiting on any
            for x in values.values():
                if isinstance(x, jax.Array):
                    x.copy_to_host_async()
        return {name: _to_host(name, x, copy) for name, x in values.items()}

    # -- restoring
    def restore(
        self, path: PathLike, allow_missing: bool = False, *, sharding: Any = None
    ) -> list[Variable]:
        """Fill the variables in place from a checkpoint (a file, a sharded checkpoint
        directory, or a manager directory: its latest).

        Everything is validated and loaded before any variable is assigned; on error no
        variable changes. Raises CheckpointError for a name missing from the file (unless
        ``allow_missing``), a shape or dtype that differs, or a corrupt file. Returns the
        variables skipped because the file lacks them (empty without ``allow_missing``).

        Each value lands on its variable's current sharding, or, with ``sharding``, on a
        new one, which the variable then keeps: a ``Sharding`` or ``Mesh`` (replicated) for
        all, a dict ``{variable name: Sharding}``, or a function ``variable -> Sharding |
        None`` (as for ``ps.sharding.reshard``). A target that does not fit its variable's
        shape raises ValueError before anything is read.
        """
        _outside_traces("restore")
        mapping = self._mapping()
        moves: dict[int, Any] = {}
        if sharding is not None:
            for v, sh in _sharding.plan(list(mapping.values()), sharding):
                moves[id(v)] = sh
        resolved = _resolve(path)
        if os.path.isdir(resolved):
            return self._restore_sharded(resolved, mapping, allow_missing, moves)
        with _Reader(resolved) as r:
            present = {n: v for n, v in mapping.items() if n in r.entries}
            skipped = [v for n, v in mapping.items() if n not in r.entries]
            if skipped and not allow_missing:
                missing = [n for n in mapping if n not in r.entries]
                raise CheckpointError(
                    f"Checkpoint '{r.path}' lacks {len(missing)} variable(s) of this Saver: "
                    f"{_preview(missing)}{_suggest(missing[0], r.entries)}. Pass "
                    "allow_missing=True to restore the others."
                )
            for name, v in present.items():
                _check_fits(r.path, r.entries[name], v)
                _check_assignable(name, v)
            values = _load_placed(r, present, moves)
        _assign_all(present, values, moves)
        return skipped

    def _restore_sharded(
        self,
        path: str,
        mapping: dict[str, Variable],
        allow_missing: bool,
        moves: Mapping[int, Any],
    ) -> list[Variable]:
        entries = _sharded_entries(path)
        present = {n: v for n, v in mapping.items() if n in entries}
        skipped = [v for n, v in mapping.items() if n not in entries]
        if skipped and not allow_missing:
            missing = [n for n in mapping if n not in entries]
            raise CheckpointError(
                f"Checkpoint '{path}' lacks {len(missing)} variable(s) of this Saver: "
                f"{_preview(missing)}{_suggest(missing[0], entries)}. Pass "
                "allow_missing=True to restore the others."
            )
        wanted = {}
        for name, v in present.items():
            e = entries[name]
            if e["shape"] != tuple(v.shape) or e["dtype"] != v.dtype:
                raise CheckpointError(_mismatch(path, name, e["shape"], e["dtype"], v))
            _check_assignable(name, v)
            wanted[name] = (e, None if _is_string(v.dtype) else moves.get(id(v), v.sharding))
        _assign_all(present, _sharded_load(path, wanted), moves)
        return skipped


def _assign_all(
    present: Mapping[str, Variable], values: Mapping[str, Any], moves: Mapping[int, Any]
) -> None:
    """Assign every loaded value (cannot fail: exact shapes, dtypes, placement); a variable
    restored onto a new sharding (``moves``) takes the value's placement."""
    for name, value in values.items():
        v = present[name]
        if id(v) in moves:
            with v._lock:
                v._value = value
        else:
            v.assign(value, read_value=False)


def _sharded_entries(path: str) -> dict[str, dict[str, Any]]:
    try:
        return {e["name"]: e for e in _orbax.read_metadata(path)}
    except _orbax.FormatError as e:
        raise CheckpointError(f"Checkpoint '{path}' is not readable: {e}.") from None


def _sharded_load(path: str, wanted: Mapping[str, tuple[dict[str, Any], Any]]) -> dict[str, Any]:
    try:
        return _orbax.load(path, wanted)
    except ImportError:
        raise
    except Exception as e:  # Orbax / TensorStore: missing or corrupt array data
        raise CheckpointError(
            f"Checkpoint '{path}' could not be read ({type(e).__name__}: {e}). Restore "
            "another checkpoint."
        ) from e


def _by_full_name(variables: Iterable[Any]) -> dict[str, Variable]:
    out: dict[str, Variable] = {}
    for v in variables:
        if not isinstance(v, Variable):
            raise TypeError(f"Saver: expected ps.Variable, got {type(v).__name__}.")
        if v.name in out and out[v.name] is not v:
            raise ValueError(
                f"Saver: two different variables are named '{v.name}' (from different "
                "stores?); pass a dict {checkpoint_name: variable} to name them."
            )
        out[v.name] = v
    return out


def _outside_traces(what: str) -> None:
    if _trace.active():
        raise CheckpointError(
            f"Cannot {what} a checkpoint inside a traced function (ps.function, ps.pure, "
            "ps.grad): it would run once, at trace time, with trace-time values. Call it "
            "outside the compiled step."
        )


def _current(name: str, v: Any, sharded: bool = False) -> Any:
    x = v.value()
    if isinstance(x, jax.core.Tracer):
        raise CheckpointError(
            f"Cannot save variable '{name}' inside a traced function (jax.jit, jax.grad...): "
            "its value is not known there. Save outside the compiled step."
        )
    if not sharded and isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise CheckpointError(
            f"Variable '{name}' spans several processes, so no process can write it to one "
            "file: save a sharded checkpoint (Saver(..., sharded=True), the default when "
            "jax.process_count() > 1)."
        )
    return x


def _to_host(name: str, x: Any, copy: bool) -> np.ndarray:
    if not isinstance(x, jax.Array):
        return np.asarray(x)  # strings: immutable NumPy arrays, swapped (never mutated) on assign
    arr = np.asarray(x)
    if copy and any(d.platform == "cpu" for d in x.devices()):
        arr = arr.copy()  # on CPU np.asarray shares the device buffer, which a donation may reuse
    return arr


def _check_assignable(name: str, v: Variable) -> None:
    if v._detached:
        raise TypeError(
            f"Saver: '{name}' is a detached copy of variable '{v.name}' (it went through a "
            "JAX transformation as a pytree) and cannot be assigned; restore the original."
        )


def _check_fits(path: str, e: _Entry, v: Variable) -> None:
    if e.shape != tuple(v.shape) or e.dtype != v.dtype:
        raise CheckpointError(_mismatch(path, e.name, e.shape, e.dtype, v))


def _mismatch(path: str, name: str, shape: tuple[int, ...], dtype: np.dtype, v: Variable) -> str:
    return (
        f"Checkpoint '{path}' holds '{name}' with shape {shape} and dtype "
        f"{_dtype_name(dtype)}, but variable '{v.name}' has shape {tuple(v.shape)} and "
        f"dtype {_dtype_name(v.dtype)}. Restore into a model built with the same "
        "configuration, or leave this variable out of the Saver."
    )


def _load_placed(
    r: _Reader, variables: Mapping[str, Variable], moves: Mapping[int, Any]
) -> dict[str, Any]:
    """Each tensor, verified, and put where its variable lives or moves to (``device_put``
    in batches of ``_CHUNK`` bytes, so host memory holds at most a batch beyond what jax
    keeps)."""
    out: dict[str, Any] = {}
    batch: list[tuple[str, np.ndarray, Any]] = []
    size = 0
    for name, arr in r.load_many(variables):  # raises at the end if a checksum fails
        v = variables[name]
        if _is_string(v.dtype):
            out[name] = arr
            continue
        batch.append((name, arr, moves.get(id(v), v.sharding)))
        size += arr.nbytes
        if size >= _CHUNK:
            out.update(_put(batch))
            batch, size = [], 0
    out.update(_put(batch))
    return out


def _put(batch: list[tuple[str, np.ndarray, Any]]) -> dict[str, Any]:
    if not batch:
        return {}
    names, arrays, shardings = zip(*batch)
    placed = jax.device_put(list(arrays), list(shardings), may_alias=True)
    return dict(zip(names, placed))


# -------------------------------------------------------------------- CheckpointManager

_CKPT_RE = re.compile(r"^ckpt-(?P<step>\d+)(?P<file>\.safetensors)?$")


def _scan(directory: str) -> list[tuple[int, str]]:
    """``[(step, path)]`` of the checkpoints in ``directory``, oldest step first: files
    ``ckpt-<step>.safetensors`` and sharded checkpoint directories ``ckpt-<step>`` (Orbax's
    temporary directories do not match)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = _CKPT_RE.match(name)
        path = os.path.join(directory, name)
        if m and (os.path.isfile(path) if m["file"] else _orbax.is_checkpoint(path)):
            found.append((int(m["step"]), path))
    return sorted(found)


def _remove_stale_temps(directory: str) -> None:
    """Delete temporary files left by writers (this host's processes) that no longer run."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            m = _TEMP_RE.match(name)
            if m and not _pid_alive(int(m["pid"])):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


_PENDING: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    for manager in list(_PENDING):
        try:
            manager.wait()
        except Exception as e:  # nothing can be raised at exit; say it loudly
            print(f"paramstore: a background checkpoint save failed: {e!r}", file=sys.stderr)


class CheckpointManager:
    """Numbered checkpoints ``ckpt-<step>.safetensors`` (or sharded ``ckpt-<step>``
    directories, see ``Saver``'s ``sharded``, which ``sharded=`` here sets) in
    ``directory``; keeps the newest ``max_to_keep`` (None keeps all). See the module
    docstring for ``async_save``."""

    def __init__(
        self,
        directory: PathLike,
        saver_or_vars: Any = None,
        max_to_keep: int | None = 5,
        async_save: bool = False,
        *,
        sharded: bool | None = None,
    ) -> None:
        if max_to_keep is not None and (operator.index(max_to_keep) < 1):
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}.")
        self.directory = os.fspath(directory)
        if isinstance(saver_or_vars, Saver):
            if sharded is not None and sharded != saver_or_vars.sharded:
                raise ValueError(
                    "CheckpointManager: sharded= conflicts with the Saver's own setting; "
                    "give it to the Saver."
                )
            self.saver = saver_or_vars
        else:
            self.saver = Saver(saver_or_vars, sharded=sharded)
        self.max_to_keep = max_to_keep
        self.async_save = bool(async_save)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._orbax_async: Any = None  # an Orbax AsyncCheckpointer, for sharded async saves
        self._orbax_pending = False
        if jax.process_index() == 0:
            os.makedirs(self.directory, exist_ok=True)
            _remove_stale_temps(self.directory)

    def path_for(self, step: int) -> str:
        name = f"ckpt-{operator.index(step)}"
        if not self.saver._writes_sharded():
            name += ".safetensors"
        return os.path.join(self.directory, name)

    @property
    def checkpoints(self) -> list[str]:
        """The checkpoint paths, oldest step first (after any pending save finished)."""
        self.wait()
        return [p for _, p in _scan(self.directory)]

    @property
    def latest_checkpoint(self) -> str | None:
        """The path of the highest step, or None."""
        found = self.checkpoints
        return found[-1] if found else None

    @property
    def latest_step(self) -> int | None:
        """The highest saved step, or None."""
        self.wait()
        found = _scan(self.directory)
        return found[-1][0] if found else None

    def save(self, step: int) -> str:
        """Save the variables as checkpoint ``step`` (replacing one of the same step) and
        delete the oldest beyond ``max_to_keep``. Returns its path. With ``async_save`` the
        values are copied to host now and the file is written in the background."""
        self.wait()
        path = self.path_for(step)
        if self.saver._writes_sharded():
            values = self.saver._device_values()
            if not self.async_save:
                _orbax.save(path, values)
                self._prune()
                return path
            if self._orbax_async is None:
                self._orbax_async = _orbax.async_checkpointer()
            _orbax.save(path, values, self._orbax_async)  # returns once copied to host
            self._orbax_pending = True
            _PENDING.add(self)
            return path
        if not self.async_save:
            self._write(path, self.saver._snapshot(copy=False))
            return path
        arrays = self.saver._snapshot(copy=True)
        self._thread = threading.Thread(
            target=self._background, args=(path, arrays), name=f"paramstore-save-{step}"
        )
        _PENDING.add(self)
        self._thread.start()
        return path

    def _write(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        _remove_stale_temps(self.directory)
        write_arrays(path, arrays)
        self._prune()

    def _prune(self) -> None:
        """Delete the oldest checkpoints beyond ``max_to_keep`` (process 0 only; the
        others wait for it)."""
        if self.max_to_keep is not None and jax.process_index() == 0:
            for _, old in _scan(self.directory)[: -self.max_to_keep]:
                with contextlib.suppress(FileNotFoundError):
                    if os.path.isdir(old):
                        shutil.rmtree(old)
                    else:
                        os.unlink(old)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("paramstore.CheckpointManager.prune")

    def _background(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        try:
            self._write(path, arrays)
        except BaseException as e:
            e.add_note(f"(raised by the background save of '{path}')")
            self._error = e

    def wait(self) -> None:
        """Block until a pending background save is written; re-raise its error, if any."""
        if self._orbax_pending:
            self._orbax_pending = False
            _PENDING.discard(self)
            self._orbax_async.wait_until_finished()
            self._prune()
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
            _PENDING.discard(self)
        error, self._error = self._error, None
        if error is not None:
            raise error

    def restore_latest(self, allow_missing: bool = False) -> str | None:
        """Restore the latest checkpoint (see ``Saver.restore``); its path, or None if the
        directory has none."""
        path = self.latest_checkpoint
        if path is not None:
            self.saver.restore(path, allow_missing=allow_missing)
        return path


# --------------------------------------------------------------------------- inspection


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError


def _stats(arr: np.ndarray) -> list[str]:
    """min, max, mean (over the finite values) and the count of NaN/inf values."""
    if _is_string(arr.dtype) or not arr.size:
        return ["-", "-", "-", "-"]
    if arr.dtype.kind == "c":
        return ["-", "-", f"{complex(arr.mean()):.6g}", str(int(np.sum(~np.isfinite(arr))))]
    x = arr.reshape(-1)
    if x.dtype.kind not in "iu":
        x = x.astype(np.float64)
    finite = x[np.isfinite(x)] if x.dtype.kind == "f" else x
    bad = str(x.size - finite.size)
    if not finite.size:
        return ["-", "-", "-", bad]
    mean = float(np.mean(finite, dtype=np.float64))
    return [f"{finite.min():.6g}", f"{finite.max():.6g}", f"{mean:.6g}", bad]


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _inspect_sharded(path: str, values: bool, name: str | None) -> str:
    entries = _sharded_entries(path)
    if name is not None and name not in entries:
        raise CheckpointError(
            f"Checkpoint '{path}' has no variable '{name}'{_suggest(name, entries)}. "
            f"Its variables: {_preview(sorted(entries))}."
        )
    chosen = [entries[name]] if name is not None else [entries[n] for n in sorted(entries)]
    loaded = _sharded_load(path, {e["name"]: (e, None) for e in chosen}) if values else {}
    head = ["name", "shape", "dtype", "size", "bytes"]
    rows = [head + (["min", "max", "mean", "nan/inf"] if values else [])]
    total = 0
    for e in chosen:
        size = math.prod(e["shape"])
        nbytes = (
            sum(len(t.encode("utf-8")) for t in e["strings"])
            if _is_string(e["dtype"])
            else size * e["dtype"].itemsize
        )
        total += nbytes
        row = [e["name"], str(list(e["shape"])), _dtype_name(e["dtype"]), str(size)]
        row.append(_human(nbytes))
        if values:
            row += _stats(loaded[e["name"]])
        rows.append(row)
    lines = [
        f"{path}: {len(chosen)} variables, {_human(total)}, sharded (Orbax), "
        f"format version {_orbax.VERSION}",
        _table(rows),
    ]
    if values and name is not None:
        with np.printoptions(threshold=1000, edgeitems=5):
            lines.append(f"\n{name} =\n{loaded[name]!r}")
    return "\n".join(lines)


def _inspect(path: PathLike, values: bool, name: str | None) -> str:
    resolved = _resolve(path)
    if os.path.isdir(resolved):
        return _inspect_sharded(resolved, values, name)
    with _Reader(resolved) as r:
        entries = sorted(r.entries.values(), key=_by_name)
        if name is not None:
            entries = [r.entry(name)]
        head = ["name", "shape", "dtype", "size", "bytes"]
        rows = [head + (["min", "max", "mean", "nan/inf"] if values else [])]
        loaded = {}
        for e in entries:
            row = [e.name, str(list(e.shape)), _dtype_name(e.dtype)]
            row += [str(math.prod(e.shape)), _human(e.nbytes)]
            if values:
                loaded[e.name] = r.load(e.name)
                row += _stats(loaded[e.name])
            rows.append(row)
        total = sum(e.nbytes for e in entries)
        version = r.metadata.get(_KEY_VERSION, "none (plain safetensors)")
        lines = [f"{r.path}: {len(entries)} variables, {_human(total)}, format version {version}"]
        lines.append(_table(rows))
    if values and name is not None:
        with np.printoptions(threshold=1000, edgeitems=5):
            lines.append(f"\n{name} =\n{loaded[name]!r}")
    return "\n".join(lines)


def inspect_main(path: PathLike, values: bool = False, name: str | None = None) -> int:
    """``python -m paramstore inspect``: print a checkpoint's variables (name, shape, dtype,
    size; with ``values`` also min/max/mean, and the full value of ``name``). Returns the exit
    status: 0, or 1 after printing the error for a missing or corrupt checkpoint."""
    try:
        print(_inspect(path, values, name))
    except (OSError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
