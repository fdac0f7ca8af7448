"""The checkpoint file format: checked safetensors (private; see docs/checkpoints.md).

A checkpoint file is a standard safetensors file: an 8-byte little-endian header length, a
JSON header, then the raw little-endian bytes of each tensor. In ``__metadata__`` paramstore
adds a format version and, per tensor, a checksum of its bytes (format 2: XXH3-64, which runs
near memory speed; format 1, still read: CRC-32) and the true dtype and shape of tensors
safetensors cannot describe (strings, complex128, ...). Every tensor of a paramstore file must
carry its checksum: a missing or renamed checksum entry is itself an error, so no header edit
turns verification off. A safetensors file from another program (no paramstore metadata) has
no checksums and is read only when the caller allows unverified data. Nothing is pickled.

This module is the format alone: dtype codes, how a tensor is encoded and decoded, how a
header is built, and the bounded JSON parse. ``paramstore.checkpoint.formats.safetensors.header`` reads and
checks a header; ``paramstore.checkpoint.formats.safetensors.file`` reads and writes files with the I/O engine
of ``paramstore.checkpoint.io``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from paramstore.checkpoint.format import STRING, CheckpointError, dtype_name, is_string

FORMAT_VERSION = 2
"""The paramstore layout version written in ``__metadata__["paramstore.format_version"]``
(2: XXH3-64 checksums; version 1 files, CRC-32, are still read)."""

READ_VERSIONS = {1: "crc32", 2: "xxh3"}
"""The format versions this paramstore reads, and the checksum each one carries."""

KEY_VERSION = "paramstore.format_version"
KEY_TENSORS = "paramstore.tensors"
MAX_HEADER = 16 * 2**20  # ~100,000 variables; refused before reading, so parsing stays fast
MAX_DEPTH = 8  # JSON nesting a header may use (paramstore's own need 3)
_STRING = STRING
DIGITS = {"crc32": 8, "xxh3": 16}


# ------------------------------------------------------------------------------- dtypes

# safetensors dtype codes with a NumPy equivalent. Any other fixed-size dtype (complex128,
# int4, the other float8 types...) is stored as raw bytes ("U8") with its true dtype in the
# metadata; so are strings (see _encode_strings).
CODES: dict[str, np.dtype] = {
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
CODE_OF = {dt: code for code, dt in CODES.items()}


def dtype_from_name(name: Any) -> np.dtype:
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
class Tensor:
    """One tensor as stored: safetensors code and shape, its bytes, and for raw or string
    data (``special``) the logical dtype name and shape that go in the metadata."""

    name: str
    code: str
    stored_shape: tuple[int, ...]
    data: memoryview  # flat, format "B"
    special: tuple[str, tuple[int, ...]] | None
    itemsize: int


def encode(name: str, arr: np.ndarray) -> Tensor:
    """The stored form of ``arr``: itself if safetensors has its dtype, else its raw bytes."""
    shape = tuple(map(int, arr.shape))
    dtype = arr.dtype
    if _is_string(dtype):
        try:
            blob = _encode_strings(arr)
        except UnicodeError as e:
            raise CheckpointError(
                f"Cannot save '{name}': its strings are not valid UTF-8 text ({e}); the "
                "format stores strings as UTF-8. Decode bytes before "
                "making a string variable (b.decode('utf-8')), or keep them as a uint8 array."
            ) from None
        return Tensor(name, "U8", (blob.size,), blob.data, ("string", shape), 1)
    if not _storable(dtype):
        raise CheckpointError(
            f"Cannot save '{name}': dtype {dtype} is not a numeric or string dtype."
        )
    flat = _little_endian(arr).reshape(-1).view(np.uint8)
    code = CODE_OF.get(dtype if dtype.isnative else dtype.newbyteorder("="))
    if code is None:
        special = (dtype.name, shape)
        return Tensor(name, "U8", (flat.size,), flat.data, special, dtype.itemsize)
    return Tensor(name, code, shape, flat.data, None, dtype.itemsize)


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


# ------------------------------------------------------------------------------- header


@dataclasses.dataclass(frozen=True)
class Entry:
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


def build_header(tensors: Sequence[Tensor], crcs: Mapping[str, str]) -> bytes:
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
        KEY_VERSION: str(FORMAT_VERSION),
        KEY_TENSORS: json.dumps(extra, separators=(",", ":")),
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


def parse_json(raw: bytes, what: str) -> Any:
    """JSON text with at most ``MAX_DEPTH`` levels, without duplicate keys (ValueError)."""
    depth = json_depth(raw)
    if depth > MAX_DEPTH:
        raise ValueError(f"{what} nests {depth} levels deep, more than {MAX_DEPTH}")
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{what} is not valid JSON ({e})") from None


def check_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"A checkpoint name must be a non-empty str, got {name!r}.")
    if name == "__metadata__":
        raise CheckpointError("'__metadata__' is reserved by safetensors; rename the variable.")


def decode(e: Entry, buf: np.ndarray) -> np.ndarray:
    if _is_string(e.dtype):
        return _decode_strings(buf, e.shape)
    if e.code == "BOOL" and buf.size and buf.max() > 1:
        raise ValueError("bool data holds bytes other than 0 and 1")
    if sys.byteorder == "little":
        return buf.view(e.dtype).reshape(e.shape)
    return buf.view(e.dtype.newbyteorder("<")).reshape(e.shape).astype(e.dtype)
