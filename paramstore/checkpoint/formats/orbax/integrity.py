"""Integrity of sharded checkpoints, per shard and per file (see ``paramstore.checkpoint.formats.orbax.format``).

Two checks, both computed where the data lives and never on a gathered array:

* **Shard sums** (values). For every shard a process holds (replica 0 only: each element is
  counted once), the device that holds it computes two sums over the shard's 32-bit words
  ``w[j]``, where ``j`` is the word's index in the *global* array (an element of 8 or 16
  bytes is 2 or 4 words; one of 1 or 2 bytes is one word, zero-extended):
  ``s1 = sum(w[j] * (2j + 1))`` and ``s2 = sum((w[j] + 1) * (j * 0x9E3779B1 | 1))``, each
  mod 2**32. Because ``j`` is global, the sums of any set of shards that tile the array add
  up (mod 2**32) to the sums of the whole array, whatever the layout: a reader on another
  mesh or process count checks its own shards' total against the writer's. A single flipped
  bit ``k`` of word ``j`` changes ``s1`` by ``2**k * (2j + 1)``, never 0 mod 2**32; random
  damage passes both with odds of about 2**-64. The per-device program is one fused
  reduction: no temporary the size of the shard (its compiled ``temp_size_in_bytes`` is
  checked in tests/checkpoint/test_sharded_checkpoint.py).
* **File digests** (bytes). After Orbax has written its files, each process hashes the
  files it wrote (XXH3-64), so that a flipped bit in a file no value depends on (Orbax's
  metadata, an OCDBT node merged away) is still caught.

Each process writes its sums and digests to ``paramstore/process_<i>.json``; process 0
writes the variable list to ``paramstore/metadata`` once every process file is there, which
makes the checkpoint visible. Every one of these JSON files is a wrapper
``{"format", "version", "body": "<JSON text>", "xxh3": "<digest of body>"}``: any flipped
bit either breaks the JSON, changes a fixed field, or fails the digest (the body is ASCII,
so no two encodings of it decode alike).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import xxhash
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from paramstore._core.placement import in_host_memory
from paramstore.checkpoint.formats.safetensors.format import MAX_DEPTH, json_depth

Box = tuple[tuple[int, int], ...]  # a shard's [start, stop) per dimension of the global array
Sums = tuple[int, int]  # (s1, s2), each mod 2**32
WRAPPER_VERSION = 3
MAX_JSON = 256 * 2**20  # the metadata holds string values too
_GOLDEN = 0x9E3779B1
_READ = 16 * 2**20  # bytes per read when hashing a file
_BLOCK = 2**16  # words per step of the summing loop (256 KiB temporaries)
_PROCESS_RE = re.compile(r"^(?:ocdbt\.)?process_(\d+)$")


class IntegrityError(ValueError):
    """A paramstore JSON file of a sharded checkpoint is missing, malformed or damaged."""


# ----------------------------------------------------------------------------- shard sums


def _words(x: jax.Array) -> jax.Array:
    """The 32-bit words of ``x``, shape ``x.shape + (words per element,)``."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)[..., None]
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1)
        return _words(x).reshape(*x.shape[:-1], -1)
    size = x.dtype.itemsize
    if size < 4:
        unsigned = jnp.uint8 if size == 1 else jnp.uint16
        return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)[..., None]
    w = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return w if size > 4 else w[..., None]


def _rows_sums(x: jax.Array, base: jax.Array) -> jax.Array:
    """``[s1, s2]`` of rows ``x`` (R, C) of elements whose first words sit at global word
    indices ``base``."""
    words = _words(x)
    w = words.reshape(x.shape[0], -1)
    j = base[:, None] + jax.lax.broadcasted_iota(jnp.uint32, w.shape, 1)
    s1 = jnp.sum(w * (2 * j + 1), dtype=jnp.uint32)
    s2 = jnp.sum((w + 1) * ((j * jnp.uint32(_GOLDEN)) | 1), dtype=jnp.uint32)
    return jnp.stack([s1, s2])


