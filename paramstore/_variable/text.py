"""A variable as text: ``repr(v)``, TensorFlow's form (``<ps.Variable 'name' shape=(2,)
dtype=float32, numpy=array([1., 2.], dtype=float32)>``), for a concrete variable and an
abstract one (``Variable.__repr__`` and ``_Abstract.__repr__`` call these; the HTML of
Jupyter is ``_core.html``'s)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np

from paramstore._core.jax_api import Tracer
from paramstore._core.ownership import ownership

if TYPE_CHECKING:  # the class sits above this module: a name for annotations only
    from paramstore.variable import Variable

__all__ = ["describe", "describe_abstract"]


def _head(var: Variable) -> str:
    dtype = "string" if var._is_string else str(var._dtype)
    return f"<ps.Variable '{var._name}' shape={var._shape} dtype={dtype}"


def describe(var: Variable) -> str:
    """``repr`` of a variable with a value (or one being computed, or traced)."""
    head = _head(var)
    if var._pending():
        return f"{head} (initial value being computed)>"
    value = var.value()
    if isinstance(value, Tracer):
        return f"{head} (traced)>"
    if not getattr(value, "is_fully_addressable", True) and not value.is_fully_replicated:
        # sharded over several processes: no process can show the whole value
        return f"{head}, sharded over {len(value.sharding.device_set)} devices>"
    if var._is_key:
        return f"{head}, key_data={np.asarray(jax.random.key_data(value))!r}>"
    array = np.asarray(value)
    # As TensorFlow: a 0-d value prints as the Python scalar (numpy=1.5, not array(1.5, ...)).
    text = repr(array.item()) if array.ndim == 0 and not var._is_string else repr(array)
    return f"{head}, numpy={text}>"


def describe_abstract(var: Variable) -> str:
    """``repr`` of an abstract variable: its shape, dtype and sharding (it has no value)."""
    sharding = ownership.peek(var).sharding
    return f"{_head(var)} abstract{'' if sharding is None else f' sharding={sharding}'}>"
