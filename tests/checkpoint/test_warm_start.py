"""ps.checkpoint.init_from_checkpoint: map forms, regex pairs, transforms, casts, stacked
layers, abstract and sharded variables, all or nothing (the TF1 oracle is in
tests/checkpoint/test_warm_start_tf.py). The checks that need several devices run in an
8-device subprocess: this file is also that subprocess's script."""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":  # the multi-device subprocess: before jax is imported
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib
import re
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _multidevice import multi_device_tests, run_checks
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import paramstore as ps
from paramstore.checkpoint import CheckpointError, init_from_checkpoint
from paramstore.checkpoint.formats.huggingface import read as hf_read

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 6)).astype(np.float32)  # a fused (in, 3 * out) matrix
B = RNG.standard_normal(6).astype(np.float32)
LAYERS = RNG.standard_normal((3, 2, 5)).astype(np.float32)


def hf_file(directory: str) -> str:
    path = os.path.join(directory, "model.safetensors")
    tensors = {
        "enc.attn.c_attn.weight": W,
        "enc.attn.c_attn.bias": B,
        "enc.ln.weight": np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16),
        "enc.step": np.array([7], np.int32),
        **{f"enc.h.{i}.w": LAYERS[i] for i in range(3)},
    }
    save_file(tensors, path, metadata={"format": "pt"})
    return path


@pytest.fixture
def hf(tmp_path):
    return hf_file(str(tmp_path))


def zeros(name: str, shape: tuple[int, ...], dtype=jnp.float32) -> ps.Variable:
    return ps.Variable(jnp.zeros(shape, dtype), name=name)


def test_regex_pairs_tuple_replacements_and_transforms_split_a_fused_matrix(hf, fresh_store):
    q, k, v = (zeros(f"net/{n}/kernel", (4, 2)) for n in "qkv")
    qb, kb, vb = (zeros(f"net/{n}/bias", (2,)) for n in "qkv")
    split = {f"{n}/": (lambda x, i=i: x[..., 2 * i : 2 * i + 2]) for i, n in enumerate("qkv")}
    done = init_from_checkpoint(
        hf,
        [
            (r"enc\.attn\.c_attn\.weight", ("net/q/kernel", "net/k/kernel", "net/v/kernel")),
            (r"enc\.attn\.c_attn\.(bias)", ("net/q/\\1", "net/k/\\1", "net/v/\\1")),
        ],
        transforms=split,
        allow_unverified=True,
    )
    assert done == {
        **{f"net/{n}/kernel": "enc.attn.c_attn.weight" for n in "qkv"},
        **{f"net/{n}/bias": "enc.attn.c_attn.bias" for n in "qkv"},
    }
    for i, (kern, bias) in enumerate([(q, qb), (k, kb), (v, vb)]):
        np.testing.assert_array_equal(kern.numpy(), W[:, 2 * i : 2 * i + 2])
        np.testing.assert_array_equal(bias.numpy(), B[2 * i : 2 * i + 2])


def test_first_pair_wins_and_unmatched_names_are_skipped(hf, fresh_store):
    a, b = zeros("a", (4, 6)), zeros("b", (4, 6))
    done = init_from_checkpoint(
        hf, [(r".*c_attn\.weight", "a"), (r"enc\.attn\.c_attn\.w.*", "b")], allow_unverified=True
    )
    assert done == {"a": "enc.attn.c_attn.weight"}  # the bias, ln, h.* match no pair in full
    np.testing.assert_array_equal(a.numpy(), W)
    assert not b.numpy().any()


def test_stacked_layers_by_index_and_the_whole_stack(hf, fresh_store):
    stacked = zeros("blocks/w", (3, 2, 5))
    done = init_from_checkpoint(hf, [(r"enc\.h\.(\d+)\.w", r"blocks/w[\1]")], allow_unverified=True)
    assert done == {f"blocks/w[{i}]": f"enc.h.{i}.w" for i in range(3)}
    np.testing.assert_array_equal(stacked.numpy(), LAYERS)
    # a transform sees each layer's own value (its pattern searches 'blocks/w[1]')
    init_from_checkpoint(
        hf,
        [(r"enc\.h\.(\d+)\.w", r"blocks/w[\1]")],
        transforms={r"\[1\]$": lambda x: x * 0},
        allow_unverified=True,
    )
    np.testing.assert_array_equal(stacked.numpy()[1], 0)
    np.testing.assert_array_equal(stacked.numpy()[2], LAYERS[2])


