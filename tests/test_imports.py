"""The package's import structure: no function-local imports, no cycles, layers respected.

Everything is read with ``ast``; nothing in ``paramstore`` is imported. The checker is proven
on small synthetic packages first (so it catches what it should whatever the package's state),
then run on ``paramstore/``.

Rules (issue 9, item 6):

1. Every ``import`` / ``from ... import`` statement is at module level, never in a function,
   method or class body. Optional heavy packages are imported with
   ``importlib.import_module(...)`` where needed. Imports under a module-level
   ``if TYPE_CHECKING:`` are allowed and are not dependencies.
2. No cycle among paramstore's own modules. An edge is any runtime import of a paramstore
   module: module level, function level (rule 1 forbids those, but a cycle closed through one
   is still a cycle) or a literal ``importlib.import_module("paramstore...")``.
   ``from paramstore import x`` means the submodule ``paramstore.x`` where that file exists,
   else the package root. ``paramstore/__init__.py`` and ``__main__.py`` re-export everything:
   their outgoing edges are ignored; edges into the root count.
3. Lower layers never import higher ones (``LAYERS`` below, bottom to top). Importing the
   package root (``import paramstore``) is allowed only from the top layer.
"""

from __future__ import annotations

import ast
import importlib
import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "paramstore"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / PACKAGE

# Bottom to top. Each entry is a top-level module or a subpackage below ``paramstore.`` (a
# subpackage's entry covers every module inside it: the layers are package boundaries). A module
# that no entry covers fails test_every_module_is_in_the_layer_table: add it where it belongs.
LAYERS: list[tuple[str, list[str]]] = [
    ("core", ["typing", "_core"]),
    ("variable", ["variable", "_variable", "constraints", "regularizers"]),
    (
        "scopes and modules",
        ["scope", "module", "initializers", "random", "_traverse", "_collect", "_summary"],
    ),
    ("functional core", ["functional", "remat", "regularization"]),
    ("compiled functions", ["function", "_function", "sharding"]),
    (
        "training",
        ["mixed_precision", "optimizer", "nn", "metrics", "_display", "averaging", "plan"],
    ),
    ("checkpoints", ["checkpoint"]),
    ("entry points", ["cli", "demo", "doctor", "__main__"]),
]

# Modules whose outgoing edges are not dependencies (they re-export or launch everything).
REEXPORTERS = {PACKAGE, f"{PACKAGE}.__main__"}


# ---------------------------------------------------------------------------- the checker


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. "paramstore.scope"
    path: str  # its file, e.g. "paramstore/scope.py"
    line: int
    text: str  # the statement, e.g. "from paramstore.functional import state"
    targets: tuple[str, ...]  # the paramstore modules it imports (may be empty)
    local: bool  # inside a function, method or class body
    type_only: bool  # under a module-level `if TYPE_CHECKING:`


def module_name(path: str) -> str:
    """``paramstore/nn/dense.py`` -> ``paramstore.nn.dense``; ``.../__init__.py`` -> the package."""
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_import_module_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id == "import_module"
    )


