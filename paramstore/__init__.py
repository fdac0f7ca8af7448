"""paramstore: TensorFlow-style stateful Variables for JAX, compiled with ``jax.jit``.

See ``docs/api.md`` for the reference; each module's docstring states its part of it.
"""

from paramstore import (
    checkpoint,
    constraints,
    initializers,
    metrics,
    mixed_precision,
    nn,
    random,
    regularizers,
    sharding,
    typing,
)
from paramstore._core.placement import device
from paramstore._display.display import display
from paramstore._summary import summary
from paramstore._variable.abstract import abstract
from paramstore.averaging import ExponentialMovingAverage
from paramstore.checkpoint import CheckpointManager, Saver
from paramstore.checkpoint.objects import Checkpoint
from paramstore.function import Function, function
from paramstore.functional import (
    State,
    grad,
    non_trainable,
    pure,
    state,
    trainable,
    update,
    value_and_grad,
)
from paramstore.module import Module
from paramstore.optimizer import Optimizer
from paramstore.optimizer.loss_scale import LossScaleOptimizer
from paramstore.plan import Plan, PlanRow, plan
from paramstore.regularization import regularization_loss
from paramstore.remat import remat
from paramstore.scope import (
    AUTO_REUSE,
    VariableScope,
    VariableStore,
    get_variable,
    name_scope,
    variable_scope,
)
from paramstore.sharding import initialize
from paramstore.variable import Reference, Variable, VariableSlice

__version__ = "0.1.0"

__all__ = [
    "AUTO_REUSE",
    "Checkpoint",
    "CheckpointManager",
    "ExponentialMovingAverage",
    "Function",
    "LossScaleOptimizer",
    "Module",
    "Optimizer",
    "Plan",
    "PlanRow",
    "Reference",
    "Saver",
    "State",
    "Variable",
    "VariableScope",
    "VariableSlice",
    "VariableStore",
    "abstract",
    "checkpoint",
    "constraints",
    "device",
    "display",
    "function",
    "get_variable",
    "grad",
    "initialize",
    "initializers",
    "metrics",
    "mixed_precision",
    "name_scope",
    "nn",
    "non_trainable",
    "plan",
    "pure",
    "random",
    "regularization_loss",
    "regularizers",
    "remat",
    "sharding",
    "state",
    "summary",
    "trainable",
    "typing",
    "update",
    "value_and_grad",
    "variable_scope",
]
