"""Keras ``.weights.h5`` files, read-only (private; docs/checkpoints.md, "TensorFlow users'
files"). A ``checkpoint.format.Reader`` whose names are the HDF5 dataset paths
(``layers/dense/vars/0``).

An HDF5 file can point elsewhere and claim sizes it does not hold, so every dataset is
checked when the file is opened, before anything is allocated or read:

* links: only hard links; a soft or external link (``h5py.SoftLink``/``ExternalLink``) is
  refused, and so are virtual datasets and datasets with external storage (which would read
  other files: ``/etc/passwd``, a FIFO, ``/dev/zero``);
* dtypes: fixed-size numbers, or fixed-length byte strings; variable-length data, object
  references, array, compound, enum and opaque dtypes are refused, naming the dataset;
* sizes: a dataset's bytes (shape x itemsize) must be stored in the file: without filters,
  its allocated storage must hold them (a dataset never written, read as its fill value, is
  refused); with filters (gzip...), they may be at most ``MAX_INFLATE`` times its stored bytes
  plus ``INFLATE_SLACK``; and never more than the file's own size times ``MAX_INFLATE``;
* at most ``MAX_OBJECTS`` links are visited.

HDF5 stores no checksum unless the writer asked for the Fletcher-32 filter (Keras does not),
so a value is verified only where its dataset has that filter. h5py is optional (``pip
install 'paramstore[tensorflow]'``) and imported on first use.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from paramstore.checkpoint.format import STRING, CheckpointError, Entry, PathLike, no_such_variable
from paramstore.checkpoint.formats.tensorflow.checkpoint import import_optional, strings_array
from paramstore.checkpoint.io import check_regular
from paramstore.checkpoint.placement import place

MAX_INFLATE = 16  # a filtered dataset may decompress to at most 16x its stored bytes ...
INFLATE_SLACK = 1 << 20  # ... plus 1 MiB (small tensors of zeros compress far better)
MAX_OBJECTS = 1_000_000  # links visited in one file
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


def is_hdf5(path: str) -> bool:
    """Whether the regular file ``path`` starts with the HDF5 signature (False for anything
    else, a FIFO included: it is never opened)."""
    try:
        check_regular(path)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, CheckpointError):
        return False
    try:
        return os.read(fd, 8) == HDF5_MAGIC
    except OSError:
        return False
    finally:
        os.close(fd)


class KerasWeights:
    """A Keras ``.weights.h5`` file (``model.save_weights``), by HDF5 dataset path, with
    every dataset checked when it is opened (see the module docstring)."""

    def __init__(self, path: PathLike) -> None:
        self.path = os.fspath(path)
        h5py = import_optional("h5py", "Keras .weights.h5 files")
        self._h5py = h5py
        self._size = check_regular(self.path, "HDF5 file").st_size
        try:
            self._file = h5py.File(self.path, "r")
        except (OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"HDF5 file '{self.path}' is corrupt: {e}.") from None
        try:
            self._datasets: dict[str, Any] = {}
            self.entries: dict[str, Entry] = {}
            self._walk()
        except CheckpointError:
            self._file.close()
            raise
        except Exception as e:  # h5py raises many types for a damaged file
            self._file.close()
            raise CheckpointError(
                f"HDF5 file '{self.path}' is corrupt: {type(e).__name__}: {e}."
            ) from None
        self.description = "Keras .weights.h5 (read-only)"

    def _refuse(self, name: str, why: str) -> CheckpointError:
        return CheckpointError(
            f"HDF5 file '{self.path}': '{name}' {why}; paramstore reads only datasets stored "
            "in the file itself, of fixed-size numbers or byte strings, as Keras writes them."
        )

    def _walk(self) -> None:
        """Visit every link from the root with h5py's low-level API (the high-level
        ``visititems`` + ``file[name]`` costs more per dataset); each group once."""
        seen: set[int] = set()
        stack: list[tuple[Any, str]] = [(self._file.id, "")]
        count = 0
        while stack:
            gid, prefix = stack.pop()
            for raw in gid:
                count += 1
                if count > MAX_OBJECTS:
                    raise CheckpointError(
                        f"HDF5 file '{self.path}' has more than {MAX_OBJECTS:,} objects."
                    )
                name = prefix + raw.decode("utf-8", "surrogateescape")
                self._check_link(gid, raw, name)
                oid = self._h5py.h5o.open(gid, raw)
                if isinstance(oid, self._h5py.h5g.GroupID):
                    addr = self._h5py.h5o.get_info(oid).addr
                    if addr not in seen:  # a group linked twice (or a cycle): once
                        seen.add(addr)
                        stack.append((oid, name + "/"))
                elif isinstance(oid, self._h5py.h5d.DatasetID):
                    self.entries[name] = self._check(name, oid)
                    self._datasets[name] = oid

    def _check_link(self, gid: Any, raw: bytes, name: str) -> None:
        h5l = self._h5py.h5l
        kind = gid.links.get_info(raw).type
        if kind == h5l.TYPE_SOFT:
            target = gid.links.get_val(raw).decode("utf-8", "replace")
            raise self._refuse(name, f"is a soft link (to '{target}')")
        if kind == h5l.TYPE_EXTERNAL:
            target = gid.links.get_val(raw)[0].decode("utf-8", "replace")
            raise self._refuse(name, f"is an external link (to '{target}')")
        if kind != h5l.TYPE_HARD:
            raise self._refuse(name, "is a user-defined link")

    def _check(self, name: str, oid: Any) -> Entry:
        h5py = self._h5py
        dcpl = oid.get_create_plist()
        if dcpl.get_layout() == h5py.h5d.VIRTUAL:
            raise self._refuse(name, "is a virtual dataset (its data lives in other files)")
        if dcpl.get_external_count():
            raise self._refuse(name, "has external storage (its data lives in another file)")
        dt = oid.dtype
        if h5py.check_vlen_dtype(dt) is not None or (
            h5py.check_string_dtype(dt) is not None and dt.kind == "O"
        ):
            raise self._refuse(name, "holds variable-length data")
        if h5py.check_ref_dtype(dt) is not None:
            raise self._refuse(name, "holds object references")
        if dt.subdtype is not None:
            raise self._refuse(name, f"has the array dtype {dt}")
        if dt.names is not None or dt.kind not in "biufcS" or h5py.check_enum_dtype(dt):
            raise self._refuse(name, f"has the dtype {dt}")
        if oid.shape is None:
            raise self._refuse(name, "has no dataspace")
        shape = tuple(int(d) for d in oid.shape)
        nbytes = math.prod(shape) * dt.itemsize
        stored = int(oid.get_storage_size())
        filtered = dcpl.get_nfilters() > 0
        limit = MAX_INFLATE * stored + INFLATE_SLACK if filtered else stored
        if nbytes and (nbytes > limit or nbytes > MAX_INFLATE * self._size):
            raise self._refuse(
                name,
                f"claims shape {list(shape)} of {dt} ({nbytes:,} bytes) but stores "
                f"{stored:,} bytes{' compressed' if filtered else ''} in a file of "
                f"{self._size:,} bytes",
            )
        dtype = STRING if dt.kind == "S" else np.dtype(dt)
        return Entry(name, shape, dtype, nbytes)

    def close(self) -> None:
        self._file.close()

    def load(self, wanted: Mapping[str, Any]) -> dict[str, Any]:
        values: dict[str, np.ndarray] = {}
        for name in wanted:
            if name not in self._datasets:
                raise no_such_variable(self.path, name, self.entries)
            try:
                arr = np.asarray(self._h5py.Dataset(self._datasets[name])[()])
            except Exception as e:  # a Fletcher-32 mismatch, a bad chunk
                raise CheckpointError(
                    f"HDF5 file '{self.path}' is corrupt: dataset '{name}' cannot be read "
                    f"({type(e).__name__}: {e})."
                ) from None
            if arr.shape != self.entries[name].shape:
                raise CheckpointError(
                    f"HDF5 file '{self.path}' is corrupt: dataset '{name}' read as shape "
                    f"{arr.shape}, not {self.entries[name].shape}."
                )
            values[name] = strings_array(arr) if arr.dtype.kind in "OS" else arr
        return place(values, wanted)