def _resolve(name: str, modules: set[str]) -> str | None:
    """The paramstore module that importing ``name`` runs last (longest existing prefix)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _targets(node: ast.AST, importer: str, is_pkg: bool, modules: set[str]) -> tuple[str, ...]:
    found: list[str | None] = []
    if isinstance(node, ast.Import):
        found = [_resolve(a.name, modules) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base_parts = importer.split(".")
            if not is_pkg:
                base_parts.pop()
            base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            found.append(sub if sub in modules else _resolve(base, modules))
    elif _is_import_module_call(node):
        assert isinstance(node, ast.Call)
        args = node.args
        if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
            name = args[0].value
            if name.startswith(".") and len(args) > 1 and isinstance(args[1], ast.Constant):
                name = f"{args[1].value}{name}"
            found = [_resolve(name, modules)]
    return tuple(sorted({t for t in found if t is not None and t != importer}))


def scan(sources: Mapping[str, str]) -> list[Import]:
    """Every import in ``{relative path: source}``, with what it imports from the package."""
    modules = {module_name(p) for p in sources}
    result: list[Import] = []

    def visit(node: ast.AST, path: str, local: bool, type_only: bool) -> None:
        importer = module_name(path)
        is_pkg = path.endswith("__init__.py")
        if isinstance(node, ast.Import | ast.ImportFrom) or _is_import_module_call(node):
            result.append(
                Import(
                    module=importer,
                    path=path,
                    line=node.lineno,  # type: ignore[attr-defined]
                    text=ast.unparse(node),
                    targets=_targets(node, importer, is_pkg, modules),
                    local=local and not _is_import_module_call(node),
                    type_only=type_only,
                )
            )
        if isinstance(node, ast.If) and not local and _is_type_checking(node.test):
            for child in node.body:
                visit(child, path, local, True)
            for child in node.orelse:
                visit(child, path, local, type_only)
            return
        inner = local or isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef
        )
        for child in ast.iter_child_nodes(node):
            visit(child, path, inner, type_only)

    for path in sorted(sources):
        visit(ast.parse(sources[path], filename=path), path, False, False)
    return result


def local_imports(imports: list[Import]) -> list[str]:
    """``path:line: statement`` for each import inside a function, method or class body."""
    return [f"{i.path}:{i.line}: {i.text}" for i in imports if i.local]


def graph(imports: list[Import]) -> dict[str, set[str]]:
    """``{module: paramstore modules it imports at run time}`` (re-exporters' edges left out)."""
    edges: dict[str, set[str]] = {}
    for i in imports:
        edges.setdefault(i.module, set())
        if not i.type_only and i.module not in REEXPORTERS:
            edges[i.module].update(i.targets)
    return edges


def cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """One path per cycle closed by a back edge of a depth-first walk: ``[a, b, ..., a]``."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            walk(node)
    return found


def layer_of(module: str, layers: list[tuple[str, list[str]]] = LAYERS) -> int | None:
    """The layer index of ``module``; the package root is the top; None: not in the table."""
    if module == PACKAGE:
        return len(layers) - 1
    short = module.removeprefix(f"{PACKAGE}.")
    for index, (_, entries) in enumerate(layers):
        if any(short == e or short.startswith(e + ".") for e in entries):
            return index
    return None


def unknown_modules(modules: list[str], layers: list[tuple[str, list[str]]] = LAYERS) -> list[str]:
    return sorted(m for m in modules if layer_of(m, layers) is None)


def layer_violations(
    imports: list[Import], layers: list[tuple[str, list[str]]] = LAYERS
) -> list[str]:
    """``path:line: a (layer) imports b (higher layer)`` for each import that goes up."""
    out = []
    for i in imports:
        if i.type_only or i.module in REEXPORTERS:
            continue
        low = layer_of(i.module, layers)
        for target in i.targets:
            high = layer_of(target, layers)
            if low is not None and high is not None and high > low:
                out.append(
                    f"{i.path}:{i.line}: {i.module} (layer {low}, {layers[low][0]}) imports "
                    f"{target} (layer {high}, {layers[high][0]}): {i.text}"
                )
    return out


def package_sources() -> dict[str, str]:
    root = PACKAGE_DIR.parent
    return {
        p.relative_to(root).as_posix(): p.read_text(encoding="utf-8")
        for p in sorted(PACKAGE_DIR.rglob("*.py"))
    }


# ------------------------------------------------------------- the checker on synthetic code


def synthetic(**files: str) -> list[Import]:
    """``synthetic(a="...", nn_="...", nn_dense="...")``: paramstore/a.py,
    paramstore/nn/__init__.py, paramstore/nn/dense.py (a root __init__ re-exports a)."""
    sources = {"paramstore/__init__.py": "from paramstore.a import *\n"}
    for name, src in files.items():
        if name.startswith("nn_"):
            name = "nn/" + (name[3:] or "__init__")
        sources[f"paramstore/{name}.py"] = textwrap.dedent(src)
    return scan(sources)


def test_checker_finds_function_method_and_class_level_imports_with_file_and_line():
    imports = synthetic(
        a="""\
        import os
        try:
            import json
        except ImportError:
            json = None

        def f():
            import difflib
            return difflib

        class C:
            import re

            def m(self):
                from paramstore import b
                return b
        """,
        b="x = 1\n",
    )
    assert local_imports(imports) == [
        "paramstore/a.py:8: import difflib",
        "paramstore/a.py:12: import re",
        "paramstore/a.py:15: from paramstore import b",
    ]


def test_checker_allows_module_level_type_checking_and_importlib():
    imports = synthetic(
        a="""\
        import importlib
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from paramstore.b import B
        else:
            from paramstore.c import C

        def optional():
            return importlib.import_module("orbax.checkpoint")
        """,
        b="from paramstore.a import thing\n",
        c="y = 2\n",
    )
    assert local_imports(imports) == []
    edges = graph(imports)
    assert edges["paramstore.a"] == {"paramstore.c"}  # the TYPE_CHECKING one is no edge
    assert cycles(edges) == []  # a -> b only for the type checker: no cycle


def test_checker_reports_a_cycle_path_including_one_closed_in_a_function():
    imports = synthetic(
        a="from paramstore import b\n",
        b="from . import c\n",
        c="""\
        def late():
            from paramstore.a import thing
            return thing
        """,
        d="import paramstore.a\n",
    )
    assert cycles(graph(imports)) == [
        ["paramstore.a", "paramstore.b", "paramstore.c", "paramstore.a"]
    ]


def test_checker_counts_importlib_of_own_modules_and_resolves_names():
    imports = synthetic(
        a="""\
        import importlib
        def f():
            return importlib.import_module("paramstore.b")
        """,
        b="from paramstore import Variable, a\n",  # a name from the root, and a submodule
        nn_="from .dense import Dense\nfrom .. import c\n",
        nn_dense="from ..b import x\nimport paramstore.nn\n",
        c="x = 1\n",
    )
    assert local_imports(imports) == []  # importlib is the allowed way
    edges = graph(imports)
    assert edges["paramstore.a"] == {"paramstore.b"}
    assert edges["paramstore.b"] == {"paramstore", "paramstore.a"}
    assert edges["paramstore.nn"] == {"paramstore.nn.dense", "paramstore.c"}
    assert edges["paramstore.nn.dense"] == {"paramstore.b", "paramstore.nn"}
    assert sorted(map(tuple, cycles(edges))) == [
        ("paramstore.a", "paramstore.b", "paramstore.a"),
        ("paramstore.nn", "paramstore.nn.dense", "paramstore.nn"),
    ]
    assert "paramstore" not in edges or edges["paramstore"] == set()  # root re-exports


def test_checker_layers_and_unknown_modules():
    layers = [("low", ["base", "_helper"]), ("mid", ["core", "nn"]), ("top", ["cli"])]
    imports = synthetic(
        base="from paramstore import core\n",  # up: violation
        core="from paramstore import base, _helper\nimport paramstore\n",  # down ok; root: not top
        nn_x="from paramstore import cli\n",
        cli="import paramstore\nfrom paramstore import core\n",
        _helper="z = 0\n",
        extra="w = 0\n",
    )
    found = layer_violations(imports, layers)
    assert found == [
        "paramstore/base.py:1: paramstore.base (layer 0, low) imports paramstore.core "
        "(layer 1, mid): from paramstore import core",
        "paramstore/core.py:2: paramstore.core (layer 1, mid) imports paramstore "
        "(layer 2, top): import paramstore",
        "paramstore/nn/x.py:1: paramstore.nn.x (layer 1, mid) imports paramstore.cli "
        "(layer 2, top): from paramstore import cli",
    ]
    names = ["paramstore.base", "paramstore._helper", "paramstore.nn.x", "paramstore.extra"]
    assert unknown_modules(names, layers) == ["paramstore.extra"]
    assert layer_of("paramstore._anything", LAYERS) is None  # no default layer, private or not
    assert layer_of("paramstore.checkpoint.formats.tensorflow.x", LAYERS) == 6  # a package's own
    assert layer_of("paramstore.checkpointing", LAYERS) is None  # a prefix is not a package


# ------------------------------------------------------------------------------ the package


@pytest.fixture(scope="module")
def package_imports():
    imports = scan(package_sources())
    assert {i.module for i in imports} >= {"paramstore.variable", "paramstore.checkpoint"}
    return imports


def test_every_module_is_in_the_layer_table():
    names = [module_name(p) for p in package_sources()]
    missing = unknown_modules(names)
    assert not missing, f"add these modules to LAYERS in {__file__}: {missing}"


def test_no_function_local_imports(package_imports):
    found = local_imports(package_imports)
    assert not found, (
        "imports inside a function, method or class body (move them to module level; "
        "optional heavy packages: importlib.import_module):\n" + "\n".join(found)
    )


def test_no_import_cycles(package_imports):
    found = cycles(graph(package_imports))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_lower_layers_never_import_higher_ones(package_imports):
    found = layer_violations(package_imports)
    assert not found, "imports that go up the layers:\n" + "\n".join(found)


def test_one_write_path_and_one_hand_out_path_for_a_variables_array():
    """Only paramstore/_core/ownership.py reads or writes a variable's array (``_value``) or its
    record of what was handed out (``_given``): every write goes through ``write`` /
    ``write_many`` (so the steady path sees it) and every read that gives the array away
    through ``hand_out`` (so it is never donated afterwards)."""
    writes, reads = [], []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path == PACKAGE_DIR / "_core" / "ownership.py":
            continue
        rel = path.relative_to(PACKAGE_DIR.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in OWNED_FIELDS:
                if isinstance(node.ctx, ast.Load) and node.attr == "_value":
                    reads.append(f"{rel}:{node.lineno}")
                else:
                    writes.append(f"{rel}:{node.lineno}")
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) in ("setattr", "getattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in OWNED_FIELDS
            ):
                writes.append(f"{rel}:{node.lineno}")
    assert not writes, f"write variables through paramstore._core.ownership: {writes}"
    assert not reads, f"read variables through ownership.hand_out / peek: {reads}"


OWNED_FIELDS = ("_value", "_given", "_override", "_donors")  # _core.ownership.Owned's slots
# What a caller of ``ownership.peek`` may read from its result: metadata, never the data.
METADATA = {"sharding", "shape", "dtype", "ndim", "size", "committed", "aval", "weak_type"}


def _metadata_only(call: ast.Call, parent: ast.AST | None) -> bool:
    """Whether ``ownership.peek(...)`` (``call``) is used for metadata only: an attribute of
    METADATA read from it, ``getattr(peek(v), "<metadata>", default)``, or an
    ``isinstance`` test."""
    if isinstance(parent, ast.Attribute):
        return parent.attr in METADATA
    if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name):
        if parent.func.id == "isinstance" and parent.args[:1] == [call]:
            return True
        if parent.func.id == "getattr" and parent.args[:1] == [call]:
            name = parent.args[1] if len(parent.args) > 1 else None
            return isinstance(name, ast.Constant) and name.value in METADATA
    return False


def test_no_read_of_a_variables_array_outside_ownership():
    """Every call of ``ownership.peek`` outside ``_core/ownership.py`` reads metadata only
    (issue 23): a value read goes through ``hand_out``, ``copy`` or a write/step of
    ownership, so no data is read outside the state lock (a step in another thread could
    donate the buffer meanwhile)."""
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path == PACKAGE_DIR / "_core" / "ownership.py":
            continue
        rel = path.relative_to(PACKAGE_DIR.parent).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "peek"
                and getattr(node.func.value, "id", None) == "ownership"
                and not _metadata_only(node, parents.get(node))
            ):
                found.append(f"{rel}:{node.lineno}")
    assert not found, (
        f"ownership.peek used for more than metadata (use hand_out, copy or spec): {found}"
    )


def test_the_peek_check_sees_a_data_read():
    tree = ast.parse("x = ownership.peek(v)\ny = ownership.peek(v).sharding\n")
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert [_metadata_only(c, parents[c]) for c in calls] == [False, True]


# Variable's underscore members that other modules of the package may use (docs/architecture.md,
# "Variable's package interface"); every other private member stays inside the variable layer.
VARIABLE_PACKAGE_INTERFACE = {
    "_write",
    "_swap",
    "_coerce",
    "_check_arithmetic",
    "_colocated",
    "_is_string",
    "_is_key",
    "_store",
    "_freeze",
}
VARIABLE_LAYER = {
    "variable.py",
    "_variable/abstract.py",
    "_variable/convert.py",
    "_variable/text.py",
    "_core/ownership.py",
}


def test_other_modules_reach_variables_only_through_their_package_interface():
    Variable = importlib.import_module("paramstore.variable").Variable
    private = {
        name
        for cls in Variable.__mro__
        for name in (*vars(cls), *getattr(cls, "__slots__", ()))
        if name.startswith("_") and not name.startswith("__") and not name.endswith("_")
    }
    assert private >= VARIABLE_PACKAGE_INTERFACE  # the list names real members
    reached = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path.relative_to(PACKAGE_DIR).as_posix() in VARIABLE_LAYER:
            continue
        rel = path.relative_to(PACKAGE_DIR.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private - VARIABLE_PACKAGE_INTERFACE
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                reached.append(f"{rel}:{node.lineno} .{node.attr}")
    assert reached == [], (
        f"use a Variable's public API or its package interface (docs/architecture.md): {reached}"
    )


def test_one_per_thread_context():
    """Every per-thread stack paramstore keeps is a field of ``_core.context.ctx``: no other
    module makes a ``threading.local`` or a ``ContextVar`` (docs/architecture.md)."""
    others = sorted(
        path.relative_to(PACKAGE_DIR.parent).as_posix()
        for path in PACKAGE_DIR.rglob("*.py")
        if path != PACKAGE_DIR / "_core" / "context.py"
        and any(word in path.read_text() for word in ("threading.local", "ContextVar"))
    )
    assert others == [], f"keep per-thread state in paramstore._core.context.ctx: {others}"


def test_jax_internals_are_used_in_paramstore_jax_only():
    users = sorted(
        path.relative_to(PACKAGE_DIR.parent).as_posix()
        for path in PACKAGE_DIR.rglob("*.py")
        if path != PACKAGE_DIR / "_core" / "jax_api.py" and "jax._src" in path.read_text()
    )
    assert users == [], f"move these jax._src uses into paramstore/_core/jax_api.py: {users}"


def core_aliases(source: str, path: str) -> list[str]:
    """Imports of a ``paramstore._core`` module under another name than its own (a leading
    underscore aside): ``from paramstore._core import frames as _trace`` hid which module a
    call goes to (issue 33)."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        pairs: list[tuple[str, str | None, int]] = []
        if isinstance(node, ast.ImportFrom) and node.module == f"{PACKAGE}._core":
            pairs = [(a.name, a.asname, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            pairs = [
                (a.name.rsplit(".", 1)[1], a.asname, node.lineno)
                for a in node.names
                if a.name.startswith(f"{PACKAGE}._core.")
            ]
        for name, alias, line in pairs:
            if alias is not None and alias.lstrip("_") != name:
                found.append(f"{path}:{line}: {name} as {alias}")
    return found


def test_core_modules_are_imported_under_their_own_names():
    assert core_aliases("from paramstore._core import frames as _trace, seed as _seed\n", "x") == [
        "x:1: frames as _trace"
    ]
    assert core_aliases("import paramstore._core.frames as fr\n", "y") == ["y:1: frames as fr"]
    found = [hit for rel, source in package_sources().items() for hit in core_aliases(source, rel)]
    assert found == [], f"import _core modules under their own names: {found}"


# Class names of the higher layers that are also plain words ("Sum the deltas"), so not
# searched for; the layers' base classes are searched for all the same.
ENGLISH = {"Accuracy", "Activation", "Flatten", "Mean", "Precision", "Projection", "Recall"}
ENGLISH |= {"Reshape", "Slot", "Sum", "Template"}


def higher_names_in_core(sources: Mapping[str, str]) -> list[str]:
    """Where a ``_core`` module names a class of ``nn`` or ``metrics`` (``Repeat``, ``Layer``,
    ``Dropout``...), refers to ``nn.``, or has a ``keras`` identifier (issue 33: the bottom
    layer is generic; what a higher layer needs of it is a hook the higher layer fills)."""
    classes = {
        node.name
        for rel, source in sources.items()
        if rel.startswith((f"{PACKAGE}/nn/", f"{PACKAGE}/metrics/"))
        for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_")
    } - ENGLISH
    word = re.compile(r"\b(?:" + "|".join(sorted(classes)) + r")\b|\bnn\.")
    found = []
    for rel, source in sources.items():
        if not rel.startswith(f"{PACKAGE}/_core/"):
            continue
        if "keras" in rel:
            found.append(f"{rel}: a keras module")
        for number, line in enumerate(source.splitlines(), 1):
            if word.search(line):
                found.append(f"{rel}:{number}: {line.strip()}")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.alias):
                names = [node.name, node.asname or ""]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Name | ast.Attribute | ast.FunctionDef | ast.ClassDef):
                names = [getattr(node, "id", "") or getattr(node, "attr", "") or node.name]
            else:
                continue
            if any("keras" in n.lower() for n in names):
                found.append(f"{rel}:{getattr(node, 'lineno', '?')}: a keras name")
    return sorted(set(found))


def test_core_names_no_higher_layer():
    assert higher_names_in_core(
        {
            "paramstore/nn/repeat/x.py": "class Repeat: ...\nclass Sum: ...\n",
            "paramstore/_core/a.py": '"""A Repeat scan. Sum it."""\nx = ps.nn.Dense\n',
            "paramstore/_core/b.py": "from paramstore._core.keras_objects import get\n",
            "paramstore/_core/keras_objects.py": "",
        }
    ) == [
        'paramstore/_core/a.py:1: """A Repeat scan. Sum it."""',
        "paramstore/_core/a.py:2: x = ps.nn.Dense",
        "paramstore/_core/b.py:1: a keras name",
        "paramstore/_core/keras_objects.py: a keras module",
    ]
    found = higher_names_in_core(package_sources())
    assert found == [], f"paramstore/_core names a higher layer's classes: {found}"


# Errors still told apart by their text, each for a reason (the test fails when one is gone).
MESSAGE_TESTS = {
    # Python's own RuntimeError from Thread.start at interpreter shutdown: no type tells it.
    "paramstore/checkpoint/io.py",
}


def _is_str_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "str"
        and len(node.args) == 1
    )


