"""TensorFlow checkpoints, read-only: TF1 ``Saver`` / TF2 ``tf.train.Checkpoint`` prefixes
(see docs/checkpoints.md, "TensorFlow users' files"; Keras ``.weights.h5`` files are in
``paramstore.checkpoint.formats.tensorflow.keras``).

A ``checkpoint.format.Reader``. Names are the checkpoint's keys (``dense/kernel``,
``model/layer/.ATTRIBUTES/VARIABLE_VALUE``; the serialized object graph
``_CHECKPOINTABLE_OBJECT_GRAPH`` is left out). The index is parsed and checked in Python
(``paramstore.checkpoint.formats.tensorflow.index``), so listing needs no TensorFlow and TensorFlow never sees an
index paramstore has not checked; entries that are not tensors of numbers or strings
(``DT_VARIANT``, ``DT_RESOURCE``) are listed in ``skipped`` and loading one is a
CheckpointError naming it. Values are read by TensorFlow (``pip install
'paramstore[tensorflow]'``, imported with ``importlib`` on first load), which checks its
own per-tensor CRC32C (a mismatch is a CheckpointError here).
"""

from __future__ import annotations

import codecs
import importlib
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from paramstore.checkpoint.format import STRING, CheckpointError, PathLike, no_such_variable
from paramstore.checkpoint.formats.tensorflow.index import TFEntry, TFIndex, data_path, is_prefix
from paramstore.checkpoint.io import check_regular, open_regular
from paramstore.checkpoint.placement import place

__all__ = [
    "TensorFlowCheckpoint",
    "is_prefix",
    "is_checkpoint_dir",
    "import_optional",
    "strings_array",
]

_INSTALL = "pip install 'paramstore[tensorflow]' (tensorflow-cpu and h5py)"
_MAX_STATE = 1 << 20  # the bytes of a directory's "checkpoint" file paramstore reads
_LATEST = re.compile(rb'^\s*model_checkpoint_path:\s*"((?:[^"\\]|\\.)*)"', re.M)


def import_optional(name: str, what: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"Reading {what} needs {name}: {_INSTALL}. ({e})") from e


def is_checkpoint_dir(path: str) -> bool:
    """Whether ``path`` is a directory TensorFlow saved into (it has a ``checkpoint`` file)."""
    return os.path.isfile(os.path.join(path, "checkpoint"))


def latest(directory: str) -> str:
    """The prefix a directory's ``checkpoint`` state file names (as
    ``tf.train.latest_checkpoint``, without TensorFlow; relative paths are relative to
    ``directory``, and a moved directory's own copy is preferred)."""
    state = os.path.join(directory, "checkpoint")
    st = check_regular(state, "TensorFlow checkpoint state file")
    with open_regular(state, "TensorFlow checkpoint state file") as f:
        text = f.read(min(st.st_size, _MAX_STATE))
    m = _LATEST.search(text)
    if m is None:
        raise CheckpointError(f"TensorFlow checkpoint directory '{directory}' names no checkpoint.")
    try:
        name = codecs.escape_decode(m[1])[0].decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"TensorFlow checkpoint state '{state}' is corrupt.") from None
    prefix = os.path.join(directory, name)
    if not is_prefix(prefix):
        prefix = os.path.join(directory, os.path.basename(name))
    if not is_prefix(prefix):
        raise CheckpointError(
            f"TensorFlow checkpoint directory '{directory}' names '{name}', which is not there."
        )
    return prefix


def strings_array(arr: np.ndarray) -> np.ndarray:
    """TensorFlow's bytes objects as a read-only NumPy string array."""
    flat = [b.decode("utf-8", "surrogateescape") for b in arr.reshape(-1).tolist()]
    out = np.array(flat, dtype=STRING).reshape(arr.shape)
    out.flags.writeable = False
    return out


class TensorFlowCheckpoint:
    """A TF1 ``Saver`` or TF2 ``tf.train.Checkpoint`` checkpoint (a prefix, its ``.index``
    file, or a directory with a ``checkpoint`` file: its latest)."""

    def __init__(self, path: PathLike) -> None:
        where = os.fspath(path)
        if os.path.isdir(where):
            where = latest(where)
        self.path = where.removesuffix(".index")
        index = TFIndex(self.path)
        self._index = index
        self.entries: dict[str, TFEntry] = index.entries
        self.skipped: dict[str, str] = index.skipped
        self.description = "TensorFlow checkpoint (read-only)"
        self._reader: Any = None

    def close(self) -> None:
        self._reader = None

    def _tf_reader(self) -> Any:
        if self._reader is None:
            tf = import_optional("tensorflow", "the values of TensorFlow checkpoints")
            try:
                self._reader = tf.train.load_checkpoint(self.path)
            except Exception as e:  # tf.errors.*
                raise CheckpointError(
                    f"TensorFlow checkpoint '{self.path}' is corrupt or unreadable: "
                    f"{type(e).__name__}: {e}"
                ) from None
        return self._reader

    def _check_strings(self, e: TFEntry) -> None:
        """A string tensor's lengths must add up to its bytes before TensorFlow allocates
        them (each length is a varint; a crafted one could claim exabytes)."""
        if e.name in self._index.sliced or not e.size:
            return
        path = data_path(self.path, e.shard, self._index.shards)
        with open_regular(path, "TensorFlow checkpoint data file") as f:
            f.seek(e.offset)
            raw = f.read(e.size)
        pos, total, count = 0, 0, int(np.prod(e.shape))
        for _ in range(count):
            length = shift = 0
            while True:
                if pos >= len(raw) or shift > 63:
                    raise CheckpointError(
                        f"TensorFlow checkpoint '{self.path}' is corrupt: the string lengths "
                        f"of '{e.name}' run past its data."
                    )
                b = raw[pos]
                pos += 1
                length |= (b & 0x7F) << shift
                shift += 7
                if b < 0x80:
                    break
            total += length
        if pos + 4 + total != len(raw):
            raise CheckpointError(
                f"TensorFlow checkpoint '{self.path}' is corrupt: the strings of '{e.name}' "
                f"claim {total} bytes; its data holds {len(raw) - pos - 4}."
            )

    def load(self, wanted: Mapping[str, Any]) -> dict[str, Any]:
        for name in wanted:
            if name in self.skipped:
                raise CheckpointError(
                    f"TensorFlow checkpoint '{self.path}': entry '{name}' holds "
                    f"{self.skipped[name]}; paramstore reads only tensors of numbers and "
                    "strings. Leave it out of the names to restore."
                )
            if name not in self.entries:
                raise no_such_variable(self.path, name, self.entries)
            if self.entries[name].dtype == STRING:
                self._check_strings(self.entries[name])
        reader: Any = self._tf_reader() if wanted else None
        values: dict[str, np.ndarray] = {}
        for name in wanted:
            try:
                arr = np.asarray(reader.get_tensor(name))
            except Exception as e:  # tf.errors.DataLossError: a CRC32C mismatch
                raise CheckpointError(
                    f"TensorFlow checkpoint '{self.path}' is corrupt: variable '{name}' "
                    f"cannot be read ({type(e).__name__}: {e})."
                ) from None
            if arr.shape != self.entries[name].shape:
                raise CheckpointError(
                    f"TensorFlow checkpoint '{self.path}' is corrupt: variable '{name}' read "
                    f"as shape {arr.shape}, its index says {self.entries[name].shape}."
                )
            values[name] = strings_array(arr) if arr.dtype == object else arr
        return place(values, wanted)
