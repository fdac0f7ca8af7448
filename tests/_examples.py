"""``load_example(name)``: ``examples/<name>.py`` imported as ``examples.<name>`` (the
examples are a package; the checkout's root is put on ``sys.path`` once, as a user's working
directory would be)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as module ``examples.<name>`` (registered in ``sys.modules``,
    where dataclasses look their module up)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"examples.{name}")