def _blocked_sums(x: jax.Array, base: jax.Array) -> jax.Array:
    """``_rows_sums`` a block of rows at a time (about ``_BLOCK`` elements), so that no
    temporary is larger than a block: XLA's CPU backend materializes a reduction's
    elementwise input (summed at once, a 8 MiB shard needed 16 MiB of temporaries)."""
    rows, cols = x.shape
    step = max(1, _BLOCK // max(cols, 1))
    full, rest = divmod(rows, step)
    acc = jnp.zeros(2, jnp.uint32)
    if full > 1:

        def body(i: jax.Array, acc: jax.Array) -> jax.Array:
            blk = jax.lax.dynamic_slice_in_dim(x, i * step, step)
            b = jax.lax.dynamic_slice_in_dim(base, i * step, step)
            return acc + _rows_sums(blk, b)

        acc = jax.lax.fori_loop(0, full, body, acc)
    elif full == 1:
        acc = _rows_sums(x[:step], base[:step])
    if rest:
        acc = acc + _rows_sums(x[full * step :], base[full * step :])
    return acc


def _shard_sums_impl(data: jax.Array, start: jax.Array, stride: jax.Array) -> jax.Array:
    """``[s1, s2]`` (uint32) of one shard whose first element sits at global index
    ``start`` of an array with element ``stride`` per dimension (both uint32 vectors, traced,
    so that shards of one shape share one compiled program)."""
    pieces = _words(jnp.zeros((), data.dtype)).size
    if data.ndim == 0:
        return _rows_sums(data.reshape(1, 1), jnp.zeros(1, jnp.uint32))
    lead, cols = data.shape[:-1], data.shape[-1]
    x = data.reshape(math.prod(lead), cols)
    # the global word index of each row's first word (one value per row, not per element)
    base = jnp.full(lead, start[-1] * stride[-1], jnp.uint32)
    for k in range(len(lead)):
        base = base + (jax.lax.broadcasted_iota(jnp.uint32, lead, k) + start[k]) * stride[k]
    base = base.reshape(-1) * jnp.uint32(pieces)
    if x.shape[0] == 1 and cols > _BLOCK:  # one long row (a 1-D shard): fold it
        fold = cols // _BLOCK
        head = x[0, : fold * _BLOCK].reshape(fold, _BLOCK)
        offsets = base[0] + jnp.uint32(_BLOCK * pieces) * jax.lax.iota(jnp.uint32, fold)
        acc = _blocked_sums(head, offsets)
        if cols % _BLOCK:
            tail = x[:, fold * _BLOCK :]
            acc = acc + _rows_sums(tail, base[:1] + jnp.uint32(fold * _BLOCK * pieces))
        return acc
    return _blocked_sums(x, base)


_shard_sums = jax.jit(_shard_sums_impl)


@functools.lru_cache(maxsize=64)
def _spmd_sums(mesh: Mesh, arrays: tuple[tuple[Any, tuple[int, ...], np.dtype], ...]) -> Any:
    """One compiled SPMD program that sums every device's shard of each of ``arrays``
    (``(spec, shape, dtype)`` on ``mesh``) where it lives (``jax.shard_map``); its result
    is ``[s1, s2]`` per array per device, shape ``(devices, arrays, 2)``. One compilation
    for a whole save: a program per shard compiled once per device (8 compilations of
    ~0.5 s for one array), a program per array once per shape."""
    names = mesh.axis_names

    def starts(spec: tuple[Any, ...], shape: tuple[int, ...]) -> jax.Array:
        local = NamedSharding(mesh, P(*spec)).shard_shape(shape)
        out = []
        for k, entry in enumerate(spec):
            axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
            idx = jnp.uint32(0)
            for a in axes:
                idx = idx * jnp.uint32(mesh.shape[a]) + jax.lax.axis_index(a).astype(jnp.uint32)
            out.append(idx * jnp.uint32(local[k]))
        return jnp.stack(out) if out else jnp.zeros(0, jnp.uint32)

    def body(*blocks: jax.Array) -> jax.Array:
        sums = [
            _shard_sums_impl(block, starts(spec, shape), jnp.asarray(_strides(shape)))
            for block, (spec, shape, _) in zip(blocks, arrays)
        ]
        return jnp.stack(sums)[None]

    specs = tuple(P(*spec) for spec, _, _ in arrays)
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(names), check_vma=False)
    )


def _strides(shape: Sequence[int]) -> np.ndarray:
    out = [math.prod(shape[k + 1 :]) % 2**32 for k in range(len(shape))]
    return np.asarray(out, np.uint32)


def _box(index: tuple[slice, ...], shape: Sequence[int]) -> Box:
    return tuple(
        (int(s.start or 0), int(d if s.stop is None else s.stop)) for s, d in zip(index, shape)
    )


Pending = list[tuple[Box, jax.Array, int]]  # (box, per-device result, row in it)


