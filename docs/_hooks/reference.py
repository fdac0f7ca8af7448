"""MkDocs hook: the API reference pages, generated from the code at build time.

One page for the top level (every non-module name in ``paramstore.__all__``) and one per
public submodule (every module named in ``paramstore.__all__``: ``nn``, ``initializers``,
``random``, ``checkpoint``, ``sharding``, ``metrics``, ...), each rendering the names of that
module's ``__all__`` through mkdocstrings. Nothing is listed by hand, so a name or a module
added to an ``__all__`` appears in the reference on the next build, and ``mkdocs build
--strict`` fails if one cannot be rendered. ``tests/test_docs.py`` checks the result.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # mkdocs is imported when the hook runs, not when tests import this file
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files

PACKAGE = "paramstore"
SECTION = "API reference"
OTHER = "Design"  # the nav section that receives pages nobody listed in mkdocs.yml
# Public submodules that ``paramstore.__all__`` does not list (yet): documented all the same.
EXTRA_MODULES = ("sharding",)


def public_names(module: ModuleType) -> list[str]:
    """``module.__all__`` (sorted, as the reference lists it), or its public attributes."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    return sorted(names, key=lambda n: (n.lower(), n))


def reference_pages() -> dict[str, tuple[str, ModuleType, list[str]]]:
    """``{page path: (title, module, member names)}``, the top level first."""
    package = importlib.import_module(PACKAGE)
    names = public_names(package)
    submodules = [n for n in names if inspect.ismodule(getattr(package, n))]
    submodules += [
        n
        for n in EXTRA_MODULES
        if n not in submodules and inspect.ismodule(getattr(package, n, None))
    ]
    pages = {
        "reference/paramstore.md": (
            "ps (top level)",
            package,
            [n for n in names if n not in submodules],
        )
    }
    for name in submodules:
        module = getattr(package, name)
        pages[f"reference/{name}.md"] = (f"ps.{name}", module, public_names(module))
    return pages


def anchor(module: ModuleType, name: str) -> str:
    """The id of ``module.name``'s entry on its reference page.

    ``module.name`` as a rule; but a name that is also a submodule's name (``ps.function``,
    the decorator, and ``paramstore.function``, its module) resolves to the module for
    mkdocstrings, so such a name is rendered, and found, under its definition's path.
    """
    path = f"{module.__name__}.{name}"
    obj = getattr(module, name)
    if path in sys.modules and not inspect.ismodule(obj):
        return f"{obj.__module__}.{obj.__qualname__}"
    return path


def _page(title: str, module: ModuleType, members: list[str]) -> str:
    plain = [m for m in members if anchor(module, m) == f"{module.__name__}.{m}"]
    listed = "\n".join(f"        - {m}" for m in plain)
    text = (
        f"# {title}\n\n"
        f"Generated from the docstrings of `{module.__name__}` "
        f"(its `__all__`: {len(members)} names).\n\n"
        f"::: {module.__name__}\n"
        "    options:\n"
        "      show_root_heading: false\n"
        "      show_root_toc_entry: false\n"
        "      members:\n"
        f"{listed}\n"
    )
    for m in members:
        if m not in plain:
            text += f"\n::: {anchor(module, m)}\n    options:\n      show_root_full_path: false\n"
    return text


def _index(pages: dict[str, tuple[str, ModuleType, list[str]]]) -> str:
    lines = [
        "# API reference",
        "",
        "Generated from the code: every name of `paramstore.__all__` and of each public "
        "submodule's `__all__`, with its signature and docstring. For the contract in one "
        "page, see the [API overview](../api.md).",
        "",
        "| module | names |",
        "|---|---|",
    ]
    for path, (title, module, members) in pages.items():
        page = path.removeprefix("reference/")
        links = ", ".join(f"[`{m}`]({page}#{anchor(module, m)})" for m in members)
        lines.append(f"| [`{title}`]({page}) | {links} |")
    return "\n".join(lines) + "\n"


def on_config(config: MkDocsConfig, **_: Any) -> MkDocsConfig:
    pages = reference_pages()
    section = [{"Overview": "reference/index.md"}]
    section += [{title: path} for path, (title, _m, _n) in pages.items()]
    nav = [item for item in (config.nav or []) if SECTION not in item]
    config.nav = [*nav, {SECTION: section}]
    return config


def _nav_paths(nav: Any) -> set[str]:
    """Every page path named in a ``nav`` list (nested sections included)."""
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, dict):
        return set().union(*(_nav_paths(v) for v in nav.values()))
    if isinstance(nav, list):
        return set().union(*(_nav_paths(v) for v in nav))
    return set()


def _title(markdown: str, default: str) -> str:
    for line in markdown.splitlines():
        if line.startswith("# "):
            return line[2:].replace("`", "").strip()
    return default


def on_files(files: Files, config: MkDocsConfig, **_: Any) -> Files:
    File = importlib.import_module("mkdocs.structure.files").File
    pages = reference_pages()
    files.append(File.generated(config, "reference/index.md", content=_index(pages)))
    for path, (title, module, members) in pages.items():
        files.append(File.generated(config, path, content=_page(title, module, members)))
    # A page added to docs/ without a nav entry goes under OTHER (in the order of its file
    # name) instead of failing the strict build as an omitted page.
    listed = _nav_paths(config.nav)
    extra = [
        {_title(f.content_string, f.src_uri): f.src_uri}
        for f in sorted(files.documentation_pages(), key=lambda f: f.src_uri)
        if f.src_uri not in listed
    ]
    if extra:
        nav = list(config.nav or [])
        section = next((i for i in nav if isinstance(i, dict) and OTHER in i), None)
        if section is None:
            nav.insert(len(nav) - 1, {OTHER: extra})  # before the API reference
        else:
            section[OTHER] = [*section[OTHER], *extra]
        config.nav = nav
    return files
