"""Display: _repr_html_ for every Module, layer, metric and Variable; ps.display with and
without treescope."""

from __future__ import annotations

import importlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

import paramstore as ps
from paramstore._display import display as _display


class Tower(ps.Module):
    def __init__(self):
        self.w = ps.Variable(jnp.ones((2, 3)), name="w")
        self.layers = [ps.nn.Dense(4), ps.nn.BatchNormalization()]
        self.head = {"out": ps.nn.Dense(2)}

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head["out"](x)


def test_variable_renders_as_a_table():
    v = ps.Variable(np.zeros((3, 5), np.float32), name="table<x>")
    html = v._repr_html_()
    assert "<table" in html and "(3, 5)" in html and "float32" in html
    assert ">15<" in html and "60 B" in html  # parameters and bytes
    assert "table&lt;x&gt;" in html and "table<x>" not in html  # escaped


def test_custom_module_renders_nested_tables_with_counts_and_bytes():
    model = Tower()
    model(jnp.ones((1, 3)))
    html = model._repr_html_()
    # Its own variable, then each submodule in its own nested section.
    assert html.index("tower/w") < html.index("<details")
    assert html.count("<details") == 3
    for path in ("layers[0]", "layers[1]", "head[&#x27;out&#x27;]"):
        assert path in html
    total = sum(int(v.size) for v in model.variables)
    assert f"{total:,} params" in html
    nbytes = sum(int(v.size) * 4 for v in model.variables)
    assert f"({nbytes} B)" in html
    assert re.search(r"moving_mean.*?no", html)  # the trainable flag


def test_layers_and_metrics_render_and_unbuilt_says_so():
    assert "not built" in ps.nn.Conv2D(2, 3)._repr_html_()
    m = ps.metrics.Mean()
    assert "mean/total" in m._repr_html_() and "mean/count" in m._repr_html_()


def test_tree_is_nested_dicts_of_arrays():
    model = Tower()
    model(jnp.ones((1, 3)))
    tree = _display.tree(model)
    (title,) = tree
    assert title == f"Tower '{model.scope_name}'"
    body = tree[title]
    assert set(body) == {"w", "layers", "head"}
    np.testing.assert_array_equal(body["w"], np.ones((2, 3)))
    (dense,) = body["layers"][0].values()
    assert dense["kernel"].shape == (3, 4)
    with pytest.raises(TypeError, match="ps.display expects a ps.Module"):
        ps.display(3)


def test_display_with_treescope(capsys):
    pytest.importorskip("treescope")
    model = Tower()
    model(jnp.ones((1, 3)))
    ps.display(model)
    out = capsys.readouterr().out
    assert "Tower" in out and "kernel" in out and "float32" in out


def test_display_without_treescope_falls_back(monkeypatch, capsys):
    real = importlib.import_module

    def no_treescope(name, *args, **kwargs):
        if name == "treescope":
            raise ImportError("No module named 'treescope'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(_display.importlib, "import_module", no_treescope)
    v = ps.Variable(jnp.ones(3), name="fallback")
    ps.display(v)
    out = capsys.readouterr().out
    assert "fallback" in out and "Total params: 3" in out
    assert "treescope is not installed" in out and "paramstore[display]" in out
    with pytest.raises(ImportError, match=r"needs the treescope package: pip install"):
        ps.display(v, require_treescope=True)


def test_long_names_wrap_so_every_column_fits():
    """Issue 27: notebook 07's Repeat table was wider than the page (Dtype, Params, Bytes cut
    off): the name and attribute columns wrap."""
    repeat = ps.nn.Repeat(lambda: ps.nn.Sequential([ps.nn.Dense(4), ps.nn.Dense(4)]), 2)
    repeat(jnp.ones((1, 4)))
    page = repeat._repr_html_()
    cells = re.findall(r'<td style="([^"]*)">([^<]*)</td>', page)
    names = [style for style, text in cells if "/kernel" in text]
    assert names and all("overflow-wrap:anywhere" in style for style in names)
    numbers = [style for style, text in cells if text.endswith(" B") or text.endswith("KiB")]
    assert numbers and not any("overflow-wrap" in style for style in numbers)
