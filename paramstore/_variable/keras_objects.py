"""Keras-style configurable objects by name (what ``ps.regularizers`` and ``ps.constraints``
share): ``get(identifier)`` (None, a name, a serialized dict, a class, a callable),
``serialize`` / ``deserialize`` in Keras' dict form (``{"module": "keras.<kind>s",
"class_name": ..., "config": ..., "registered_name": None}``, which Keras also reads), and
``abstract_call``, a user function run on a ``ShapeDtypeStruct`` to check what it returns.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.typing import DTypeLike

__all__ = ["Registry", "abstract_call"]


class Registry:
    """The names of one kind of object (``"regularizer"``, ``"constraint"``): ``makers``
    maps every accepted name to a zero-argument factory, ``classes`` the class names that a
    serialized dict may carry; ``known`` lists the names for errors, ``shape`` says what a
    callable of this kind computes."""

    def __init__(
        self,
        kind: str,
        base: type,
        makers: Mapping[str, Callable[[], Any]],
        classes: Mapping[str, type],
        known: str,
        shape: str,
    ) -> None:
        self.kind, self.base, self.makers, self.classes = kind, base, makers, classes
        self.known, self.shape = known, shape

    def serialize(self, obj: Any) -> dict[str, Any]:
        if not isinstance(obj, self.base):
            raise TypeError(
                f"ps.{self.kind}s.serialize takes a ps.{self.kind}s object, got "
                f"{type(obj).__name__}."
            )
        return {
            "module": f"keras.{self.kind}s",
            "class_name": type(obj).__name__,
            "config": obj.get_config(),  # type: ignore[attr-defined]  # self.base's method
            "registered_name": None,
        }

    def named(self, name: str) -> Any:
        make = self.makers.get(name)
        if make is None:
            raise ValueError(
                f"Unknown {self.kind} {name!r}: use one of {self.known}, a ps.{self.kind}s "
                f"object, or a callable {self.shape}."
            )
        return make()

    def deserialize(self, config: Mapping[str, Any] | str) -> Any:
        if isinstance(config, str):
            return self.named(config)
        if not isinstance(config, Mapping) or "class_name" not in config:
            raise ValueError(
                f"Could not interpret {self.kind} config {config!r:.80}: expected "
                f"ps.{self.kind}s.serialize's dict (with 'class_name' and 'config')."
            )
        cls = self.classes.get(config["class_name"])
        if cls is None:
            raise ValueError(
                f"Unknown {self.kind} class {config['class_name']!r}; known: "
                f"{', '.join(self.classes)}."
            )
        return cls.from_config(config.get("config") or {})  # type: ignore[attr-defined]

    def get(self, identifier: Any, where: str) -> Any:
        if identifier is None:
            return None
        if isinstance(identifier, str):
            try:
                return self.named(identifier)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        if isinstance(identifier, Mapping):
            return self.deserialize(identifier)
        if inspect.isclass(identifier):
            identifier = identifier()
        if callable(identifier):
            return identifier
        raise ValueError(
            f"{where}: could not interpret {self.kind} identifier {identifier!r:.60} (a "
            f"{type(identifier).__name__}): pass one of {self.known}, a ps.{self.kind}s object "
            f"or a callable {self.shape}."
        )


def abstract_call(
    fn: Callable[..., Any], shape: tuple[int, ...], dtype: DTypeLike, name: str, kind: str
) -> Any:
    """``fn`` run abstractly on a value of ``shape`` and ``dtype``: its output's shapes and
    dtypes; a failure is a ``ValueError`` saying it is variable ``name``'s ``kind``."""
    try:
        return jax.eval_shape(fn, jax.ShapeDtypeStruct(shape, dtype))
    except Exception as e:  # the user's code: say whose it is
        raise ValueError(
            f"The {kind} of variable '{name}' ({fn!r:.60}) failed on a value of shape {shape} "
            f"and dtype {dtype}: {type(e).__name__}: {e}"
        ) from e
