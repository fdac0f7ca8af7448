"""``ps.nn.Repeat`` (stacked blocks applied by one ``lax.scan``) and ``ps.remat``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _backends import ROUNDING, assert_same_numbers
from jax.sharding import PartitionSpec as P

import paramstore as ps

D = 8


class Block(ps.Module):
    """Pre-norm residual MLP block (lazy layers)."""

    def __init__(self, name=None):
        self.ln = ps.nn.LayerNormalization()
        self.dense = ps.nn.Dense(D)

    def __call__(self, x):
        return x + self.dense(self.ln(x))


def _reference(stacked, x, n):
    """The same n blocks written by hand over the stacked arrays (pure JAX)."""
    for i in range(n):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        h = (x - m) * jax.lax.rsqrt(v + 1e-3) * stacked["ln/gamma"][i] + stacked["ln/beta"][i]
        x = x + h @ stacked["dense/kernel"][i] + stacked["dense/bias"][i]
    return x


def _x(shape=(2, D), seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


def _values(repeat):
    return {k: v.value() for k, v in repeat.stacked.items()}


def test_variables_are_stacked_named_and_differ_per_layer():
    r = ps.nn.Repeat(Block, 4)
    assert r.variables == ()  # built on the first call, from the input's shape
    r(_x())
    names = {v.name: v.shape for v in r.variables}
    assert names == {
        "repeat/block/dense/kernel": (4, D, D),
        "repeat/block/dense/bias": (4, D),
        "repeat/block/layer_normalization/gamma": (4, D),
        "repeat/block/layer_normalization/beta": (4, D),
    }
    k = r.stacked["dense/kernel"].numpy()
    for i in range(1, 4):
        assert not np.allclose(k[0], k[i])  # each layer's slice drawn from its own key
    assert np.allclose(r.stacked["ln/gamma"].numpy(), 1.0)
    # glorot_uniform's bound for every layer
    assert np.abs(k).max() <= np.sqrt(6 / (2 * D)) + 1e-6


def test_eager_jitted_and_unrolled_agree_and_program_holds_one_block():
    x = _x()
    r = ps.nn.Repeat(Block, 3)
    y = r(x)
    np.testing.assert_allclose(y, _reference(_values(r), x, 3), rtol=1e-5, atol=1e-5)
    f = ps.function(lambda x: r(x))
    np.testing.assert_allclose(f(x), y, rtol=1e-6, atol=1e-6)
    assert f.trace_count == 1

    def dots(n):
        with ps.VariableStore():
            rep = ps.nn.Repeat(Block, n)
            rep(x)
            pure = ps.pure(lambda: rep(x), rep)
            return str(jax.make_jaxpr(lambda s: pure(s)[0])(ps.state(rep))).count("dot_general")

    assert dots(2) == dots(7) > 0  # one block in the program, whatever n


def test_built_lazily_inside_ps_function_and_same_values_as_eager():
    x = _x()
    r = ps.nn.Repeat(lambda: ps.nn.Dense(D), 5)
    f = ps.function(lambda x: r(x))
    y = f(x)
    assert [v.shape for v in r.variables] == [(5, D), (5, D, D)]
    np.testing.assert_allclose(y, r(x), rtol=1e-6, atol=1e-6)
    with ps.VariableStore():  # the same names and seed give the same initial values
        r2 = ps.nn.Repeat(lambda: ps.nn.Dense(D), 5)
        r2(x)  # built eagerly (bit-equal on CPU; XLA:GPU rounds a traced build differently)
        assert_same_numbers(r2.stacked["kernel"].numpy(), r.stacked["kernel"].numpy(), **ROUNDING)


def test_grad_matches_jax_grad_of_the_hand_written_blocks():
    x = _x()
    r = ps.nn.Repeat(Block, 3)
    r(x)
    ref = jax.grad(lambda p: (_reference(p, x, 3) ** 2).mean())(_values(r))
    g = ps.grad(lambda: (r(x) ** 2).mean(), r.stacked)()
    for key in ref:
        np.testing.assert_allclose(g[key], ref[key], rtol=1e-5, atol=1e-6)
    # a Module (the Repeat itself) gives its trainable variables' gradients, in order
    g_mod = ps.grad(lambda: (r(x) ** 2).mean(), r)()
    by_name = {v.name: gi for v, gi in zip(r.trainable_variables, g_mod)}
    np.testing.assert_allclose(
        by_name["repeat/block/dense/kernel"], ref["dense/kernel"], 1e-5, 1e-6
    )


def test_optimizer_slots_are_stacked_and_training_lowers_the_loss():
    x, target = _x(seed=1), _x(seed=2)
    r = ps.nn.Repeat(Block, 3)
    r(x)
    opt = ps.Optimizer(optax.adam(1e-2), r)
    slots = {v.name: v.shape for v in opt.variables}
    assert slots["optimizer/repeat/block/dense/kernel/mu"] == (3, D, D)

    @ps.function
    def step(x, t):
        loss, grads = ps.value_and_grad(lambda: ((r(x) - t) ** 2).mean(), r)()
        opt.apply_gradients(zip(grads, r.trainable_variables))
        return loss

    losses = [float(step(x, target)) for _ in range(20)]
    assert losses[-1] < 0.5 * losses[0]
    assert step.trace_count == 1


def test_batchnorm_moving_statistics_are_kept_per_layer():
    class BNBlock(ps.Module):
        def __init__(self, name=None):
            self.bn = ps.nn.BatchNormalization(momentum=0.5)
            self.dense = ps.nn.Dense(D)

        def __call__(self, x, training=None):
            return x + self.dense(self.bn(x, training=training))

    x = _x((16, D)) * 3.0 + 1.0
    r = ps.nn.Repeat(BNBlock, 3)
    f = ps.function(lambda x, training: r(x, training=training), static_argnames="training")
    f(x, training=False)
    mean = r.stacked["bn/moving_mean"]
    np.testing.assert_array_equal(mean.numpy(), 0.0)  # training=False: nothing updated
    f(x, training=True)
    m = mean.numpy()
    np.testing.assert_allclose(m[0], 0.5 * np.asarray(x).mean(0), rtol=1e-5, atol=1e-5)
    var = r.stacked["bn/moving_variance"].numpy()
    np.testing.assert_allclose(var[0], 0.5 + 0.5 * np.asarray(x).var(0), rtol=1e-4)
    assert not np.allclose(var[1], var[0]) and not np.allclose(var[2], var[1])  # each its own
    before = var.copy()
    r(x, training=True)  # eagerly too
    assert not np.allclose(r.stacked["bn/moving_variance"].numpy(), before)


def test_dropout_generator_gives_each_layer_its_own_stream():
    class DropBlock(ps.Module):
        def __init__(self, name=None):
            self.drop = ps.nn.Dropout(0.5, generator=ps.random.Generator(7))

        def __call__(self, x, training=None):
            # a variable-free residual would have nothing to stack: scale by a weight
            return self.drop(x, training=training) * self.w + 0.0 * x

        @property
        def w(self):
            return self._w

    def make():
        b = DropBlock()
        b._w = ps.Variable(1.0)
        return b

    x = jnp.ones((4, 64))
    r = ps.nn.Repeat(make, 3)
    masks = []

    def probe(x):
        return r(x, training=True)

    f = ps.function(probe)
    y1 = f(x)
    state = r.stacked["drop/generator/state"].numpy()
    assert state.shape == (3, 2) and len({tuple(s) for s in state}) == 3
    y2 = f(x)
    assert not np.array_equal(y1, y2)  # a new mask on every call
    assert not np.array_equal(r.stacked["drop/generator/state"].numpy(), state)
    # each layer drew its own mask: the survivors are 2**k-scaled where k layers kept them
    vals = set(np.unique(np.asarray(y1)).tolist())
    assert vals <= {0.0, 8.0} and 8.0 in vals and 0.0 in vals
    masks.append(y1)
    assert np.array_equal(r(x, training=False), x)  # training=False: identity


def test_global_generator_dropout_eagerly_and_under_grad():
    class Blk(ps.Module):
        def __init__(self, name=None):
            self.dense = ps.nn.Dense(D)
            self.drop = ps.nn.Dropout(0.5)

        def __call__(self, x, training=None):
            return x + self.drop(self.dense(x), training=training)

    x = _x()
    r = ps.nn.Repeat(Blk, 2)
    r(x)
    g = ps.random.get_global_generator()
    s0 = g.state.numpy()
    grads = ps.grad(lambda: r(x, training=True).sum(), r)()
    assert len(grads) == 2 and all(np.isfinite(gi).all() for gi in grads)
    s1 = g.state.numpy()
    assert not np.array_equal(s0, s1)  # the global stream advanced
    a, b = r(x, training=True), r(x, training=True)
    assert not np.array_equal(a, b)


def test_remat_gives_the_same_gradients_and_puts_a_checkpoint_in_the_program():
    x = _x()
    plain = ps.nn.Repeat(Block, 3)
    plain(x)
    for remat in (True, jax.checkpoint_policies.dots_saveable):
        with ps.VariableStore():
            r = ps.nn.Repeat(Block, 3, remat=remat)
            r(x)
            ps.update(r.stacked, {k: v.value() for k, v in plain.stacked.items()})
            g = ps.grad(lambda r=r: (r(x) ** 2).sum(), r.stacked)()
            g0 = ps.grad(lambda: (plain(x) ** 2).sum(), plain.stacked)()
            for k in g0:
                np.testing.assert_allclose(g[k], g0[k], rtol=1e-5, atol=1e-6)
            pure = ps.pure(lambda r=r: r(x).sum(), r)
            jaxpr = jax.make_jaxpr(lambda v, pure=pure: pure(v)[0])(ps.state(r))
            assert "checkpoint" in str(jaxpr) or "remat" in str(jaxpr)


def test_ps_remat_wraps_functions_and_methods_that_use_variables():
    dense = ps.nn.Dense(4)
    x = _x((3, 5))
    dense(x)
    calls = ps.Variable(0, trainable=False)

    def f(x):
        calls.assign_add(1)
        return jnp.tanh(dense(x)).sum()

    g_ref = ps.grad(f, dense)(x)
    g = ps.grad(ps.remat(f), dense)(x)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert int(calls) == 2  # the assign inside the remat body took effect
    jitted = ps.function(
        lambda x: ps.grad(ps.remat(f, policy=jax.checkpoint_policies.nothing_saveable), dense)(x)
    )
    for a, b in zip(jitted(x), g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-6)

    class M(ps.Module):
        def __init__(self, name=None):
            self.w = ps.Variable(jnp.ones((5, 2)))

        @ps.remat
        def __call__(self, x, scale=2.0):
            return jnp.sin(x @ self.w).sum() * scale

    m = M()
    np.testing.assert_allclose(
        ps.grad(lambda: m(x), m)()[0], jax.grad(lambda w: jnp.sin(x @ w).sum() * 2.0)(m.w.value())
    )
    with pytest.raises(TypeError, match="policy"):
        ps.remat(f, policy="dots")


def test_checkpoint_round_trip_and_conversion_from_unrolled_blocks(tmp_path):
    x = _x()

    class Unrolled(ps.Module):
        def __init__(self, name=None):
            self.blocks = [Block() for _ in range(3)]

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    class Stacked(ps.Module):
        def __init__(self, name=None):
            self.blocks = ps.nn.Repeat(Block, 3)

        def __call__(self, x):
            return self.blocks(x)

    old = Unrolled()
    y_old = old(x)
    path = ps.Checkpoint(model=old).save(str(tmp_path / "unrolled"))
    state = {
        n: ps.checkpoint.load_variable(path, n) for n, _, _ in ps.checkpoint.list_variables(path)
    }
    assert "model/blocks/1/dense/kernel" in state
    stacked_state = ps.nn.Repeat.stack_state(state, "model/blocks")
    assert stacked_state["model/blocks/stacked/dense/kernel"].shape == (3, D, D)
    with ps.VariableStore():
        arrays = {k: ps.Variable(v) for k, v in stacked_state.items()}
        new_path = ps.Saver(arrays).save(str(tmp_path / "stacked"))
    with ps.VariableStore():
        new = Stacked()
        status = ps.Checkpoint(model=new).restore(new_path)  # deferred: built on first call
        np.testing.assert_allclose(new(x), y_old, rtol=1e-5, atol=1e-5)
        status.assert_consumed()
        # and back: the stacked checkpoint to n separate blocks
        p2 = ps.Checkpoint(model=new).save(str(tmp_path / "stacked2"))
        s2 = {n: ps.checkpoint.load_variable(p2, n) for n, _, _ in ps.checkpoint.list_variables(p2)}
        back = ps.nn.Repeat.unstack_state(s2, "model/blocks")
        assert set(back) == set(state)
        for k in state:
            np.testing.assert_array_equal(back[k], state[k])
        # live blocks: store_blocks / load_blocks
        other = Unrolled()
        other(x)
        new.blocks.store_blocks(other.blocks)
        np.testing.assert_allclose(other(x), y_old, rtol=1e-5, atol=1e-5)
        fresh = Stacked()
        fresh(x)
        fresh.blocks.load_blocks(old.blocks)
        np.testing.assert_allclose(fresh(x), y_old, rtol=1e-5, atol=1e-5)
    with pytest.raises(KeyError, match="model/nothing"):
        ps.nn.Repeat.stack_state(state, "model/nothing")


def test_nested_repeat_layers_differ():
    x = _x()
    outer = ps.nn.Repeat(lambda: ps.nn.Repeat(lambda: ps.nn.Dense(D), 2), 3)
    y = outer(x)
    k = outer.stacked["stacked/kernel"].numpy()
    assert k.shape == (3, 2, D, D)
    flat = k.reshape(6, D, D)
    assert len({flat[i].tobytes() for i in range(6)}) == 6
    ref = x
    for i in range(3):
        for j in range(2):
            ref = ref @ k[i, j] + outer.stacked["stacked/bias"].numpy()[i, j]
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------- bad input


def _nothing_created(fresh_store, fn, exc, *words):
    before = [v.name for v in fresh_store.variables()]
    with pytest.raises(exc) as info:
        fn()
    for word in words:
        assert word in str(info.value), str(info.value)
    assert [v.name for v in fresh_store.variables()] == before
    return info


@pytest.mark.parametrize("n", [0, -2, 2.5, True, "3"])
def test_n_must_be_a_positive_int(fresh_store, n):
    _nothing_created(fresh_store, lambda: ps.nn.Repeat(Block, n), ValueError, "positive int")


def test_make_block_must_be_a_factory_of_callables(fresh_store):
    block = Block()
    _nothing_created(fresh_store, lambda: ps.nn.Repeat(block, 2), TypeError, "factory")
    _nothing_created(fresh_store, lambda: ps.nn.Repeat(lambda: 3, 2), TypeError, "not callable")
    _nothing_created(
        fresh_store, lambda: ps.nn.Repeat(Block, 2, remat="yes"), TypeError, "checkpoint_policies"
    )


def test_a_block_without_variables_is_refused(fresh_store):
    r = ps.nn.Repeat(lambda: ps.nn.Dropout(0.1), 3)
    info = _nothing_created(fresh_store, lambda: r(_x()), ValueError, "no variables", "Dropout")
    assert "Python loop" in str(info.value)
    assert not r.built


def test_a_block_creating_variables_on_every_call_is_refused(fresh_store):
    class Greedy(ps.Module):
        def __init__(self, name=None):
            self.ws = []

        def __call__(self, x):
            self.ws.append(ps.Variable(jnp.ones(x.shape[-1])))
            return x * self.ws[-1]

    r = ps.nn.Repeat(Greedy, 2)
    _nothing_created(fresh_store, lambda: r(_x()), ValueError, "second call", "Greedy")
    f = ps.function(lambda x: r(x))
    _nothing_created(fresh_store, lambda: f(_x()), ValueError, "second call")


def test_a_block_creating_a_variable_only_in_the_scan_is_refused(fresh_store):
    """The template is learned from two calls; a variable made on a later call (inside the
    scan, whose frame refuses creation: frames.CreationRefused) is named as the block's."""

    class Late(ps.Module):
        def __init__(self, name=None):
            self.w = ps.Variable(jnp.ones(D))
            self.calls = 0
            self.extra = []

        def __call__(self, x):
            self.calls += 1
            if self.calls > 2:
                self.extra.append(ps.Variable(jnp.ones(D)))
            return x * self.w

    r = ps.nn.Repeat(Late, 2)
    with pytest.raises(ValueError, match="created a variable after its first call") as info:
        r(_x())
    assert "Late" in str(info.value) and "Repeat" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_block_changing_the_shape_is_refused(fresh_store):
    r = ps.nn.Repeat(lambda: ps.nn.Dense(3), 2)
    info = _nothing_created(fresh_store, lambda: r(_x()), ValueError, "(2, 8)", "(2, 3)", "Dense")
    assert "carry" in str(info.value)
    f = ps.function(lambda x: r(x))
    _nothing_created(fresh_store, lambda: f(_x()), ValueError, "Dense", "carry")
    r2 = ps.nn.Repeat(Block, 2)
    r2(_x())
    kept = {v.name: v.numpy() for v in r2.variables}
    _nothing_created(fresh_store, lambda: r2(_x((2, 5))), ValueError, "built for inputs")
    for v in r2.variables:
        np.testing.assert_array_equal(v.numpy(), kept[v.name])


