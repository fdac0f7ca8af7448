"""TensorFlow users' files, read-only: TF1 ``Saver`` / TF2 ``tf.train.Checkpoint`` prefixes
and Keras ``.weights.h5`` files (see docs/checkpoints.md, "TensorFlow users' files").

Both are ``_format.Reader`` s. Names are the file's own: a TensorFlow checkpoint's keys
(``dense/kernel``, ``model/layer/.ATTRIBUTES/VARIABLE_VALUE``; the serialized object graph
``_CHECKPOINTABLE_OBJECT_GRAPH`` is left out) and a ``.weights.h5`` file's HDF5 dataset
paths (``layers/dense/vars/0``). TensorFlow checks its own per-tensor CRC32C on every read
(a mismatch is a CheckpointError here). HDF5 stores no checksum unless the writer asked for
the Fletcher-32 filter (Keras does not), so a ``.weights.h5`` value is verified only where
its dataset has that filter; its structure is still checked.

TensorFlow and h5py are optional (``pip install 'paramstore[tensorflow]'``) and imported
with ``importlib`` on first use, never by ``import paramstore``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from paramstore._checkpoint_placement import place
from paramstore._format import STRING, CheckpointError, Entry, PathLike, no_such_variable

_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
_OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"
_INSTALL = "pip install 'paramstore[tensorflow]' (tensorflow-cpu and h5py)"


def _import(name: str, what: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"Reading {what} needs {name}: {_INSTALL}. ({e})") from e


def is_prefix(path: str) -> bool:
    """Whether ``path`` is a TensorFlow checkpoint prefix (``<path>.index`` exists) or its
    ``.index`` file."""
    return os.path.isfile(path + ".index") or (path.endswith(".index") and os.path.isfile(path))


def is_checkpoint_dir(path: str) -> bool:
    """Whether ``path`` is a directory TensorFlow saved into (it has a ``checkpoint`` file)."""
    return os.path.isfile(os.path.join(path, "checkpoint"))


def is_hdf5(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(8) == _HDF5_MAGIC
    except OSError:
        return False


def _strings(arr: np.ndarray) -> np.ndarray:
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
        tf = _import("tensorflow", "TensorFlow checkpoints")
        if os.path.isdir(where):
            latest = tf.train.latest_checkpoint(where)
            if latest is None:
                raise CheckpointError(f"TensorFlow checkpoint directory '{where}' has none.")
            where = latest
        self.path = where.removesuffix(".index")
        try:
            self._reader = tf.train.load_checkpoint(self.path)
            shapes = self._reader.get_variable_to_shape_map()
            dtypes = self._reader.get_variable_to_dtype_map()
        except Exception as e:  # tf.errors.*: a corrupt or foreign index
            raise CheckpointError(
                f"TensorFlow checkpoint '{self.path}' is corrupt or unreadable: "
                f"{type(e).__name__}: {e}"
            ) from None
        self.entries: dict[str, Entry] = {}
        for name, shape in shapes.items():
            if name == _OBJECT_GRAPH:
                continue
            dt = dtypes[name]
            dtype = STRING if dt.name == "string" else np.dtype(dt.as_numpy_dtype)
            nbytes = 0 if dtype == STRING else int(np.prod(shape)) * dtype.itemsize
            self.entries[name] = Entry(name, tuple(int(d) for d in shape), dtype, nbytes)
        self.description = "TensorFlow checkpoint (read-only)"

    def close(self) -> None:
        pass

    def load(self, wanted: Mapping[str, Any]) -> dict[str, Any]:
        values: dict[str, np.ndarray] = {}
        for name in wanted:
            if name not in self.entries:
                raise no_such_variable(self.path, name, self.entries)
            try:
                arr = np.asarray(self._reader.get_tensor(name))
            except Exception as e:  # tf.errors.DataLossError: a CRC32C mismatch
                raise CheckpointError(
                    f"TensorFlow checkpoint '{self.path}' is corrupt: variable '{name}' "
                    f"cannot be read ({type(e).__name__}: {e})."
                ) from None
            values[name] = _strings(arr) if arr.dtype == object else arr
        return place(values, wanted)


class KerasWeights:
    """A Keras ``.weights.h5`` file (``model.save_weights``), by HDF5 dataset path."""

    def __init__(self, path: PathLike) -> None:
        self.path = os.fspath(path)
        h5py = _import("h5py", "Keras .weights.h5 files")
        try:
            self._file = h5py.File(self.path, "r")
        except OSError as e:
            raise CheckpointError(f"HDF5 file '{self.path}' is corrupt: {e}.") from None
        self._datasets: dict[str, Any] = {}
        self._file.visititems(self._visit)
        self.entries = {}
        for name, ds in self._datasets.items():
            dtype = STRING if ds.dtype.kind in "OS" else np.dtype(ds.dtype)
            self.entries[name] = Entry(name, tuple(ds.shape), dtype, int(ds.nbytes))
        self.description = "Keras .weights.h5 (read-only)"

    def _visit(self, name: str, obj: Any) -> None:
        if hasattr(obj, "dtype") and hasattr(obj, "shape"):
            self._datasets[name] = obj

    def close(self) -> None:
        self._file.close()

    def load(self, wanted: Mapping[str, Any]) -> dict[str, Any]:
        values: dict[str, np.ndarray] = {}
        for name in wanted:
            if name not in self._datasets:
                raise no_such_variable(self.path, name, self.entries)
            try:
                arr = np.asarray(self._datasets[name][()])
            except (OSError, ValueError) as e:  # a Fletcher-32 mismatch, a bad chunk
                raise CheckpointError(
                    f"HDF5 file '{self.path}' is corrupt: dataset '{name}' cannot be read ({e})."
                ) from None
            values[name] = _strings(arr) if arr.dtype.kind in "OS" else arr
        return place(values, wanted)
