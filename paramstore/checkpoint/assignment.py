"""Which checkpoint value goes to which variable: ``init_from_checkpoint``'s assignment maps
(private; the contract is ``paramstore.checkpoint.warm_start``'s docstring).

``resolve`` turns a map in one of TF1's dict forms, or a list of ``(pattern, replacement)``
pairs, into ``Target``s: one checkpoint name into one variable, or into one layer
(``name[i]``) of a stacked variable. It reads names only (the checkpoint's entries and the
store's variables), never a value, and raises ValueError for anything that does not resolve:
a key or pattern that matches no checkpoint name, a variable that does not exist, two
checkpoint names for one variable, a stacked variable whose layers are not all given.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from paramstore._core.store import VariableStore, preview_names
from paramstore.checkpoint.format import suggest
from paramstore.nn._quant import is_scale
from paramstore.variable import Variable

_LAYER = re.compile(r"(?P<base>.+)\[(?P<index>\d+)\]")


@dataclasses.dataclass(frozen=True)
class Target:
    """Checkpoint value ``ckpt`` goes to ``var`` (layer ``index`` of it, if not None)."""

    ckpt: str
    var: Variable
    index: int | None

    @property
    def label(self) -> str:
        """The variable's full name, with ``[index]`` for one layer of a stacked variable."""
        return self.var.name if self.index is None else f"{self.var.name}[{self.index}]"

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(self.var.shape)
        return shape if self.index is None else shape[1:]


def resolve(
    assignment_map: Any, names: Collection[str], store: VariableStore, path: str
) -> list[Target]:
    """The targets of ``assignment_map`` over a checkpoint whose names are ``names``."""
    if isinstance(assignment_map, Mapping):
        targets = _from_dict(assignment_map, names, store, path)
    elif isinstance(assignment_map, Sequence) and not isinstance(assignment_map, str):
        targets = _from_pairs(assignment_map, names, store, path)
    else:
        raise TypeError(
            "init_from_checkpoint: assignment_map must be a dict in TF1's forms "
            "({'old/': 'new/'}, {'old/v': 'new/v'}, {'old/v': variable}) or a list of "
            f"(pattern, replacement) pairs, got {type(assignment_map).__name__}."
        )
    _check_targets(targets)
    return targets


# ------------------------------------------------------------------ TF1's dict forms


def _from_dict(
    mapping: Mapping[Any, Any], names: Collection[str], store: VariableStore, path: str
) -> list[Target]:
    targets: list[Target] = []
    for key, value in sorted(mapping.items(), key=lambda kv: str(kv[0])):
        if not isinstance(key, str):
            raise TypeError(
                f"init_from_checkpoint: an assignment_map key must be a checkpoint name (str), "
                f"got {type(key).__name__} {key!r}."
            )
        if isinstance(value, Variable):
            targets.append(Target(_present(key, names, path), value, None))
            continue
        if not isinstance(value, str):
            raise TypeError(
                f"init_from_checkpoint: assignment_map['{key}'] must be a variable name, a scope "
                f"('new/') or a Variable, got {type(value).__name__} {value!r}."
            )
        found = _lookup(value, store)
        if found is not None:
            targets.append(Target(_present(key, names, path), *found))
        else:
            targets.extend(_scope(key, value, names, store, path))
    return targets


def _scope(
    key: str, scope: str, names: Collection[str], store: VariableStore, path: str
) -> list[Target]:
    """TF1's scope form: every variable under ``scope`` from the same relative name under
    checkpoint scope ``key`` (``'/'`` for either is the root)."""
    if not key.endswith("/") or not scope.endswith("/"):
        raise ValueError(
            f"init_from_checkpoint: assignment_map['{key}'] = '{scope}': there is no variable "
            f"'{scope}'{suggest(scope, (v.name for v in store.variables()))}, and a scope maps "
            "only to a scope, both ending in '/' ({'old/': 'new/'}, '/' for the root)."
        )
    if key != "/" and not any(n.startswith(key) for n in names):
        raise ValueError(
            f"init_from_checkpoint: assignment_map key '{key}' matches no checkpoint name of "
            f"'{path}' (its names: {preview_names(sorted(names))})."
        )
    prefix = "" if scope == "/" else scope
    under = sorted((v for v in store.variables() if v.name.startswith(prefix)), key=_name)
    if not under:
        raise ValueError(
            f"init_from_checkpoint: assignment_map['{key}'] = '{scope}': no variable is under "
            f"scope '{scope}'; create the model before warm-starting it."
        )
    targets = []
    for v in under:
        ckpt = ("" if key == "/" else key) + v.name[len(prefix) :]
        if ckpt not in names and is_scale(v):
            continue  # a quantization scale a float checkpoint lacks: computed while loading
        if ckpt not in names:
            raise ValueError(
                f"init_from_checkpoint: variable '{v.name}' (under '{scope}') has no checkpoint "
                f"value '{ckpt}' (under '{key}') in '{path}'{suggest(ckpt, names)}. Map a narrower "
                "scope, or map the variables one by one."
            )
        targets.append(Target(ckpt, v, None))
    return targets