def test_cast_between_floats_only_with_cast_true(hf, fresh_store):
    g = zeros("ln/gamma", (4,))
    with pytest.raises(
        ValueError, match=r"'enc.ln.weight'.*\(4,\).*bfloat16.*'ln/gamma'.*float32.*cast=True"
    ):
        init_from_checkpoint(hf, {"enc.ln.weight": "ln/gamma"}, allow_unverified=True)
    assert not g.numpy().any()
    init_from_checkpoint(hf, {"enc.ln.weight": "ln/gamma"}, cast=True, allow_unverified=True)
    np.testing.assert_array_equal(g.numpy(), [0, 1, 2, 3])
    h = zeros("ln/h", (4,), jnp.bfloat16)
    init_from_checkpoint(hf, {"enc.ln.weight": h}, allow_unverified=True)  # same dtype: no cast
    assert h.dtype == jnp.bfloat16


def test_integer_float_cast_is_refused_even_with_cast(hf, fresh_store):
    s = zeros("step", (1,))
    before = s.numpy().copy()
    with pytest.raises(ValueError, match=r"'enc.step'.*int32.*'step'.*float32.*floating-point"):
        init_from_checkpoint(hf, {"enc.step": s}, cast=True, allow_unverified=True)
    np.testing.assert_array_equal(s.numpy(), before)


def _unchanged(variables: list[ps.Variable]) -> Callable[[], None]:
    before = [v.numpy().copy() for v in variables]

    def check() -> None:
        for v, b in zip(variables, before):
            np.testing.assert_array_equal(v.numpy(), b)

    return check


@pytest.mark.parametrize(
    ("amap", "kw", "error", "match"),
    [
        ({"nope.weight": "a"}, {}, ValueError, r"key 'nope.weight' matches no checkpoint name"),
        ({"nope/": "net/"}, {}, ValueError, r"key 'nope/' matches no checkpoint name"),
        ([(r"nope\..*", "a")], {}, ValueError, re.escape(r"pattern 'nope\..*' matches no")),
        ([(r"enc\.attn\.c_attn\.weight", "missing")], {}, ValueError, r"no such variable"),
        (
            [(r"enc\.attn\.c_attn\.weight", "a"), (r"enc\.h\.0\.w", "a")],
            {},
            ValueError,
            r"'enc.attn.c_attn.weight' and 'enc.h.0.w' both map to variable 'a'",
        ),
        (
            {"enc.attn.c_attn.weight": "a"},
            {"transforms": {"a": lambda x: x.T}},
            ValueError,
            r"'enc.attn.c_attn.weight' with shape \(6, 4\) and dtype float32 after its "
            r"transforms, but variable 'a' has shape \(4, 6\)",
        ),
        (
            {"enc.attn.c_attn.weight": "a"},
            {"transforms": {"a": lambda x: x.astype(np.int32)}},
            ValueError,
            r"dtype int32 after its transforms.*'a'.*float32.*only between floating",
        ),
        (
            {"enc.attn.c_attn.weight": "a"},
            {"transforms": {"a": lambda x: 1 / 0}},
            ValueError,
            r"transform '.*<lambda>' for variable 'a' raised ZeroDivisionError",
        ),
        (
            {"enc.attn.c_attn.weight": "a"},
            {"transforms": {"zzz": np.transpose}},
            ValueError,
            r"transforms pattern 'zzz' matches none of the variables",
        ),
        ([(r"enc\.h\.[01]\.w", r"blocks/w[0]")], {}, ValueError, r"both map to variable"),
        ([(r"enc\.h\.([01])\.w", r"blocks/w[\1]")], {}, ValueError, r"not \[2\]; map every layer"),
        ([(r"enc\.h\.(\d)\.w", r"blocks/w[\g<1>0]")], {}, ValueError, r"names layer 10"),
        ({"enc.ln.weight": "/"}, {}, ValueError, r"a scope maps only to a scope"),
    ],
)
def test_bad_maps_raise_naming_what_and_change_nothing(hf, fresh_store, amap, kw, error, match):
    a = zeros("a", (4, 6))
    stacked = zeros("blocks/w", (3, 2, 5))
    # a value that would be assigned before the failing one, were it not all or nothing
    first = zeros("aa", (4,))
    unchanged = _unchanged([a, stacked, first])
    if isinstance(amap, dict):
        amap = {"enc.ln.weight": first, **amap} if "enc.ln.weight" not in amap else amap
        kw = {"cast": True, **kw}
    with pytest.raises(error, match=match):
        init_from_checkpoint(hf, amap, allow_unverified=True, **kw)
    unchanged()