def test_layout_map_and_partitions_describe_one_block_the_stacked_axis_is_replicated():
    mesh = jax.make_mesh((len(jax.devices()),), ("model",))
    layout = ps.sharding.LayoutMap(mesh)
    layout[r"dense.*/kernel"] = (None, "model")
    x = _x()
    with ps.device(layout):
        r = ps.nn.Repeat(lambda: ps.nn.Dense(D), 3)
        r(x)
    specs = ps.sharding.specs(r)
    assert specs["repeat/dense/kernel"] == P(None, None, "model")
    assert r.stacked["kernel"].shape == (3, D, D)
    with ps.sharding.axis_rules(mesh, {"mlp": "model"}):
        r2 = ps.nn.Repeat(lambda: ps.nn.Dense(D, kernel_partition=("embed", "mlp")), 2)
        r2(x)
    kernel = r2.stacked["kernel"]
    assert kernel.partition == (None, "embed", "mlp")
    assert ps.sharding.specs(r2)[kernel.name] == P(None, None, "model")
    np.testing.assert_allclose(r2(x), ps.function(lambda x: r2(x))(x), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_extra_arguments_reach_every_block_eagerly_and_compiled():
    class Masked(ps.Module):
        def __init__(self, name=None):
            self.attn = ps.nn.MultiHeadAttention(2, 4)

        def __call__(self, x, mask, causal=False):
            return x + self.attn(x, x, mask=mask, use_causal_mask=causal)

    x = _x((2, 5, D))
    mask = jnp.ones((2, 5, 5), bool).at[:, :, 3:].set(False)
    r = ps.nn.Repeat(Masked, 2)
    eager = r(x, mask, causal=True)
    compiled = ps.function(lambda x, m: r(x, m, causal=True))(x, mask)
    np.testing.assert_allclose(eager, compiled, rtol=1e-5, atol=1e-5)
    assert not np.allclose(r(x, mask, causal=False), eager)  # the flag reached the blocks
    # masked keys (positions 3, 4) do not change the first query's output
    x2 = x.at[:, 3:].set(5.0)
    np.testing.assert_allclose(r(x2, mask, causal=True)[:, 0], eager[:, 0], rtol=1e-5, atol=1e-5)


def _made(build):
    """The stacked variables (name -> value) a fresh Repeat gets from ``build(r)``."""
    ps.random.set_seed(0)
    with ps.VariableStore():
        r = ps.nn.Repeat(Block, 3)
        build(r)
        assert r.built
        return r, {v.name: np.asarray(v.numpy()) for v in r.variables}


def test_build_creates_what_the_first_call_creates():
    _, lazy = _made(lambda r: r(_x((5, D))))
    built_r, built = _made(lambda r: r.build((None, D)))
    assert sorted(built) == sorted(lazy)
    for name in lazy:
        np.testing.assert_array_equal(built[name], lazy[name])
    # then calling it creates nothing more and gives what the lazily built one gives
    with ps.VariableStore():
        ps.random.set_seed(0)
        again = ps.nn.Repeat(Block, 3)
        y_lazy = again(_x((5, D)))
        before = [v.name for v in again.variables]
    y = built_r(_x((5, D)))
    assert [v.name for v in built_r.variables] == before
    np.testing.assert_allclose(y, y_lazy, rtol=1e-6)


def test_sequential_build_builds_the_repeat_inside():
    seq = ps.nn.Sequential([ps.nn.Dense(D), ps.nn.Repeat(Block, 2), ps.nn.Dense(3)])
    seq.build((None, 4))
    rep = seq.layers[1]
    assert rep.built and {v.shape for v in rep.stacked.values()} >= {(2, D, D), (2, D)}
    names = sorted(v.name for v in seq.variables)
    assert seq(jnp.ones((2, 4))).shape == (2, 3)
    assert sorted(v.name for v in seq.variables) == names  # the call created nothing


def test_build_with_a_contradicting_shape_raises_and_changes_nothing(fresh_store):
    r = ps.nn.Repeat(Block, 2)
    r.build((None, D))
    values = _values(r)
    for shape in [(None, D + 1), (None, 3, D)]:
        _nothing_created(fresh_store, lambda s=shape: r.build(s), ValueError, "was built for")
    _nothing_created(fresh_store, lambda: r(_x((2, D + 1))), ValueError, "was built for")
    for k, v in _values(r).items():
        np.testing.assert_array_equal(v, values[k])
    r.build((4, D))  # a compatible shape is fine: nothing rebuilt
    assert [v.name for v in fresh_store.variables()] == [v.name for v in r.variables]


def test_build_needs_the_inner_axes_and_a_shape(fresh_store):
    r = ps.nn.Repeat(Block, 2)
    _nothing_created(fresh_store, lambda: r.build((None, None, D)), ValueError, "every axis")
    _nothing_created(fresh_store, lambda: r.build("x"), TypeError, "input shape")
    assert not r.built
