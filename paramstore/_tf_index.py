"""A TensorFlow checkpoint's ``.index`` file, parsed in Python with bounds checks (private).

A TensorFlow checkpoint (TF1 ``Saver`` V2 or TF2 ``tf.train.Checkpoint``) is a prefix with an
``<prefix>.index`` file, a LevelDB-style table mapping each tensor name to a
``BundleEntryProto`` (dtype, shape, shard, offset, size, CRC32C), and data files
``<prefix>.data-<i>-of-<n>``. TensorFlow's own reader aborts the interpreter on some crafted
values (a dimension -5: "Check failed: size >= 0"), so paramstore never gives it an index
before this module has read and checked every entry:

* the table: footer magic, every block handle inside the file, no compressed block, entries
  and restart points inside their block, keys strictly increasing;
* the header entry: one or more shards (at most ``MAX_SHARDS``), little-endian;
* each entry: a known dtype, at most ``MAX_DIMS`` dimensions, each ``0 <= d``, no unknown
  rank, a shard that exists, ``offset + size`` inside that data file (a regular file), and
  ``size`` equal to what the dtype and shape need (strings: room for their lengths); slices of
  a partitioned variable inside the variable's shape.

Entries TensorFlow cannot give as tensors (``DT_VARIANT``, e.g. a ``tf.data`` iterator's
state; ``DT_RESOURCE``; quantized types) are kept apart in ``skipped`` with the reason.
Reading costs one pass over the index (about 10 us an entry); nothing is allocated from a
size the file claims beyond the file's own bytes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from collections.abc import Iterator

import ml_dtypes
import numpy as np

from paramstore._checkpoint_io import check_regular, open_regular
from paramstore._format import STRING, CheckpointError

MAX_INDEX = 1 << 30  # an index larger than this is refused before it is read
MAX_SHARDS = 100_000
MAX_DIMS = 254  # TensorFlow's own limit (TensorShape)
_MAGIC = 0xDB4775248B80FB57
_FOOTER = 48
_OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"

# TensorFlow's DataType enum -> NumPy dtype (types.proto)
DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.float32),
    2: np.dtype(np.float64),
    3: np.dtype(np.int32),
    4: np.dtype(np.uint8),
    5: np.dtype(np.int16),
    6: np.dtype(np.int8),
    7: STRING,
    8: np.dtype(np.complex64),
    9: np.dtype(np.int64),
    10: np.dtype(np.bool_),
    14: np.dtype(ml_dtypes.bfloat16),
    17: np.dtype(np.uint16),
    18: np.dtype(np.complex128),
    19: np.dtype(np.float16),
    22: np.dtype(np.uint32),
    23: np.dtype(np.uint64),
    24: np.dtype(ml_dtypes.float8_e5m2),
    25: np.dtype(ml_dtypes.float8_e4m3fn),
}
_UNREADABLE = {
    20: "DT_RESOURCE (a resource handle, not a value)",
    21: "DT_VARIANT (e.g. a tf.data iterator's state), which is not a tensor of numbers",
}


@dataclasses.dataclass(frozen=True)
class TFEntry:
    """One tensor of a TensorFlow checkpoint, checked against its data file."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    shard: int
    offset: int
    size: int


class _Bad(Exception):
    """A malformed index (turned into CheckpointError naming the file)."""


# ----------------------------------------------------------------------- wire format


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    b = buf[pos] if pos < end else -1
    if 0 <= b < 0x80:  # the common one-byte case, inline
        return b, pos + 1
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Bad("a varint runs past its end")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int | bytes]]:
    """``(field number, wire type, value)`` of a protobuf message in ``buf[pos:end]``."""
    while pos < end:
        key, pos = _varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield field, wire, value
        elif wire == 2:
            n, pos = _varint(buf, pos, end)
            if pos + n > end:
                raise _Bad("a field runs past its message")
            yield field, wire, buf[pos : pos + n]
            pos += n
        elif wire == 5:
            if pos + 4 > end:
                raise _Bad("a field runs past its message")
            yield field, wire, int.from_bytes(buf[pos : pos + 4], "little")
            pos += 4
        elif wire == 1:
            if pos + 8 > end:
                raise _Bad("a field runs past its message")
            yield field, wire, int.from_bytes(buf[pos : pos + 8], "little")
            pos += 8
        else:
            raise _Bad(f"wire type {wire} is not one TensorFlow writes")


