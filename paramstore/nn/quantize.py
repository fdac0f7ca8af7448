"""``ps.nn.quantize`` / ``ps.nn.dequantize``: quantized weights over a whole model.

Contract (docs/api.md, "Quantized weights"; the per-layer math is ``paramstore.nn._quant``):

* ``quantize(module, mode, *, where=None)`` quantizes every ``Dense``, ``Embedding`` and
  attention projection in ``module`` (``module`` itself included) whose full name
  (``layer.scope_name``) the regular expression ``where`` searches (``None``: all), the
  blocks of a ``ps.nn.Repeat`` included (named as its template's layers,
  ``repeat/block/dense``): their stacked kernel ``(n, in, units)`` becomes int8
  ``(n, in, units)`` (int4: packed) with a stacked scale ``(n, units)``, one scale row per
  block. Returns the list of layers it changed.
* The attention projections are the ``Projection`` layers of ``MultiHeadAttention`` and
  ``GroupQueryAttention``, named ``<layer>/query``, ``/key``, ``/value`` and
  ``/attention_output`` (as for ``ps.nn.enable_lora``): ``where`` is searched in these
  names, so a pattern matching the attention layer's name picks all four, and
  ``r"attn/(query|value)$"`` two of them; the list returned holds the projections. An
  attention layer not built yet has no projections: when nothing matches, the error names
  such layers.
* ``dequantize(module_or_layer, *, where=None)`` undoes it on every quantized layer
  ``where`` matches (float kernels back, scales removed, the ``trainable`` flag from before).
* Everything is checked before anything changes: an unknown mode, ``where`` not a str
  (``TypeError``), no quantizable layer in ``module``, none matching ``where`` (``ValueError``
  naming the pattern and listing the names), a matching layer unbuilt, quantized already or
  with LoRA enabled (``ValueError`` naming it); ``dequantize`` with no quantized layer
  matching: ``ValueError``.
* A ``ps.function`` traced before is traced anew at its next call (the replaced variables are
  retired: ``TRACE_EPOCH``).
"""

from __future__ import annotations

import re
from typing import Any

from paramstore._core import frames
from paramstore._core.context import TRACE_EPOCH
from paramstore._core.jax_api import EVAL, in_trace
from paramstore.module import Module
from paramstore.nn._quant import (
    QuantLayer,
    check_mode,
    dequantize_variable,
    quantize_variable,
)
from paramstore.nn.attention import AttentionProjections
from paramstore.nn.lora import describe, layers_of, relayout
from paramstore.nn.repeat import Repeat
from paramstore.nn.repeat.layout import attribute_paths

__all__ = ["dequantize", "quantize"]

Quantizable = QuantLayer
_WHAT = "Dense, Embedding or attention projection"
Found = list[tuple[Quantizable, Repeat | None]]


def quantizable_layers(module: Any) -> Found:
    """Every ``Dense``/``Embedding``/attention ``Projection`` in ``module`` (with the Repeat
    whose template holds it)."""
    return layers_of(module, QuantLayer)


def _unbuilt_attention(module: Any) -> str:
    """A hint naming the attention layers of ``module`` not built yet (their projections,
    made when they build, cannot be found yet); "" when there is none."""
    names = [ly.scope_name for ly, _ in layers_of(module, AttentionProjections) if not ly.built]
    if not names:
        return ""
    return (
        f" The attention layers {names} are not built yet, so they have no projections: "
        "call the model (or build it) before quantize."
    )


