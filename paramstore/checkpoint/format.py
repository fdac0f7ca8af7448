"""The one interface every checkpoint format implements (private; see docs/checkpoints.md).

A format is a reader class opened on a path: ``entries`` (``{name: Entry}``, read from the
file's header or metadata alone) and ``load(wanted)``, which reads ``{name: placement}``
(a ``jax.sharding.Sharding``, or None for a NumPy array on the host) and returns
``{name: value}`` only once every value has been read and verified; it raises
``CheckpointError`` otherwise. Writable formats also have a module-level ``save``.
Implemented by ``checkpoint.formats.safetensors.file.SafetensorsFile`` (the default single file),
``checkpoint.formats.orbax.read.ShardedCheckpoint`` (Orbax directories) and, read-only,
``checkpoint.formats.tensorflow.checkpoint.TensorFlowCheckpoint`` / ``checkpoint.formats.tensorflow.checkpoint.KerasWeights``. ``paramstore.checkpoint.open_reader``
picks one from what is on disk.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import numpy as np

from paramstore._core.store import preview_names

PathLike = str | os.PathLike[str]
STRING = np.dtypes.StringDType()


class CheckpointError(ValueError):
    """A checkpoint file is malformed, corrupt, or does not fit the variables."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """What a checkpoint says of one value, before reading it."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int


class EntryInfo(Protocol):
    """What every format's entries provide (``Entry``, or a format's richer record)."""

    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> np.dtype: ...
    @property
    def nbytes(self) -> int: ...


class Reader(Protocol):
    """An open checkpoint of some format (see the module docstring)."""

    path: str
    description: str  # e.g. "paramstore file, format version 2"

    @property
    def entries(self) -> Mapping[str, EntryInfo]: ...

    def load(self, wanted: Mapping[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


def is_string(dt: np.dtype) -> bool:
    return isinstance(dt, np.dtypes.StringDType)


def dtype_name(dt: np.dtype) -> str:
    return "string" if is_string(dt) else dt.name


def suggest(name: str, names: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``names``, or ``""``."""
    close = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def no_such_variable(path: str, name: str, names: Iterable[str]) -> CheckpointError:
    names = sorted(names)
    return CheckpointError(
        f"Checkpoint '{path}' has no variable '{name}'{suggest(name, names)}. "
        f"Its variables: {preview_names(names)}."
    )


def lacks_variables(
    path: str, missing: list[str], names: Iterable[str], hint: str
) -> CheckpointError:
    """The one "lacks N variable(s)" error of Saver and Checkpoint restores."""
    return CheckpointError(
        f"Checkpoint '{path}' lacks {len(missing)} variable(s): {preview_names(missing)}"
        f"{suggest(missing[0], names)}. {hint}"
    )
