"""The public API is typed: no public parameter or return is ``Any`` or unannotated unless it is
listed in ``ALLOWED`` below with the reason ``Any`` is really right there (issue 15, "Types").

The walk starts at ``paramstore.__all__`` and goes into every public submodule's ``__all__``
(``ps.nn``, ``ps.metrics``, ``ps.initializers``, ``ps.random``, ``ps.sharding``,
``ps.checkpoint``, ``ps.typing``); for a class it takes ``__init__``, ``__call__`` and every
public method and property (inherited ones once, under the class that defines them). A
parameter counts when its annotation is missing or ``Any`` (``self``/``cls`` excepted); a
return when it is ``Any``.
"""

from __future__ import annotations

import ast
import inspect
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paramstore

# "qualified.name(parameter)" or "qualified.name -> return": why Any is right there.
ALLOWED: dict[str, str] = {
    "paramstore.plan.plan(args)": (
        "forwarded as is to the user's step function (arrays, ShapeDtypeStructs, any pytree)"
    ),
    "paramstore.plan.plan(kwargs)": "forwarded as is to the user's step function",
    "paramstore.optimizer.Optimizer.apply_gradients(extra_args)": (
        "forwarded as is to the user's optax transformation (tx.update(..., **extra_args))"
    ),
    "paramstore.optimizer.loss_scale.LossScaleOptimizer.apply_gradients(extra_args)": (
        "forwarded as is to the inner optimizer's optax transformation (tx.update)"
    ),
    "paramstore.nn.repeat.Repeat.__call__(args)": "forwarded to the user's block, any values",
    "paramstore.nn.repeat.Repeat.__call__(kwargs)": "forwarded to the user's block, any values",
    "paramstore.nn.core.Sequential.__call__(x)": (
        "passed to the first layer, which may be any user callable (any input it takes)"
    ),
    "paramstore.nn.core.Sequential.__call__ -> return": (
        "what the last layer returns: any user callable's result"
    ),
}

# ``PyTree`` is ``Any`` under a name (paramstore.typing): it counts as Any here.
ANY = (inspect.Parameter.empty, Any, "Any", "typing.Any", "PyTree")


def _functions(obj: object, name: str, seen: set[int]) -> Iterator[tuple[str, Callable[..., Any]]]:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, types.ModuleType):
        for attr in getattr(obj, "__all__", ()):
            yield from _functions(getattr(obj, attr), f"{name}.{attr}", seen)
    elif inspect.isclass(obj):
        if not obj.__module__.startswith("paramstore"):
            return
        for attr, member in vars(obj).items():
            if attr.startswith("_") and attr not in ("__init__", "__call__"):
                continue
            if isinstance(member, staticmethod | classmethod):
                member = member.__func__
            if isinstance(member, property):
                member = member.fget
            if (
                inspect.isfunction(member)
                and member.__module__.startswith("paramstore")  # not typing.Protocol's own
                and id(member) not in seen
            ):
                seen.add(id(member))
                yield f"{obj.__module__}.{obj.__qualname__}.{attr}", member
        for base in obj.__mro__[1:]:
            if base.__module__.startswith("paramstore"):
                yield from _functions(base, base.__qualname__, seen)
    elif inspect.isfunction(obj) and obj.__module__.startswith("paramstore"):
        yield f"{obj.__module__}.{obj.__qualname__}", obj
    elif callable(obj) and getattr(obj, "__wrapped__", None) is not None:
        yield from _functions(obj.__wrapped__, name, seen)


def untyped(root: types.ModuleType = paramstore) -> tuple[list[str], list[str], int, int]:
    """(untyped parameters, untyped returns, all parameters, all returns) under ``root``."""
    params, returns, n_params, n_returns = [], [], 0, 0
    for name, fn in _functions(root, root.__name__, set()):
        sig = inspect.signature(fn)
        for p in sig.parameters.values():
            if p.name in ("self", "cls"):
                continue
            n_params += 1
            if p.annotation in ANY:
                params.append(f"{name}({p.name})")
        n_returns += 1
        if sig.return_annotation in ANY[1:]:
            returns.append(f"{name} -> return")
    return params, returns, n_params, n_returns