def dispatch_sums(values: Mapping[str, Any]) -> dict[str, Pending]:
    """Start the sums of every shard of each value that this process holds (replica 0),
    each on the device holding it, without waiting: ``{key: [(box, pending, row)]}`` for
    ``fetch``. The arrays sharded over one mesh are summed by one program
    (``_spmd_sums``); a NumPy array counts as one shard, summed on a CPU device."""
    out: dict[str, Pending] = {}
    groups: dict[Mesh, list[tuple[str, jax.Array, NamedSharding]]] = {}
    for key, x in values.items():
        if not isinstance(x, jax.Array):
            x = jax.device_put(np.asarray(x), jax.devices("cpu")[0])
        sharding = x.sharding
        if in_host_memory(sharding):  # (optimizer slots offloaded to host memory)
            out[key] = _per_shard(x, on_host=True)
        elif (
            isinstance(sharding, NamedSharding)
            and isinstance(sharding.mesh, Mesh)
            and len(sharding.device_set) > 1
        ):
            groups.setdefault(sharding.mesh, []).append((key, x, sharding))
        else:
            out[key] = _per_shard(x)
    for mesh, members in groups.items():
        signature = tuple(
            (_padded_spec(sh.spec, x.ndim), tuple(x.shape), np.dtype(x.dtype))
            for _, x, sh in members
        )
        sums = _spmd_sums(mesh, signature)(*(x for _, x, _ in members))
        by_device = {s.device: s.data for s in sums.addressable_shards}
        for row, (key, x, _) in enumerate(members):
            out[key] = [
                (_box(s.index, x.shape), by_device[s.device], row)
                for s in x.addressable_shards
                if s.replica_id == 0
            ]
    return out


def _padded_spec(spec: Any, ndim: int) -> tuple[Any, ...]:
    return tuple(spec) + (None,) * (ndim - len(spec))


def _per_shard(x: jax.Array, on_host: bool = False) -> Pending:
    """A program per shard, on its device (single-device and non-named shardings); with
    ``on_host`` (an array in host memory) on a CPU device, from the shard's host bytes,
    so that checkpointing offloaded state takes no accelerator memory."""
    shape = tuple(x.shape)
    stride = _strides(shape)
    out = []
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        box = _box(shard.index, shape)
        start = np.asarray([b[0] % 2**32 for b in box], np.uint32)
        data = shard.data
        if on_host:
            data = jax.device_put(np.asarray(data), jax.devices("cpu")[0])
        args = jax.device_put((start, stride), next(iter(data.devices())))
        out.append((box, _shard_sums(data, *args)[None], 0))
    return out


def fetch(pending: Iterable[tuple[Box, jax.Array, int]]) -> list[tuple[Box, Sums]]:
    """Wait for ``dispatch_sums`` results: ``[(box, (s1, s2))]`` (each per-device result
    copied to the host once)."""
    host: dict[int, np.ndarray] = {}
    out = []
    for box, sums, row in pending:
        if id(sums) not in host:
            host[id(sums)] = np.asarray(sums).reshape(-1, 2)
        s1, s2 = host[id(sums)][row].tolist()
        out.append((box, (int(s1), int(s2))))
    return out


def total(sums: Iterable[Sums]) -> Sums:
    """The sums of a set of shards that tile an array: the array's own sums."""
    s1 = s2 = 0
    for a, b in sums:
        s1, s2 = (s1 + a) % 2**32, (s2 + b) % 2**32
    return s1, s2


def hexsums(sums: Sums) -> str:
    return f"{sums[0]:08x}{sums[1]:08x}"


def parse_hexsums(text: Any) -> Sums:
    if not (isinstance(text, str) and re.fullmatch(r"[0-9a-f]{16}", text)):
        raise IntegrityError(f"bad shard checksum {text!r}")
    return int(text[:8], 16), int(text[8:], 16)


