"""``LSTM``, ``GRU`` and ``Bidirectional``: Keras 3's recurrent layers, run by one ``lax.scan``.

Contract (docs/api.md, "Layers"; docs/layers.md, "Recurrent layers"):

* ``LSTM(units, ...)`` and ``GRU(units, ..., reset_after=True)`` take ``(batch, timesteps,
  features)`` inputs and have Keras 3's variables, on the layer itself: ``kernel``
  ``(features, k * units)``, ``recurrent_kernel`` ``(units, k * units)`` and ``bias``
  (``(4 * units,)`` for LSTM, ``(2, 3 * units)`` for GRU with ``reset_after``,
  ``(3 * units,)`` without), with Keras' gate order (LSTM ``i, f, c, o``; GRU ``z, r, h``),
  activations (``tanh``, recurrent ``sigmoid``) and initializers (``glorot_uniform``,
  ``orthogonal``, ``zeros``; ``unit_forget_bias`` sets the forget gate's bias to one).
* The output is the last state ``(batch, units)``, or every step's ``(batch, timesteps,
  units)`` with ``return_sequences=True``; with ``return_state=True`` a list ``[output,
  *final_states]`` (LSTM: ``h, c``; GRU: ``h``). ``go_backwards=True`` reads the sequence
  from its end (and returns the steps in that reversed order, as Keras does).
  ``initial_state`` (a list of ``(batch, units)`` arrays) replaces the zero state.
* The time loop is one ``jax.lax.scan`` over the steps (the input projection of every
  step is one matmul before it): one trace, and a compiled program whose size does not
  depend on the number of steps.
* ``Bidirectional(layer, merge_mode="concat", backward_layer=None)`` runs a copy of
  ``layer`` forwards (``forward_<name>``) and one backwards (``backward_<name>``), built
  from ``layer``'s arguments as Keras does, and merges their outputs (the backward
  sequence flipped back to the input's order): ``"concat"``, ``"sum"``, ``"mul"``,
  ``"ave"`` or None (a list of both).
* ``dtype=`` (a ``ps.mixed_precision`` policy): variables in its variable dtype, inputs,
  states and outputs in its compute dtype, as Keras 3. ``Bidirectional``'s ``dtype=`` casts
  its input and the two outputs it merges (not the states), as Keras: its two directions keep
  the wrapped layer's policy (Keras rebuilds them from the layer's config, policy included);
  a given ``backward_layer`` keeps its own.
* ``kernel_regularizer``, ``recurrent_regularizer``, ``bias_regularizer`` and the three
  ``*_constraint`` arguments (Keras 3's names) attach to ``kernel``, ``recurrent_kernel``
  and ``bias`` (``ps.regularization_loss``; optimizers apply the constraints).
* Not supported (an error, not a silent difference): ``mask``, ``dropout``,
  ``recurrent_dropout``, ``stateful`` and ``unroll`` are not arguments.
* Bad input: anything but a 3-D input raises ``ValueError`` naming the layer before
  anything is built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from paramstore.nn._arguments import Activation
from paramstore.nn._base import Layer, PolicyLike, Shape, as_float
from paramstore.nn._recurrent_base import Output, RecurrentLayer
from paramstore.typing import (
    ConstraintLike,
    Initializer,
    LayerInitializer,
    RegularizerLike,
    ShapeLike,
    ValueLike,
)

__all__ = ["LSTM", "GRU", "Bidirectional"]

Array = jax.Array


class LSTM(RecurrentLayer):
    """Long short-term memory, as ``keras.layers.LSTM`` (Keras 3's variables, gate order
    ``i, f, c, o``, defaults and results; see the module docstring). ``unit_forget_bias``
    (default True) starts the forget gate's bias at one."""

    _gates = 4
    _n_states = 2

    def __init__(
        self,
        units: int,
        activation: str | Activation | None = "tanh",
        recurrent_activation: str | Activation | None = "sigmoid",
        use_bias: bool = True,
        kernel_initializer: LayerInitializer = None,
        recurrent_initializer: LayerInitializer = None,
        bias_initializer: LayerInitializer = None,
        unit_forget_bias: bool = True,
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
        super().__init__(
            units,
            activation,
            recurrent_activation,
            use_bias,
            kernel_initializer,
            recurrent_initializer,
            bias_initializer,
            return_sequences,
            return_state,
            go_backwards,
            name=name,
            kernel_regularizer=kernel_regularizer,
            recurrent_regularizer=recurrent_regularizer,
            bias_regularizer=bias_regularizer,
            kernel_constraint=kernel_constraint,
            recurrent_constraint=recurrent_constraint,
            bias_constraint=bias_constraint,
            dtype=dtype,
        )
        self.unit_forget_bias = bool(unit_forget_bias)
        self._config["unit_forget_bias"] = unit_forget_bias

    def _bias_initializer(self) -> Initializer:
        if not self.unit_forget_bias:
            return self._bias_init
        u, init = self.units, self._bias_init

        def forget_ones(shape: ShapeLike, dtype: DTypeLike = jnp.float32) -> Array:
            ones = jnp.ones((u,), dtype)  # the forget gate's quarter
            return jnp.concatenate([init((u,), dtype), ones, init((2 * u,), dtype)])

        return forget_ones

    def _inputs(self, x: Array) -> Array:
        xw = super()._inputs(x)
        return xw if self.bias is None else xw + self.cast(self.bias)

    def _step(
        self, rk: Array, rb: Array | None, carry: tuple[Array, ...], xw: Array
    ) -> tuple[tuple[Array, ...], Array]:
        h, c = carry
        z = xw + h @ rk
        i, f, g, o = jnp.split(z, 4, axis=-1)
        act, rec = self.activation, self.recurrent_activation
        c = rec(f) * c + rec(i) * act(g)
        h = rec(o) * act(c)
        return (h, c), h


class GRU(RecurrentLayer):
    """Gated recurrent unit, as ``keras.layers.GRU`` (gate order ``z, r, h``). With
    ``reset_after=True`` (Keras 3's default, cuDNN's form) the reset gate multiplies the
    recurrent projection and ``bias`` is ``(2, 3 * units)`` (input and recurrent biases);
    with False it multiplies the state before it and ``bias`` is ``(3 * units,)``."""

    _gates = 3
    _n_states = 1

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
        reset_after: bool = True,
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
        super().__init__(
            units,
            activation,
            recurrent_activation,
            use_bias,
            kernel_initializer,
            recurrent_initializer,
            bias_initializer,
            return_sequences,
            return_state,
            go_backwards,
            name=name,
            kernel_regularizer=kernel_regularizer,
            recurrent_regularizer=recurrent_regularizer,
            bias_regularizer=bias_regularizer,
            kernel_constraint=kernel_constraint,
            recurrent_constraint=recurrent_constraint,
            bias_constraint=bias_constraint,
            dtype=dtype,
        )
        self.reset_after = bool(reset_after)
        self._config["reset_after"] = reset_after

    def _bias_shape(self) -> tuple[int, ...]:
        n = 3 * self.units
        return (2, n) if self.reset_after else (n,)

    def _inputs(self, x: Array) -> Array:
        xw = super()._inputs(x)
        if self.bias is None:
            return xw
        b = self.cast(self.bias)
        return xw + (b[0] if self.reset_after else b)

    def _recurrent_bias(self) -> Array | None:
        if self.bias is None or not self.reset_after:
            return None
        return self.cast(self.bias)[1]

    def _step(
        self, rk: Array, rb: Array | None, carry: tuple[Array, ...], xw: Array
    ) -> tuple[tuple[Array, ...], Array]:
        (h,) = carry
        u = self.units
        act, rec = self.activation, self.recurrent_activation
        x_z, x_r, x_h = jnp.split(xw, 3, axis=-1)
        if self.reset_after:
            inner = h @ rk if rb is None else h @ rk + rb
            r_z, r_r, r_h = jnp.split(inner, 3, axis=-1)
            z, r = rec(x_z + r_z), rec(x_r + r_r)
            hh = act(x_h + r * r_h)
        else:
            zr = h @ rk[:, : 2 * u]
            z, r = rec(x_z + zr[:, :u]), rec(x_r + zr[:, u:])
            hh = act(x_h + (r * h) @ rk[:, 2 * u :])
        h = z * h + (1 - z) * hh
        return (h,), h


_MERGES: dict[str, Callable[[Array, Array], Array]] = {
    "concat": lambda a, b: jnp.concatenate([a, b], axis=-1),
    "sum": jnp.add,
    "mul": jnp.multiply,
    "ave": lambda a, b: (a + b) / 2,
}


class Bidirectional(Layer):
    """Runs a recurrent layer forwards and backwards and merges the outputs, as
    ``keras.layers.Bidirectional``: ``forward_layer`` and ``backward_layer`` are copies of
    ``layer`` made from its arguments (``forward_lstm``, ``backward_lstm``; ``layer``
    itself is not used, as in Keras), unless ``backward_layer`` is given. The backward
    sequence is flipped back to the input's order before ``merge_mode`` (``"concat"``,
    ``"sum"``, ``"mul"``, ``"ave"``, or None for a list of both) merges them. With
    ``return_state`` the result is ``[output, *forward_states, *backward_states]``."""

    _keras_order = ("forward_layer", "backward_layer")

    def __init__(
        self,
        layer: RecurrentLayer,
        merge_mode: str | None = "concat",
        backward_layer: RecurrentLayer | None = None,
        name: str | None = None,
        *,
        dtype: PolicyLike = None,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        if not isinstance(layer, RecurrentLayer):
            raise TypeError(
                f"Bidirectional: layer must be a ps.nn.LSTM or ps.nn.GRU, got "
                f"{type(layer).__name__}."
            )
        if merge_mode is not None and merge_mode not in _MERGES:
            raise ValueError(
                f"Bidirectional: merge_mode must be one of {sorted(_MERGES)} or None, got "
                f"{merge_mode!r}."
            )
        if backward_layer is not None and not isinstance(backward_layer, RecurrentLayer):
            raise TypeError(
                "Bidirectional: backward_layer must be a ps.nn.LSTM or ps.nn.GRU, got "
                f"{type(backward_layer).__name__}."
            )
        if backward_layer is not None and (
            backward_layer.return_sequences != layer.return_sequences
            or backward_layer.return_state != layer.return_state
        ):
            raise ValueError(
                "Bidirectional: backward_layer must have the same return_sequences and "
                "return_state as layer."
            )
        self.merge_mode = merge_mode
        config = layer.config()
        kind = type(layer)
        self.forward_layer = kind(**{**config, "name": f"forward_{layer.name}"})
        if backward_layer is None:
            back = {**config, "go_backwards": not config["go_backwards"]}
            backward_layer = kind(**{**back, "name": f"backward_{layer.name}"})
        self.backward_layer = backward_layer
        self.return_sequences = layer.return_sequences
        self.return_state = layer.return_state

    def check_shape(self, *shapes: Shape | None) -> None:
        """A 3-D input, as the wrapped layer needs."""
        self.forward_layer.check_shape(*shapes)

    def build(self, input_shape: Shape) -> None:
        """Build both directions for inputs of ``input_shape``."""
        self.forward_layer.build(input_shape)
        self.backward_layer.build(input_shape)

    def check_built(self, *shapes: Shape | None) -> None:
        """Each direction checks its own input."""

    def compute_output_shape(self, input_shape: Shape) -> Shape | None:
        """The merged output's shape (None when ``merge_mode`` is None or with
        ``return_state``)."""
        shape = self.forward_layer.compute_output_shape(input_shape)
        if shape is None or self.merge_mode is None:
            return None
        if self.merge_mode == "concat" and shape[-1] is not None:
            return (*shape[:-1], 2 * shape[-1])
        return shape

    def __call__(
        self,
        sequences: ValueLike,
        initial_state: Sequence[ValueLike] | None = None,
        training: bool | None = None,
    ) -> Output:
        """Run both directions over ``sequences`` and merge them (``initial_state``: the
        forward states, then the backward ones)."""
        x = as_float(sequences, self)
        self.ensure_built(tuple(x.shape))
        forward_state = backward_state = None
        if initial_state is not None:
            half = len(initial_state) // 2
            forward_state, backward_state = initial_state[:half], initial_state[half:]
        y = self.forward_layer(x, forward_state)
        y_rev = self.backward_layer(x, backward_state)
        states: list[Array] = []
        if self.return_state:
            assert isinstance(y, list) and isinstance(y_rev, list)
            states = [*y[1:], *y_rev[1:]]
            y, y_rev = y[0], y_rev[0]
        assert not isinstance(y, list) and not isinstance(y_rev, list)
        y, y_rev = self.cast(y), self.cast(y_rev)  # as Keras: outputs (not states) in ours
        if self.return_sequences:
            y_rev = jnp.flip(y_rev, axis=1)
        if self.merge_mode is None:
            return [y, y_rev, *states]
        out = _MERGES[self.merge_mode](y, y_rev)
        return [out, *states] if self.return_state else out