def _signed(v: int) -> int:
    """A protobuf int64 read as a varint (two's complement)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _slices(msgs: list[bytes], shape: tuple[int, ...]) -> None:
    """Each TensorSliceProto's extents must lie inside ``shape``."""
    for msg in msgs:
        extents = [v for f, _, v in _fields(msg, 0, len(msg)) if f == 1]
        if len(extents) not in (0, len(shape)):
            raise _Bad(f"a slice has {len(extents)} extents for a {len(shape)}-D tensor")
        for dim, ext in zip(shape, extents):
            if not isinstance(ext, bytes):
                raise _Bad("a slice extent is not a message")
            start, length = 0, None
            for f, _, v in _fields(ext, 0, len(ext)):
                if f == 1 and isinstance(v, int):
                    start = _signed(v)
                elif f == 2 and isinstance(v, int):
                    length = _signed(v)
            if start < 0 or (length is not None and (length < 0 or start + length > dim)):
                raise _Bad(f"a slice [{start}, +{length}) does not fit a dimension of {dim}")


def _bundle_entry(buf: bytes) -> tuple[int, tuple[int, ...], int, int, int, list[bytes]]:
    """``(dtype, shape, shard_id, offset, size, slices)`` of a ``BundleEntryProto``.

    The fields TensorFlow writes are decoded in one loop with one-byte varints inline (about
    3x faster than the generic ``_fields``: a 100,000-entry index lists in ~1 s); anything
    else goes through ``_fields``, with the same bounds checks."""
    end = len(buf)
    pos = 0
    dtype = shard = offset = size = 0
    shape: tuple[int, ...] = ()
    slices: list[bytes] = []
    while pos < end:
        key = buf[pos]
        if key in _VARINT_FIELDS and pos + 1 < end and buf[pos + 1] < 0x80:
            v = buf[pos + 1]  # the common case: a one-byte value
            pos += 2
        elif key in _VARINT_FIELDS:
            v, pos = _varint(buf, pos + 1, end)
        elif key == 0x12 or key == 0x3A:  # shape (2) or a slice (7): length-delimited
            n, pos = _varint(buf, pos + 1, end)
            if pos + n > end:
                raise _Bad("a field runs past its message")
            if key == 0x12:
                shape = _shape(buf[pos : pos + n])
            else:
                slices.append(buf[pos : pos + n])
            pos += n
            continue
        elif key == 0x35:  # crc32c (6), fixed32: checked by TensorFlow on read
            if pos + 5 > end:
                raise _Bad("a field runs past its message")
            pos += 5
            continue
        else:  # a field TensorFlow does not write today: skip it with the generic reader
            nxt = _skip(buf, pos, end)
            pos = nxt
            continue
        if key == 0x08:
            dtype = v
        elif key == 0x18:
            shard = _signed(v)
        elif key == 0x20:
            offset = _signed(v)
        else:
            size = _signed(v)
    return dtype, shape, shard, offset, size, slices


_VARINT_FIELDS = frozenset((0x08, 0x18, 0x20, 0x28))  # dtype, shard_id, offset, size


def _skip(buf: bytes, pos: int, end: int) -> int:
    """The position after the one field at ``pos``."""
    key, after = _varint(buf, pos, end)
    wire = key & 7
    if wire == 0:
        return _varint(buf, after, end)[1]
    if wire == 2:
        n, after = _varint(buf, after, end)
        size = n
    elif wire in (1, 5):
        size = 8 if wire == 1 else 4
    else:
        raise _Bad(f"wire type {wire} is not one TensorFlow writes")
    if after + size > end:
        raise _Bad("a field runs past its message")
    return after + size