def test_a_corrupt_tensor_late_in_the_map_changes_nothing(tmp_path, fresh_store):
    path = str(tmp_path / "m.safetensors")
    save_file({"a": np.ones(3, np.float32), "b": np.array([0, 1], np.uint8).view(np.bool_)}, path)
    data = bytearray(Path(path).read_bytes())
    data[-1] = 7  # a bool byte that is neither 0 nor 1
    Path(path).write_bytes(bytes(data))
    a, b = zeros("a", (3,)), ps.Variable(np.zeros(2, bool), name="b")
    unchanged = _unchanged([a, b])
    with pytest.raises(CheckpointError, match=r"bool tensor 'b'"):
        init_from_checkpoint(path, {"a": a, "b": b}, allow_unverified=True)
    unchanged()


def test_hugging_face_files_need_allow_unverified(hf, fresh_store):
    a = zeros("a", (4, 6))
    with pytest.raises(CheckpointError, match="pass allow_unverified=True"):
        init_from_checkpoint(hf, {"enc.attn.c_attn.weight": a})
    assert not a.numpy().any()


def test_values_are_read_through_views_one_at_a_time(hf, fresh_store, monkeypatch):
    """A Hugging Face tensor is read through a view of its own bytes (a FileTensor), never
    loaded whole by the reader."""
    viewed = []
    real = hf_read.FileTensor._fill
    monkeypatch.setattr(
        hf_read.FileTensor, "_fill", lambda t, a, b: viewed.append(t._e.name) or real(t, a, b)
    )
    monkeypatch.setattr(hf_read.PlainSafetensors, "load", lambda *a: pytest.fail("whole load"))
    a, b = zeros("a", (4, 6)), zeros("b", (6,))
    init_from_checkpoint(
        hf, {"enc.attn.c_attn.weight": a, "enc.attn.c_attn.bias": b}, allow_unverified=True
    )
    assert sorted(viewed) == ["enc.attn.c_attn.bias", "enc.attn.c_attn.weight"]
    np.testing.assert_array_equal(b.numpy(), B)


def test_paramstore_files_and_abstract_variables(tmp_path, fresh_store):
    src = {"old/a": np.arange(6, dtype=np.float32).reshape(2, 3), "old/b": np.ones(3, np.int32)}
    path = ps.checkpoint.write_arrays(str(tmp_path / "ckpt.safetensors"), src)
    with ps.abstract():
        a = ps.Variable(jax.ShapeDtypeStruct((2, 3), jnp.float32), name="new/a")
        b = ps.Variable(jax.ShapeDtypeStruct((3,), jnp.int32), name="new/b")
    assert a.is_abstract
    assert init_from_checkpoint(path, {"old/": "new/"}) == {"new/a": "old/a", "new/b": "old/b"}
    assert not a.is_abstract and not b.is_abstract
    np.testing.assert_array_equal(a.numpy(), src["old/a"])
    np.testing.assert_array_equal(b.numpy(), src["old/b"])


def test_sharded_orbax_checkpoint(tmp_path, fresh_store):
    x = ps.Variable(np.arange(8, dtype=np.float32), name="enc/x")
    path = ps.Saver([x], sharded=True).save(str(tmp_path / "ckpt"))
    y = zeros("dec/x", (8,))
    assert init_from_checkpoint(path, {"enc/": "dec/"}) == {"dec/x": "enc/x"}
    np.testing.assert_array_equal(y.numpy(), np.arange(8))


