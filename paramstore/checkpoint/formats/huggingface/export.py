"""``export_safetensors``: variables as plain safetensors that ``safetensors`` and
``transformers`` load (private; the contract is the function's docstring and
docs/guides/pretrained.md).

Where the file(s) go: a ``path`` that is an existing directory receives Hugging Face's
names (``model.safetensors``, or shards ``model-00001-of-0000N.safetensors`` and
``model.safetensors.index.json``), replacing an earlier export's files there (and keeping
every other file: ``config.json``, tokenizer files); any other ``path`` is the file itself,
or, when the tensors are sharded, a new directory. Every name, shape and dtype is checked
before the first byte is written. Values are streamed: one variable at a time is copied to
the host (a sharded one gathered, a big-endian one byte-swapped) and written.

Atomic like every checkpoint (issue 36): each file is written under a temporary name and
fsynced first. A new file or directory is renamed into place whole. Into a directory, the
index is the one commit point of a sharded export (readers prefer ``model.safetensors``,
which is removed once a sharded export is committed): the new shards are renamed to names
the index on disk does not list, then the index naming them replaces the old one; where
those are the standard names the old export uses, the shards first go in under versioned
names (``model-00001-of-00002.<token>.safetensors``), the index naming them is committed,
then the standard names are linked to them and a second index commits those. So at every
instant (a crash, ``kill -9``) the index names a whole export, the old one or the new one.
The commit runs under the directory's lock (``checkpoint.atomic.directory_lock``: other
exports, in any process, wait) with Ctrl-C held back until it ends, and removes the files
of exports no index lists any more and the temporaries of killed exports. An export that
fails or is interrupted before its commit removes its temporaries.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import struct
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from paramstore._collect import named
from paramstore._core.interrupts import deferred
from paramstore.checkpoint.atomic import (
    directory_lock,
    fsync_dir,
    hold,
    live_temp,
    new_token,
    release,
    remove_path,
    remove_stale_temps,
    remove_temps,
    temp_path,
)
from paramstore.checkpoint.format import PathLike, dtype_name
from paramstore.checkpoint.formats.huggingface.read import INDEX, MAX_INDEX, SINGLE
from paramstore.checkpoint.formats.safetensors.format import CODE_OF, check_name
from paramstore.checkpoint.io import BUFFER
from paramstore.checkpoint.namemap import Exported, NameMap
from paramstore.scope import default_store
from paramstore.variable import Variable

Names = Mapping[str, str | None] | Callable[[str], str | None] | NameMap


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
    return _new_directory(path, shards)


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
    dtype = _native(value.dtype)
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
            "dtype": CODE_OF[_native(value.dtype)],
            "shape": [int(d) for d in value.shape],
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _native(dtype: Any) -> np.dtype:
    """``dtype`` in this machine's byte order (a big-endian float32 is a float32: it is
    written little-endian, as safetensors stores every value)."""
    dt: np.dtype = np.dtype(dtype)
    if dt.byteorder in "<>":
        dt = dt.newbyteorder("=")
    return dt


def _host(value: Any) -> np.ndarray:
    """The value on the host, little-endian and contiguous (a sharded one gathered)."""
    x = value.value() if isinstance(value, Variable) else value
    arr = np.ascontiguousarray(np.asarray(x))
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False)


def _write_file(path: str, shard: list[Tensor]) -> None:
    """``shard`` as one safetensors file at ``path``, written aside and renamed."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with live_temp(path) as tmp:
        try:
            _write_aside(tmp, shard)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    fsync_dir(directory)


def _write_aside(tmp: str, shard: list[Tensor]) -> None:
    """``shard`` as the new safetensors file ``tmp``, fsynced (removed if that fails)."""
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


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _index_text(shards: list[list[Tensor]], files: list[str]) -> bytes:
    """The index of ``shards`` stored in ``files`` (one file name per shard)."""
    weight_map = {t[0]: file for shard, file in zip(shards, files) for t in shard}
    total = sum(_nbytes(t) for shard in shards for t in shard)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(index, indent=2).encode()


def _stage(directory: str, shards: list[list[Tensor]], token: str) -> list[tuple[str, str]]:
    """Each shard written to a temporary in ``directory`` named with ``token``, marked in
    use (``checkpoint.atomic.hold``): ``[(its file name, its temporary)]``."""
    names = (
        [SINGLE] if len(shards) == 1 else [_shard_name(i, len(shards)) for i in range(len(shards))]
    )
    staged: list[tuple[str, str]] = []
    for name, shard in zip(names, shards):
        tmp = temp_path(os.path.join(directory, name), token)
        hold(tmp)
        staged.append((name, tmp))
        _write_aside(tmp, shard)
    return staged


