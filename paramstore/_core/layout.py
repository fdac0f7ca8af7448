"""Where a new variable lives, decided by its name: ``LayoutMap``, partitions, axis rules.

The part of ``paramstore.sharding`` that variable creation consults (so it sits below
``variable``); ``paramstore.sharding`` re-exports it. Contract (docs/api.md, "Models larger
than one device"):

* ``LayoutMap(mesh)`` maps regular expressions to layouts, as Keras 3's
  ``keras.distribution.LayoutMap``: ``layout_map[r"dense.*/kernel"] = (None, "model")``. A
  layout is a tuple with one entry per dimension (a mesh axis name, ``None`` or a tuple of
  axis names), a ``PartitionSpec`` (``P()`` replicates whatever the rank), a ``Sharding``,
  or ``None`` (replicated). ``layout_map[name]`` looks a variable's full name up: an exact
  key wins, else the one key that ``re.search`` finds in the name; two or more matching keys
  raise ``ValueError`` naming them; no match gives ``None`` (replicated over the mesh).
* ``with ps.device(layout_map):`` gives every variable created inside the layout its name
  maps to (``target``). A layout of the wrong rank, or one naming an axis the mesh lacks,
  raises ``ValueError`` naming the variable, before anything is created.
* ``partition=("embed", "mlp")`` on a variable records one *logical* axis name (or None, or
  a tuple of names) per dimension. Inside ``with axis_rules(mesh, {"embed": "data"}):`` a
  partitioned variable is created split over the mesh axes its names map to; a logical
  name missing from the rules leaves that dimension whole. A rule naming an axis the mesh
  lacks raises ``ValueError`` when the block is entered. A ``LayoutMap`` entry for the
  variable's name wins over its partition.
* Precedence for a new variable: ``sharding=``/``device=`` given to it, then a
  ``LayoutMap`` entry matching its name, then its partition under the innermost
  ``axis_rules``, then the innermost ``ps.device`` block (a ``LayoutMap`` there: replicated
  over its mesh), else none (JAX's default device, uncommitted).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping
from typing import Any

from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from paramstore._core.context import ctx
from paramstore._core.placement import Layouts, check_fits, current_placement, placement
from paramstore.typing import DeviceLike

__all__ = [
    "LayoutMap",
    "Layout",
    "Partition",
    "axis_rules",
    "current_rules",
    "check_partition",
    "target",
    "may_shard",
]

Axes = str | None | tuple[str, ...]
Layout = tuple[Axes, ...] | PartitionSpec | Sharding | None
"""A layout: one mesh axis name (or None, or a tuple of names) per dimension, a
PartitionSpec, a Sharding, or None (replicated)."""
Partition = tuple[Axes, ...]
"""A partition: one logical axis name (or None, or a tuple of names) per dimension."""


def _axes(entry: object) -> tuple[str, ...]:
    """The names in one spec entry (``None`` -> ``()``, ``"x"`` -> ``("x",)``)."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, (tuple, list)) and all(isinstance(a, str) for a in entry):
        return tuple(entry)
    raise TypeError(
        f"A layout or partition entry is an axis name, None or a tuple of names, got {entry!r}."
    )


def _as_spec(entries: Iterable[object]) -> tuple[Axes, ...]:
    out: list[Axes] = []
    for entry in entries:
        axes = _axes(entry)
        out.append(None if not axes else axes[0] if isinstance(entry, str) else axes)
    return tuple(out)


def _mesh_axes_error(what: str, missing: list[str], mesh: Mesh, fix: str) -> ValueError:
    return ValueError(
        f"{what} names mesh axis {missing[0]!r}, which the mesh {dict(mesh.shape)} lacks. "
        f"{fix} (the mesh's axes are {', '.join(map(repr, mesh.axis_names))})."
    )


