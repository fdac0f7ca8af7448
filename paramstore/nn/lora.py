"""``ps.nn.enable_lora`` / ``ps.nn.merge_lora``: LoRA over a whole model, ``Repeat`` included.

Contract (docs/api.md, "LoRA"; the per-layer part is ``paramstore.nn._lora``):

* ``enable_lora(module, rank, *, where=None, lora_alpha=None)`` enables LoRA on every
  ``Dense`` and ``Embedding`` inside ``module`` (``module`` itself included) whose full name
  (``layer.scope_name``, e.g. ``model/block/dense_1``) the regular expression ``where``
  matches (``re.search``; ``None``: all), and returns the list of layers it changed. The
  blocks of a ``ps.nn.Repeat`` count, named as the template block's layers
  (``repeat/block/dense``): their LoRA variables are stacked like the rest,
  ``(n, in, rank)`` (``a`` drawn per block, ``b`` zeros), the stacked target becomes
  non-trainable, and the Repeat keeps them in ``repeat.stacked``.
* Everything is checked first, and on an error nothing changes: ``rank`` not an int >= 1,
  ``where`` not a str (``TypeError``), a module with no ``Dense``/``Embedding`` at all
  (``TypeError`` naming it), no layer matching ``where`` (``ValueError`` listing the
  names), a matching layer not built or with LoRA already (``ValueError`` naming it).
* ``merge_lora(module)`` merges every layer of ``module`` that has LoRA (the Repeat's
  stacked ones per block) and returns the list; ``ValueError`` if none has LoRA.
* The attention layers' projections (``MultiHeadAttention``, ``GroupQueryAttention``:
  ``<layer>/query``, ``/key``, ``/value``, ``/attention_output``) are such layers too.
* ``merge_lora`` gives each target back the ``trainable`` flags it had before
  ``enable_lora`` (a frozen kernel stays frozen, the stacked one of a Repeat too).
* A ``ps.function`` traced before either traces again on its next call.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

from paramstore import initializers as _init
from paramstore._core import frames
from paramstore._core import seed as _seed
from paramstore._core.jax_api import EVAL, in_trace
from paramstore.module import Module
from paramstore.nn._base import all_or_nothing
from paramstore.nn._lora import (
    LoRALayer,
    check_alpha,
    check_rank,
    freeze_target,
    restore_flags,
)
from paramstore.nn.repeat import Repeat
from paramstore.nn.repeat.layout import (
    attribute_paths,
    stacked_initial,
    stacked_partition,
    stacked_sharding,
)
from paramstore.variable import Variable

__all__ = ["enable_lora", "merge_lora"]

L = TypeVar("L", bound=Module)

Found = list[tuple[LoRALayer, Repeat | None]]


def describe(module: Any) -> str:
    """``Kind 'full/name'`` of a Module (its type's name otherwise), for messages."""
    if isinstance(module, Module):
        return f"{type(module).__name__} '{module.scope_name}'"
    return type(module).__name__


def _modules(root: Any) -> list[Module]:
    if not isinstance(root, Module):
        return []
    return [root, *root.submodules]


def layers_of(module: Any, kind: type[L]) -> list[tuple[L, Repeat | None]]:
    """Every ``kind`` layer in ``module``, with the Repeat whose template holds it (None for
    a layer of its own): what ``enable_lora``/``merge_lora`` and ``ps.nn.quantize`` walk."""
    found: list[tuple[L, Repeat | None]] = []
    for m in _modules(module):
        if isinstance(m, kind):
            found.append((m, None))
        elif isinstance(m, Repeat):
            found.extend((t, m) for t in _modules(m._template.block) if isinstance(t, kind))
    return found


def _lora_layers(module: Any) -> Found:
    """Every LoRA-capable layer in ``module`` (with the Repeat whose template holds it)."""
    return layers_of(module, LoRALayer)


def enable_lora(
    module: Module, rank: int, *, where: str | None = None, lora_alpha: float | None = None
) -> list[LoRALayer]:
    """Enable LoRA on the ``Dense``/``Embedding`` layers of ``module`` whose full name
    ``where`` matches (see the module docstring); returns the layers changed."""
    me = "ps.nn.enable_lora"
    rank = check_rank(rank, me)
    alpha = check_alpha(lora_alpha, rank, me)
    if where is not None and not isinstance(where, str):
        raise TypeError(
            f"{me}: where must be a regular expression (a str searched in each layer's full "
            f"name, e.g. r'attn|mlp'), got {type(where).__name__}."
        )
    found = _lora_layers(module)
    if not found:
        raise TypeError(
            f"{me}: {describe(module)} has no layer with LoRA: only ps.nn.Dense, "
            "ps.nn.Embedding and the projections of the attention layers (also inside a "
            "Repeat's blocks) support it."
        )
    pattern = re.compile(where) if where is not None else None
    chosen = [(ly, r) for ly, r in found if pattern is None or pattern.search(ly.scope_name)]
    if not chosen:
        raise ValueError(
            f"{me}: no Dense, Embedding or attention projection of {describe(module)} matches "
            f"where={where!r}; their full names are {[ly.scope_name for ly, _ in found]}."
        )
    for layer, rep in chosen:
        if rep is not None and not rep.built:
            raise ValueError(
                f"{me}: {layer.describe()} is in {describe(rep)}, which is not built yet: "
                "call the model (or build it) before enable_lora."
            )
        layer.check_lora_enable()
    for layer, rep in chosen:
        if rep is None:
            with all_or_nothing(layer), layer.name_scope:  # a failure leaves no stray variable
                layer._add_lora(rank, alpha, _init.he_uniform(), _init.zeros())
        else:
            _enable_stacked(rep, layer, rank, alpha)
    return [layer for layer, _ in chosen]


def _enable_stacked(rep: Repeat, layer: LoRALayer, rank: int, alpha: float) -> None:
    """LoRA on a Repeat's template layer, then its stacked copies (one per block)."""
    t = rep._template
    with (
        t.store,
        _seed.recording() as inits,
        frames.no_frames(),
        in_trace(EVAL),
        layer.name_scope,
    ):
        new = layer._add_lora(rank, alpha, _init.he_uniform(), _init.zeros())
    t.inits.update(inits)
    paths = attribute_paths(t.block)
    by_key = dict(zip(rep._order, t.tvars))
    key_of = {id(v): k for k, v in by_key.items()}
    target = rep.stacked[key_of[id(getattr(layer, layer.lora_target))]]
    layer._lora_was_trainable = freeze_target(target)  # the stacked one's, not the template's
    stacked = dict(rep.stacked)
    for v in new:
        key = paths[id(v)]
        init = inits.get(v.name)
        with frames.no_frames(), in_trace(EVAL):
            source = None if init is not None else v.value()
        stacked[key] = Variable(
            stacked_initial(init, source, rep.n, v.name, False),
            trainable=True,
            dtype=v.dtype,
            sharding=stacked_sharding(v),
            partition=stacked_partition(v),
            _full_name=v.name,
        )
        by_key[key] = v
    relayout(rep, by_key, stacked)


def relayout(rep: Repeat, by_key: dict[str, Variable], stacked: dict[str, Variable]) -> None:
    """Set the Repeat's template variables and stacked ones (same keys) in one go, and
    drop what was traced for the old set."""
    t = rep._template
    order = sorted(by_key)
    t.tvars = [by_key[k] for k in order]
    rep._order = order
    rep.stacked = {k: stacked[k] for k in order}
    t.others.clear()
    t.compiled = None  # the eager path's ps.function traced the old variables


def merge_lora(module: Module) -> list[LoRALayer]:
    """Merge every LoRA of ``module`` into its target (``Repeat`` blocks: per block) and
    remove the LoRA variables; returns the layers merged. ``ValueError`` if none has LoRA."""
    chosen = [(ly, r) for ly, r in _lora_layers(module) if ly.lora_enabled]
    if not chosen:
        raise ValueError(
            f"ps.nn.merge_lora: no layer of {describe(module)} has LoRA enabled; nothing to "
            "merge (enable it with ps.nn.enable_lora or layer.enable_lora)."
        )
    for layer, _ in chosen:
        layer.check_lora_merge()  # all checked first (a quantized layer is refused)
    for layer, rep in chosen:
        if rep is None:
            layer.merge_lora()
            continue
        by_key = dict(zip(rep._order, rep._template.tvars))
        key_of = {id(v): k for k, v in by_key.items()}
        target, a, b = (rep.stacked[key_of[id(v)]] for v in layer.lora_parts())
        target.assign(layer.lora_merged(target.value(), a.value(), b.value()), read_value=False)
        gone = {key_of[id(v)] for v in layer.lora_parts()[1:]}
        layer.drop_lora()
        frozen = not (layer.trainable and rep.trainable)
        restore_flags(target, layer._lora_was_trainable, frozen)  # as before enable_lora
        keep = {k: v for k, v in by_key.items() if k not in gone}
        relayout(rep, keep, rep.stacked)
    return [layer for layer, _ in chosen]