def uncovered(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """None if ``boxes`` tile an array of ``shape`` exactly (each element once), else what
    is wrong, in words. Checked on the grid of the boxes' own boundaries (a few cells per
    shard), not element by element."""
    size = math.prod(shape)
    for box in boxes:
        if len(box) != len(shape) or any(not (0 <= a <= b <= d) for (a, b), d in zip(box, shape)):
            return f"shard {fmt_box(box)} lies outside the shape {tuple(shape)}"
    covered = sum(math.prod(b - a for a, b in box) for box in boxes)
    if covered != size:
        return f"its shards hold {covered} of its {size} elements"
    if not shape or size == 0:
        return None if len(boxes) == 1 or size == 0 else "its shards overlap"
    cuts = [sorted({0, d, *(x for box in boxes for x in box[k])}) for k, d in enumerate(shape)]
    count = np.zeros([len(c) - 1 for c in cuts], np.int32)
    for box in boxes:
        cells = tuple(slice(c.index(a), c.index(b)) for c, (a, b) in zip(cuts, box))
        count[cells] += 1
    if (count > 1).any():
        return "its shards overlap"
    return None if (count == 1).all() else "its shards leave a gap"


def fmt_box(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


# ---------------------------------------------------------------------------- file digests


def owner(rel: str) -> int:
    """The process that writes the file ``rel`` (a path relative to the checkpoint):
    ``arrays/ocdbt.process_3/...`` and ``arrays/array_metadatas/process_3`` are process 3's,
    everything else process 0's."""
    for part in rel.split("/"):
        m = _PROCESS_RE.match(part)
        if m:
            return int(m[1])
    return 0


def files_of(root: str, process: int, skip: str) -> list[str]:
    """The files under ``root`` (relative, '/'-separated, sorted) that ``process`` wrote,
    outside the directory ``skip``."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        if rel_dir == skip:
            dirnames[:] = []
            continue
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if owner(rel) == process:
                out.append(rel)
    return sorted(out)


def digest_file(path: str, buffer: bytearray | None = None) -> tuple[int, str]:
    """``(size, XXH3-64 hex)`` of a file, read in 16 MiB pieces into one reused buffer."""
    h = xxhash.xxh3_64()
    buf = buffer if buffer is not None else bytearray(_READ)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def digest_files(root: str, rels: Iterable[str]) -> dict[str, list[Any]]:
    buf = bytearray(_READ)
    return {rel: list(digest_file(os.path.join(root, rel), buf)) for rel in rels}


def bad_files(root: str, expected: Mapping[str, Sequence[Any]]) -> list[str]:
    """The files of ``expected`` (``{rel: [size, hex]}``) that are missing or differ."""
    bad = []
    buf = bytearray(_READ)
    for rel, want in expected.items():
        file = os.path.join(root, rel)
        try:
            if os.path.getsize(file) != want[0] or list(digest_file(file, buf)) != list(want):
                bad.append(rel)
        except OSError:
            bad.append(f"{rel} (missing)")
    return bad


# ------------------------------------------------------------------- JSON with a digest


def write_json(path: str, fmt: str, body: Any) -> None:
    """Write ``body`` wrapped with its digest (see the module docstring), atomically
    (temporary file, fsync, rename)."""
    text = json.dumps(body, ensure_ascii=True, separators=(",", ":"))
    wrapper = {
        "format": fmt,
        "version": WRAPPER_VERSION,
        "body": text,
        "xxh3": xxhash.xxh3_64_hexdigest(text.encode()),
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="ascii") as f:
        json.dump(wrapper, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str, fmt: str) -> Any:
    """The body of a file ``write_json`` wrote (IntegrityError if it is not intact)."""
    try:
        if os.path.getsize(path) > MAX_JSON:
            raise IntegrityError(f"{path} exceeds {MAX_JSON // 2**20} MiB")
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise IntegrityError(f"{path} is missing") from None
    except OSError as e:
        raise IntegrityError(f"{path} cannot be read ({e})") from None
    wrapper = _loads(raw, path)
    if not isinstance(wrapper, dict) or wrapper.get("format") != fmt:
        raise IntegrityError(f"{path} is not a {fmt} file")
    version = wrapper.get("version")
    if version != WRAPPER_VERSION:
        raise IntegrityError(
            f"{path} has format version {version!r}, not {WRAPPER_VERSION}: "
            + (
                "written by an earlier paramstore (whole-array checksums); load it with that "
                "version and save it again"
                if version in (1, 2)
                else "upgrade paramstore"
            )
        )
    text, digest = wrapper.get("body"), wrapper.get("xxh3")
    if not (isinstance(text, str) and text.isascii() and isinstance(digest, str)):
        raise IntegrityError(f"{path} lacks its body or digest")
    if xxhash.xxh3_64_hexdigest(text.encode()) != digest:
        raise IntegrityError(f"{path} fails its digest (a flipped bit, or an edit)")
    return _loads(text.encode(), path)


def _loads(raw: bytes, path: str) -> Any:
    depth = json_depth(raw)
    if depth > MAX_DEPTH:
        raise IntegrityError(f"{path} nests {depth} levels deep, more than {MAX_DEPTH}")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise IntegrityError(f"{path} is not valid JSON ({e})") from None


def wait_for(paths: Sequence[str], timeout: float) -> list[str]:
    """Poll until every path exists (other processes' files); the ones still missing."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        missing = [p for p in paths if not os.path.exists(p)]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