def _shape(msg: bytes) -> tuple[int, ...]:
    """The dimensions of a ``TensorShapeProto`` (each ``Dim`` usually ``12 02 08 <d>``)."""
    dims: list[int] = []
    pos, end = 0, len(msg)
    while pos < end:
        key = msg[pos]
        if key == 0x12:
            n, pos = _varint(msg, pos + 1, end)
            if pos + n > end:
                raise _Bad("a field runs past its message")
            if n == 2 and msg[pos] == 0x08 and msg[pos + 1] < 0x80:
                size = msg[pos + 1]
            else:
                size = 0
                for f2, w2, v2 in _fields(msg, pos, pos + n):
                    if f2 == 1 and w2 == 0 and isinstance(v2, int):
                        size = _signed(v2)
            pos += n
            if size < 0:
                raise _Bad(f"a dimension is {size}")
            dims.append(size)
            if len(dims) > MAX_DIMS:
                raise _Bad(f"the shape has more than {MAX_DIMS} dimensions")
        elif key == 0x18:
            flag, pos = _varint(msg, pos + 1, end)
            if flag:
                raise _Bad("the shape has an unknown rank")
        else:
            pos = _skip(msg, pos, end)
    return tuple(dims)


# ----------------------------------------------------------------------------- table


def _handle(buf: bytes, pos: int, end: int, size: int) -> tuple[int, int, int]:
    offset, pos = _varint(buf, pos, end)
    n, pos = _varint(buf, pos, end)
    if offset + n + 5 > size:
        raise _Bad(f"a block [{offset}, +{n}) lies past the end of the index ({size} bytes)")
    return offset, n, pos


def _block(raw: bytes, offset: int, n: int) -> Iterator[tuple[bytes, bytes]]:
    """The ``(key, value)`` entries of the block at ``raw[offset:offset + n]``."""
    if raw[offset + n] != 0:
        raise _Bad("a block is compressed, which TensorFlow's checkpoints never are")
    if n < 4:
        raise _Bad("a block is shorter than its restart count")
    end = offset + n
    restarts = int.from_bytes(raw[end - 4 : end], "little")
    limit = end - 4 - 4 * restarts
    if restarts < 1 or limit < offset:
        raise _Bad(f"a block claims {restarts} restart points")
    pos, key = offset, b""
    while pos < limit:
        if pos + 3 <= limit and raw[pos] | raw[pos + 1] | raw[pos + 2] < 0x80:
            shared, fresh, length = raw[pos], raw[pos + 1], raw[pos + 2]  # one byte each
            pos += 3
        else:
            shared, pos = _varint(raw, pos, limit)
            fresh, pos = _varint(raw, pos, limit)
            length, pos = _varint(raw, pos, limit)
        if shared > len(key) or pos + fresh + length > limit:
            raise _Bad("a block entry runs past its block")
        key = key[:shared] + raw[pos : pos + fresh]
        pos += fresh
        yield key, raw[pos : pos + length]
        pos += length


def _table(raw: bytes) -> Iterator[tuple[bytes, bytes]]:
    size = len(raw)
    if size < _FOOTER:
        raise _Bad(f"it has {size} bytes, fewer than a table's footer")
    if struct.unpack("<Q", raw[-8:])[0] != _MAGIC:
        raise _Bad("its footer lacks the table magic number")
    foot = size - _FOOTER
    _, _, pos = _handle(raw, foot, size - 8, size)  # the meta-index block (unused)
    offset, n, _ = _handle(raw, pos, size - 8, size)
    last = b""
    for _, handle in _block(raw, offset, n):
        block_offset, block_n, _ = _handle(handle, 0, len(handle), size)
        for key, value in _block(raw, block_offset, block_n):
            if last and key <= last:
                raise _Bad("its keys are not in increasing order")
            last = key or b"\x00"
            yield key, value


# ---------------------------------------------------------------------------- reader


def data_path(prefix: str, shard: int, shards: int) -> str:
    return f"{prefix}.data-{shard:05d}-of-{shards:05d}"


