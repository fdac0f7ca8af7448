"""A collection of variables: one traversal, one parser, one rule for duplicates, filters,
partial updates, and optimizer slots checkpointed by path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import paramstore as ps
from paramstore._traverse import walk
from paramstore.nn.repeat.layout import all_variables, attribute_paths, generators

X = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)


class Block(ps.Module):
    """Two layers, a non-trainable counter: a Module with trainable and other variables."""

    def __init__(self, n: int = 3, scale: float = 1.0, name: str | None = None):
        self.w = ps.Variable(scale * jnp.linspace(-1.0, 1.0, n * n).reshape(n, n), name="w")
        self.b = ps.Variable(scale * jnp.ones(n), name="b")
        self.steps = ps.Variable(0, trainable=False, name="steps")

    def __call__(self, x):
        return jnp.tanh(x @ self.w + self.b)


class Stack(ps.Module):
    def __init__(self, n_layers: int):
        self.layers = [Block(scale=1.0 + i, name=f"layer{i}") for i in range(n_layers)]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def values(variables):
    return [np.asarray(v.numpy()).copy() for v in variables]


def assert_same(before, variables):
    for a, v in zip(before, variables, strict=True):
        np.testing.assert_array_equal(a, v.numpy())


# ------------------------------------------------------------------ one traversal


def test_one_traversal_gives_module_order_and_checkpoint_paths():
    model = Stack(2)
    model.extra = {"z": ps.Variable(1.0, name="z"), "a": [model.layers[0]]}  # shared layer
    found = list(walk(model, ""))
    assert found[0] == ("", model)
    paths = {p: x for p, x in found if isinstance(x, ps.Variable)}
    # a module's own leaves first (sorted attributes, dict keys sorted), then submodules
    assert [x for _, x in found if isinstance(x, ps.Variable)] == list(model.variables)
    # the shared layer is met first under extra/a/0 (extra < layers), then not again
    assert paths["extra/a/0/w"] is model.layers[0].w
    assert not any(p.startswith("layers/0/") for p in paths)
    assert paths["layers/1/b"] is model.layers[1].b
    assert [p for p, _ in walk(model)] == [None] * len(found)  # no paths asked: none built
    ckpt = ps.Checkpoint(model=model)
    assert list(ckpt.variables_by_path()) == [f"model/{p}" for p in paths]


class WithGenerator(ps.Module):
    def __init__(self, name=None):
        self.z = ps.Variable(1.0, name="z")
        self.gen = ps.random.Generator(0, name="g")
        self.a = {"k": ps.Variable(2.0, name="a")}


def test_the_walk_yields_holders_and_takes_another_order():
    m = WithGenerator()
    kinds = [(p, type(x).__name__) for p, x in walk(m, "", holders=True)]
    assert kinds == [
        ("", "WithGenerator"),
        ("a/k", "Variable"),
        ("gen", "Generator"),
        ("z", "Variable"),
        ("gen/state", "Variable"),  # a holder's own finds after its node's
    ]
    assert [p for p, _ in walk(m, "")] == ["", "a/k", "z"]  # no holders: tf.Module's walk
    backwards = walk(m, "", children=lambda node: list(node._ps_children())[::-1])
    assert [p for p, _ in backwards] == ["", "z", "a/k"]


def test_repeat_block_paths_are_the_checkpoint_paths():
    """nn.repeat's block paths, generators and variables come from the one traversal."""
    m = WithGenerator()
    paths = attribute_paths(m)
    by_path = ps.Checkpoint(block=m).variables_by_path()
    assert {f"block/{paths[id(v)]}": v for v in all_variables(m)} == by_path
    assert generators(m) == [m.gen]
    assert set(paths.values()) == {"a/k", "gen/state", "z"}