# -------------------------------------------------------------------- regex pairs


def _from_pairs(
    pairs: Sequence[Any], names: Collection[str], store: VariableStore, path: str
) -> list[Target]:
    compiled = []
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise TypeError(
                "init_from_checkpoint: each item of a list assignment_map is a (pattern, "
                f"replacement) pair, got {pair!r}."
            )
        pattern, replacement = pair
        replacements = replacement if isinstance(replacement, tuple) else (replacement,)
        if not replacements or not all(isinstance(r, (str, Variable)) for r in replacements):
            raise TypeError(
                f"init_from_checkpoint: the replacement of pattern '{pattern}' must be a str, a "
                f"Variable, or a tuple of them, got {replacement!r}."
            )
        compiled.append((compile_pattern(pattern, "assignment_map"), replacements))
    used: set[int] = set()
    targets = []
    for name in sorted(names):
        matches = [(i, pattern.fullmatch(name)) for i, (pattern, _) in enumerate(compiled)]
        used.update(i for i, m in matches if m is not None)
        for (_, m), (pattern, replacements) in zip(matches, compiled):
            if m is None:
                continue
            for r in replacements:
                if isinstance(r, Variable):
                    targets.append(Target(name, r, None))
                    continue
                full = _expand(m, r, pattern.pattern)
                found = _lookup(full, store)
                if found is None:
                    raise ValueError(
                        f"init_from_checkpoint: checkpoint name '{name}' matches '{pattern.pattern}'"
                        f", which names variable '{full}', but there is no such variable"
                        f"{suggest(full, (v.name for v in store.variables()))}."
                    )
                targets.append(Target(name, *found))
            break
    unused = [p.pattern for i, (p, _) in enumerate(compiled) if i not in used]
    if unused:
        raise ValueError(
            f"init_from_checkpoint: pattern '{unused[0]}' matches no checkpoint name of '{path}' "
            f"in full (its names: {preview_names(sorted(names))})."
        )
    return targets


def compile_pattern(pattern: str, what: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"init_from_checkpoint: {what} pattern {pattern!r}: {e}.") from None


def _expand(m: re.Match[str], replacement: str, pattern: str) -> str:
    try:
        return m.expand(replacement)
    except (re.error, IndexError) as e:
        raise ValueError(
            f"init_from_checkpoint: replacement {replacement!r} of pattern '{pattern}': {e}."
        ) from None


# ------------------------------------------------------------------------ helpers


def _name(v: Variable) -> str:
    return v.name


def _present(key: str, names: Collection[str], path: str) -> str:
    if key not in names:
        raise ValueError(
            f"init_from_checkpoint: assignment_map key '{key}' matches no checkpoint name of "
            f"'{path}'{suggest(key, names)} (its names: {preview_names(sorted(names))})."
        )
    return key


def _lookup(name: str, store: VariableStore) -> tuple[Variable, int | None] | None:
    """The variable of full name ``name``, or layer ``i`` of ``base[i]``; None if neither."""
    var = store.get(name)
    if isinstance(var, Variable):
        return var, None
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    var = store.get(m["base"])
    if not isinstance(var, Variable):
        return None
    index = int(m["index"])
    n = var.shape[0] if var.shape else 0
    if index >= n:
        raise ValueError(
            f"init_from_checkpoint: '{name}' names layer {index} of variable '{var.name}', which "
            f"has shape {tuple(var.shape)} (layers 0..{n - 1} along its first axis)."
        )
    return var, index


def _check_targets(targets: list[Target]) -> None:
    """One checkpoint value per variable (or per layer); a stacked variable gets all."""
    by_var: dict[int, list[Target]] = {}
    for t in targets:
        by_var.setdefault(id(t.var), []).append(t)
    for group in by_var.values():
        v = group[0].var
        seen: dict[int | None, str] = {}
        for t in group:
            clash = t.index in seen or (None in seen) or (t.index is None and len(seen))
            if clash:
                other = seen.get(t.index) or next(iter(seen.values()))
                raise ValueError(
                    f"init_from_checkpoint: checkpoint names '{other}' and '{t.ckpt}' both map to "
                    f"variable '{t.label}'; map each variable from one name."
                )
            seen[t.index] = t.ckpt
        layers = [t.index for t in group if t.index is not None]
        if layers and len(layers) != v.shape[0]:
            missing = sorted(set(range(v.shape[0])) - set(layers))
            raise ValueError(
                f"init_from_checkpoint: the map fills layers {sorted(layers)} of stacked variable "
                f"'{v.name}' but not {missing}; map every layer (e.g. a pattern with (\\d+) and a "
                "replacement ending in [\\1])."
            )
