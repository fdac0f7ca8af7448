"""ps.checkpoint.NameMap: one name map read by init_from_checkpoint and turned around by
export_safetensors (stacked layers, fused tensors split and joined, transposes), its single
name queries, and the errors (each naming what is wrong, nothing written or changed)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import paramstore as ps

RNG = np.random.default_rng(3)
E, H, D, N = 6, 2, 3, 2  # embedding, heads, head size, blocks


class Block(ps.Module):
    def __init__(self):
        self.attn = ps.nn.MultiHeadAttention(H, D, name="attn")
        self.fc = ps.nn.Dense(E, name="fc")

    def __call__(self, x):
        return x + self.fc(self.attn(x, x))


class Net(ps.Module):
    def __init__(self):
        self.embed = ps.nn.Embedding(10, E)
        self.blocks = ps.nn.Repeat(Block, N)
        self.head = ps.nn.Dense(4, name="head")

    def __call__(self, ids):
        return self.head(self.blocks(self.embed(ids)))


IDS = np.array([[1, 2, 3]], np.int32)


def reshape(shape_in, shape_out):
    return ps.checkpoint.Transform(lambda x: x.reshape(shape_out), lambda x: x.reshape(shape_in))


def name_map(model, drop=None):
    s = {k: v.name + r"[\1]" for k, v in model.blocks.stacked.items()}
    w = "attn/weights/"
    qkv = ("query", "key", "value")
    h = r"h\.(\d+)\."
    rules = [
        (r"embed\.weight", model.embed.embeddings.name),
        (r"head\.weight", model.head.kernel.name, ps.checkpoint.transpose()),
        (r"head\.bias", model.head.bias.name),
        (
            h + r"qkv\.weight",
            tuple(s[f"{w}{p}/kernel"] for p in qkv),
            ps.checkpoint.chain(ps.checkpoint.split(1), reshape((E, E), (E, H, D))),
        ),
        (
            h + r"qkv\.bias",
            tuple(s[f"{w}{p}/bias"] for p in qkv),
            ps.checkpoint.chain(ps.checkpoint.split(0), reshape((E,), (H, D))),
        ),
        (h + r"o\.weight", s[f"{w}attention_output/kernel"], reshape((E, E), (H, D, E))),
        (h + r"o\.bias", s[f"{w}attention_output/bias"]),
        (h + r"fc\.weight", s["fc/kernel"], ps.checkpoint.transpose()),
        (h + r"fc\.bias", s["fc/bias"]),
    ]
    return ps.checkpoint.NameMap([r for r in rules if r[0] != drop])


def hf_tensors():
    t = {
        "embed.weight": RNG.standard_normal((10, E)),
        "head.weight": RNG.standard_normal((4, E)),  # torch Linear: (out, in)
        "head.bias": RNG.standard_normal(4),
    }
    for i in range(N):
        t[f"h.{i}.qkv.weight"] = RNG.standard_normal((E, 3 * E))
        t[f"h.{i}.qkv.bias"] = RNG.standard_normal(3 * E)
        t[f"h.{i}.o.weight"] = RNG.standard_normal((E, E))
        t[f"h.{i}.o.bias"] = RNG.standard_normal(E)
        t[f"h.{i}.fc.weight"] = RNG.standard_normal((E, E))
        t[f"h.{i}.fc.bias"] = RNG.standard_normal(E)
    return {k: v.astype(np.float32) for k, v in t.items()}


def built_model():
    with ps.abstract():
        model = Net()
        model.embed.build((1, 3))
        model.blocks.build((1, 3, E))
        model.head.build((1, 3, E))
    return model


def test_one_map_reads_and_exports_back_bit_exactly(tmp_path):
    tensors = hf_tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = built_model()
    nm = name_map(model)
    assigned = ps.checkpoint.init_from_checkpoint(str(tmp_path), nm, allow_unverified=True)
    assert not any(v.is_abstract for v in model.variables)
    q = model.blocks.stacked["attn/weights/query/kernel"]
    assert assigned[f"{q.name}[1]"] == "h.1.qkv.weight"
    np.testing.assert_array_equal(q.numpy()[1], tensors["h.1.qkv.weight"][:, :E].reshape(E, H, D))
    v = model.blocks.stacked["attn/weights/value/bias"]
    np.testing.assert_array_equal(v.numpy()[0], tensors["h.0.qkv.bias"][2 * E :].reshape(H, D))
    np.testing.assert_array_equal(model.head.kernel.numpy(), tensors["head.weight"].T)

    out = tmp_path / "export"
    os.makedirs(out)
    ps.checkpoint.export_safetensors(str(out), model, names=nm)
    back = load_file(str(out / "model.safetensors"))
    assert sorted(back) == sorted(tensors)
    for k in tensors:
        np.testing.assert_array_equal(back[k], tensors[k], err_msg=k)
    # sharded export: the same tensors
    ps.checkpoint.export_safetensors(str(tmp_path / "shards"), model, names=nm, max_shard_size=200)
    again = ps.checkpoint.init_from_checkpoint(str(tmp_path / "shards"), nm, allow_unverified=True)
    assert again == assigned


def test_single_name_queries():
    model = built_model()
    nm = name_map(model)
    k = model.blocks.stacked["attn/weights/key/kernel"].name
    q = model.blocks.stacked["attn/weights/query/kernel"].name
    assert nm.checkpoint_name(f"{k}[1]") == "h.1.qkv.weight"
    assert nm.checkpoint_name(model.head.bias.name) == "head.bias"
    assert nm.checkpoint_name(k) is None  # the stacked variable itself: its layers have names
    assert nm.checkpoint_name("nothing/here") is None
    assert nm.variable_name("h.7.qkv.weight")[:2] == (f"{q}[7]", f"{k}[7]")
    assert nm.variable_name("head.weight") == model.head.kernel.name
    assert nm.variable_name("h.x.qkv.weight") is None


def test_ready_made_transforms_invert():
    x = RNG.standard_normal((2, 3, 4))
    t = ps.checkpoint.transpose((1, 2, 0))
    np.testing.assert_array_equal(t.inverse(t.forward(x)), x)
    assert ps.checkpoint.transpose().forward(x).shape == (4, 3, 2)
    c = ps.checkpoint.NameMap([("a", ("x", "y"), ps.checkpoint.split(2))])._rules[0].transform
    parts = c.forward(x)
    assert [p.shape for p in parts] == [(2, 3, 2), (2, 3, 2)]
    np.testing.assert_array_equal(c.inverse(parts), x)
    with pytest.raises(ValueError, match="does not split into 2 equal parts"):
        c.forward(np.zeros((2, 3, 5)))
    with pytest.raises(TypeError, match="axis must be an int"):
        ps.checkpoint.split("1")
    with pytest.raises(TypeError, match="takes ps.checkpoint.Transform objects"):
        ps.checkpoint.chain(np.transpose)
    with pytest.raises(TypeError, match="takes two functions"):
        ps.checkpoint.Transform(np.transpose, None)


def test_export_errors_name_the_variable_and_write_nothing(tmp_path):
    model = Net()
    model(IDS)
    nm = name_map(model)
    partial = name_map(model, drop=r"head\.bias")
    target = tmp_path / "out.safetensors"
    with pytest.raises(ValueError, match=r"no rule's target is variable 'net/head/bias'"):
        ps.checkpoint.export_safetensors(str(target), model, names=partial)
    assert not target.exists() and os.listdir(tmp_path) == []
    # a tuple target with a part missing among the variables exported
    q = model.blocks.stacked["attn/weights/query/kernel"]
    with pytest.raises(ValueError, match=r"joins 3 variables .* part 1"):
        ps.checkpoint.export_safetensors(str(target), {q.name: q}, names=nm)
    assert os.listdir(tmp_path) == []


def test_a_rule_that_cannot_be_turned_around_reads_but_does_not_export(tmp_path):
    save_file({"w.weight": np.ones((2, 3), np.float32)}, str(tmp_path / "m.safetensors"))
    v = ps.Variable(np.zeros((2, 3), np.float32), name="lin/kernel")
    nm = ps.checkpoint.NameMap([(r"(?:w|v)\.weight", "lin/kernel")])
    ps.checkpoint.init_from_checkpoint(str(tmp_path / "m.safetensors"), nm, allow_unverified=True)
    np.testing.assert_array_equal(v.numpy(), 1.0)
    with pytest.raises(ValueError, match=r"'lin/kernel' is reached by rule .* cannot be turned"):
        ps.checkpoint.export_safetensors(str(tmp_path / "o.safetensors"), [v], names=nm)
    with pytest.raises(ValueError, match="cannot be turned around"):
        nm.checkpoint_name("lin/kernel")
    assert not (tmp_path / "o.safetensors").exists()


def test_ambiguous_and_group_checked_ways_back():
    nm = ps.checkpoint.NameMap([(r"([a-z_]+)\.([a-z_]+)", r"\1_\2")])
    with pytest.raises(ValueError, match=r"'a_b_c' fills the target .* more than one way"):
        nm.checkpoint_name("a_b_c")
    assert nm.checkpoint_name("a_b") == "a.b"
    # each group's text must match the group's own pattern in full
    digits = ps.checkpoint.NameMap([(r"h\.(\d+)\.w", r"m/w[\1]")])
    assert digits.checkpoint_name("m/w[12]") == "h.12.w"
    assert digits.checkpoint_name("m/w[x]") is None
    # anchors change nothing in a full match; an escaped "$" is literal text
    anchored = ps.checkpoint.NameMap([(r"^h\.(\d+)\.w$", r"m/w[\1]"), (r"a\$", "b")])
    assert anchored.checkpoint_name("m/w[3]") == "h.3.w"
    assert anchored.checkpoint_name("b") == "a$"


def test_bad_rules_raise_when_made():
    with pytest.raises(TypeError, match=r"each rule is \(pattern, target\)"):
        ps.checkpoint.NameMap([("a",)])
    with pytest.raises(TypeError, match="must be a ps.checkpoint.Transform"):
        ps.checkpoint.NameMap([("a", "b", np.transpose)])
    with pytest.raises(ValueError, match="pattern '\\(': "):
        ps.checkpoint.NameMap([("(", "b")])
    with pytest.raises(TypeError, match="takes a list of rules"):
        ps.checkpoint.NameMap("a")


def test_reading_with_a_name_map_is_all_or_nothing(tmp_path):
    tensors = hf_tensors()
    tensors["h.1.qkv.weight"] = np.zeros((E, 3 * E + 1), np.float32)  # no equal split
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = Net()
    model(IDS)
    before = {v.name: v.numpy().copy() for v in model.variables}
    with pytest.raises(ValueError, match="does not split into 3 equal parts"):
        ps.checkpoint.init_from_checkpoint(str(tmp_path), name_map(model), allow_unverified=True)
    for v in model.variables:
        np.testing.assert_array_equal(v.numpy(), before[v.name])
    assert jnp.asarray(model(IDS)).shape == (1, 3, 4)