class LayoutMap(Layouts):
    """Variable name (regular expression) -> layout, over one ``Mesh`` (Keras 3 semantics;
    see the module docstring). Use it with ``with ps.device(layout_map):``."""

    def __init__(self, mesh: Mesh) -> None:
        if not isinstance(mesh, Mesh):
            raise TypeError(
                f"LayoutMap(mesh) needs a jax.sharding.Mesh, got {type(mesh).__name__}; make "
                "one with jax.make_mesh((4, 2), ('data', 'model'))."
            )
        self._mesh = mesh
        self._layouts: dict[str, Layout] = {}
        self._patterns: dict[str, re.Pattern[str]] = {}

    @property
    def mesh(self) -> Mesh:
        """The mesh the layouts refer to."""
        return self._mesh

    device_mesh = mesh  # Keras' name

    def __setitem__(self, key: str, layout: Layout) -> None:
        if not isinstance(key, str):
            raise TypeError(f"A LayoutMap key is a regular expression (str), got {key!r}.")
        if key in self._layouts:
            raise ValueError(
                f"LayoutMap key {key!r} already has the layout {self._layouts[key]!r}; delete "
                "it first (del layout_map[key]) to give it another."
            )
        if isinstance(layout, list):
            layout = tuple(layout)
        if isinstance(layout, tuple):
            layout = _as_spec(layout)
        elif layout is not None and not isinstance(layout, (PartitionSpec, Sharding)):
            raise TypeError(
                f"LayoutMap[{key!r}]: a layout is a tuple of mesh axis names (None: not "
                f"split), a PartitionSpec or a Sharding, got {type(layout).__name__}."
            )
        try:
            pattern = re.compile(key)
        except re.error as e:
            raise ValueError(f"LayoutMap key {key!r} is not a regular expression: {e}.") from None
        self._layouts[key] = layout
        self._patterns[key] = pattern

    def __getitem__(self, name: str) -> Layout:
        """The layout for the variable named ``name`` (None: no key matches)."""
        hit = self.lookup(name)
        return None if hit is None else hit[1]

    def __delitem__(self, key: str) -> None:
        del self._layouts[key]
        del self._patterns[key]

    def __contains__(self, key: object) -> bool:
        return key in self._layouts

    def __iter__(self) -> Iterator[str]:
        return iter(self._layouts)

    def __len__(self) -> int:
        return len(self._layouts)

    def keys(self) -> KeysView[str]:
        """The keys (exact names and regular expressions), in insertion order."""
        return self._layouts.keys()

    def items(self) -> ItemsView[str, Layout]:
        """``(key, layout)`` pairs, in insertion order."""
        return self._layouts.items()

    def get(self, name: str, default: Layout = None) -> Layout:
        """The layout stored under the key ``name`` (not a lookup by variable name), or
        ``default``."""
        hit = self.lookup(name)
        return default if hit is None else hit[1]

    def __repr__(self) -> str:
        body = ", ".join(f"{k!r}: {v!r}" for k, v in self._layouts.items())
        return f"LayoutMap(mesh={dict(self._mesh.shape)}, {{{body}}})"

    def lookup(self, name: str) -> tuple[str, Layout] | None:
        """``(key, layout)`` for ``name``: the exact key, else the one key found in it."""
        if name in self._layouts:
            return name, self._layouts[name]
        hits = [k for k, p in self._patterns.items() if p.search(name)]
        if len(hits) > 1:
            raise ValueError(
                f"Variable '{name}' matches {len(hits)} LayoutMap keys "
                f"({', '.join(map(repr, hits))}), so its layout is ambiguous. Make the keys "
                f"more specific (anchor them: r'^dense/kernel$'), or add the exact name "
                f"{name!r} as a key (an exact match wins)."
            )
        return (hits[0], self._layouts[hits[0]]) if hits else None

    def sharding_for(self, name: str, shape: tuple[int, ...]) -> Sharding | None:
        """The sharding of a variable ``name`` of ``shape`` (None: no key matches), checked
        to fit (``ValueError`` naming the variable otherwise)."""
        hit = self.lookup(name)
        if hit is None:
            return None
        key, layout = hit
        what = f"The layout for variable '{name}' (LayoutMap key {key!r}: {layout!r})"
        if isinstance(layout, Sharding):
            if isinstance(layout, NamedSharding):
                _check_rank(tuple(layout.spec), shape, name, what)
            check_fits(layout, shape, f"variable '{name}'")
            return layout
        entries = () if layout is None else tuple(layout)
        _check_rank(entries, shape, name, what)
        missing = [a for e in entries for a in _axes(e) if a not in self._mesh.shape]
        if missing:
            raise _mesh_axes_error(what, missing, self._mesh, "Use an axis of the mesh")
        axes = [a for e in entries for a in _axes(e)]
        twice = sorted({a for a in axes if axes.count(a) > 1})
        if twice:
            raise ValueError(
                f"{what} uses mesh axis {', '.join(map(repr, twice))} more than once; a mesh "
                "axis can split one dimension only. Give each axis once."
            )
        sharding = NamedSharding(self._mesh, PartitionSpec(*entries))
        check_fits(sharding, shape, f"variable '{name}'")
        return sharding

    def replicated(self) -> Sharding:
        """A sharding that replicates a variable over the whole mesh."""
        return NamedSharding(self._mesh, PartitionSpec())


def _check_rank(entries: tuple[Any, ...], shape: tuple[int, ...], name: str, what: str) -> None:
    if entries and len(entries) != len(shape):
        raise ValueError(
            f"{what} has {len(entries)} entries, but the variable has shape {tuple(shape)} "
            f"(rank {len(shape)}). Give one entry per dimension (None: not split), or a "
            "more specific key so that this one does not match it."
        )


# --------------------------------------------------------------------------- axis rules


