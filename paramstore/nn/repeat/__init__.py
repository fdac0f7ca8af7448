"""``ps.nn.Repeat``: ``n`` copies of a block, stored stacked, applied by one ``lax.scan``.

Contract (docs/api.md, "Layers"; docs/guides/repeat.md):

* ``Repeat(make_block, n, *, remat=None, name=None)`` calls ``make_block()`` once, inside
  its own name scope, and keeps the result as a *template*: its variables live in a private
  store and are never trained or saved. On the first call the template is run eagerly on
  an input of the same shape (only traced inside ``ps.abstract()``, below) (twice: the first call builds a lazy layer, the second must
  create nothing), which tells the block's variables, their initializers and checks that
  the block keeps its input's shape and dtype. Then each template variable becomes one
  real variable of the same full name (``repeat/block/dense/kernel``) with a leading axis
  of ``n``: a callable initial value (every ``ps.nn`` layer's) is run for each layer under
  ``jax.vmap`` with the layer index folded into its name-derived key, so layers differ; a
  concrete initial value is copied into every layer, except a ``ps.random.Generator``'s
  state, which is split per layer (``fold_in(key, i)``), so each layer draws its own
  stream. Nothing is created in the real store before every check passed.
* ``repeat.build(input_shape)`` does the first call's build on zeros of that shape.
* ``repeat(x, *args, training=None, **kwargs)`` runs ``lax.scan`` over the stacked
  values: the body binds the template's variables to the current layer's slices (a
  binding frame, as ``ps.pure``) and calls ``block(x, *args, **kwargs)`` (with
  ``training=`` where the block takes it), so the program holds one block whatever ``n``.
  Variables the block assigns (moving statistics, generator states) come out of the scan
  stacked and are assigned back; other variables it reads or assigns (the global
  generator) go through the enclosing ``ps.function``'s frame. Called eagerly outside any
  frame, the scan runs inside an internal ``ps.function`` (one compile per signature).
* ``remat=True`` (or a ``jax.checkpoint_policies`` policy) wraps the body in
  ``jax.checkpoint``: activations inside a block are recomputed in the backward pass.
* The stacked variables are ``repeat.stacked``, a dict keyed by each variable's attribute
  path inside the block (``attn/weights/query/kernel``), so a ``ps.Checkpoint`` key reads
  ``model/blocks/stacked/<path>`` where an unrolled list of blocks has
  ``model/blocks/<i>/<path>``: ``Repeat.stack_state``/``unstack_state`` convert one into
  the other; ``load_blocks``/``store_blocks`` copy to and from live blocks.
* Sharding: the template's variables are created where the stacked ones are (inside the
  same ``ps.device(layout_map)`` / ``axis_rules`` blocks), so a ``LayoutMap`` entry or a
  partition describes the per-block shape; each stacked variable gets its template's
  ``NamedSharding`` with the stacked axis replicated in front (``P(None, *spec)``) and its
  partition with ``None`` in front.
* Inside ``with ps.abstract():`` (the Repeat made or built there) the template is only
  traced (``jax.eval_shape``; ``_repeat_template``): its variables are abstract, nothing of
  the block is computed or allocated, and the stacked variables are created abstract, with
  the names, shapes, dtypes, shardings and initializers a concrete build gives them, so
  ``ps.initialize`` gives the same values and a checkpoint restores into them. Calling it
  before that raises the abstract-variable ``ValueError`` naming a stacked variable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paramstore._core import frames
from paramstore._core import seed as _seed
from paramstore._core.jax_api import EVAL, current_trace
from paramstore._core.store import VariableStore
from paramstore.function import function
from paramstore.module import Module
from paramstore.nn._base import Layer, PolicyLike, Shape, autocast
from paramstore.nn.repeat.layout import (
    all_variables,
    attribute_paths,
    generators,
    stack_state,
    stacked_initial,
    stacked_partition,
    stacked_shape,
    stacked_sharding,
    unstack_state,
)
from paramstore.nn.repeat.template import Template, describe, learn, sources
from paramstore.remat import checkpoint_policy
from paramstore.typing import ValueLike
from paramstore.variable import Variable

__all__ = ["Repeat"]


class Repeat(Layer):
    """``n`` blocks made by ``make_block()``, stored stacked and applied by one ``lax.scan``.

    See the module docstring for the contract. ``remat`` is ``None``/``False`` (keep every
    activation), ``True`` (recompute each block in the backward pass) or a
    ``jax.checkpoint_policies`` policy (what to save). ``dtype`` is the Repeat's policy:
    a floating input is cast to its compute dtype; the blocks' layers have their own
    policies (the global one when ``make_block()`` runs, in the constructor), and their
    stacked variables keep the template's dtypes.
    """

    stacked: dict[str, Variable]

    def __init__(
        self,
        make_block: Callable[[], Any],
        n: int,
        *,
        remat: bool | Callable[..., Any] | None = None,
        name: str | None = None,
        dtype: PolicyLike = None,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(
                f"Repeat '{self.scope_name}': n must be a positive int (the number of "
                f"blocks), got {n!r}. Use n >= 1; for no block at all, leave the Repeat out."
            )
        if not callable(make_block) or isinstance(make_block, Module):
            raise TypeError(
                f"Repeat '{self.scope_name}': make_block must be a zero-argument callable "
                f"returning a new block (e.g. lambda: Block(64)), got "
                f"{type(make_block).__name__}. Pass the factory, not a block."
            )
        self.n = int(n)
        self.remat_policy = checkpoint_policy(remat, f"Repeat '{self.scope_name}'")
        self.remat = remat is not None and remat is not False
        store = VariableStore()
        with store, _seed.recording() as inits, frames.no_frames():
            block = make_block()
        if not callable(block):
            raise TypeError(
                f"Repeat '{self.scope_name}': make_block() returned a "
                f"{type(block).__name__}, which is not callable. It must return a layer or "
                "a Module with __call__(x, ...) returning an array shaped like x."
            )
        self._template = Template(block, store, dict(inits))
        self._order: list[str] = []
        self._in_shape: tuple[int, ...] | None = None

    # ------------------------------------------------------------------ building
    def _build_stacked(self, x: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        t = self._template
        frames.check_create()  # a later ps.function trace: the usual error, nothing run
        found = learn(t, f"Repeat '{self.scope_name}'", x, args, kwargs)
        paths = attribute_paths(t.block)
        streams = {id(g.state) for g in generators(t.block)}
        own = f"{t.block.scope_name}/" if isinstance(t.block, Module) else ""
        keys: dict[str, Variable] = {}
        for v in found:
            key = paths.get(id(v)) or v.name.removeprefix(own)
            keys[key] = v
        source = sources(t, f"Repeat '{self.scope_name}'", found)
        made: dict[str, Variable] = {}
        order = sorted(keys)
        for key in order:
            v = keys[key]
            init = t.inits.get(v.name)
            made[key] = Variable(
                stacked_initial(init, source[id(v)], self.n, v.name, id(v) in streams)
                if init is not None or source[id(v)] is not None
                else stacked_shape(v, self.n),
                trainable=v.trainable,
                dtype=None if v._is_key else v.dtype,
                sharding=stacked_sharding(v),
                partition=stacked_partition(v),
                constraint=None if v.constraint is None else jax.vmap(v.constraint),
                regularizer=v.regularizer,  # a sum over the blocks (L1, L2...): the same
                _full_name=v.name,
            )
        t.tvars = [keys[k] for k in order]
        self._order = order
        self._in_shape = tuple(np.shape(x))
        self.stacked = made  # one assignment: a pending ps.Checkpoint restore sees it all
        self.built = True

    def build(self, input_shape: Shape) -> None:
        """Create the stacked variables as a first call on inputs of ``input_shape`` would
        (same names, shapes, initial values): the template runs on zeros of that shape
        (a ``None`` first axis counts as 1) in the Repeat's compute dtype. A block whose call
        needs more than the input (a mask, a flag) is built by calling the Repeat."""
        if any(d is None for d in input_shape[1:]):
            raise ValueError(
                f"Repeat '{self.scope_name}'.build needs every axis but the first known (the "
                f"template block runs on zeros of that shape), got {tuple(input_shape)}. "
                "Pass a shape such as (None, 16, 64)."
            )
        dims = tuple(1 if d is None else d for d in input_shape)
        self._build_stacked(jax.ShapeDtypeStruct(dims, jnp.dtype(self.compute_dtype)), (), {})

    def compute_output_shape(self, input_shape: Shape) -> Shape:
        """The blocks keep their input's shape, so the Repeat does too."""
        return tuple(input_shape)

    def check_built(self, *shapes: Shape | None) -> None:
        """Raise if a built Repeat gets inputs of another rank or last axis."""
        new = shapes[0] if shapes else None
        old = self._in_shape
        if new is None or old is None:
            return
        if len(new) != len(old) or (new[-1] is not None and new[-1] != old[-1]):
            raise ValueError(
                f"Repeat '{self.scope_name}' was built for inputs of shape {old} (rank and "
                f"last axis), got {tuple(new)}. Pass inputs like the first one, or use a "
                "new Repeat."
            )

    # ------------------------------------------------------------------ calling
    def __call__(
        self, x: ValueLike, *args: Any, training: bool | None = None, **kwargs: Any
    ) -> jax.Array:
        """Apply the ``n`` blocks in order to ``x`` (one ``lax.scan``), passing ``training``
        to each."""
        if isinstance(x, Variable):
            x = x.value()
        x = autocast(jnp.asarray(x), self)
        if not self.built:
            self._build_stacked(x, args, kwargs)
        else:
            self.check_built(tuple(x.shape))
        if not frames.active() and current_trace() is EVAL:
            out: jax.Array = self._eager(x, args, kwargs, training)
        else:
            out = self._scan(x, args, kwargs, training)
        return out  # the blocks' output: an array shaped like x (the scan's carry)

    def _eager(
        self, x: Any, args: tuple[Any, ...], kwargs: dict[str, Any], training: bool | None
    ) -> Any:
        """Eagerly: the scan inside a ps.function (an eager lax.scan compiles every call)."""
        t = self._template
        if t.compiled is None:
            t.compiled = function(_run_static, static_argnames=("static",))
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        arrays = [leaf for leaf in leaves if isinstance(leaf, (jax.Array, np.ndarray))]
        static = tuple(
            None if isinstance(leaf, (jax.Array, np.ndarray)) else leaf for leaf in leaves
        )
        return t.compiled(self, x, arrays, static=(tree, static, training))

    def _scan(
        self, x: Any, args: tuple[Any, ...], kwargs: dict[str, Any], training: bool | None
    ) -> Any:
        t = self._template
        stacked = [self.stacked[k] for k in self._order]
        xs = [v.value() for v in stacked]
        template = t.tvars
        call_kwargs = dict(kwargs)
        if training is not None and t.takes_training:
            call_kwargs["training"] = training
        # Variables the block uses that are not its own (a shared layer, the global
        # generator): read ones are closed over, assigned ones travel in the carry, so the
        # scan has no side effects whatever encloses the Repeat (ps.grad, ps.pure ...).
        read, written = self._others(x, xs, args, call_kwargs)
        read_values = [v.value() for v in read]
        assigned: list[int] = []

        def body(carry: tuple[Any, list[Any]], slices: list[Any]) -> tuple[Any, list[Any]]:
            h, state = carry
            bound = [*zip(template, slices), *zip(read, read_values), *zip(written, state)]
            y, frame = self._run_block(h, bound, frames.PURE, args, call_kwargs)
            own = [i for i, v in enumerate(template) if id(v) in frame.assigned]
            assigned[:] = own
            new_state = [frame.final(v) for v in written]
            return (y, new_state), [frame.final(template[i]) for i in own]

        step = body
        if self.remat:
            step = jax.checkpoint(body, policy=self.remat_policy, prevent_cse=False)
        (y, state), new = jax.lax.scan(step, (x, [v.value() for v in written]), xs)
        for i, value in zip(assigned, new):
            stacked[i].assign(value, read_value=False)
        for v, value in zip(written, state):
            v.assign(value, read_value=False)
        return y

    def _run_block(
        self,
        h: Any,
        bound: list[tuple[Variable, Any]],
        kind: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, frames.Frame]:
        """Call the template block on ``h`` with ``bound`` variables (a binding frame)."""
        t = self._template
        me = f"Repeat '{self.scope_name}'"
        frame = frames.Frame(me, kind, bound, allow_create=False)
        try:
            with frames.push(frame):
                y = t.block(h, *args, **kwargs)
                y = y.value() if isinstance(y, Variable) else y
        except frames.CreationRefused:
            raise ValueError(
                f"{me}: the block {describe(t.block)} created a variable after its first "
                "call. A repeated block must create its variables once (in __init__ or "
                "on its first call)."
            ) from None
        if jnp.shape(y) != jnp.shape(h) or jnp.result_type(y) != jnp.result_type(h):
            raise ValueError(
                f"{me}: the block {describe(t.block)} returned shape {jnp.shape(y)} dtype "
                f"{jnp.result_type(y)} for an input of shape {jnp.shape(h)} dtype "
                f"{jnp.result_type(h)}; a scan's carry keeps its shape and dtype."
            )
        return y, frame

    def _others(
        self, x: Any, xs: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[list[Variable], list[Variable]]:
        """The variables outside the block that one step reads, and those it assigns,
        found once per input signature by tracing one step abstractly on its own."""
        t = self._template
        avals = jax.tree_util.tree_map(
            lambda a: (
                jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
                if isinstance(a, (jax.Array, np.ndarray))
                else a
            ),
            (x, args, kwargs),
        )
        try:
            key: Any = hash(str(avals))
        except TypeError:
            key = None
        found = t.others.get(key) if key is not None else None
        if found is None:
            capture = frames.Frame(f"Repeat '{self.scope_name}' (discovery)", frames.CAPTURE)
            sl = [jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)) for a in xs]
            outer: list[frames.Frame] = []

            def one(h: Any, sl: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                with frames.push(capture):
                    y, frame = self._run_block(h, list(zip(t.tvars, sl)), frames.OPEN, args, kwargs)
                outer.append(frame)
                return y

            leaves, tree = jax.tree_util.tree_flatten((x, args, kwargs))
            where = [i for i, a in enumerate(leaves) if isinstance(a, (jax.Array, np.ndarray))]

            def flat(slices: list[Any], *arrays: Any) -> Any:
                full = list(leaves)
                for i, a in zip(where, arrays):
                    full[i] = a
                h, a_args, a_kwargs = jax.tree_util.tree_unflatten(tree, full)
                return one(h, slices, a_args, a_kwargs)

            specs = [jax.ShapeDtypeStruct(jnp.shape(leaves[i]), leaves[i].dtype) for i in where]
            with frames.no_frames():
                jax.eval_shape(flat, sl, *specs)
            mine = {id(v) for v in t.tvars}
            written = [v for k, v in outer[0].assigned.items() if k not in mine]
            w_ids = {id(v) for v in written}
            read = [v for k, v in capture.vars.items() if k not in mine and k not in w_ids]
            found = (read, written)
            if key is not None:
                t.others[key] = found
        return found

    # ------------------------------------------------------------- conversions
    def load_blocks(self, blocks: Sequence[Module]) -> None:
        """Assign the stacked variables from ``n`` built blocks of the block's structure
        (an unrolled model's list): all or nothing."""
        values = self._block_values(blocks, "load_blocks")
        stacked = {k: jnp.stack([vals[k] for vals in values]) for k in self._order}
        checked = [(self.stacked[k], stacked[k]) for k in self._order]
        for var, value in checked:
            if tuple(value.shape) != var.shape:
                raise ValueError(
                    f"Repeat '{self.scope_name}'.load_blocks: '{var.name}' has shape "
                    f"{var.shape}, the blocks give {tuple(value.shape)}; nothing assigned."
                )
        for var, value in checked:
            var.assign(value.astype(var.dtype), read_value=False)

    def store_blocks(self, blocks: Sequence[Module]) -> None:
        """Assign ``n`` built blocks' variables from the stacked ones (the reverse of
        ``load_blocks``)."""
        self._block_values(blocks, "store_blocks")
        for i, block in enumerate(blocks):
            paths = attribute_paths(block)
            by_path = {p: v for v in all_variables(block) if (p := paths.get(id(v)))}
            for key in self._order:
                by_path[key].assign(self.stacked[key][i].value(), read_value=False)

    def _block_values(self, blocks: Sequence[Module], what: str) -> list[dict[str, Any]]:
        me = f"Repeat '{self.scope_name}'.{what}"
        if not self.built:
            raise ValueError(f"{me}: the Repeat is not built yet; call it on an input first.")
        if len(blocks) != self.n:
            raise ValueError(f"{me}: expected {self.n} blocks, got {len(blocks)}.")
        out = []
        for i, block in enumerate(blocks):
            paths = attribute_paths(block)
            vals = {p: v.value() for v in all_variables(block) if (p := paths.get(id(v)))}
            missing = sorted(set(self._order) - set(vals))
            extra = sorted(set(vals) - set(self._order))
            if missing or extra:
                raise ValueError(
                    f"{me}: block {i} does not match the repeated block: missing {missing}, "
                    f"unexpected {extra}. Build every block (call it once) first."
                )
            out.append(vals)
        return out

    stack_state = staticmethod(stack_state)
    unstack_state = staticmethod(unstack_state)


def _run_static(repeat: Repeat, x: Any, arrays: list[Any], static: tuple[Any, ...]) -> Any:
    """The eager path's ps.function body: rebuild the arguments and scan."""
    tree, leaves, training = static
    it = iter(arrays)
    args, kwargs = jax.tree_util.tree_unflatten(
        tree, [next(it) if leaf is None else leaf for leaf in leaves]
    )
    return repeat._scan(x, args, kwargs, training)