def test_the_same_forms_everywhere_a_list_of_modules_included(tmp_path):
    a, b = Block(name="a"), Block(name="b")
    extra = ps.Variable(jnp.zeros(3), name="extra")
    store = ps.VariableStore()
    with store:
        kept = ps.Variable(2.0, name="kept")
    gen = ps.random.Generator(0, name="rng")
    forms = {  # form: the variables it gives, in order
        "list of modules": ([a, b], [*a.variables, *b.variables]),
        "nested": ([[a, extra], (b,)], [*a.variables, extra, *b.variables]),
        "dict": ({"x": extra, "w": a.w}, [extra, a.w]),
        "module": (a, list(a.variables)),
        "store and generator": ([store, gen], [kept, gen.state]),
    }
    for label, (form, expected) in forms.items():
        state = ps.state(form)
        assert len(state) == len(expected), label
        for x, v in zip(state.values(), expected):
            np.testing.assert_array_equal(x, v.numpy())
        path = ps.Saver(form).save(str(tmp_path / label.replace(" ", "_")))
        assert len(ps.checkpoint.list_variables(path)) == len(expected), label
        ps.sharding.reshard(form, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        assert all(v.device == jax.devices()[0] for v in expected)
    # ps.grad and ps.Optimizer take the same forms, the Modules' trainable variables
    for form in ([a, b], [[a, extra], (b,)], {"x": extra, "w": a.w}, a):
        grads = ps.grad(lambda: jnp.sum(b(a(X) + extra)), form)()
        opt = ps.Optimizer(optax.sgd(0.1), form)
        before = values(opt.var_list)
        opt.apply_gradients(grads)
        assert any(not np.array_equal(x, v.numpy()) for x, v in zip(before, opt.var_list))


def test_value_and_grad_of_a_list_of_modules_is_each_module_alone():
    blocks = [Block(name="block"), Block(scale=0.5, name="block2")]

    def loss():
        return jnp.sum(blocks[1](blocks[0](X)) ** 2)

    value, grads = ps.value_and_grad(loss, blocks)()
    assert isinstance(grads, list) and len(grads) == 2
    for block, g in zip(blocks, grads):
        v_alone, g_alone = ps.value_and_grad(loss, block)()
        assert isinstance(g, tuple) and len(g) == len(block.trainable_variables) == 2
        np.testing.assert_allclose(value, v_alone)
        for x, y in zip(g, g_alone, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-6)
    # the optimizer takes that structure; optax sees a dict keyed by name (masks by name)
    opt = ps.Optimizer(
        optax.adamw(0.1, mask=ps.Optimizer.by_name(lambda n: not n.endswith("/b"))), blocks
    )
    opt.apply_gradients(grads)
    opt.apply_gradients([x for g in grads for x in g])  # or flat, in the parser's order
    assert int(opt.iterations.numpy()) == 2
    with pytest.raises(ValueError, match=r"at \[1\]: expected a tuple of 2, got a tuple, 1"):
        opt.apply_gradients([grads[0], grads[1][:1]])


def test_value_and_grad_of_a_list_of_modules_inside_function():
    blocks = [Block(name="block"), Block(scale=0.5, name="block2")]
    opt = ps.Optimizer(optax.sgd(0.1), blocks)

    @ps.function
    def step(x):
        loss, grads = ps.value_and_grad(lambda: jnp.mean(blocks[1](blocks[0](x))), blocks)()
        opt.apply_gradients(grads)
        return loss

    w0 = blocks[0].w.numpy()
    _, g = ps.value_and_grad(lambda: jnp.mean(blocks[1](blocks[0](X))), blocks)()
    step(X)  # the Block's trainable variables in attribute order: (b, w)
    np.testing.assert_allclose(blocks[0].w.numpy(), w0 - 0.1 * np.asarray(g[0][1]), rtol=1e-5)


# ------------------------------------------------------------------ duplicates


@pytest.mark.parametrize("form", ["[v, v]", "[dense, dense]", "[model, model.dense]"])
def test_an_optimizer_refuses_a_variable_reached_twice(form, fresh_store):
    dense = Block(name="dense")
    model = ps.Module(name="model")
    model.dense = dense
    collection = {
        "[v, v]": [dense.w, dense.w],
        "[dense, dense]": [dense, dense],
        "[model, model.dense]": [model, dense],
    }[form]
    created = len(fresh_store.variables())
    with pytest.raises(
        ValueError, match=r"variable 'dense/[bw]' is given twice.*each variable once"
    ):
        ps.Optimizer(optax.adam(0.1), collection)
    assert len(fresh_store.variables()) == created  # no slot, no counter


def test_grad_gives_a_variable_listed_twice_its_full_gradient_in_each_place():
    dense = Block(name="dense")
    g_twice = ps.grad(lambda: jnp.sum(dense(X)), [dense, dense])()
    g_once = ps.grad(lambda: jnp.sum(dense(X)), dense)()
    assert len(g_twice) == 2
    for g in g_twice:
        for x, y in zip(g, g_once, strict=True):
            np.testing.assert_allclose(x, y)


# ------------------------------------------------------------------ filters


def test_state_filters_by_callable_regex_and_ready_made():
    model = Stack(2)
    names = [v.name for v in model.variables]
    assert list(ps.state(model, where=ps.trainable)) == [
        v.name for v in model.variables if v.trainable
    ]
    assert list(ps.state(model, where=ps.non_trainable)) == [
        "stack/layer0/steps",
        "stack/layer1/steps",
    ]
    assert list(ps.state(model, where="layer1/")) == [n for n in names if "layer1/" in n]
    assert list(ps.state(model, where=r"/w$")) == ["stack/layer0/w", "stack/layer1/w"]
    assert list(ps.state(model, where=lambda v: v.shape == (3,))) == [
        "stack/layer0/b",
        "stack/layer1/b",
    ]
    # a dict's keys name the state; the expression is searched in the variables' names
    named = {"k": model.layers[0].w, "c": model.layers[0].steps}
    assert list(ps.state(named, where="steps$")) == ["c"]
    assert list(ps.state(named, where=ps.trainable)) == ["k"]


@pytest.mark.parametrize(
    "where, error, message",
    [
        (
            "nothing/matches",
            ValueError,
            r"where='nothing/matches' keeps none of the [46] variables",
        ),
        (lambda v: False, ValueError, r"keeps none of the [46] variables"),
        ("w[", ValueError, r"where='w\[' is not a valid regular expression"),
        (3, TypeError, r"where must be a callable \(variable\) -> bool.*got int 3"),
    ],
)
def test_bad_filters_raise_everywhere_and_change_nothing(where, error, message):
    model = Stack(2)
    before = values(model.variables)
    for call in (
        lambda: ps.state(model, where=where),
        lambda: ps.pure(lambda: model(X), model, where=where),
        lambda: ps.grad(lambda: jnp.sum(model(X)), model, where=where),
        lambda: ps.value_and_grad(lambda: jnp.sum(model(X)), [model], where=where),
    ):
        with pytest.raises(error, match=message):
            call()
    assert_same(before, model.variables)


def test_pure_with_a_filter_binds_only_the_kept_variables():
    model = Stack(2)
    kept = ps.state(model, where="layer1")
    f = ps.pure(lambda x: model(x), model, where="layer1")
    doubled = {k: v * 2 for k, v in kept.items()}
    out, new = f(doubled, X)
    assert list(new) == list(kept)
    # layer0 is read as it is, layer1 from the values given
    expected = jnp.tanh(
        model.layers[0](X) @ (2 * model.layers[1].w.value()) + 2 * model.layers[1].b.value()
    )
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    with pytest.raises(KeyError, match=r"missing \[.*layer1/w.*\]"):
        f({k: v for k, v in kept.items() if not k.endswith("/w")}, X)


def test_grad_with_a_filter_drops_the_others_from_the_structure():
    model = Stack(2)
    loss = lambda: jnp.sum(model(X) ** 2)  # noqa: E731
    full = ps.grad(loss, model)()
    only_w = ps.grad(loss, model, where=r"/w$")()
    assert len(full) == 4 and len(only_w) == 2
    np.testing.assert_allclose(only_w[0], full[1], rtol=1e-6)  # (b, w) per layer
    np.testing.assert_allclose(only_w[1], full[3], rtol=1e-6)
    per_layer = ps.grad(loss, model.layers, where="layer1")()
    assert per_layer[0] == () and len(per_layer[1]) == 2
    v, d = ps.value_and_grad(loss, {"a": model.layers[0].w, "b": model.layers[0].b}, where="/w")()
    assert list(d) == ["a"]


# ------------------------------------------------------------------ partial updates


def test_update_partial_assigns_only_the_names_present():
    model = Stack(2)
    before = values(model.variables)
    ps.update(model, {"stack/layer1/b": jnp.full(3, 7.0)}, partial=True)
    np.testing.assert_array_equal(model.layers[1].b.numpy(), np.full(3, 7.0))
    others = [(x, v) for x, v in zip(before, model.variables) if v is not model.layers[1].b]
    assert len(others) == 5
    assert_same([x for x, _ in others], [v for _, v in others])


@pytest.mark.parametrize("partial", [True, False])
def test_update_errors_name_the_keys_and_assign_nothing(partial):
    model = Stack(1)
    before = values(model.variables)
    bad = {"stack/layer0/b": jnp.full(3, 7.0), "stack/layer0/typo": jnp.ones(3)}
    message = r"'stack/layer0/typo'.*Nothing was assigned" if partial else r"unexpected \['st"
    with pytest.raises(KeyError, match=message):
        ps.update(model, bad, partial=partial)
    assert_same(before, model.variables)
    if not partial:
        with pytest.raises(KeyError, match=r"missing \['stack/layer0/steps', 'stack/layer0/w'\]"):
            ps.update(model, {"stack/layer0/b": jnp.zeros(3)})
        assert_same(before, model.variables)
    with pytest.raises(ValueError, match="shape"):  # shapes checked before any assign
        ps.update(model, {**ps.state(model), "stack/layer0/w": jnp.ones(2)}, partial=partial)
    assert_same(before, model.variables)
    with pytest.raises(TypeError, match="partial must be True or False"):
        ps.update(model, dict(ps.state(model)), partial="yes")
    assert_same(before, model.variables)


# ------------------------------------------------------------------ slot keys by path


def _trained(n_layers: int, steps: int = 2):
    model = Stack(n_layers)
    opt = ps.Optimizer(optax.adam(0.05), model)
    for _ in range(steps):
        opt.apply_gradients(ps.grad(lambda: jnp.sum(model(X) ** 2), model)())
    return model, opt


def test_slots_are_keyed_by_the_parameter_path_and_a_new_layer_shifts_nothing(tmp_path):
    model, opt = _trained(2)
    keys = list(ps.Checkpoint(model=model, optimizer=opt).variables_by_path())
    assert "optimizer/model/layers/0/w/mu" in keys and "optimizer/model/layers/1/b/nu" in keys
    assert "optimizer/count" in keys and "optimizer/iterations" in keys
    assert not any("/state/" in k for k in keys)

    bigger, opt3 = _trained(3)
    keys3 = list(ps.Checkpoint(model=bigger, optimizer=opt3).variables_by_path())
    assert set(keys) <= set(keys3)  # the existing keys stay; the new layer adds its own
    assert "optimizer/model/layers/2/w/mu" in keys3

    # not in the checkpoint, a parameter lends its name
    alone = ps.Checkpoint(optimizer=opt).variables_by_path()
    assert "optimizer/stack/layer0/w/mu" in alone


def test_slots_round_trip_and_training_resumes_exactly(tmp_path):
    model, opt = _trained(2)
    path = ps.Checkpoint(model=model, optimizer=opt).save(tmp_path / "c.safetensors")
    saved = values([*model.variables, *opt.variables])

    model2, opt2 = _trained(2, steps=0)  # new store names: stack_1/...
    assert model2.variables[0].name != model.variables[0].name
    ps.Checkpoint(model=model2, optimizer=opt2).restore(path).assert_consumed()
    assert_same(saved, [*model2.variables, *opt2.variables])

    for m, o in ((model, opt), (model2, opt2)):
        o.apply_gradients(ps.grad(lambda m=m: jnp.sum(m(X) ** 2), m)())
    assert_same(values([*model.variables, *opt.variables]), [*model2.variables, *opt2.variables])


@pytest.mark.slow
def test_the_traversal_benchmark_prints_its_table():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "traversal.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--blocks", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[reference]" in done.stdout and "variables_by_path" in done.stdout


@jax.tree_util.register_pytree_node_class
class Pair:
    """A pytree of fixed structure holding two variables."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def tree_flatten(self):
        return (self.first, self.second), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def test_grad_over_another_pytree_keeps_its_structure_and_a_filter_leaves_none():
    a = ps.Variable(jnp.ones(2), name="a")
    b = ps.Variable(jnp.full(2, 3.0), name="b")
    loss = lambda: jnp.sum(a * b)  # noqa: E731
    g = ps.grad(loss, Pair(a, b))()
    assert isinstance(g, Pair)
    np.testing.assert_allclose(g.first, [3.0, 3.0])
    np.testing.assert_allclose(g.second, [1.0, 1.0])
    only_b = ps.grad(loss, Pair(a, b), where="^b$")()
    assert only_b.first is None
    np.testing.assert_allclose(only_b.second, [1.0, 1.0])


def test_an_optimizer_subclass_attribute_is_traversed_and_checkpointed(tmp_path):
    model, _ = _trained(1, steps=0)

    class Tracked(ps.Optimizer):
        pass

    opt = Tracked(optax.sgd(0.1), model)
    opt.note = ps.Variable(5.0, trainable=False, name="note")
    assert opt.variables[0] is opt.iterations and opt.variables[-1] is opt.note
    assert "optimizer/note" in ps.Checkpoint(model=model, optimizer=opt).variables_by_path()


def test_two_variables_on_one_checkpoint_path_are_refused(tmp_path):
    v1, v2 = ps.Variable(1.0, name="v1"), ps.Variable(2.0, name="v2")
    ckpt = ps.Checkpoint(model={1: v1, "1": v2})
    with pytest.raises(
        ps.checkpoint.CheckpointError, match=r"'v1' and 'v2'\) have the same path 'model/1'"
    ):
        ckpt.save(tmp_path / "c.safetensors")
    assert not any(tmp_path.iterdir())  # nothing written