@contextlib.contextmanager
def axis_rules(
    mesh: Mesh, rules: Mapping[str, Axes] | Iterable[tuple[str, Axes]]
) -> Iterator[Mesh]:
    """Map logical axis names (variables' ``partition=``) to axes of ``mesh`` for the
    variables created inside: ``axis_rules(mesh, {"embed": "data", "mlp": "model"})``.

    ``rules`` is a dict or a sequence of ``(logical name, mesh axis | None | tuple of
    axes)`` pairs. A rule naming an axis the mesh lacks raises ``ValueError`` here."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"axis_rules(mesh, rules) needs a jax.sharding.Mesh, got {mesh!r}.")
    pairs = rules.items() if isinstance(rules, Mapping) else rules
    table: dict[str, tuple[str, ...]] = {}
    for logical, axes in pairs:
        if not isinstance(logical, str):
            raise TypeError(f"axis_rules: a logical axis name is a str, got {logical!r}.")
        names = _axes(axes)
        missing = [a for a in names if a not in mesh.shape]
        if missing:
            raise _mesh_axes_error(
                f"axis_rules: the rule {logical!r} -> {axes!r}",
                missing,
                mesh,
                "Map the logical name to an axis of the mesh, or to None",
            )
        table[logical] = names
    ctx.axis_rules += ((mesh, table),)  # no call, so no signal check, before the try
    try:
        yield mesh
    finally:
        ctx.axis_rules.pop()


def current_rules() -> tuple[Mesh, dict[str, tuple[str, ...]]] | None:
    """The innermost ``axis_rules`` block's mesh and rules, if any."""
    return ctx.axis_rules[-1] if ctx.axis_rules else None


def check_partition(
    partition: object, name: str, shape: tuple[int, ...] | None
) -> Partition | None:
    """``partition`` as a tuple (one entry per dimension), or ``TypeError``/``ValueError``
    naming the variable."""
    if partition is None:
        return None
    if isinstance(partition, PartitionSpec):
        partition = tuple(partition)
    if not isinstance(partition, (tuple, list)):
        raise TypeError(
            f"Variable '{name}': partition= is a tuple with one logical axis name (or None) "
            f"per dimension, e.g. ('embed', 'mlp'), got {type(partition).__name__}."
        )
    try:
        out = _as_spec(partition)
    except TypeError as e:
        raise TypeError(f"Variable '{name}': partition={tuple(partition)!r}: {e}") from None
    if shape is not None and len(out) != len(shape):
        raise ValueError(
            f"Variable '{name}' has shape {tuple(shape)} (rank {len(shape)}), but its "
            f"partition {out!r} has {len(out)} entries. Give one logical axis name (or None) "
            "per dimension."
        )
    return out


def _from_rules(name: str, shape: tuple[int, ...], partition: Partition) -> Sharding | None:
    found = current_rules()
    if found is None:
        return None
    mesh, table = found
    spec: list[Axes] = []
    used: dict[str, Any] = {}
    for entry in partition:
        axes = tuple(a for logical in _axes(entry) for a in table.get(logical, ()))
        for a in axes:
            if a in used:
                raise ValueError(
                    f"Variable '{name}': its partition {partition!r} maps both {used[a]!r} "
                    f"and {entry!r} to mesh axis {a!r} under the axis rules; a mesh axis can "
                    "split one dimension only. Change the rules or the partition."
                )
            used[a] = entry
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    sharding = NamedSharding(mesh, PartitionSpec(*spec))
    check_fits(sharding, shape, f"variable '{name}' (partition {partition!r})")
    return sharding


def target(
    name: str,
    shape: tuple[int, ...],
    partition: Partition | None = None,
    device: DeviceLike | Sharding | None = None,
    sharding: Sharding | Mesh | None = None,
) -> Sharding | None:
    """The sharding a new variable ``name`` of ``shape`` gets (see the precedence in the
    module docstring), checked to fit; None: no placement asked for."""
    if device is not None or sharding is not None:
        return _explicit(device, sharding)
    context = current_placement()
    if isinstance(context, LayoutMap):
        found = context.sharding_for(name, shape)
        if found is not None:
            return found
    if partition is not None:
        ruled = _from_rules(name, shape, partition)
        if ruled is not None:
            return ruled
    if isinstance(context, LayoutMap):
        return context.replicated()
    if isinstance(context, Layouts):  # another kind of name -> layout map
        return context.sharding_for(name, shape) or context.replicated()
    return context


def may_shard(
    device: DeviceLike | Sharding | None,
    sharding: Sharding | Mesh | None,
    partition: Partition | None,
) -> bool:
    """Whether a new variable may get a sharding that splits it over several devices (then
    creation needs its shape first): such a ``sharding=``/``device=`` or ``ps.device``
    block, a ``LayoutMap``, or a partition under ``axis_rules``. False is the common,
    cheap case (also a replicated placement: the whole value is every device's share)."""
    if device is not None or sharding is not None:
        return _splits(_explicit(device, sharding))
    context = current_placement()
    if isinstance(context, Layouts) or (partition is not None and ctx.axis_rules):
        return True
    return context is not None and _splits(context)


def _splits(sharding: Sharding) -> bool:
    return len(sharding.device_set) > 1 and not sharding.is_fully_replicated


def _explicit(device: DeviceLike | Sharding | None, sharding: Sharding | Mesh | None) -> Sharding:
    """The sharding asked for by ``device=`` or ``sharding=`` (one of them is given)."""
    given = placement(device, sharding)
    assert isinstance(given, Sharding)
    return given
