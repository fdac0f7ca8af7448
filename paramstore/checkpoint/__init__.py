"""Checkpoints: ``Saver``, ``CheckpointManager``, ``list_variables``, ``load_variable``.

(``ps.Checkpoint``, object-based, is in ``paramstore.checkpoint.objects``. This module is
the public face; the work is in private modules with one job each: ``checkpoint.saver``
(Saver and the restore steps), ``checkpoint.manager`` (CheckpointManager),
``checkpoint.readers`` (which format is on disk), ``checkpoint.formats.safetensors.file`` (the single-file
format's reader and writer) over ``checkpoint.formats.safetensors.format`` (the format), ``checkpoint.io`` (the I/O
engine) and ``checkpoint.placement`` (device placement); ``checkpoint.formats.orbax.format`` and ``checkpoint.formats.tensorflow.checkpoint`` are the
other formats' readers, all implementing ``paramstore.checkpoint.format.Reader``.)

Contract (the file format is described in docs/checkpoints.md):

* A checkpoint is one standard safetensors file (readable by ``safetensors.safe_open``):
  an 8-byte little-endian header length, a JSON header, then the raw little-endian bytes
  of each tensor. paramstore adds, in the header's ``__metadata__``, a format version and,
  per tensor, an XXH3-64 of its bytes (checked on every load) and the true dtype and shape of
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
  of a directory, by the order they were written in (a rollback's saves are kept; the
  order is each checkpoint's modification time, which the manager keeps increasing). The
  directory itself is the index (it is scanned, temporary files are ignored and the
  leftovers of failed or killed saves removed, never a live writer's), so a new manager
  continues where an old one stopped. With ``async_save=True`` the host copy is taken
  inside ``save`` and the file written by a background thread; ``wait()`` (also run at
  interpreter exit, before Python stops its threads) flushes it and re-raises the error of
  a failed background write, as does the next ``save``.
* A full or read-only disk fails a save with an ``OSError`` naming the checkpoint; the
  previous checkpoint at that path is unchanged. A restore of a path that another process
  replaces or prunes meanwhile reads a complete checkpoint (``checkpoint.readers``).
* Sharded checkpoints (docs/sharding.md): where ``jax.process_count() > 1``, or with
  ``Saver(..., sharded=True)``, a checkpoint is instead an Orbax directory (see
  ``paramstore.checkpoint.formats.orbax.format``) in which each process writes only its own shards; the same
  ``Saver``/``CheckpointManager``/``list_variables``/``load_variable`` API reads and writes
  it, and restoring recognises the format from what is on disk. ``restore(...,
  sharding=...)`` restores onto new shardings (another mesh), checked before anything is
  read.
* Pretrained weights (docs/guides/pretrained.md): ``init_from_checkpoint`` is TF1's warm
  start (assignment maps, regex pairs, transforms, casts) from every format above and from
  Hugging Face safetensors (a file, a ``model.safetensors.index.json`` with its shards, or a
  directory holding either; read with ``allow_unverified=True``, which ``list_variables``,
  ``load_variable`` and ``Saver.restore`` accept too); ``export_safetensors`` writes plain
  safetensors in Hugging Face's layout.
"""

from __future__ import annotations

import numpy as np

from paramstore.checkpoint.format import CheckpointError, PathLike, no_such_variable
from paramstore.checkpoint.formats.huggingface import export as _export
from paramstore.checkpoint.formats.safetensors.file import write_arrays
from paramstore.checkpoint.formats.safetensors.format import FORMAT_VERSION
from paramstore.checkpoint.manager import CheckpointManager
from paramstore.checkpoint.namemap import NameMap
from paramstore.checkpoint.readers import open_reader, opened
from paramstore.checkpoint.saver import Saver
from paramstore.checkpoint.transforms import Transform, chain, split, transpose
from paramstore.checkpoint.warm_start import init_from_checkpoint
from paramstore.typing import VariablesLike

__all__ = [
    "Saver",
    "CheckpointManager",
    "CheckpointError",
    "list_variables",
    "load_variable",
    "init_from_checkpoint",
    "export_safetensors",
    "NameMap",
    "Transform",
    "transpose",
    "split",
    "chain",
    "open_reader",
    "write_arrays",
    "read_arrays",
    "FORMAT_VERSION",
]


def list_variables(
    path: PathLike, *, allow_unverified: bool = False
) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """``[(name, shape, dtype)]`` of a checkpoint, sorted by name, read from its header or
    metadata only.

    ``path`` is a checkpoint file, a sharded checkpoint directory, a CheckpointManager
    directory (its latest checkpoint), a TensorFlow checkpoint prefix or a Keras
    ``.weights.h5`` file (both need ``paramstore[tensorflow]``). String variables have dtype
    ``np.dtypes.StringDType()``. A safetensors file without paramstore checksums is read
    only with ``allow_unverified=True``.
    """
    with opened(path, allow_unverified) as r:
        return sorted((e.name, e.shape, e.dtype) for e in r.entries.values())


def load_variable(path: PathLike, name: str, *, allow_unverified: bool = False) -> np.ndarray:
    """The value of variable ``name`` in a checkpoint (any ``list_variables`` accepts),
    checked against its checksum; strings come back as a NumPy string array. Raises
    CheckpointError if absent or corrupt."""
    with opened(path, allow_unverified) as r:
        if name not in r.entries and name not in getattr(r, "skipped", {}):
            raise no_such_variable(r.path, name, r.entries)
        value: np.ndarray = r.load({name: None})[name]
        return value


def read_arrays(path: PathLike, *, allow_unverified: bool = False) -> dict[str, np.ndarray]:
    """Every value of a checkpoint as ``{name: NumPy array}`` (checksums verified)."""
    with opened(path, allow_unverified) as r:
        return r.load(dict.fromkeys(r.entries))


def export_safetensors(
    path: PathLike,
    variables: VariablesLike | None,
    *,
    names: _export.Names | None = None,
    max_shard_size: int | None = None,
) -> str:
    """Write ``variables`` as plain safetensors that the ``safetensors`` library and
    ``transformers`` load, with the variables' dtypes (bfloat16 included) and no paramstore
    metadata (``__metadata__`` is ``{"format": "pt"}``, as ``transformers`` expects).

    ``variables``: any collection ``ps.Saver`` accepts (None: the default store's live
    variables; a dict ``{name: Variable}``, whose values may also be arrays; a list; a
    Module). ``names``: a dict (its keys must be names of ``variables``; a variable it does
    not list keeps its name) or a callable mapping a full name to the name in the file,
    ``None`` to leave the variable out; or a ``NameMap``, turned around (each variable, each
    layer of a stacked one, under the checkpoint name its rule gives, through the inverse
    transform; a variable no rule reaches raises ValueError). ``max_shard_size`` (bytes): when the tensors exceed
    it, they are split into ``model-00001-of-0000N.safetensors`` files (a tensor bigger than
    that alone in its file) with ``model.safetensors.index.json`` (``metadata.total_size``,
    ``weight_map``), in directory ``path``. A ``path`` that is an existing directory (a
    Hugging Face model directory) receives ``model.safetensors`` or the shards and index,
    and the files of an earlier export there that the new one does not use are removed.

    Atomic: every name, shape and dtype is checked before anything is written (two
    variables for one name, a name that is not a str, a dtype safetensors lacks: ValueError
    or TypeError, nothing written); each file is written aside and renamed into place (the
    index last; a new shard directory renamed whole). Streaming: one variable at a time is
    copied to the host (a sharded one gathered) and written. Returns the path written."""
    return _export.export_safetensors(path, variables, names=names, max_shard_size=max_shard_size)