def _into_directory(directory: str, shards: list[list[Tensor]]) -> str:
    """Hugging Face's file names in an existing directory, committed by the index (see the
    module docstring); an interrupt or an error before the commit removes every
    temporary and leaves the old export."""
    token = new_token()
    staged: list[tuple[str, str]] = []
    try:
        staged = _stage(directory, shards, token)
        with deferred():  # Ctrl-C: raised once the commit is whole
            _commit(directory, shards, staged, token)
    except BaseException:
        remove_temps(directory, token)
        raise
    finally:
        for _, tmp in staged:
            release(tmp)
    return directory


def _new_directory(path: str, shards: list[list[Tensor]]) -> str:
    """A sharded export at ``path``, where no directory is: written whole into a staging
    directory beside it and renamed into place; if another export made the directory
    meanwhile, committed into it (``_commit``) instead."""
    parent, base = os.path.split(path)
    remove_stale_temps(parent, base.__eq__)  # a killed export's staging directory
    token = new_token()
    tmp = temp_path(path, token)
    hold(tmp)
    staged: list[tuple[str, str]] = []
    try:
        os.makedirs(tmp)
        staged = _stage(tmp, shards, token)
        for name, file in staged:
            os.replace(file, os.path.join(tmp, name))
        _write_index(tmp, _index_text(shards, [name for name, _ in staged]), token)
        fsync_dir(tmp)
        with deferred():
            try:
                os.rename(tmp, path)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not os.path.isdir(path):
                    raise
                moved = [(name, os.path.join(tmp, name)) for name, _ in staged]
                _commit(path, shards, moved, token)
            fsync_dir(os.path.dirname(path))
    finally:
        remove_path(tmp)  # (gone once renamed into place; what is left after a commit into it)
        for _, file in staged:
            release(file)
        release(tmp)
    return path


_EXPORTED_RE = re.compile(r"^model-\d{5}-of-\d{5}(?:\.[0-9a-f]{8})?\.safetensors$")


def _commit(
    directory: str, shards: list[list[Tensor]], staged: list[tuple[str, str]], token: str
) -> None:
    """Put the staged files (``[(file name, temporary)]``, on ``directory``'s file system)
    in place as the export of ``directory`` (see the module docstring), under its lock;
    then remove what no export uses any more. The caller holds interrupts back."""
    with directory_lock(directory):
        try:
            if [name for name, _ in staged] == [SINGLE]:
                os.replace(staged[0][1], os.path.join(directory, SINGLE))  # readers prefer it
                fsync_dir(directory)
                _unlink(directory, INDEX)
                return
            names = [name for name, _ in staged]
            listed = _listed(directory)
            if listed.isdisjoint(names):  # the standard names are free: one commit
                _place(directory, staged, names)
                _write_index(directory, _index_text(shards, names), token)
            else:  # versioned names first (committed), then the standard ones
                versioned = [
                    name.replace(".safetensors", f".{token}.safetensors") for name in names
                ]
                _place(directory, staged, versioned)
                _write_index(directory, _index_text(shards, versioned), token)
                if _link(directory, versioned, names):
                    _write_index(directory, _index_text(shards, names), token)
            _unlink(directory, SINGLE)  # a single-file export, which readers would prefer
        finally:
            _remove_unlisted(directory)
            remove_stale_temps(directory, _is_export_file)


def _is_export_file(name: str) -> bool:
    return name in (SINGLE, INDEX) or bool(_EXPORTED_RE.match(name))


def _place(directory: str, staged: list[tuple[str, str]], names: list[str]) -> None:
    for (_, tmp), name in zip(staged, names):
        os.replace(tmp, os.path.join(directory, name))
    fsync_dir(directory)  # the shards' names are durable before an index names them


def _write_index(directory: str, text: bytes, token: str) -> None:
    """The index ``text`` put in place atomically (the commit point), fsynced."""
    target = os.path.join(directory, INDEX)
    tmp = temp_path(target, token)
    with open(tmp, "xb") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    fsync_dir(directory)


def _link(directory: str, sources: list[str], names: list[str]) -> bool:
    """Each of ``names`` (listed by no index now) a hard link to its source; False where
    the file system has no hard links (the versioned names then stay)."""
    try:
        for source, name in zip(sources, names):
            _unlink(directory, name)
            os.link(os.path.join(directory, source), os.path.join(directory, name))
    except OSError as e:
        if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            return False
        raise
    fsync_dir(directory)
    return True


def _listed(directory: str) -> set[str]:
    """The file names the index in ``directory`` lists (none if it is missing or damaged)."""
    try:
        with open(os.path.join(directory, INDEX), "rb") as f:
            index = json.loads(f.read(MAX_INDEX + 1))
        files = index["weight_map"].values()
        return {f for f in files if isinstance(f, str)}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return set()


def _remove_unlisted(directory: str) -> None:
    """Remove the shard files of earlier exports that the index no longer lists."""
    keep = _listed(directory)
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if _EXPORTED_RE.match(name) and name not in keep:
                _unlink(directory, name)


def _unlink(directory: str, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, name))
