"""Reading and checking a safetensors header (private; the format is ``checkpoint.formats.safetensors.format``).

``read_header`` bounds everything before it allocates or parses: the header's length
against the file and ``MAX_HEADER``, its JSON nesting against ``MAX_DEPTH``, and, before a
full JSON parse, whether the file carries paramstore's version key at all (so an unverified
file is refused in the time a byte search takes, not a parse). Then every entry: dtype code,
shape, offsets, bytes against dtype and shape, the checksum's form, and that the tensors tile
the data section exactly. Errors are ValueError (NotACheckpoint for a file that is not
safetensors at all) naming the tensor; the reader turns them into CheckpointError.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Mapping
from typing import Any, BinaryIO

import numpy as np

from paramstore.checkpoint.format import is_string
from paramstore.checkpoint.formats.safetensors.format import (
    CODES,
    DIGITS,
    KEY_TENSORS,
    KEY_VERSION,
    MAX_HEADER,
    READ_VERSIONS,
    Entry,
    NotACheckpoint,
    dtype_from_name,
    parse_json,
)


def read_header(
    f: BinaryIO, size: int, allow_unverified: bool = False
) -> tuple[dict[str, Entry], dict[str, str]]:
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
    if len(raw) != n:
        raise ValueError(f"the file is truncated inside its header of {n} bytes")
    if not allow_unverified and b'"paramstore.' not in raw:
        # No paramstore key anywhere: refused in the time of a byte search (~5 ms for
        # 15 MiB), not the seconds a full parse of a hostile header would take.
        raise ValueError(_UNVERIFIED)
    header = parse_json(raw, "the header")
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
        raise ValueError(f"{KEY_TENSORS} describes tensors the file lacks: {sorted(unknown)[:3]}")
    _check_layout(entries, base, size)
    return entries, meta


_UNVERIFIED = (
    "it has no paramstore checksums (a safetensors file from another program?), so its "
    "values cannot be verified; pass allow_unverified=True to read it anyway"
)


def _paramstore_metadata(
    meta: Mapping[str, str], allow_unverified: bool
) -> tuple[str | None, dict[str, Any]]:
    """The checksum algorithm and the per-tensor paramstore metadata. A file without any
    paramstore key is a foreign safetensors file: ``(None, {})`` if ``allow_unverified``."""
    version = meta.get(KEY_VERSION)
    if version is None:
        if any(k.startswith("paramstore") for k in meta):
            raise ValueError(f"the header lacks {KEY_VERSION}")
        if not allow_unverified:
            raise ValueError(_UNVERIFIED)
        return None, {}
    algorithm = READ_VERSIONS.get(int(version)) if version.isdigit() else None
    if algorithm is None:
        raise ValueError(
            f"paramstore format version {version!r} is not supported (this paramstore reads "
            f"versions {sorted(READ_VERSIONS)}); upgrade paramstore"
        )
    if KEY_TENSORS not in meta:
        raise ValueError(f"the header lacks {KEY_TENSORS}, which holds the checksums")
    extra = parse_json(meta[KEY_TENSORS].encode(), KEY_TENSORS)
    if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
        raise ValueError(f"{KEY_TENSORS} is not a map of objects")
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
) -> Entry:
    if not isinstance(e, dict) or not e.keys() >= _ENTRY_KEYS:
        raise ValueError(f"the entry of '{name}' lacks dtype, shape or data_offsets")
    code = e["dtype"]
    if not isinstance(code, str) or code not in CODES:
        raise ValueError(f"'{name}' has dtype {code!r}, which paramstore cannot read")
    shape_value = e["shape"]
    try:
        stored_shape = _shape(shape_value, "")  # no message to format unless it fails
    except ValueError:
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
    want = math.prod(stored_shape) * CODES[code].itemsize
    if end - start != want:
        raise ValueError(
            f"'{name}' has data_offsets {offsets} ({end - start} bytes) but dtype {code} and "
            f"shape {list(stored_shape)} need {want} bytes"
        )
    extra = extra or {}
    dtype, shape = CODES[code], stored_shape
    if "dtype" in extra:
        dtype, shape = _logical(name, code, stored_shape, extra)
    digest = None
    if algorithm is not None:
        digest = extra.get(algorithm)
        digits = DIGITS[algorithm]
        if not (isinstance(digest, str) and len(digest) == digits and _HEX.fullmatch(digest)):
            raise ValueError(
                f"the {algorithm} checksum of '{name}' is missing or not {digits} hex digits "
                f"({digest!r})"
            )
    return Entry(name, code, base + start, base + end, dtype, shape, digest, algorithm or "")


_HEX = re.compile(r"[0-9a-f]+")
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))


def _logical(
    name: str, code: str, stored_shape: tuple[int, ...], extra: dict[str, Any]
) -> tuple[np.dtype, tuple[int, ...]]:
    """The true dtype and shape of a tensor stored as raw bytes or string data."""
    try:
        dtype = dtype_from_name(extra["dtype"])
    except ValueError as e:
        raise ValueError(f"'{name}': {e}") from None
    shape = _shape(extra.get("shape"), f"the logical shape of '{name}'")
    if code != "U8" or len(stored_shape) != 1:
        raise ValueError(f"'{name}' is {extra['dtype']} data but not stored as 1-D U8")
    if not is_string(dtype):
        want = math.prod(shape) * dtype.itemsize
        if want != stored_shape[0]:
            raise ValueError(
                f"'{name}' of dtype {dtype.name} and shape {list(shape)} needs {want} bytes, "
                f"but {stored_shape[0]} are stored"
            )
    return dtype, shape


def _check_layout(entries: Mapping[str, Entry], base: int, size: int) -> None:
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
