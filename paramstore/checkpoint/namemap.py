"""``NameMap``: one name map for both directions, checkpoint names <-> variable names.

Contract (docs/api.md "Pretrained weights"; docs/guides/pretrained.md, "One name map"):

* ``NameMap(rules)``; a rule is ``(pattern, target)`` or ``(pattern, target, transform)``.
  ``pattern`` is a regular expression over checkpoint names, matched in full, made of
  literal text (``\\.`` escapes included) and groups (``(\\d+)``, ``([^.]+)``, named ones
  too); ``target`` a variable full name using the groups (``\\1``, ``\\g<1>``,
  ``\\g<name>``), ``name[\\1]`` for one layer of a stacked variable, or a tuple of such
  names (one fused checkpoint tensor into several variables). ``transform`` a
  ``Transform(forward, inverse)`` (``paramstore.checkpoint.transforms``: forward maps the
  checkpoint value to the variable value, a tuple of values for a tuple target, inverse
  back; ``transpose``, ``split`` and ``chain`` are ready-made ones).
* Reading (``init_from_checkpoint(ckpt, name_map)``): as the list of ``(pattern, target)``
  pairs (first rule whose pattern matches wins), each variable's value passed through its
  rule's forward transform (part ``j`` of a tuple target gets ``forward(value)[j]``).
* Turned around (``export_safetensors(path, variables, names=name_map)``, ``exported``):
  each variable (each layer ``name[i]`` of a stacked one) goes under the checkpoint name of
  the first rule whose target it fills, through the inverse transform, the parts of a tuple
  target joined. A variable no rule reaches, a tuple target with a part missing, a rule
  that cannot be turned around (its pattern has alternation, repetition or classes outside
  its groups, or the target leaves a group out) reached by a variable, and a variable name
  that fills a target in more than one way raise ``ValueError`` naming them. Making a
  NameMap and reading with it never raise for the direction not used.
* ``checkpoint_name(variable_name)`` and ``variable_name(checkpoint_name)`` answer single
  names (None where no rule applies; a tuple of names for a tuple target).
* Values are computed when the export writes them (one at a time): an exported tensor
  knows its shape and dtype from ``jax.eval_shape`` of the inverse (for a transform that
  cannot be traced, the value is computed at once).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from paramstore.checkpoint.transforms import Transform, bind
from paramstore.variable import Variable

__all__ = ["NameMap", "Exported"]

Fn = Callable[[Any], Any]


# ------------------------------------------------------------------ the way back

_GROUP_REF = re.compile(r"\\(?:(\d+)|g<([^>]+)>)")
_META = set(".^$*+?{}[]|")


@dataclass
class _Pattern:
    """A pattern as literal text and top-level groups (``None``: why it cannot be turned
    around)."""

    pieces: list[str | int]  # literal text, or a group number
    group_regex: dict[int, str]
    names: dict[str, int]
    problem: str | None


def _parse_pattern(pattern: str) -> _Pattern:
    pieces: list[str | int] = []
    group_regex: dict[int, str] = {}
    names: dict[str, int] = {}
    problem: str | None = None
    literal: list[str] = []
    i, number = 0, 0
    if pattern.startswith("^"):  # anchors change nothing in a full match
        i = 1
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1]
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            nxt = pattern[i + 1 : i + 2]
            if nxt and not nxt.isalnum():
                literal.append(nxt)
            elif problem is None:
                problem = f"'\\{nxt}' outside a group"
            i += 2
        elif c == "(":
            depth, j, in_class = 0, i, False
            while j < len(pattern):  # the matching parenthesis
                ch = pattern[j]
                if ch == "\\":
                    j += 2
                    continue
                if in_class:
                    in_class = ch != "]"
                elif ch == "[":
                    in_class = True
                elif ch == "(":
                    depth += 1
                elif ch == ")":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            body = pattern[i + 1 : j]
            name = None
            if body.startswith("?P<"):
                name, _, body = body[3:].partition(">")
            elif body.startswith("?"):
                problem = problem or f"'({body[:12]}...)' is not a plain group"
                i = j + 1
                continue
            number += 1
            inner = len(re.findall(r"(?<!\\)\((?!\?)|\(\?P<", body))
            if literal:
                pieces.append("".join(literal))
                literal = []
            pieces.append(number)
            group_regex[number] = body
            if name:
                names[name] = number
            number += inner  # nested groups take numbers too
            i = j + 1
            if pattern[i : i + 1] in ("*", "+", "?", "{"):
                problem = problem or f"a repeated group '({body})'"
        elif c in _META:
            problem = problem or f"'{c}' outside a group"
            i += 1
        else:
            literal.append(c)
            i += 1
    if literal:
        pieces.append("".join(literal))
    return _Pattern(pieces, group_regex, names, problem)


def _template(target: str, parsed: _Pattern) -> list[str | int]:
    """A target as literal text and group numbers."""
    out: list[str | int] = []
    pos = 0
    for m in _GROUP_REF.finditer(target):
        if m.start() > pos:
            out.append(target[pos : m.start()])
        ref = m.group(1) or m.group(2)
        out.append(int(ref) if ref.isdigit() else parsed.names.get(ref, -1))
        pos = m.end()
    if pos < len(target):
        out.append(target[pos:])
    return out


def _fills(template: list[str | int], parsed: _Pattern, name: str) -> list[dict[int, str]]:
    """Every way ``name`` fills ``template`` (group number -> text), each group's text
    matching the group's own pattern in full."""
    found: list[dict[int, str]] = []

    def walk(k: int, pos: int, got: dict[int, str]) -> None:
        if k == len(template):
            if pos == len(name):
                found.append(dict(got))
            return
        piece = template[k]
        if isinstance(piece, str):
            if name.startswith(piece, pos):
                walk(k + 1, pos + len(piece), got)
            return
        if piece in got:
            if name.startswith(got[piece], pos):
                walk(k + 1, pos + len(got[piece]), got)
            return
        regex = re.compile(parsed.group_regex.get(piece, "(?!)"))
        for end in range(pos, len(name) + 1):
            text = name[pos:end]
            if regex.fullmatch(text):
                got[piece] = text
                walk(k + 1, end, got)
                del got[piece]

    walk(0, 0, {})
    return found


