"""The command line: ``python -m paramstore {demo,doctor,inspect} ...``.

* ``demo``: train a small model end to end (see :mod:`paramstore.demo`).
* ``doctor``: versions, backend, devices and a self-test (see :mod:`paramstore.doctor`).
* ``inspect PATH [--values] [--name GLOB]``: print the variables of a checkpoint (any
  format ``ps.checkpoint.list_variables`` reads), with the number of parameters and bytes
  in total. Names are printed escaped (control characters, ANSI escapes, newlines and lone
  surrogates as ``\\x1b``, ``\\n``, ``\\udcff``), so a name cannot forge a row. ``--name``
  takes a glob (``'dense*/w'``); with ``--values`` and a single match, the full value is
  printed. Entries a reader cannot give as tensors (a TensorFlow ``DT_VARIANT``) are listed
  as skipped, with the reason. Output into a closed pipe (``| head``) ends quietly. Exit
  status 0, or 1 after one line on stderr for a missing, foreign or corrupt file; never a
  traceback.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from paramstore import __version__
from paramstore._core.html import human_bytes
from paramstore.checkpoint.format import (
    CheckpointError,
    EntryInfo,
    PathLike,
    dtype_name,
    is_string,
    no_such_variable,
)
from paramstore.checkpoint.readers import opened


def escape(text: str) -> str:
    """``text`` with every non-printable character (and backslash) escaped; never raises."""
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch.isprintable() and not 0xD800 <= ord(ch) <= 0xDFFF:
            out.append(ch)
        else:
            out.append(ascii(ch)[1:-1])
    return "".join(out)


def stats(arr: np.ndarray) -> list[str]:
    """min, max, mean (over the finite values) and the count of NaN/inf values."""
    if is_string(arr.dtype) or not arr.size:
        return ["-", "-", "-", "-"]
    if arr.dtype.kind == "c":
        return ["-", "-", f"{complex(arr.mean()):.6g}", str(int(np.sum(~np.isfinite(arr))))]
    x = arr.reshape(-1)
    if x.dtype.kind not in "iub":
        x = x.astype(np.float64)
    finite = x[np.isfinite(x)] if x.dtype.kind == "f" else x
    bad = str(x.size - finite.size)
    if not finite.size:
        return ["-", "-", "-", bad]
    mean = float(np.mean(finite, dtype=np.float64))
    return [f"{finite.min():.6g}", f"{finite.max():.6g}", f"{mean:.6g}", bad]


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def render(path: PathLike, values: bool = False, name: str | None = None) -> str:
    """The text ``inspect`` prints (CheckpointError / OSError for a bad path or name)."""
    with opened(path) as r:
        entries: list[EntryInfo] = sorted(r.entries.values(), key=lambda e: e.name)
        if name is not None:
            chosen = [e for e in entries if fnmatch.fnmatchcase(e.name, name)]
            if not chosen:
                raise no_such_variable(r.path, name, r.entries)
            entries = chosen
        loaded: dict[str, Any] = r.load(dict.fromkeys(e.name for e in entries)) if values else {}
        head = ["name", "shape", "dtype", "size", "bytes"]
        rows = [head + (["min", "max", "mean", "nan/inf"] if values else [])]
        for e in entries:
            row = [escape(e.name), str(list(e.shape)), dtype_name(e.dtype)]
            row += [str(math.prod(e.shape)), human_bytes(e.nbytes)]
            if values:
                row += stats(loaded[e.name])
            rows.append(row)
        params = sum(math.prod(e.shape) for e in entries if not is_string(e.dtype))
        total = sum(e.nbytes for e in entries)
        lines = [
            f"{escape(r.path)}: {len(entries)} variables, {params:,} parameters, "
            f"{human_bytes(total)}, {r.description}",
            table(rows),
        ]
        skipped: dict[str, str] = getattr(r, "skipped", {})
        for key in sorted(skipped):
            lines.append(f"skipped '{escape(key)}': {escape(skipped[key])}")
    if values and len(entries) == 1:
        with np.printoptions(threshold=1000, edgeitems=5):
            value = loaded[entries[0].name]
            lines.append(f"\n{escape(entries[0].name)} =\n{escape(repr(value))}")
    return "\n".join(lines)


def inspect(path: PathLike, values: bool = False, name: str | None = None) -> int:
    """Print a checkpoint's variables; the exit status (see the module docstring)."""
    try:
        text = render(path, values, name)
    except (OSError, CheckpointError, ImportError) as e:
        print(f"error: {escape(str(e))}", file=sys.stderr)
        return 1
    except Exception as e:  # a reader bug must not print a traceback over the user's file
        print(
            f"error: cannot read '{escape(os.fspath(path))}' ({type(e).__name__}: "
            f"{escape(str(e))}); please report this with the file.",
            file=sys.stderr,
        )
        return 1
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader left (| head): say nothing, and keep Python from complaining at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m paramstore", description="paramstore command line."
    )
    parser.add_argument(
        "--version", action="version", version=f"paramstore {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train an MLP on the digits data set", add_help=False)
    p_inspect = sub.add_parser("inspect", help="print the variables of a checkpoint")
    p_inspect.add_argument(
        "path",
        help="a checkpoint file or directory, a TensorFlow checkpoint prefix or a Keras "
        ".weights.h5 file",
    )
    p_inspect.add_argument("--values", action="store_true", help="print the values too")
    p_inspect.add_argument(
        "--name", default=None, help="only the variables matching this glob ('dense*/w')"
    )
    sub.add_parser("doctor", help="print versions and devices; run a self-test of a few seconds")
    if argv and argv[0] in ("demo", "doctor"):
        module = importlib.import_module(f"paramstore.{argv[0]}")
        status: int = module.main(argv[1:])
        return status
    args = parser.parse_args(argv)
    return inspect(args.path, values=args.values, name=args.name)
