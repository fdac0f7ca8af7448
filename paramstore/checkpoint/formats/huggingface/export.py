"""``export_safetensors``: variables as plain safetensors that ``safetensors`` and
``transformers`` load (private; the contract is the function's docstring and
docs/guides/pretrained.md).

Where the file(s) go: a ``path`` that is an existing directory receives Hugging Face's
names (``model.safetensors``, or shards ``model-00001-of-0000N.safetensors`` and
``model.safetensors.index.json``), replacing an earlier export's files there; any other
``path`` is the file itself, or, when the tensors are sharded, a new directory. Each file is
written aside (a temporary name), fsynced and renamed into place, the index last, and a new
directory is renamed into place whole, so a crash leaves the old export or the new one.
Every name, shape and dtype is checked before the first byte is written. Values are
streamed: one variable at a time is copied to the host (a sharded one gathered) and written.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from paramstore._collect import named
from paramstore.checkpoint.atomic import fsync_dir, temp_path
from paramstore.checkpoint.format import PathLike, dtype_name
from paramstore.checkpoint.formats.huggingface.read import INDEX, SINGLE
from paramstore.checkpoint.formats.safetensors.format import CODE_OF, check_name
from paramstore.checkpoint.io import BUFFER
from paramstore.checkpoint.namemap import Exported, NameMap
from paramstore.scope import default_store
from paramstore.variable import Variable

Names = Mapping[str, str | None] | Callable[[str], str | None] | NameMap
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def export_safetensors(
    path: PathLike,
    variables: Any,
    *,
    names: Names | None = None,
    max_shard_size: int | None = None,
) -> str:
    """Write ``variables`` as plain safetensors (see ``paramstore.checkpoint``'s
    ``export_safetensors``); returns the file or directory written."""
    path = os.fspath(path)
    if max_shard_size is not None and (
        isinstance(max_shard_size, bool)
        or not isinstance(max_shard_size, int)
        or max_shard_size < 1
    ):
        raise ValueError(
            f"export_safetensors: max_shard_size must be a positive number of bytes, got "
            f"{max_shard_size!r}."
        )
    tensors = _tensors(variables, names)
    shards = _plan(tensors, max_shard_size)
    if os.path.isdir(path):
        return _into_directory(path, shards)
    if len(shards) == 1:
        _write_file(path, shards[0])
        return path
    tmp = temp_path(path)
    try:
        os.makedirs(tmp)
        _write_shards(tmp, shards, aside=False)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(os.path.dirname(path))
    return path


Tensor = tuple[str, str, Any]  # (file name, where it came from, Variable or array)


def _tensors(variables: Any, names: Names | None) -> list[Tensor]:
    """``[(file name, source name, value)]``, every name checked, nothing read yet."""
    source = default_store() if variables is None else variables
    if isinstance(source, Mapping):
        items = list(source.items())
        for k, v in items:
            if not isinstance(k, str):
                raise TypeError(
                    f"export_safetensors: a name must be a str, got {type(k).__name__} {k!r}."
                )
            if not isinstance(v, (Variable, np.ndarray, jax.Array)):
                raise TypeError(
                    f"export_safetensors: '{k}' is a {type(v).__name__}; give Variables or arrays."
                )
    else:
        items = list(zip(*named(source)))
    if isinstance(names, NameMap):  # turned around: checkpoint names, inverse transforms
        renamed = names.exported(items)
    else:
        rename = _renamer(names, items)
        renamed = [(rename(k), k, v) for k, v in items]
    out: list[Tensor] = []
    taken: dict[str, str] = {}
    for file_name, key, value in renamed:
        if file_name is None:
            continue
        if not isinstance(file_name, str) or not file_name:
            raise TypeError(
                f"export_safetensors: variable '{key}' is named {file_name!r}; a name in the file "
                "must be a non-empty str (None leaves the variable out)."
            )
        check_name(file_name)
        if file_name in taken:
            raise ValueError(
                f"export_safetensors: variables '{taken[file_name]}' and '{key}' are both named "
                f"'{file_name}'; give each its own name."
            )
        taken[file_name] = key
        for source, _ in value.sources if isinstance(value, Exported) else ():
            _check_value(key, source)
        _check_value(key, value)
        out.append((file_name, key, value))
    if not out:
        raise ValueError("export_safetensors: no variable to export.")
    return out


def _renamer(names: Names | None, items: list[tuple[str, Any]]) -> Callable[[str], Any]:
    """``names`` (a dict or a callable) as a function full name -> file name."""
    if isinstance(names, Mapping):
        unknown = [k for k in names if k not in dict(items)]
        if unknown:
            raise ValueError(
                f"export_safetensors: names renames '{unknown[0]}', which is none of the "
                f"variables exported ({', '.join(k for k, _ in items[:5])}, ...)."
            )
        return lambda k: names.get(k, k)
    if callable(names):
        return names
    if names is None:
        return lambda k: k
    raise TypeError(
        "export_safetensors: names must be a dict, a callable or a ps.checkpoint.NameMap, got "
        f"{type(names).__name__}."
    )


def _check_value(key: str, value: Any) -> None:
    if isinstance(value, Variable) and value.is_abstract:
        raise ValueError(
            f"export_safetensors: variable '{key}' is abstract (no value yet); restore or "
            "ps.initialize it first."
        )
    dtype = np.dtype(value.dtype)
    if dtype not in CODE_OF:
        raise ValueError(
            f"export_safetensors: '{key}' has dtype {dtype_name(dtype)}, which safetensors "
            "cannot hold; leave it out (names=... returning None) or convert it."
        )
    if isinstance(value, Variable) and not value.value().is_fully_addressable:
        raise ValueError(
            f"export_safetensors: variable '{key}' spans several processes; one process cannot "
            "write it. Save a sharded checkpoint (ps.Saver(..., sharded=True)) instead."
        )


def _nbytes(t: Tensor) -> int:
    value = t[2]
    return int(np.prod(value.shape, dtype=np.int64)) * int(np.dtype(value.dtype).itemsize)


def _plan(tensors: list[Tensor], max_shard_size: int | None) -> list[list[Tensor]]:
    """Tensors in shards of at most ``max_shard_size`` bytes (a bigger tensor alone)."""
    if max_shard_size is None:
        return [tensors]
    shards: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        n = _nbytes(t)
        if shards[-1] and size + n > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


def _header(shard: list[Tensor]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, _, value in shard:
        end = offset + _nbytes((name, "", value))
        header[name] = {
            "dtype": CODE_OF[np.dtype(value.dtype)],
            "shape": [int(d) for d in value.shape],
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _host(value: Any) -> np.ndarray:
    """The value on the host, little-endian and contiguous (a sharded one gathered)."""
    x = value.value() if isinstance(value, Variable) else value
    arr = np.ascontiguousarray(np.asarray(x))
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False)


def _write_file(path: str, shard: list[Tensor]) -> None:
    """``shard`` as one safetensors file at ``path``, written aside and renamed."""
    tmp = _write_aside(path, shard)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def _write_aside(path: str, shard: list[Tensor]) -> str:
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "xb", buffering=BUFFER) as f:
            f.write(_header(shard))
            for _, _, value in shard:  # one at a time: at most one host copy alive
                arr = _host(value)
                f.write(arr.reshape(-1).view(np.uint8).data)
                del arr
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _write_shards(directory: str, shards: list[list[Tensor]], aside: bool) -> list[str]:
    """The shard files and the index in ``directory``; ``aside``: each under a temporary
    name, returned as ``[temporary path]`` (in shard order, the index last) to rename."""
    n = len(shards)
    written: list[str] = []
    try:
        weight_map: dict[str, str] = {}
        total = 0
        for i, shard in enumerate(shards):
            target = os.path.join(directory, _shard_name(i, n))
            tmp = _write_aside(target, shard)
            written.append(tmp)
            if not aside:
                os.replace(tmp, target)
            for t in shard:
                weight_map[t[0]] = _shard_name(i, n)
                total += _nbytes(t)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        target = os.path.join(directory, INDEX)
        tmp = temp_path(target)
        written.append(tmp)
        with open(tmp, "x") as f:
            json.dump(index, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        if not aside:
            os.replace(tmp, target)
    except BaseException:
        for tmp in written:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    return written


def _into_directory(directory: str, shards: list[list[Tensor]]) -> str:
    """Hugging Face's file names in an existing directory; the files of an earlier export
    there that the new one does not use are removed once the new one is in place."""
    before = set(os.listdir(directory))
    if len(shards) == 1:
        _write_file(os.path.join(directory, SINGLE), shards[0])
        keep = {SINGLE}
    else:
        temps = _write_shards(directory, shards, aside=True)
        targets = [_shard_name(i, len(shards)) for i in range(len(shards))] + [INDEX]
        for tmp, target in zip(temps, targets):  # the index last: it commits the export
            os.replace(tmp, os.path.join(directory, target))
        keep = set(targets)
    for stale in sorted(before - keep):
        if stale in (SINGLE, INDEX) or _SHARD_RE.match(stale):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, stale))
    fsync_dir(directory)
    return directory
