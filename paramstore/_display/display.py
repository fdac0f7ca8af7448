"""``ps.display(obj)``: an interactive view of a Module, layer, metric or Variable.

Contract (docs/api.md, "Layers", display):

* With the optional ``treescope`` package (``pip install paramstore[display]``),
  ``ps.display(obj)`` renders ``obj`` with treescope: a Module as a tree of its attributes
  (submodules nested, each Variable as its array with shape, dtype and values), in Jupyter
  through ``treescope.display``, elsewhere as treescope's text rendering printed.
* Without treescope it falls back to paramstore's own table: in Jupyter the HTML of
  ``obj._repr_html_()``, elsewhere ``ps.summary(obj)`` printed, followed by a line saying how
  to get treescope. ``ps.display(obj, require_treescope=True)`` raises ``ImportError``
  instead.
* ``tree(obj)`` is the nested ``dict`` treescope is given (also handy on its own).

treescope is imported lazily with ``importlib`` (an optional extra, not a dependency).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any

from paramstore._summary import summary
from paramstore.module import Module
from paramstore.variable import Variable

__all__ = ["display", "tree"]

_INSTALL = "pip install 'paramstore[display]' (or pip install treescope)"


def _child(x: Any, seen: set[int]) -> Any:
    if isinstance(x, Variable):
        return x.value()
    if isinstance(x, Module):
        return tree(x, seen)
    if isinstance(x, Mapping):
        return {str(k): _child(v, seen) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_child(v, seen) for v in x]
    return x


def tree(obj: Module | Variable, _seen: set[int] | None = None) -> Any:
    """``obj`` as nested dicts: ``{"<Class> '<scope>'": {attribute: array or subtree}}``
    (a Variable: ``{"<name>": array}``); private attributes are left out."""
    seen = set() if _seen is None else _seen
    if isinstance(obj, Variable):
        return {obj.name: obj.value()}
    if not isinstance(obj, Module):
        raise TypeError(
            f"ps.display expects a ps.Module (a layer, a metric) or a ps.Variable, got a "
            f"{type(obj).__name__}."
        )
    if id(obj) in seen:
        return f"<{type(obj).__name__} '{obj.scope_name}' (shown above)>"
    seen.add(id(obj))
    body = {
        key: _child(value, seen)
        for key, value in sorted(vars(obj).items())
        if not key.startswith("_") and _holds_state(value)
    }
    return {f"{type(obj).__name__} '{obj.scope_name}'": body}


def _holds_state(x: Any) -> bool:
    if isinstance(x, (Variable, Module)):
        return True
    if isinstance(x, Mapping):
        return any(_holds_state(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_holds_state(v) for v in x)
    return False


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    get = getattr(shell, "get_ipython", None)
    return bool(get is not None and get() is not None and hasattr(get(), "kernel"))


def display(obj: Module | Variable, *, require_treescope: bool = False) -> None:
    """Show ``obj`` (see the module docstring)."""
    data = tree(obj)  # checks the type first
    try:
        treescope = importlib.import_module("treescope")
    except ImportError:
        if require_treescope:
            raise ImportError(
                f"ps.display(..., require_treescope=True) needs the treescope package: {_INSTALL}."
            ) from None
        treescope = None
    if treescope is not None:
        if _in_notebook():
            treescope.display(data)
        else:
            print(treescope.render_to_text(data))
        return
    if _in_notebook():
        ipd = importlib.import_module("IPython.display")
        ipd.display(ipd.HTML(obj._repr_html_()))
    else:
        print(summary(obj))
    print(f"(treescope is not installed: {_INSTALL} for an interactive view)")
