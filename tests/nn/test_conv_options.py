"""Conv1D/Conv2D dilation_rate, groups and data_format, and the pooling layers' data_format,
against Keras 3 (same inputs and weights, eagerly and in ps.function); their bad inputs."""

from __future__ import annotations

import numpy as np
import pytest

import paramstore as ps

RNG = np.random.default_rng(11)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


CONV = [
    ("Conv2D", (2, 9, 8, 4), {"dilation_rate": 2}),
    ("Conv2D", (2, 9, 8, 4), {"dilation_rate": (2, 1), "padding": "same"}),
    ("Conv2D", (2, 9, 8, 4), {"groups": 2}),
    ("Conv2D", (2, 9, 8, 4), {"groups": 4, "strides": 2, "padding": "same"}),
    ("Conv2D", (2, 4, 9, 8), {"data_format": "channels_first"}),
    ("Conv2D", (2, 4, 9, 8), {"data_format": "channels_first", "groups": 2, "dilation_rate": 2}),
    ("Conv1D", (2, 11, 4), {"dilation_rate": 3}),
    ("Conv1D", (2, 11, 4), {"groups": 2, "padding": "same"}),
    ("Conv1D", (2, 4, 11), {"data_format": "channels_first", "strides": 2}),
]


@pytest.mark.tf
@pytest.mark.parametrize("kind,shape,kw", CONV)
def test_conv_options_match_keras(keras, kind, shape, kw):
    x = rand(*shape)
    ours = getattr(ps.nn, kind)(8, 3, **kw)
    theirs = getattr(keras.layers, kind)(8, 3, **kw)
    ours.build((None, *shape[1:]))
    theirs.build((None, *shape[1:]))
    assert [v.shape for v in ours.weights] == [tuple(w.shape) for w in theirs.weights]
    ours.bias.assign(rand(8))
    theirs.set_weights(ours.get_weights())
    want = np.asarray(theirs(x))
    got = ours(x)
    assert got.shape == want.shape == ours.compute_output_shape(shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ps.function(lambda x: ours(x))(x), want, rtol=1e-4, atol=1e-4)


@pytest.mark.tf
@pytest.mark.parametrize(
    "kind,kw",
    [
        ("MaxPooling2D", {}),
        ("MaxPooling2D", {"pool_size": 3, "strides": 2, "padding": "same"}),
        ("AveragePooling2D", {"pool_size": 2}),
        ("AveragePooling2D", {"pool_size": (3, 2), "strides": 1, "padding": "same"}),
        ("GlobalAveragePooling2D", {}),
        ("GlobalMaxPooling2D", {"keepdims": True}),
    ],
)
def test_pooling_channels_first_matches_keras(keras, kind, kw):
    x = rand(2, 3, 7, 6)  # (batch, channels, height, width)
    ours = getattr(ps.nn, kind)(data_format="channels_first", **kw)
    theirs = getattr(keras.layers, kind)(data_format="channels_first", **kw)
    np.testing.assert_allclose(ours(x), np.asarray(theirs(x)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["Conv1D", "Conv2D"])
def test_groups_not_dividing_the_channels_builds_nothing(kind):
    layer = getattr(ps.nn, kind)(4, 1, groups=2)
    x = np.ones((1, 5, 3) if kind == "Conv1D" else (1, 5, 5, 3), np.float32)
    with pytest.raises(ValueError, match=rf"{kind} '\w+': the input's 3 channels .* groups=2"):
        layer(x)
    assert not layer.built and layer.variables == ()


def test_bad_conv_arguments():
    with pytest.raises(ValueError, match=r"Conv2D: filters \(6\) must be divisible by groups"):
        ps.nn.Conv2D(6, 3, groups=4)
    with pytest.raises(ValueError, match=r"Conv2D: strides \(2, 2\) > 1 together with dilation"):
        ps.nn.Conv2D(4, 3, strides=2, dilation_rate=2)
    with pytest.raises(ValueError, match=r"Conv1D: data_format must be 'channels_last'.*'NCW'"):
        ps.nn.Conv1D(4, 3, data_format="NCW")
    with pytest.raises(ValueError, match="MaxPooling2D: data_format must be"):
        ps.nn.MaxPooling2D(data_format="channels_middle")
    with pytest.raises(ValueError, match="GlobalAveragePooling2D: data_format must be"):
        ps.nn.GlobalAveragePooling2D(data_format=None)
    with pytest.raises(ValueError, match="groups must be a positive int"):
        ps.nn.Conv2D(4, 3, groups=0)


def test_channels_first_built_layer_checks_the_channel_axis():
    layer = ps.nn.Conv2D(2, 1, data_format="channels_first")
    layer(np.ones((1, 3, 4, 4), np.float32))
    assert layer.kernel.shape == (1, 1, 3, 2)
    with pytest.raises(ValueError, match="was built for inputs with 3 channels"):
        layer(np.ones((1, 5, 4, 3), np.float32))


def test_dilated_kernel_larger_than_input_says_so():
    layer = ps.nn.Conv1D(2, 3, dilation_rate=4)  # extent 9
    with pytest.raises(ValueError, match=r"dilated kernel size \(9,\) is larger"):
        layer(np.ones((1, 6, 2), np.float32))
    assert not layer.built