def test_inside_a_trace_refused(hf, fresh_store):
    a = zeros("a", (4, 6))

    @ps.function
    def f():
        init_from_checkpoint(hf, {"enc.attn.c_attn.weight": a}, allow_unverified=True)
        return 0

    with pytest.raises(CheckpointError, match="outside the compiled step"):
        f()


# ------------------------------------------------------------------ 8 devices

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


@check
def check_fsdp_abstract_model_reads_only_each_devices_shard():
    mesh = jax.make_mesh((8,), ("fsdp",))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.safetensors")
        big = np.arange(16 * 4, dtype=np.float32).reshape(16, 4).astype(ml_dtypes.bfloat16)
        layers = [np.full((8, 3), i, np.float32) for i in range(2)]
        save_file({"w": big, "h.0.k": layers[0], "h.1.k": layers[1]}, path)
        lm = ps.sharding.LayoutMap(mesh)
        lm["w"] = ("fsdp", None)
        lm["blocks/k"] = (None, "fsdp", None)
        with ps.abstract(), ps.device(lm):
            w = ps.Variable(jax.ShapeDtypeStruct((16, 4), jnp.float32), name="w")
            k = ps.Variable(jax.ShapeDtypeStruct((2, 8, 3), jnp.float32), name="blocks/k")
        reads = []
        real = hf_read.FileTensor._read

        def spy(t, start, stop):
            reads.append((t._e.name, stop - start))
            return real(t, start, stop)

        hf_read.FileTensor._read = spy
        try:
            init_from_checkpoint(
                d, [("w", "w"), (r"h\.(\d)\.k", r"blocks/k[\1]")], cast=True, allow_unverified=True
            )
        finally:
            hf_read.FileTensor._read = real
        assert w.sharding == NamedSharding(mesh, P("fsdp", None))
        np.testing.assert_array_equal(w.numpy(), big.astype(np.float32))
        np.testing.assert_array_equal(k.numpy(), np.stack(layers))
        # each device copied only its own rows: 8 reads of 2 rows of w
        w_reads = [r for n, r in reads if n == "w"]
        assert len(w_reads) == 8 and all(rows == 2 for rows in w_reads), w_reads
        assert all(rows == 1 for n, rows in reads if n != "w"), reads


@check
def check_plain_sharded_variables_keep_their_sharding():
    mesh = jax.make_mesh((8,), ("fsdp",))
    sharding = NamedSharding(mesh, P(None, "fsdp"))
    v = ps.Variable(jax.device_put(jnp.zeros((2, 16)), sharding), name="v")
    with tempfile.TemporaryDirectory() as d:
        x = np.arange(32, dtype=np.float32).reshape(2, 16)
        path = ps.checkpoint.write_arrays(os.path.join(d, "c.safetensors"), {"x": x})
        init_from_checkpoint(path, {"x": v})
    assert v.sharding == sharding
    np.testing.assert_array_equal(v.numpy(), x)


@check
def check_export_gathers_sharded_variables_and_reads_back_sharded():
    mesh = jax.make_mesh((8,), ("fsdp",))
    sharding = NamedSharding(mesh, P("fsdp", None))
    x = np.arange(64, dtype=np.float32).reshape(16, 4)
    v = ps.Variable(jax.device_put(x.astype(ml_dtypes.bfloat16), sharding), name="enc/w")
    with tempfile.TemporaryDirectory() as d:
        path = ps.checkpoint.export_safetensors(os.path.join(d, "m.safetensors"), [v])
        np.testing.assert_array_equal(load_file(path)["enc/w"].astype(np.float32), x)
        w = ps.Variable(jax.device_put(jnp.zeros((16, 4)), sharding), name="dec/w")
        init_from_checkpoint(path, {"enc/": "dec/"}, cast=True, allow_unverified=True)
    assert w.sharding == sharding
    np.testing.assert_array_equal(w.numpy(), x)


warm_start_results, test_multi_device = multi_device_tests(CHECKS, __file__, "warm_start_results")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        run_checks(CHECKS, sys.argv[1])