def message_tests(source: str, path: str) -> list[str]:
    """Where ``source`` tells something apart by its text: ``"..." in str(e)``,
    ``str(e).startswith(...)`` (or ``endswith``, ``==``), ``re.search(..., str(e))``.
    Errors of paramstore's own that a caller must recognize have a class of their own
    (``frames.CreationRefused``, ``dtypes.IntegerOverflow``)."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        hit = False
        if isinstance(node, ast.Compare):
            hit = any(_is_str_call(x) for x in (node.left, *node.comparators))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("startswith", "endswith") and _is_str_call(node.func.value):
                hit = True
            if getattr(node.func.value, "id", None) == "re":
                hit = any(_is_str_call(a) for a in node.args)
        if hit:
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_errors_are_told_apart_by_their_type_not_their_text():
    assert message_tests(
        "try:\n    f()\nexcept ValueError as e:\n"
        "    if str(e).startswith('x') or 'y' in str(e) or re.match('z', str(e)):\n"
        "        raise\n",
        "m.py",
    ) == [
        "m.py:4: str(e).startswith('x')",
        "m.py:4: 'y' in str(e)",
        "m.py:4: re.match('z', str(e))",
    ]
    found = {
        rel: hits
        for rel, source in package_sources().items()
        if (hits := message_tests(source, rel))
    }
    assert set(found) == MESSAGE_TESTS, (
        "tell errors apart by their class (give an error of paramstore's own a subclass), "
        f"not by their text: {found}"
    )


ARCHITECTURE = PACKAGE_DIR.parent / "docs" / "architecture.md"


# docs/architecture.md, "Modules": one job a module, each under ~LINE_GUIDE lines but these.
LINE_GUIDE = 450
LONGER = {
    "paramstore/variable.py": "ps.Variable in one place, its hot paths written out (issue 23)",
}


def test_modules_stay_under_the_line_guide():
    sizes = {rel: source.count("\n") for rel, source in package_sources().items()}
    longer = {rel for rel, n in sizes.items() if n > LINE_GUIDE}
    assert longer <= set(LONGER), (
        f"modules past {LINE_GUIDE} lines (split one along a real seam, or add it to LONGER "
        f"with its reason and to docs/architecture.md): "
        f"{sorted((rel, sizes[rel]) for rel in longer - set(LONGER))}"
    )
    assert not set(LONGER) - longer, f"under {LINE_GUIDE} lines now: {set(LONGER) - longer}"


def test_every_path_the_docs_and_docstrings_name_exists():
    """A ``paramstore/....py`` (or ``paramstore/.../``) path in the docs, the README or the
    package's own text names a file or folder that exists (issue 33: ``nn/repeat.py``)."""
    root = PACKAGE_DIR.parent
    texts = {p: p.read_text(encoding="utf-8") for p in root.joinpath("docs").rglob("*.md")}
    texts[root / "README.md"] = (root / "README.md").read_text(encoding="utf-8")
    texts.update({PACKAGE_DIR.parent / rel: src for rel, src in package_sources().items()})
    path = re.compile(r"\bparamstore/[\w/]+(?:\.py|/)")
    missing = sorted(
        f"{file.relative_to(root)}: {found}"
        for file, text in texts.items()
        for found in set(path.findall(text))
        if not (root / found).exists()
    )
    assert missing == [], f"paths that do not exist: {missing}"


