"""HTML for Jupyter: ``Variable._repr_html_`` and ``Module._repr_html_`` (and every layer's).

Contract (docs/api.md, "Layers", display): a Variable renders as a one-row table (name, shape,
dtype, parameter count, bytes, trainable); a Module as a table of its own variables
(attribute path, full name, shape, dtype, parameters, bytes, trainable), its submodules
nested below it as collapsible sections, each with its totals; an unbuilt layer says
"not built". Every string from the user is escaped.

This module sits in the bottom layer (it imports nothing from paramstore), so
``variable.py`` and ``module.py`` can use it: it finds variables and modules by their
attributes (duck typing), not by their classes.
"""

from __future__ import annotations

import html
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeGuard

import numpy as np

__all__ = ["variable_html", "module_html", "human_bytes", "nbytes"]

_STYLE = "border-collapse:collapse;font-family:monospace;font-size:12px"
_CELL = "padding:1px 8px;border-bottom:1px solid #ddd"
# Names and attribute paths wrap (anywhere: they have no spaces) so that a deep model's
# table keeps its Shape, Dtype, Params and Bytes columns on the page (issue 27: notebook 07).
_WRAP = "max-width:24em;overflow-wrap:anywhere"
_HEAD = ("Attribute", "Variable", "Shape", "Dtype", "Params", "Bytes", "Trainable")


class ShownVariable(Protocol):
    """What a row reads of a variable (``ps.Variable`` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def trainable(self) -> bool: ...


class ShownModule(Protocol):
    """What a module's section reads of it (``ps.Module`` is one), besides its attributes."""

    @property
    def scope_name(self) -> str: ...
    @property
    def variables(self) -> Sequence[ShownVariable]: ...


def _is_variable(x: object) -> TypeGuard[ShownVariable]:
    return hasattr(x, "assign") and hasattr(x, "trainable") and hasattr(x, "shape")


def _is_module(x: object) -> TypeGuard[ShownModule]:
    return hasattr(x, "scope_name") and hasattr(x, "variables") and not _is_variable(x)


def human_bytes(n: int) -> str:
    """``512 B``, ``1.5 KiB``, ``2.0 MiB``: a byte count for people."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError  # unreachable: the loop returns at GiB


def nbytes(v: ShownVariable) -> int:
    """The bytes of a variable's array (0 for strings)."""
    try:
        itemsize: int = np.dtype(v.dtype).itemsize
        return int(np.prod(v.shape, dtype=np.int64)) * itemsize
    except TypeError:
        return 0


def _size(v: ShownVariable) -> int:
    return int(np.prod(v.shape, dtype=np.int64))


def _row(path: str, v: ShownVariable) -> str:
    cells = (
        path,
        str(v.name),
        str(tuple(v.shape)),
        str(v.dtype),
        f"{_size(v):,}",
        human_bytes(nbytes(v)),
        "yes" if v.trainable else "no",
    )
    return (
        "<tr>"
        + "".join(
            f'<td style="{_CELL};text-align:{"right" if i in (4, 5) else "left"}'
            f'{";" + _WRAP if i < 2 else ""}">{html.escape(c)}</td>'
            for i, c in enumerate(cells)
        )
        + "</tr>"
    )


def _table(rows: list[str]) -> str:
    head = "".join(f'<th style="{_CELL};text-align:left">{h}</th>' for h in _HEAD)
    return f'<table style="{_STYLE}"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def variable_html(v: ShownVariable) -> str:
    """One variable as a one-row table."""
    return f"<div><b>Variable</b>{_table([_row('', v)])}</div>"


def _children(x: object, path: str) -> Iterator[tuple[str, ShownVariable | ShownModule]]:
    """(attribute path, Variable or Module) under ``x``, through lists, tuples and dicts."""
    if _is_variable(x) or _is_module(x):
        yield path, x
    elif isinstance(x, Mapping):
        for key in sorted(x, key=str):
            yield from _children(x[key], f"{path}[{key!r}]")
    elif isinstance(x, (list, tuple)):
        for i, item in enumerate(x):
            yield from _children(item, f"{path}[{i}]")


def _totals(module: ShownModule) -> str:
    vs = list(module.variables)
    total = sum(_size(v) for v in vs)
    train = sum(_size(v) for v in vs if v.trainable)
    size = human_bytes(sum(nbytes(v) for v in vs))
    return f"{total:,} params ({size}), {train:,} trainable"


def _module(module: ShownModule, seen: set[int], depth: int) -> str:
    title = f"{html.escape(type(module).__name__)} '{html.escape(str(module.scope_name))}'"
    if getattr(module, "built", True) is False:
        return f"<div><b>{title}</b>: not built (call it on an input, or build(input_shape))</div>"
    rows: list[str] = []
    subs: list[str] = []
    for key in sorted(vars(module)):
        if key.startswith("_ps") or key in ("_scope_name", "_module_name"):
            continue
        for path, child in _children(vars(module)[key], key):
            if id(child) in seen:
                continue
            seen.add(id(child))
            if _is_variable(child):
                rows.append(_row(path, child))
            elif depth < 32 and _is_module(child):
                inner = _module(child, seen, depth + 1)
                subs.append(
                    f'<details open style="margin-left:16px"><summary>{html.escape(path)}'
                    f"</summary>{inner}</details>"
                )
    body = _table(rows) if rows else ""
    return f"<div><b>{title}</b> &mdash; {_totals(module)}{body}{''.join(subs)}</div>"


def module_html(module: ShownModule) -> str:
    """A module as nested tables (see the module docstring)."""
    return _module(module, {id(module)}, 0)