def test_the_walk_finds_untyped_parameters_and_returns_in_a_synthetic_package():
    pkg = types.ModuleType("paramstore_probe")
    sub = types.ModuleType("paramstore_probe.sub")
    source = (
        "from typing import Any\n"
        "class Base:\n"
        "    def method(self, a: int, b) -> Any: ...\n"
        "    def _private(self, c) -> Any: ...\n"
        "class Child(Base):\n"
        "    def __init__(self, x: 'PyTree', y: 'int') -> None: ...\n"
        "    def __call__(self, *args: Any, **kwargs: 'Any') -> 'Any': ...\n"
        "    @property\n"
        "    def size(self) -> int: ...\n"
        "def top(n: 'int', m: Any = 1) -> 'float': ...\n"
    )
    exec(compile(source, "paramstore_probe/sub.py", "exec", dont_inherit=True), sub.__dict__)
    sub.__all__ = ["Child", "top"]
    pkg.__all__ = ["sub"]
    pkg.sub = sub
    params, returns, n_params, n_returns = untyped(pkg)
    assert sorted(params) == [
        "paramstore_probe.sub.Base.method(b)",
        "paramstore_probe.sub.Child.__call__(args)",
        "paramstore_probe.sub.Child.__call__(kwargs)",
        "paramstore_probe.sub.Child.__init__(x)",
        "paramstore_probe.sub.top(m)",
    ]
    assert sorted(returns) == [
        "paramstore_probe.sub.Base.method -> return",
        "paramstore_probe.sub.Child.__call__ -> return",
    ]
    assert (n_params, n_returns) == (8, 5)  # _private is not public: not walked


def test_the_walk_sees_the_public_api():
    _, _, n_params, n_returns = untyped()
    assert n_params > 300 and n_returns > 200, (n_params, n_returns)
    walked = {name for name, _ in _functions(paramstore, "paramstore", set())}
    assert {
        "paramstore.variable.Variable.assign",
        "paramstore.variable.Variable.__init__",
        "paramstore.nn.core.Dense.__call__",
        "paramstore.metrics.base.Mean.update_state",
        "paramstore.initializers.resolve",
        "paramstore.sharding.reshard",
        "paramstore.random.Generator.normal",
    } <= walked


def test_public_signatures_are_typed_beyond_any():
    params, returns, _, _ = untyped()
    found = params + returns
    extra = [n for n in found if n not in ALLOWED]
    assert not extra, (
        "public parameters/returns typed Any or unannotated; use paramstore.typing's aliases, "
        "jax.typing.ArrayLike/DTypeLike or jax.Array (or, where Any is genuinely right, add "
        "the name with a reason to ALLOWED in tests/test_typing.py):\n" + "\n".join(extra)
    )
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"ALLOWED entries that are typed now (remove them): {stale}"


# ---------------------------------------------------------------- the bottom layer's annotations

CORE = Path(__file__).resolve().parent.parent / "paramstore" / "_core"


def _is_bare_any(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.strip() in ("Any", "typing.Any")
    return (isinstance(node, ast.Name) and node.id == "Any") or (
        isinstance(node, ast.Attribute) and node.attr == "Any"
    )


def annotations(source: str) -> list[ast.expr]:
    """Every annotation in ``source``: each annotated parameter (``*args`` and ``**kwargs``
    included), each return, each annotated assignment (module, class or local)."""
    found: list[ast.expr] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None and arg.annotation is not None:
                    found.append(arg.annotation)
            if node.returns is not None:
                found.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
    return found


def test_the_annotation_count_sees_every_kind():
    source = "x: Any = 1\ndef f(a: int, *b: Any, c: 'Any' = 0, **d: Any) -> dict[str, Any]: ...\n"
    assert [_is_bare_any(a) for a in annotations(source)] == [True, False, True, True, True, False]


def test_the_bottom_layer_names_its_types():
    """At most 6% of ``paramstore/_core``'s annotations are a bare ``Any`` (issue 33: 28.8%,
    176 of 612, before; 5.7%, 34 of 597, after: JAX's traces, refs, jaxprs and avals by
    their public names, Protocols for what ``_core.html`` reads of a variable or module and
    for JAX's private pieces). ``dict[str, Any]`` is not bare: it says what it is."""
    total = bare = 0
    for path in sorted(CORE.glob("*.py")):
        found = annotations(path.read_text(encoding="utf-8"))
        total += len(found)
        bare += sum(map(_is_bare_any, found))
    assert bare <= 0.06 * total, f"{bare} of {total} annotations in paramstore/_core are bare Any"