def test_the_architecture_page_draws_this_layer_table_and_every_module():
    text = ARCHITECTURE.read_text(encoding="utf-8")
    rows = []
    for line in text.split("## Layers", 1)[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[1].startswith("`"):
            rows.append((cells[0], [m.strip().strip("`") for m in cells[1].split(",")]))
    assert rows == LAYERS, f"update the layer table in {ARCHITECTURE} (or LAYERS)"
    described = {
        line[3:].split("`", 1)[0]
        for line in text.split("## Modules", 1)[1].splitlines()
        if line.startswith("- `")
    }
    modules = {module_name(p).removeprefix(f"{PACKAGE}.") for p in package_sources()}
    modules = {m if m != PACKAGE else "__init__" for m in modules}
    assert not modules - described, f"add a line for each to {ARCHITECTURE}: {modules - described}"
    assert not described - modules, f"modules that no longer exist: {described - modules}"
    packages = {m for m in modules if (PACKAGE_DIR / m.replace(".", "/") / "__init__.py").exists()}
    assert {"_core", "checkpoint", "checkpoint.formats.orbax", "nn.repeat"} <= packages
    assert not packages - described, f"add a line for each package to {ARCHITECTURE}"
    entries = {m for _, names in LAYERS for m in names}
    assert not entries - modules, f"LAYERS names what does not exist: {entries - modules}"
