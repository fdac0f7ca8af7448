"""``ps.mixed_precision``: Keras 3's dtype policies for ``ps.nn`` layers.

Contract (docs/api.md, "Mixed precision"; docs/guides/recipes.md):

* ``Policy(name)`` with Keras 3's names: ``"float32"``, ``"float16"``, ``"bfloat16"`` (the
  variables and the computation in that dtype), ``"mixed_float16"``, ``"mixed_bfloat16"``
  (variables in float32, computation in float16 / bfloat16). ``.name``,
  ``.compute_dtype``, ``.variable_dtype`` are strings, as in Keras. Policies compare
  equal by name. Any other name raises ``ValueError`` listing the names (Keras also
  accepts any dtype name, e.g. ``"float64"``; JAX computes in 32 bits by default, so
  paramstore keeps to these five).
* ``set_global_policy(policy_or_name)`` sets the policy a layer takes when it is
  constructed without ``dtype=`` (process-wide: every thread sees it; Keras keeps it per
  thread). ``global_policy()`` returns it; the default is ``Policy("float32")``.
* ``resolve(dtype, who)`` is what a layer's ``dtype=`` goes through: ``None`` (the global
  policy now), a ``Policy``, a policy name, or a floating dtype (``jnp.bfloat16``,
  ``"float16"``) meaning the policy of that name. A dtype that is not floating (``int32``,
  ``bool``) cannot hold trainable weights: ``ValueError`` naming ``who`` (the layer).
"""

from __future__ import annotations

import threading
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["Policy", "global_policy", "set_global_policy"]

# name -> (compute dtype, variable dtype), as keras.DTypePolicy._parse_name
_POLICIES: dict[str, tuple[str, str]] = {
    "float32": ("float32", "float32"),
    "float16": ("float16", "float16"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "mixed_float16": ("float16", "float32"),
    "mixed_bfloat16": ("bfloat16", "float32"),
}
NAMES: tuple[str, ...] = tuple(_POLICIES)
"""The policy names paramstore knows (Keras 3's)."""


class Policy:
    """A dtype policy, as ``keras.mixed_precision.Policy`` (``keras.DTypePolicy``):
    ``compute_dtype`` is what a layer computes and returns in, ``variable_dtype`` what it
    stores its variables in. ``Policy("mixed_bfloat16")`` computes in bfloat16 with
    float32 variables. An unknown name raises ``ValueError`` listing the names."""

    __slots__ = ("_name", "_compute", "_variable")

    def __init__(self, name: str) -> None:
        if not isinstance(name, str):
            raise TypeError(
                f"ps.mixed_precision.Policy: name must be a str such as 'mixed_bfloat16', "
                f"got {type(name).__name__} {name!r:.40}."
            )
        if name not in _POLICIES:
            raise ValueError(
                f"ps.mixed_precision.Policy: unknown policy name {name!r}. The names are "
                f"{list(NAMES)} (Keras 3's)."
            )
        self._name = name
        self._compute, self._variable = _POLICIES[name]

    @property
    def name(self) -> str:
        """The policy's name (``"mixed_bfloat16"``)."""
        return self._name

    @property
    def compute_dtype(self) -> str:
        """The dtype layers compute and return in (``"bfloat16"``), a string."""
        return self._compute

    @property
    def variable_dtype(self) -> str:
        """The dtype layers store their variables in (``"float32"``), a string."""
        return self._variable

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("ps.mixed_precision.Policy", self._name))

    def __repr__(self) -> str:
        return f'<ps.mixed_precision.Policy "{self._name}">'


_GLOBAL: list[Policy] = [Policy("float32")]
_LOCK = threading.Lock()


def global_policy() -> Policy:
    """The policy layers constructed without ``dtype=`` take (default ``"float32"``)."""
    return _GLOBAL[0]


def set_global_policy(policy: Policy | str) -> None:
    """Set the global policy: a ``Policy``, a policy name, or a floating dtype. Layers
    constructed afterwards take it; layers already constructed keep theirs. Process-wide."""
    if policy is None:
        raise TypeError(
            "ps.mixed_precision.set_global_policy: pass a Policy or a policy name such as "
            "'mixed_bfloat16' (or 'float32' to go back to the default), not None."
        )
    new = resolve(policy, "ps.mixed_precision.set_global_policy")
    with _LOCK:
        _GLOBAL[0] = new


def _dtype_name(dtype: Any) -> str | None:
    try:
        return str(np.dtype(jnp.dtype(dtype)).name)
    except TypeError:
        return None


def resolve(dtype: Any, who: str) -> Policy:
    """A layer's ``dtype=`` as a ``Policy`` (see the module docstring); ``who`` names the
    layer in errors."""
    if dtype is None:
        return global_policy()
    if isinstance(dtype, Policy):
        return dtype
    if isinstance(dtype, str) and dtype in _POLICIES:
        return Policy(dtype)
    name = _dtype_name(dtype) if not isinstance(dtype, bool) else None
    if name is None:
        raise ValueError(
            f"{who}: dtype={dtype!r:.40} is neither a policy nor a dtype. Pass a "
            f"ps.mixed_precision.Policy, one of the names {list(NAMES)}, or a floating dtype."
        )
    if not jnp.issubdtype(jnp.dtype(name), jnp.floating):
        raise ValueError(
            f"{who}: dtype={name} is not a floating dtype, so it cannot hold the layer's "
            f"variables (weights are trained in floating point). Pass a floating policy: "
            f"one of {list(NAMES)}."
        )
    if name not in _POLICIES:
        raise ValueError(f"{who}: dtype={name} is not one of the supported policies {list(NAMES)}.")
    return Policy(name)
