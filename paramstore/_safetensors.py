"""The checkpoint file format: streamed, checked safetensors (private; see docs/checkpoints.md).

A checkpoint file is a standard safetensors file: an 8-byte little-endian header length, a
JSON header, then the raw little-endian bytes of each tensor. In ``__metadata__`` paramstore
adds a format version and, per tensor, a checksum of its bytes (format 2: XXH3-64, which runs
near memory speed; format 1, still read: CRC-32) and the true dtype and shape of tensors
safetensors cannot describe (strings, complex128, ...). Every tensor of a paramstore file must
carry its checksum: a missing or renamed checksum entry is itself an error, so no header edit
turns verification off. A safetensors file from another program (no paramstore metadata) has
no checksums and is read only when the caller allows unverified data. ``write_arrays`` streams the
tensors to a temporary file and renames it atomically; ``_Reader`` checks every size in the
header against the file and every checksum before returning data. Nothing is pickled.
``paramstore.checkpoint`` builds Saver and CheckpointManager on this.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import queue
import re
import secrets
import struct
import sys
import threading
import zlib
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO

import jax
import ml_dtypes
import numpy as np
import xxhash

from paramstore._format import (
    STRING,
    CheckpointError,
    PathLike,
    dtype_name,
    is_string,
    no_such_variable,
)
from paramstore._jax import put_on_device

FORMAT_VERSION = 2
"""The paramstore layout version written in ``__metadata__["paramstore.format_version"]``
(2: XXH3-64 checksums; version 1 files, CRC-32, are still read)."""

READ_VERSIONS = {1: "crc32", 2: "xxh3"}
"""The format versions this paramstore reads, and the checksum each one carries."""

_KEY_VERSION = "paramstore.format_version"
_KEY_TENSORS = "paramstore.tensors"
MAX_HEADER = 16 * 2**20  # ~100,000 variables; refused before reading, so parsing stays fast
MAX_DEPTH = 8  # JSON nesting a header may use (paramstore's own need 3)
_CHUNK = 16 * 2**20  # bytes per write/read call and checksum job
_PARALLEL_MIN = 2**20  # smaller buffers are checksummed inline
_READ_CHUNK = 2**18  # reads are checksummed inline, while the chunk is in the CPU cache
_BUFFER = 2**20  # write buffer, for many small tensors
_RUN = 2**20  # adjacent small tensors are read with one call into one buffer of this size
_STRING = STRING
_DIGITS = {"crc32": 8, "xxh3": 16}


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


_is_string = is_string
_dtype_name = dtype_name


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


class _Hash:
    """One running checksum: XXH3-64 (format 2) or CRC-32 (format 1)."""

    __slots__ = ("_h", "_crc")

    def __init__(self, algorithm: str) -> None:
        self._h = xxhash.xxh3_64() if algorithm == "xxh3" else None
        self._crc = 0

    def update(self, data: memoryview) -> None:
        if self._h is not None:
            self._h.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return self._h.hexdigest() if self._h is not None else f"{self._crc:08x}"


def checksum(data: Any) -> str:
    """The XXH3-64 of a buffer, as 16 hex digits (what format 2 and the sharded manifest store)."""
    return xxhash.xxh3_64_hexdigest(data)


class _Checksums:
    """Checksums computed beside the file I/O. Buffers of at least ``_PARALLEL_MIN`` bytes go
    to one worker thread (xxhash and zlib release the GIL); smaller ones are computed inline,
    where a thread hand-off would cost more. The worker starts with the first big buffer, or
    with ``deferred`` only at ``start()``: a writer starts it when its data goes to disk, so
    the checksums use the CPU while the disk flushes rather than competing with the copies
    into the page cache."""

    def __init__(
        self, algorithm: str = "xxh3", deferred: bool = False, done: Collection[Any] = ()
    ) -> None:
        self._algorithm = algorithm
        self._done = done  # keys checksummed already: their data is not hashed again
        self._deferred = deferred
        self._hashes: dict[Any, _Hash] = {}
        self._digests: dict[Any, str] = {}
        self._threaded: set[Any] = set()  # keys with data sent to the worker
        self._jobs: queue.SimpleQueue[tuple[_Hash, memoryview] | None] = queue.SimpleQueue()
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
        if key in self._done:
            return
        h = self._hashes.get(key)
        if h is None:
            h = self._hashes[key] = _Hash(self._algorithm)
        if data.nbytes < _PARALLEL_MIN and key not in self._threaded:
            h.update(data)
            return
        self._threaded.add(key)  # its later data must follow in the worker's queue, in order
        self._jobs.put((h, data))
        self._queued = True
        if not self._deferred:
            self.start()

    def add_whole(self, key: Any, data: memoryview) -> None:
        """Checksum all of ``key``'s data, given at once (inline if small): no running
        hash object, for the many small tensors of a checkpoint."""
        if data.nbytes >= _PARALLEL_MIN or key in self._hashes:
            self.add(key, data)
        elif self._algorithm == "xxh3":
            self._digests[key] = xxhash.xxh3_64_hexdigest(data)
        else:
            self._digests[key] = f"{zlib.crc32(data):08x}"

    def start(self) -> None:
        """Start the worker on the queued buffers (once)."""
        if self._queued and self._thread is None:
            self._thread = threading.Thread(
                target=self._work, name="paramstore-checksum", daemon=True
            )
            self._thread.start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            h, data = job
            try:
                h.update(data)
            except BaseException as e:  # pragma: no cover - hashes do not fail on buffers
                self._error = e

    def _stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def result(self) -> dict[Any, str]:
        """``{key: hex digest}`` once every checksum is done."""
        self.start()
        self._stop()
        if self._error is not None:
            raise self._error
        out = {k: h.hexdigest() for k, h in self._hashes.items()}
        out.update(self._digests)
        return out


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
    checksum: str | None  # None only in a foreign file read unverified
    algorithm: str

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
        info: dict[str, Any] = {"xxh3": crcs.get(t.name, "0" * 16)}
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
    out = dict(pairs)
    if len(out) != len(pairs):  # a key came twice: name the first repeated one
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"the header names {key!r} twice")
            seen.add(key)
    return out


class NotACheckpoint(ValueError):
    """The file is not a safetensors file at all (a README, a TensorFlow index...)."""


def _read_header(
    f: BinaryIO, size: int, allow_unverified: bool = False
) -> tuple[dict[str, _Entry], dict[str, str]]:
    """Parse and bounds-check the header of an open file of ``size`` bytes (ValueError).

    The header's size (``MAX_HEADER``) and JSON nesting (``MAX_DEPTH``) are checked before
    it is parsed. A paramstore file must name a checksum for every tensor; a file without
    paramstore metadata is refused unless ``allow_unverified``."""
    start = f.read(9)
    if len(start) < 9 or start[8:9] != b"{":
        raise NotACheckpoint("it does not start like a safetensors file")
    (n,) = struct.unpack("<Q", start[:8])
    if n > size - 8:
        raise ValueError(f"the header length {n} exceeds the file ({size} bytes)")
    if n > MAX_HEADER:
        raise ValueError(
            f"the header of {n} bytes exceeds the {MAX_HEADER // 2**20} MiB paramstore reads "
            "(about 100,000 variables)"
        )
    raw = start[8:] + f.read(n - 1)
    header = _parse_json(raw, "the header")
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("__metadata__ is not a map of strings")
    algorithm, extra = _paramstore_metadata(meta, allow_unverified)
    base = 8 + n
    entries = {
        name: _parse_entry(name, e, base, extra.get(name), algorithm) for name, e in header.items()
    }
    unknown = extra.keys() - entries.keys()
    if unknown:
        raise ValueError(f"{_KEY_TENSORS} describes tensors the file lacks: {sorted(unknown)[:3]}")
    _check_layout(entries, base, size)
    return entries, meta


_STRING_RE = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _max_depth(raw: bytes) -> int:
    b = np.frombuffer(raw, dtype=np.uint8)
    step = ((b == ord("[")) | (b == ord("{"))).astype(np.int64)
    step -= (b == ord("]")) | (b == ord("}"))
    return int(np.cumsum(step).max()) if step.size else 0


def json_depth(raw: bytes) -> int:
    """The deepest nesting of ``[``/``{`` in JSON text, outside strings (no parsing).
    Counting every bracket is fast and an upper bound; strings are stripped (slower) only
    when that bound is over ``MAX_DEPTH``."""
    depth = _max_depth(raw)
    return depth if depth <= MAX_DEPTH else _max_depth(_STRING_RE.sub(b'""', raw))


def _parse_json(raw: bytes, what: str) -> Any:
    """JSON text with at most ``MAX_DEPTH`` levels, without duplicate keys (ValueError)."""
    depth = json_depth(raw)
    if depth > MAX_DEPTH:
        raise ValueError(f"{what} nests {depth} levels deep, more than {MAX_DEPTH}")
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{what} is not valid JSON ({e})") from None


def _paramstore_metadata(
    meta: Mapping[str, str], allow_unverified: bool
) -> tuple[str | None, dict[str, Any]]:
    """The checksum algorithm and the per-tensor paramstore metadata. A file without any
    paramstore key is a foreign safetensors file: ``(None, {})`` if ``allow_unverified``."""
    version = meta.get(_KEY_VERSION)
    if version is None:
        if any(k.startswith("paramstore") for k in meta):
            raise ValueError(f"the header lacks {_KEY_VERSION}")
        if not allow_unverified:
            raise ValueError(
                "it has no paramstore checksums (a safetensors file from another program?), "
                "so its values cannot be verified; pass allow_unverified=True to read it anyway"
            )
        return None, {}
    algorithm = READ_VERSIONS.get(int(version)) if version.isdigit() else None
    if algorithm is None:
        raise ValueError(
            f"paramstore format version {version!r} is not supported (this paramstore reads "
            f"versions {sorted(READ_VERSIONS)}); upgrade paramstore"
        )
    if _KEY_TENSORS not in meta:
        raise ValueError(f"the header lacks {_KEY_TENSORS}, which holds the checksums")
    extra = _parse_json(meta[_KEY_TENSORS].encode(), _KEY_TENSORS)
    if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
        raise ValueError(f"{_KEY_TENSORS} is not a map of objects")
    return algorithm, extra


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if isinstance(value, list):
        for d in value:  # a loop, not all(genexpr): this runs for every tensor of a header
            if type(d) is not int or not 0 <= d < 2**62:
                break
        else:
            return tuple(value)
    raise ValueError(f"{what} {value!r} is not a list of non-negative integers")


def _parse_entry(
    name: str, e: Any, base: int, extra: dict[str, Any] | None, algorithm: str | None
) -> _Entry:
    if not isinstance(e, dict) or not e.keys() >= _ENTRY_KEYS:
        raise ValueError(f"the entry of '{name}' lacks dtype, shape or data_offsets")
    code = e["dtype"]
    if not isinstance(code, str) or code not in _CODES:
        raise ValueError(f"'{name}' has dtype {code!r}, which paramstore cannot read")
    shape_value = e["shape"]
    if isinstance(shape_value, list):
        stored_shape = _shape(shape_value, "")  # no message to format unless it fails
    else:
        stored_shape = _shape(shape_value, f"the shape of '{name}'")
    offsets = e["data_offsets"]
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and type(start := offsets[0]) is int
        and type(end := offsets[1]) is int
        and start >= 0
        and end >= 0
    ):
        raise ValueError(f"the data_offsets of '{name}' are not two non-negative integers")
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
    digest = None
    if algorithm is not None:
        digest = extra.get(algorithm)
        digits = _DIGITS[algorithm]
        if not (isinstance(digest, str) and len(digest) == digits and _HEX.fullmatch(digest)):
            raise ValueError(
                f"the {algorithm} checksum of '{name}' is missing or not {digits} hex digits "
                f"({digest!r})"
            )
    return _Entry(name, code, base + start, base + end, dtype, shape, digest, algorithm or "")


_HEX = re.compile(r"[0-9a-f]+")
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))


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


TEMP_RE = re.compile(r"^\.(?P<base>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}$")


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
        check_name(name)
    tensors = [_encode(name, np.asarray(a)) for name, a in arrays.items()]
    tensors.sort(key=lambda t: -t.itemsize)  # so each tensor starts aligned to its itemsize
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = _temp_path(path)
    try:
        # Small tensors are checksummed now, so a file of only small tensors is written
        # with its final header at once; big ones are checksummed while the data flushes.
        crcs = {t.name: checksum(t.data) for t in tensors if t.data.nbytes < _PARALLEL_MIN}
        header = _build_header(tensors, crcs)
        if len(header) - 8 > MAX_HEADER:
            raise CheckpointError(
                f"Cannot save {len(tensors)} variables to '{path}': the header would take "
                f"{len(header) - 8} bytes, more than the {MAX_HEADER // 2**20} MiB a reader "
                "accepts. Save fewer, larger variables (or use Saver(..., sharded=True))."
            )
        with open(tmp, "xb", buffering=_BUFFER) as f:
            f.write(header)
            with _Checksums(deferred=True, done=crcs.keys()) as checksums:
                gather = _Gather(f)
                for t in tensors:
                    _write_tensor(gather, t, checksums)
                gather.flush()
                if checksums.queued:  # checksum the big tensors while the data goes to disk
                    checksums.start()
                    _datasync(f.fileno())
                big = checksums.result()
            if big:
                crcs.update(big)
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


def _write_tensor(f: BinaryIO | _Gather, t: _Tensor, checksums: _Checksums) -> None:
    if not t.data.nbytes:
        checksums.add(t.name, t.data)
    for i in range(0, t.data.nbytes, _CHUNK):
        chunk = t.data[i : i + _CHUNK]
        checksums.add(t.name, chunk)
        f.write(chunk)


_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "writev") else 0


class _Gather:
    """A writer over the file ``f`` that holds the buffers given to ``write`` (without
    copying them; they must stay unchanged) and writes them ``_IOV_MAX`` at a time with
    one ``os.writev``: for many small tensors, a few system calls instead of one per
    buffer. ``flush`` writes what it holds and flushes ``f``."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._views: list[memoryview] = []

    def write(self, data: memoryview) -> None:
        self._views.append(data)
        if len(self._views) >= max(_IOV_MAX, 1):
            self.flush()

    def flush(self) -> None:
        _write_views(self._f, self._views)
        self._views = []
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()


def _write_views(f: BinaryIO, views: list[memoryview]) -> None:
    """Write ``views`` at ``f``'s position: with ``os.writev``, many buffers a system call
    and no copy into the file's buffer (``f`` is flushed first), else ``f.write`` each."""
    if not _IOV_MAX:
        for v in views:
            f.write(v)
        return
    f.flush()
    fd = f.fileno()
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_MAX]
        n = os.writev(fd, batch)
        if n <= 0:
            raise OSError(f"writev wrote {n} bytes")
        for v in batch:  # skip what was written; a partial write resumes mid-buffer
            if n < v.nbytes:
                views[i] = v[n:]
                break
            n -= v.nbytes
            i += 1


def check_name(name: Any) -> None:
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


class SafetensorsFile:
    """An open checkpoint file with its checked header (the ``_format.Reader`` of the
    single-file format); ``load``/``load_many`` read tensors and verify their checksums."""

    def __init__(self, path: PathLike, allow_unverified: bool = False) -> None:
        self.path = os.fspath(path)  # a file: directories are resolved by the caller
        self._f: BinaryIO = open(self.path, "rb", buffering=0)  # noqa: SIM115 - see close()
        try:
            size = os.fstat(self._f.fileno()).st_size
            self.entries, self.metadata = _read_header(self._f, size, allow_unverified)
        except NotACheckpoint as e:
            self._f.close()
            raise CheckpointError(
                f"'{self.path}' is not a paramstore checkpoint: {e}. A checkpoint is a file "
                "written by ps.Saver, a sharded checkpoint directory, a TensorFlow checkpoint "
                "prefix or a Keras .weights.h5 file."
            ) from None
        except ValueError as e:
            self._f.close()
            raise CheckpointError(f"Checkpoint '{self.path}' is corrupt: {e}.") from None
        except BaseException:
            self._f.close()
            raise
        version = self.metadata.get(_KEY_VERSION)
        self.description = (
            f"format version {version}" if version else "plain safetensors, unverified"
        )

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    def entry(self, name: str) -> _Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise no_such_variable(self.path, name, self.entries) from None

    def load(self, wanted: Mapping[str, Any]) -> dict[str, Any]:
        """``{name: placement}`` -> ``{name: value}``, verified (see ``_format.Reader``).
        Values are ``jax.device_put`` in batches of ``_CHUNK`` bytes, one call per batch,
        so host memory holds at most a batch beyond what JAX keeps."""
        out: dict[str, Any] = {}
        batch: list[tuple[str, np.ndarray, Any]] = []
        size = 0
        for name, arr in self.load_many(wanted):  # raises at the end if a checksum fails
            placement = wanted[name]
            if placement is None or _is_string(arr.dtype):
                out[name] = arr
                continue
            batch.append((name, arr, placement))
            size += arr.nbytes
            if size >= _CHUNK:
                out.update(_put(batch))
                batch, size = [], 0
        out.update(_put(batch))
        return out

    def load_many(self, names: Iterable[str]) -> Iterator[tuple[str, np.ndarray]]:
        """``(name, value)`` for each name, in file order, as soon as each is read.

        Checksums are computed beside the reads and verified after the last item: the
        iterator raises CheckpointError instead of finishing if any fails, so a consumer
        must not act on the values before the iteration ends. ``load`` is always verified.
        """
        entries = sorted((self.entry(n) for n in names), key=lambda e: e.start)
        algorithm = entries[0].algorithm if entries else ""
        with _Checksums(algorithm or "xxh3") as checksums:
            for run in _runs(entries):
                if len(run) == 1:
                    yield self._decoded(run[0], self._read(run[0], checksums))
                    continue
                buf = self._read_run(run, checksums)
                first = run[0].start
                for e in run:
                    yield self._decoded(e, buf[e.start - first : e.end - first])
            digests = checksums.result()
        for e in entries:
            if e.checksum is not None and digests[e.name] != e.checksum:
                raise CheckpointError(
                    f"Checkpoint '{self.path}' is corrupt: the data of variable '{e.name}' "
                    f"fails its checksum ({e.algorithm} {digests[e.name]}, expected "
                    f"{e.checksum}). Restore an older checkpoint."
                )

    def _read(self, e: _Entry, checksums: _Checksums) -> np.ndarray:
        buf = _aligned_empty(e.nbytes)
        view = buf.data
        self._f.seek(e.start)
        got = 0
        if not e.nbytes:
            checksums.add(e.name, view)
        # A big tensor is hashed by the worker in pieces of _PARALLEL_MIN while the next
        # ones are read; a small one inline, each chunk while it is in the CPU cache.
        piece = _PARALLEL_MIN if e.nbytes >= _PARALLEL_MIN else 1
        hashed = 0
        while got < e.nbytes:
            n = self._f.readinto(view[got : got + _READ_CHUNK])  # type: ignore[attr-defined]
            if not n:
                raise CheckpointError(
                    f"Checkpoint '{self.path}' is truncated inside variable '{e.name}'."
                )
            got += n
            if got - hashed >= piece or got == e.nbytes:
                checksums.add(e.name, view[hashed:got])
                hashed = got
        return buf

    def _read_run(self, run: list[_Entry], checksums: _Checksums) -> np.ndarray:
        """Adjacent small tensors in one read into one buffer (each tensor a view of it,
        aligned like the first when the sizes before it are multiples of 64 bytes)."""
        first = run[0].start
        buf = _aligned_empty(run[-1].end - first)
        view = buf.data
        self._f.seek(first)
        got = 0
        while got < buf.size:
            n = self._f.readinto(view[got:])  # type: ignore[attr-defined]
            if not n:
                e = next(e for e in run if e.end > first + got)
                raise CheckpointError(
                    f"Checkpoint '{self.path}' is truncated inside variable '{e.name}'."
                )
            got += n
        for e in run:
            checksums.add_whole(e.name, view[e.start - first : e.end - first])
        return buf

    def _decoded(self, e: _Entry, buf: np.ndarray) -> tuple[str, np.ndarray]:
        try:
            return e.name, _decode(e, buf)
        except ValueError as err:
            raise CheckpointError(
                f"Checkpoint '{self.path}' is corrupt: variable '{e.name}': {err}."
            ) from None


def _runs(entries: list[_Entry]) -> Iterator[list[_Entry]]:
    """``entries`` (in file order) in groups read with one call: adjacent tensors smaller
    than ``_PARALLEL_MIN``, up to ``_RUN`` bytes a group; any other tensor alone."""
    run: list[_Entry] = []
    size = 0
    for e in entries:
        small = e.end - e.start < _PARALLEL_MIN
        if run and (not small or e.start != run[-1].end or size + e.end - e.start > _RUN):
            yield run
            run, size = [], 0
        if not small:
            yield [e]
            continue
        run.append(e)
        size += e.end - e.start
    if run:
        yield run


# dtypes that jax.device_put would place unchanged (no x64 canonicalisation), for _put
_DIRECT_DTYPES = frozenset(dt for dt in _CODES.values() if jax.dtypes.canonicalize_dtype(dt) == dt)


def _put(batch: list[tuple[str, np.ndarray, Any]]) -> dict[str, Any]:
    """The batch on its placements: what one ``jax.device_put(arrays, shardings,
    may_alias=True)`` returns. Values bound for one device (a ``SingleDeviceSharding`` in
    the device's default memory) skip device_put's per-array Python (~30 us an array):
    the same XLA call it ends in, with the same aval, committed like it."""
    out: dict[str, Any] = {}
    rest: list[tuple[str, np.ndarray, Any]] = []
    devices: dict[Any, Any] = {}
    for name, arr, sharding in batch:
        device: Any = devices.get(sharding)
        if device is None and type(sharding) is jax.sharding.SingleDeviceSharding:
            (device,) = sharding.device_set
            if sharding.memory_kind not in (None, device.default_memory().kind):
                device = None
            devices[sharding] = device
        if device is None or arr.dtype not in _DIRECT_DTYPES or type(arr) is not np.ndarray:
            rest.append((name, arr, sharding))
            continue
        out[name] = put_on_device(arr, sharding, device)
    if rest:
        names, arrays, shardings = zip(*rest)
        placed = jax.device_put(list(arrays), list(shardings), may_alias=True)
        out.update(zip(names, placed))
    return out


def _decode(e: _Entry, buf: np.ndarray) -> np.ndarray:
    if _is_string(e.dtype):
        return _decode_strings(buf, e.shape)
    if e.code == "BOOL" and buf.size and buf.max() > 1:
        raise ValueError("bool data holds bytes other than 0 and 1")
    if sys.byteorder == "little":
        return buf.view(e.dtype).reshape(e.shape)
    return buf.view(e.dtype.newbyteorder("<")).reshape(e.shape).astype(e.dtype)
