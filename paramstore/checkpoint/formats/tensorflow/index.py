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

import ml_dtypes
import numpy as np

from paramstore.checkpoint.format import STRING, CheckpointError
from paramstore.checkpoint.formats.tensorflow.proto import (
    Bad,
    bundle_entry,
    fields,
    slices_fit,
    table,
)
from paramstore.checkpoint.io import check_regular, open_regular

MAX_INDEX = 1 << 30  # an index larger than this is refused before it is read
MAX_SHARDS = 100_000
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
        except (Bad, UnicodeDecodeError, IndexError, struct.error) as e:
            raise CheckpointError(
                f"TensorFlow checkpoint '{prefix}' is corrupt: its index {e}. Restore another "
                "checkpoint."
            ) from None

    def _parse(self, raw: bytes) -> None:
        sizes: dict[int, int] = {}
        rows = []
        for key, value in table(raw):
            if not key:
                self._header(value)
                continue
            if key[0] == 0:  # a slice of a partitioned variable, stored under an encoded key
                continue
            rows.append((key.decode("utf-8", "surrogateescape"), value))
        if not self.shards:
            raise Bad("has no header entry")
        for shard in range(self.shards):
            path = data_path(self.prefix, shard, self.shards)
            try:
                sizes[shard] = check_regular(path, "TensorFlow checkpoint data file").st_size
            except FileNotFoundError:
                sizes[shard] = -1  # an error only if an entry needs it
        for name, value in rows:
            self._entry(name, value, sizes)

    def _header(self, value: bytes) -> None:
        for field, _, v in fields(value, 0, len(value)):
            if field == 1 and isinstance(v, int):
                self.shards = v
            elif field == 2 and v:
                raise Bad("header says big-endian data, which paramstore does not read")
        if not 1 <= self.shards <= MAX_SHARDS:
            raise Bad(f"header claims {self.shards} data files")

    def _entry(self, name: str, value: bytes, sizes: dict[int, int]) -> None:
        dtype_code, shape, shard, offset, size, slices = bundle_entry(value)
        if name == _OBJECT_GRAPH:
            return
        if dtype_code in _UNREADABLE or dtype_code not in DTYPES:
            why = _UNREADABLE.get(dtype_code, f"TensorFlow dtype enum {dtype_code}, unsupported")
            self.skipped[name] = why
            return
        dtype = DTYPES[dtype_code]
        count = math.prod(shape)
        if slices:
            slices_fit(slices, shape)
            self.sliced.add(name)
            nbytes = 0 if dtype == STRING else count * dtype.itemsize
            self.entries[name] = TFEntry(name, shape, dtype, nbytes, 0, 0, 0)
            return
        if not 0 <= shard < self.shards:
            raise Bad(f"entry '{name}' names data file {shard} of {self.shards}")
        if sizes[shard] < 0:
            raise Bad(f"entry '{name}' is in a data file that does not exist")
        if offset < 0 or size < 0 or offset + size > sizes[shard]:
            raise Bad(
                f"entry '{name}' claims bytes [{offset}, +{size}) of a {sizes[shard]}-byte "
                "data file"
            )
        if dtype == STRING:
            if count + 4 > size and (count or size):
                raise Bad(f"entry '{name}' has {size} bytes for {count} strings")
            nbytes = size
        else:
            nbytes = count * dtype.itemsize
            if nbytes != size:
                raise Bad(
                    f"entry '{name}' has {size} bytes, but shape {list(shape)} of "
                    f"{dtype.name} needs {nbytes}"
                )
        self.entries[name] = TFEntry(name, shape, dtype, nbytes, shard, offset, size)


def is_prefix(path: str) -> bool:
    """Whether ``path`` is a TensorFlow checkpoint prefix (``<path>.index`` exists) or its
    ``.index`` file."""
    return os.path.exists(path + ".index") or (path.endswith(".index") and os.path.exists(path))
