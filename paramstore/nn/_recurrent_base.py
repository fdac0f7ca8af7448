"""``RecurrentLayer``: what ``LSTM`` and ``GRU`` share (paramstore/nn/recurrent.py): their
arguments and checks, their three variables (made by ``add_weight`` in the layer's variable
dtype, with Keras 3's ``kernel_``/``recurrent_``/``bias_`` regularizers and constraints) and the
one ``lax.scan`` over the steps, in the layer's compute dtype (``dtype=``, a
``ps.mixed_precision`` policy)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from paramstore import initializers as _init
from paramstore.nn._arguments import Activation, initializer, resolve_activation, set_hooks
from paramstore.nn._base import Layer, PolicyLike, Shape, as_float, features
from paramstore.typing import (
    ConstraintLike,
    Initializer,
    LayerInitializer,
    RegularizerLike,
    ValueLike,
)
from paramstore.variable import Variable

__all__ = ["RecurrentLayer", "Output"]

Array = jax.Array
Output = Array | list[Array]


class RecurrentLayer(Layer):
    """What LSTM and GRU share: arguments, checks, variables and the scan."""

    variable_names = ("kernel", "recurrent_kernel", "bias")
    _gates: ClassVar[int] = 4
    _n_states: ClassVar[int] = 1
    kernel: Variable
    recurrent_kernel: Variable
    bias: Variable | None

    def __init__(
        self,
        units: int,
        activation: str | Activation | None = "tanh",
        recurrent_activation: str | Activation | None = "sigmoid",
        use_bias: bool = True,
        kernel_initializer: LayerInitializer = None,
        recurrent_initializer: LayerInitializer = None,
        bias_initializer: LayerInitializer = None,
        return_sequences: bool = False,
        return_state: bool = False,
        go_backwards: bool = False,
        name: str | None = None,
        *,
        kernel_regularizer: RegularizerLike | None = None,
        recurrent_regularizer: RegularizerLike | None = None,
        bias_regularizer: RegularizerLike | None = None,
        kernel_constraint: ConstraintLike | None = None,
        recurrent_constraint: ConstraintLike | None = None,
        bias_constraint: ConstraintLike | None = None,
        dtype: PolicyLike = None,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        set_hooks(self, locals())
        kind = type(self).__name__
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise ValueError(f"{kind}: units must be a positive int, got {units!r}.")
        self.units = units
        self._config: dict[str, Any] = {
            "units": units,
            "activation": activation,
            "recurrent_activation": recurrent_activation,
            "use_bias": use_bias,
            "kernel_initializer": kernel_initializer,
            "recurrent_initializer": recurrent_initializer,
            "bias_initializer": bias_initializer,
            "return_sequences": return_sequences,
            "return_state": return_state,
            "go_backwards": go_backwards,
            "kernel_regularizer": kernel_regularizer,
            "recurrent_regularizer": recurrent_regularizer,
            "bias_regularizer": bias_regularizer,
            "kernel_constraint": kernel_constraint,
            "recurrent_constraint": recurrent_constraint,
            "bias_constraint": bias_constraint,
            "dtype": self.dtype_policy,  # a copy keeps this layer's policy, as in Keras
        }
        self.activation = resolve_activation(activation, kind) or (lambda x: x)
        self.recurrent_activation = resolve_activation(recurrent_activation, kind) or (lambda x: x)
        self.use_bias = bool(use_bias)
        self.return_sequences = bool(return_sequences)
        self.return_state = bool(return_state)
        self.go_backwards = bool(go_backwards)
        self._kernel_init = initializer(
            kernel_initializer, _init.glorot_uniform(), kind, "kernel_initializer"
        )
        self._recurrent_init = initializer(
            recurrent_initializer, _init.orthogonal(), kind, "recurrent_initializer"
        )
        self._bias_init = initializer(bias_initializer, _init.zeros(), kind, "bias_initializer")

    def config(self) -> dict[str, Any]:
        """The constructor's arguments (what ``Bidirectional`` copies the layer from)."""
        return dict(self._config)

    def check_shape(self, *shapes: Shape | None) -> None:
        """A 3-D input ``(batch, timesteps, features)``, else ValueError naming the layer."""
        shape = shapes[0]
        if shape is not None and len(shape) != 3:
            raise ValueError(
                f"{self.describe()} expects a 3-D input (batch, timesteps, features), got "
                f"shape {shape} ({len(shape)}-D). A single sequence needs a batch axis "
                "(x[None]); one feature per step needs a feature axis (x[..., None])."
            )

    def _bias_shape(self) -> tuple[int, ...]:
        return (self._gates * self.units,)

    def _bias_initializer(self) -> Initializer:
        """What ``bias`` starts from (LSTM's ``unit_forget_bias`` changes it)."""
        return self._bias_init

    def build(self, input_shape: Shape) -> None:
        """Create ``kernel``, ``recurrent_kernel`` and ``bias`` for inputs of
        ``input_shape``."""
        n_in, units, n = features(self, input_shape), self.units, self._gates * self.units
        self.kernel = self.add_weight("kernel", (n_in, n), self._kernel_init)
        self.recurrent_kernel = self.add_weight(
            "recurrent_kernel", (units, n), self._recurrent_init, hooks_from="recurrent"
        )
        self.bias = (
            self.add_weight("bias", self._bias_shape(), self._bias_initializer())
            if self.use_bias
            else None
        )

    def compute_output_shape(self, input_shape: Shape) -> Shape | None:
        """``(batch, units)``, or ``(batch, timesteps, units)`` with ``return_sequences``
        (None with ``return_state``: a list)."""
        if self.return_state:
            return None  # a list of shapes: not a Sequential layer
        if self.return_sequences:
            return (input_shape[0], input_shape[1], self.units)
        return (input_shape[0], self.units)

    def _step(
        self, rk: Array, rb: Array | None, carry: tuple[Array, ...], xw: Array
    ) -> tuple[tuple[Array, ...], Array]:
        """One step from the recurrent kernel ``rk`` and recurrent bias ``rb`` (arrays read
        before the scan: a scan body never reads a variable)."""
        raise NotImplementedError

    def _recurrent_bias(self) -> Array | None:
        return None

    def _inputs(self, x: Array) -> Array:
        """Every step's input projection ``x @ kernel (+ input bias)``, time-major."""
        return jnp.einsum("btf,fg->tbg", x, self.cast(self.kernel))

    def _initial(self, x: Array, initial_state: Sequence[ValueLike] | None) -> tuple[Array, ...]:
        shape = (x.shape[0], self.units)
        if initial_state is None:
            return tuple(jnp.zeros(shape, x.dtype) for _ in range(self._n_states))
        states = [initial_state] if not isinstance(initial_state, (list, tuple)) else initial_state
        arrays = tuple(jnp.asarray(s, x.dtype) for s in states)
        if len(arrays) != self._n_states or any(a.shape != shape for a in arrays):
            raise ValueError(
                f"{self.describe()}: initial_state must be {self._n_states} array(s) of shape "
                f"{shape} (batch, units), got shapes {[tuple(a.shape) for a in arrays]}."
            )
        return arrays

    def __call__(
        self,
        sequences: ValueLike,
        initial_state: Sequence[ValueLike] | None = None,
        training: bool | None = None,
    ) -> Output:
        """Run the layer over ``sequences`` ``(batch, timesteps, features)`` from
        ``initial_state`` (zeros by default); see the module docstring for what it
        returns."""
        x = as_float(sequences, self)
        self.check_shape(tuple(x.shape))
        carry = self._initial(x, initial_state)  # checked before anything is built
        self.ensure_built(tuple(x.shape))
        if self.go_backwards:
            x = jnp.flip(x, axis=1)
        xw = self._inputs(x)
        rk = self.cast(self.recurrent_kernel)
        step = functools.partial(self._step, rk, self._recurrent_bias())
        carry, ys = jax.lax.scan(step, carry, xw)
        output = jnp.swapaxes(ys, 0, 1) if self.return_sequences else carry[0]
        if self.return_state:
            return [output, *carry]
        return output
