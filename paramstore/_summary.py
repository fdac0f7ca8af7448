"""``ps.summary``: a table of a module's (or a collection's) variables, as Keras prints.

Contract:

* ``summary(module_or_variables) -> str``: one row per variable (full name, shape, dtype,
  parameter count, trainable flag) in the module's ``variables`` order (or the order given),
  then the totals: all, trainable and non-trainable parameters, and their size in bytes.
  Accepts a Module (anything with ``.variables``), a Variable, or a list, tuple or dict of
  Variables (a dict's rows are named by its keys). A layer not built yet (the module or
  any of its submodules) gets a row that says "not built", and the table says how to build.
* ``summary_html(...)`` is the same table as HTML (what Jupyter shows for a layer).

It sits in the modules layer (it imports only ``paramstore.variable`` and ``_core``), so
``Module.summary`` prints it.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from paramstore._core.html import human_bytes
from paramstore.typing import HasVariables
from paramstore.variable import Variable

if TYPE_CHECKING:
    from paramstore.module import Module

__all__ = ["summary", "summary_html"]

_HEAD = ("Variable", "Shape", "Dtype", "Params", "Trainable")


def _rows(obj: Any) -> tuple[str, list[tuple[str, Variable]]]:
    """(title, [(row name, variable)]) for the accepted forms; TypeError otherwise."""
    if isinstance(obj, Variable):
        return "1 variable", [(obj.name, obj)]
    if hasattr(obj, "variables") and not isinstance(obj, (Mapping, list, tuple)):
        title = f"{type(obj).__name__} '{getattr(obj, 'scope_name', getattr(obj, 'name', ''))}'"
        return title, [(v.name, v) for v in obj.variables]
    if isinstance(obj, Mapping):
        items = [(str(k), v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        items = [(getattr(v, "name", "?"), v) for v in obj]
    else:
        raise TypeError(
            "ps.summary expects a Module, a Variable, or a list, tuple or dict of Variables, "
            f"got a {type(obj).__name__}."
        )
    for name, v in items:
        if not isinstance(v, Variable):
            raise TypeError(
                f"ps.summary: the item {name!r} is a {type(v).__name__}, not a Variable."
            )
    return f"{len(items)} variables", items


def _nbytes(v: Variable) -> int:
    try:
        return int(v.size) * np.dtype(v.dtype).itemsize
    except TypeError:  # strings
        return 0


def _table(obj: Any) -> tuple[str, list[tuple[str, ...]], list[str]]:
    title, items = _rows(obj)
    rows: list[tuple[str, ...]] = [
        (name, str(v.shape), str(v.dtype), f"{v.size:,}", "yes" if v.trainable else "no")
        for name, v in items
    ]
    total = sum(int(v.size) for _, v in items)
    trainable = sum(int(v.size) for _, v in items if v.trainable)
    nbytes = sum(_nbytes(v) for _, v in items)
    tbytes = sum(_nbytes(v) for _, v in items if v.trainable)
    totals = [
        f"Total params: {total:,} ({human_bytes(nbytes)})",
        f"Trainable params: {trainable:,} ({human_bytes(tbytes)})",
        f"Non-trainable params: {total - trainable:,} ({human_bytes(nbytes - tbytes)})",
    ]
    unbuilt = [
        m
        for m in (obj, *getattr(obj, "submodules", ()))
        if getattr(m, "built", True) is False and hasattr(m, "scope_name")
    ]
    for m in unbuilt:
        rows.append((f"{m.scope_name} ({type(m).__name__})", "not built", "", "", ""))
    if unbuilt:
        totals.insert(
            0,
            "(not built yet: a layer creates its variables on its first call, or with "
            "layer.build(input_shape))",
        )
    return title, rows, totals


def summary(
    module_or_variables: Variable
    | Module
    | HasVariables
    | Mapping[Any, Variable]
    | Sequence[Variable],
) -> str:
    """A text table of the variables (see the module docstring)."""
    title, rows, totals = _table(module_or_variables)
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(_HEAD)]

    def line(cells: tuple[str, ...]) -> str:
        parts = [
            c.rjust(w) if i == 3 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return " │ ".join(parts).rstrip()

    rule = "─" * (sum(widths) + 3 * (len(widths) - 1))
    out = [title, rule, line(_HEAD), rule, *(line(r) for r in rows), rule, *totals]
    return "\n".join(out)


def summary_html(module_or_variables: Any) -> str:
    """The same table as HTML, for Jupyter."""
    title, rows, totals = _table(module_or_variables)
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in _HEAD)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td style="text-align:{"right" if i == 3 else "left"}">{esc(c)}</td>'
            for i, c in enumerate(r)
        )
        + "</tr>"
        for r in rows
    )
    foot = "<br>".join(esc(t) for t in totals)
    return (
        f"<div><b>{esc(title)}</b><table><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table><p>{foot}</p></div>"
    )
