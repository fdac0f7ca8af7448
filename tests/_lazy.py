"""Oracle packages imported on first use, not while pytest collects.

Every xdist worker collects every test file; a module-level ``import tensorflow`` (4.6 s) or
``import torch, transformers`` (4.5 s) there made each worker pay for it before its first
test, used or not. ``lazy("tensorflow")`` stands for the module and imports it the first time
an attribute is read. The oracles are in the test extra, so a missing one is an error, never
a skip. After importing a large package, the objects it created are moved out of the garbage
collector's reach (``gc.freeze``): TensorFlow's import alone adds ~330,000 long-lived objects
that every later full collection would walk again.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
from types import ModuleType
from typing import Any

__all__ = ["lazy", "oracle"]


def oracle(name: str) -> ModuleType:
    """``import name`` (TensorFlow quietly), then ``gc.freeze()`` what the import made (once:
    a module already imported is returned as it is, with no full collection)."""
    if name in sys.modules:
        return sys.modules[name]
    if name.split(".")[0] in ("tensorflow", "keras"):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # no C++ banner about CPU features
    module = importlib.import_module(name)
    gc.collect()
    gc.freeze()
    return module


class lazy:  # noqa: N801 (it stands for a module)
    """A module imported (by ``oracle``) when an attribute is first read."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith(("_", "pytest")):  # collection probes every module global for
            raise AttributeError(attr)  # __test__, pytestmark, _pytestfixturefunction ...
        if self._module is None:
            self._module = oracle(self._name)
        return getattr(self._module, attr)