@dataclass
class _Rule:
    regex: re.Pattern[str]
    targets: tuple[str, ...]
    is_tuple: bool
    transform: Transform | None
    parsed: _Pattern
    templates: list[list[str | int]]


@dataclass
class Exported:
    """A value ``export_safetensors`` writes under a NameMap: computed (``np.asarray``)
    when written, from ``sources`` (Variables or arrays, each with a layer index or None)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    sources: list[tuple[Any, int | None]]
    inverse: Fn | None
    is_tuple: bool

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        parts = []
        for value, index in self.sources:
            x = value.value() if isinstance(value, Variable) else value
            parts.append(np.asarray(x if index is None else x[index]))
        out = parts if self.is_tuple else parts[0]
        if self.inverse is not None:
            out = self.inverse(tuple(out) if self.is_tuple else out)
        arr = np.asarray(out)
        return arr if dtype is None else arr.astype(dtype)


class NameMap:
    """Checkpoint names <-> variable names, with reversible transforms (see the module
    docstring)."""

    def __init__(self, rules: Sequence[Any]) -> None:
        if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
            raise TypeError(
                "ps.checkpoint.NameMap takes a list of rules (pattern, target) or (pattern, "
                f"target, transform), got {type(rules).__name__}."
            )
        self._rules: list[_Rule] = []
        for rule in rules:
            if not isinstance(rule, (tuple, list)) or len(rule) not in (2, 3):
                raise TypeError(
                    "ps.checkpoint.NameMap: each rule is (pattern, target) or (pattern, "
                    f"target, transform), got {rule!r}."
                )
            pattern, target = rule[0], rule[1]
            transform = rule[2] if len(rule) == 3 else None
            targets = target if isinstance(target, tuple) else (target,)
            if not isinstance(pattern, str) or not targets:
                raise TypeError(f"ps.checkpoint.NameMap: a pattern must be a str, got {rule!r}.")
            if not all(isinstance(t, str) for t in targets):
                raise TypeError(
                    f"ps.checkpoint.NameMap: the target of '{pattern}' must be a variable name "
                    f"(str) or a tuple of them, got {target!r}."
                )
            if transform is not None and not isinstance(transform, Transform):
                raise TypeError(
                    f"ps.checkpoint.NameMap: the transform of '{pattern}' must be a "
                    "ps.checkpoint.Transform (Transform(forward, inverse), transpose, split, "
                    f"chain), got {type(transform).__name__}."
                )
            try:
                regex = re.compile(pattern)
            except re.error as e:
                raise ValueError(f"ps.checkpoint.NameMap: pattern {pattern!r}: {e}.") from None
            parsed = _parse_pattern(pattern)
            self._rules.append(
                _Rule(
                    regex,
                    targets,
                    isinstance(target, tuple),
                    bind(transform, len(targets)),
                    parsed,
                    [_template(t, parsed) for t in targets],
                )
            )

    # ---------------------------------------------------------------- reading
    def pairs(self) -> list[tuple[str, str | tuple[str, ...]]]:
        """The ``(pattern, replacement)`` pairs ``init_from_checkpoint`` reads with."""
        return [(r.regex.pattern, r.targets if r.is_tuple else r.targets[0]) for r in self._rules]

    def _rule_for(self, checkpoint_name: str) -> tuple[_Rule, re.Match[str]] | None:
        for r in self._rules:
            m = r.regex.fullmatch(checkpoint_name)
            if m is not None:
                return r, m
        return None

    def variable_name(self, checkpoint_name: str) -> str | tuple[str, ...] | None:
        """The variable name (a tuple for a tuple target) of ``checkpoint_name``; None if no
        rule matches it."""
        found = self._rule_for(checkpoint_name)
        if found is None:
            return None
        r, m = found
        names = tuple(m.expand(t) for t in r.targets)
        return names if r.is_tuple else names[0]

    def forward(self, checkpoint_name: str, variable_name: str) -> Fn | None:
        """The function reading applies to ``checkpoint_name``'s value for
        ``variable_name`` (its rule's forward transform, the right part of a tuple), or
        None."""
        found = self._rule_for(checkpoint_name)
        if found is None or found[0].transform is None:
            return None
        r, m = found
        t = r.transform
        assert t is not None
        if not r.is_tuple:
            return t.forward
        j = [m.expand(x) for x in r.targets].index(variable_name)

        def part(value: Any) -> Any:
            parts: Any = t.forward(value)
            return parts[j]

        return part

    # ---------------------------------------------------------------- the way back
    def _reverse(self, variable_name: str) -> tuple[_Rule, int, str] | None:
        """The first rule whose target ``variable_name`` fills: (rule, part, checkpoint
        name)."""
        for r in self._rules:
            for j, template in enumerate(r.templates):
                fills = _fills(template, r.parsed, variable_name)
                if not fills:
                    continue
                where = f"'{r.regex.pattern}' -> {r.targets[j]!r}"
                if r.parsed.problem is not None:
                    raise ValueError(
                        f"ps.checkpoint.NameMap: variable '{variable_name}' is reached by rule "
                        f"{where}, which cannot be turned around: its pattern has "
                        f"{r.parsed.problem}. Write the pattern as literal text and groups "
                        "(one rule per alternative)."
                    )
                names = {self._build(r, f, variable_name, where) for f in map(dict, fills)}
                if len(names) > 1:
                    raise ValueError(
                        f"ps.checkpoint.NameMap: variable '{variable_name}' fills the target of "
                        f"rule {where} in more than one way (checkpoint names "
                        f"{sorted(names)}); make the groups' patterns narrower."
                    )
                return r, j, names.pop()
        return None

    @staticmethod
    def _build(r: _Rule, fill: dict[int, str], variable_name: str, where: str) -> str:
        out = []
        for piece in r.parsed.pieces:
            if isinstance(piece, str):
                out.append(piece)
            elif piece in fill:
                out.append(fill[piece])
            else:
                raise ValueError(
                    f"ps.checkpoint.NameMap: variable '{variable_name}' is reached by rule "
                    f"{where}, which cannot be turned around: its target does not use group "
                    f"{piece} of the pattern."
                )
        return "".join(out)

    def checkpoint_name(self, variable_name: str) -> str | None:
        """The checkpoint name ``variable_name`` (``name[i]`` for one layer of a stacked
        variable) goes under, the fused name for a part of a tuple target; None if no rule's
        target it fills."""
        found = self._reverse(variable_name)
        return None if found is None else found[2]

    def exported(self, items: Sequence[tuple[str, Any]]) -> list[tuple[str, str, Any]]:
        """``[(checkpoint name, variable name, value)]`` for the variables ``items``
        (``(full name, Variable or array)``), in their order; see the module docstring."""
        groups: dict[str, tuple[_Rule, dict[int, tuple[str, Any, int | None]]]] = {}
        for name, value in items:
            found = self._reverse(name)
            if found is not None:
                self._add(groups, found, name, value, None)
                continue
            if len(value.shape) >= 1:
                first = self._reverse(f"{name}[0]")
                if first is not None:
                    for i in range(value.shape[0]):
                        label = f"{name}[{i}]"
                        layer = first if i == 0 else self._reverse(label)
                        if layer is None:
                            raise ValueError(
                                f"ps.checkpoint.NameMap: no rule reaches layer '{label}' of "
                                f"the stacked variable '{name}' (layer 0 is reached)."
                            )
                        self._add(groups, layer, label, value, i)
                    continue
            raise ValueError(
                f"ps.checkpoint.NameMap: no rule's target is variable '{name}' (nor its layers "
                f"'{name}[i]'); add a rule for it, or leave it out of the variables exported."
            )
        out = []
        for ckpt, (r, parts) in groups.items():
            missing = [j for j in range(len(r.targets)) if j not in parts]
            if missing:
                have = parts[next(iter(parts))][0]
                raise ValueError(
                    f"ps.checkpoint.NameMap: checkpoint tensor '{ckpt}' joins "
                    f"{len(r.targets)} variables (rule '{r.regex.pattern}'), but part "
                    f"{missing[0]} ({r.targets[missing[0]]!r}) is not among the variables "
                    f"exported (with '{have}')."
                )
            ordered = [parts[j] for j in range(len(r.targets))]
            label = ordered[0][0] if len(ordered) == 1 else ", ".join(p[0] for p in ordered)
            out.append((ckpt, label, _value(r, ordered)))
        return out

    @staticmethod
    def _add(
        groups: dict[str, tuple[_Rule, dict[int, tuple[str, Any, int | None]]]],
        found: tuple[_Rule, int, str],
        label: str,
        value: Any,
        index: int | None,
    ) -> None:
        r, j, ckpt = found
        _, parts = groups.setdefault(ckpt, (r, {}))
        if j in parts:
            raise ValueError(
                f"ps.checkpoint.NameMap: variables '{parts[j][0]}' and '{label}' both go under "
                f"checkpoint name '{ckpt}'."
            )
        parts[j] = (label, value, index)

    def __repr__(self) -> str:
        return f"NameMap({len(self._rules)} rules)"


def _value(r: _Rule, parts: list[tuple[str, Any, int | None]]) -> Any:
    """A Variable as it is (a plain rule), else an ``Exported`` computed when written."""
    (label, value, index) = parts[0]
    if r.transform is None and not r.is_tuple and index is None:
        return value
    t = r.transform
    inverse = None if t is None else t.inverse
    sources = [(v, i) for _, v, i in parts]
    shapes = [
        jax.ShapeDtypeStruct(tuple(v.shape)[1:] if i is not None else tuple(v.shape), v.dtype)
        for v, i in sources
    ]
    if inverse is None:
        if r.is_tuple:
            raise ValueError(
                f"ps.checkpoint.NameMap: rule '{r.regex.pattern}' joins {len(r.targets)} "
                "variables into one tensor but has no transform to join them: give it one "
                "(e.g. ps.checkpoint.split(axis))."
            )
        s = shapes[0]
        return Exported(tuple(s.shape), np.dtype(s.dtype), sources, None, False)
    fn = inverse
    try:
        shape = jax.eval_shape(lambda *xs: fn(tuple(xs) if r.is_tuple else xs[0]), *shapes)
        return Exported(tuple(shape.shape), np.dtype(shape.dtype), sources, fn, r.is_tuple)
    except Exception:  # a transform JAX cannot trace: computed now  # noqa: BLE001
        arr = np.asarray(Exported((), np.dtype("float32"), sources, fn, r.is_tuple))
        del label
        return arr