def _chosen(module: Any, where: Any, me: str, found: Found, what: str, hint: str = "") -> Found:
    if where is not None and not isinstance(where, str):
        raise TypeError(
            f"{me}: where must be a regular expression (a str searched in each layer's full "
            f"name, e.g. r'mlp|attn'), got {type(where).__name__}."
        )
    if not found:
        raise ValueError(
            f"{me}: {describe(module)} has no {what}: ps.nn.Dense, ps.nn.Embedding and the "
            "projections of the attention layers (also inside a Repeat's blocks) can be "
            "quantized." + hint
        )
    pattern = re.compile(where) if where is not None else None
    unique = list({id(ly): (ly, r) for ly, r in found}.values())  # a layer used twice: once
    chosen = [(ly, r) for ly, r in unique if pattern is None or pattern.search(ly.scope_name)]
    if not chosen:
        raise ValueError(
            f"{me}: no {what} of {describe(module)} matches where={where!r}; their full "
            f"names are {[ly.scope_name for ly, _ in found]}." + hint
        )
    return chosen


def quantize(module: Module, mode: str, *, where: str | None = None) -> list[Quantizable]:
    """Quantize the ``Dense``/``Embedding`` layers and attention projections of ``module``
    whose full name ``where`` searches, in ``mode`` (``"int8"`` or ``"int4"``); returns the
    layers changed (see the module docstring)."""
    me = "ps.nn.quantize"
    mode = check_mode(mode, me)
    found = quantizable_layers(module)
    chosen = _chosen(module, where, me, found, _WHAT, _unbuilt_attention(module))
    for layer, rep in chosen:
        if rep is not None and not rep.built:
            raise ValueError(
                f"{me}: {layer.describe()} is in {describe(rep)}, which is not built yet: "
                "call the model (or build it) before quantize."
            )
        layer.check_quantize(mode)
    for layer, rep in chosen:
        if rep is None:
            layer.quantize(mode)
        else:
            _stacked(rep, layer, lambda ly: ly.quantize(mode))
    return [layer for layer, _ in chosen]


def dequantize(module_or_layer: Module, *, where: str | None = None) -> list[Quantizable]:
    """Dequantize every quantized layer of ``module_or_layer`` whose full name ``where``
    searches; returns the layers changed."""
    me = "ps.nn.dequantize"
    found = [(ly, r) for ly, r in quantizable_layers(module_or_layer) if ly.quantization_mode]
    chosen = _chosen(module_or_layer, where, me, found, "quantized layer")
    for layer, rep in chosen:
        if rep is None:
            layer.dequantize()
        else:
            _stacked(rep, layer, lambda ly: ly.dequantize())
    return [layer for layer, _ in chosen]


def _stacked(rep: Repeat, layer: Any, change: Any) -> None:
    """Apply ``change`` (quantize or dequantize) to a Repeat's template layer, then do the
    same to its stacked variables (one scale row per block) and relayout the Repeat."""
    t = rep._template
    by_key = dict(zip(rep._order, t.tvars))
    key_of = {id(v): k for k, v in by_key.items()}
    was_mode = layer.quantization_mode
    before = layer.quant_slots()
    targets = [key_of[id(slot.target)] for slot in before]
    old_scales = [key_of[id(slot.scale)] if slot.scale is not None else None for slot in before]
    with t.store, frames.no_frames(), in_trace(EVAL):
        change(layer)
    stacked = dict(rep.stacked)
    paths = attribute_paths(t.block)
    for slot, key, scale_key in zip(layer.quant_slots(), targets, old_scales):
        big = stacked[key]
        if layer.quantization_mode is not None:  # quantized now
            q, s = quantize_variable(big, slot.axis, layer.quantization_mode, slot.leaf)
            new_scale_key = paths[id(slot.scale)]
            stacked[key], stacked[new_scale_key] = q, s
            by_key[new_scale_key] = slot.scale
        else:
            assert was_mode is not None and scale_key is not None
            s = stacked.pop(scale_key)
            by_key.pop(scale_key)
            target = slot.target
            stacked[key] = dequantize_variable(
                big, s, slot.axis, was_mode, slot.units, target.dtype, target.trainable
            )
            s._store._forget(s)
            TRACE_EPOCH.retire(s)
        by_key[key] = slot.target
        big._store._forget(big)
        TRACE_EPOCH.retire(big)
    relayout(rep, by_key, stacked)