class TFIndex:
    """The checked index of the TensorFlow checkpoint at ``prefix`` (see the module
    docstring): ``entries`` ``{name: TFEntry}``, ``skipped`` ``{name: reason}``,
    ``shards`` (the number of data files)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        path = prefix + ".index"
        st = check_regular(path, "TensorFlow checkpoint index")
        if st.st_size > MAX_INDEX:
            raise CheckpointError(
                f"TensorFlow checkpoint index '{path}' has {st.st_size} bytes, more than the "
                f"{MAX_INDEX >> 20} MiB paramstore reads."
            )
        with open_regular(path, "TensorFlow checkpoint index") as f:
            raw = f.read(st.st_size + 1)
        self.entries: dict[str, TFEntry] = {}
        self.skipped: dict[str, str] = {}
        self.shards = 0
        self.sliced: set[str] = set()
        try:
            self._parse(raw)
        except (_Bad, UnicodeDecodeError, IndexError, struct.error) as e:
            raise CheckpointError(
                f"TensorFlow checkpoint '{prefix}' is corrupt: its index {e}. Restore another "
                "checkpoint."
            ) from None

    def _parse(self, raw: bytes) -> None:
        sizes: dict[int, int] = {}
        rows = []
        for key, value in _table(raw):
            if not key:
                self._header(value)
                continue
            if key[0] == 0:  # a slice of a partitioned variable, stored under an encoded key
                continue
            rows.append((key.decode("utf-8", "surrogateescape"), value))
        if not self.shards:
            raise _Bad("has no header entry")
        for shard in range(self.shards):
            path = data_path(self.prefix, shard, self.shards)
            try:
                sizes[shard] = check_regular(path, "TensorFlow checkpoint data file").st_size
            except FileNotFoundError:
                sizes[shard] = -1  # an error only if an entry needs it
        for name, value in rows:
            self._entry(name, value, sizes)

    def _header(self, value: bytes) -> None:
        for field, _, v in _fields(value, 0, len(value)):
            if field == 1 and isinstance(v, int):
                self.shards = v
            elif field == 2 and v:
                raise _Bad("header says big-endian data, which paramstore does not read")
        if not 1 <= self.shards <= MAX_SHARDS:
            raise _Bad(f"header claims {self.shards} data files")

    def _entry(self, name: str, value: bytes, sizes: dict[int, int]) -> None:
        dtype_code, shape, shard, offset, size, slices = _bundle_entry(value)
        if name == _OBJECT_GRAPH:
            return
        if dtype_code in _UNREADABLE or dtype_code not in DTYPES:
            why = _UNREADABLE.get(dtype_code, f"TensorFlow dtype enum {dtype_code}, unsupported")
            self.skipped[name] = why
            return
        dtype = DTYPES[dtype_code]
        count = math.prod(shape)
        if slices:
            _slices(slices, shape)
            self.sliced.add(name)
            nbytes = 0 if dtype == STRING else count * dtype.itemsize
            self.entries[name] = TFEntry(name, shape, dtype, nbytes, 0, 0, 0)
            return
        if not 0 <= shard < self.shards:
            raise _Bad(f"entry '{name}' names data file {shard} of {self.shards}")
        if sizes[shard] < 0:
            raise _Bad(f"entry '{name}' is in a data file that does not exist")
        if offset < 0 or size < 0 or offset + size > sizes[shard]:
            raise _Bad(
                f"entry '{name}' claims bytes [{offset}, +{size}) of a {sizes[shard]}-byte "
                "data file"
            )
        if dtype == STRING:
            if count + 4 > size and (count or size):
                raise _Bad(f"entry '{name}' has {size} bytes for {count} strings")
            nbytes = size
        else:
            nbytes = count * dtype.itemsize
            if nbytes != size:
                raise _Bad(
                    f"entry '{name}' has {size} bytes, but shape {list(shape)} of "
                    f"{dtype.name} needs {nbytes}"
                )
        self.entries[name] = TFEntry(name, shape, dtype, nbytes, shard, offset, size)


def is_prefix(path: str) -> bool:
    """Whether ``path`` is a TensorFlow checkpoint prefix (``<path>.index`` exists) or its
    ``.index`` file."""
    return os.path.exists(path + ".index") or (path.endswith(".index") and os.path.exists(path))
