"""Convolution and pooling lowerings against torch.

Every convolution case runs under both convolution algorithms (XLA's convolution and im2col);
``"auto"`` and ``"in_loop"`` pick one of them per convolution and backend, and tests check which.
Half-precision convolutions accumulate in float32 and round once, like torch's CPU kernels, so
the harness's default fp16/bf16 tolerances hold.

To keep exports and compilations few, a case may run several calls of one op family, each on
inputs of its own, and return every call's outputs (the harness names a mismatch by output
position: outputs are in the order of the calls).
"""

import math

import pytest
import torch
import torch.nn.functional as F

import jax
import jax.numpy as jnp

from ipu_backend.compiler.lowering_options import current_options, lowering_options
from ipu_backend.compiler import backend
from ipu_backend.compiler.lowerings.convolution import convolution
from tests.compiler.harness import OpCase, case_params, check_case

aten = torch.ops.aten
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def randn(*shape):
    return lambda dtype: torch.randn(shape).to(dtype)


def with_ties(*shape):
    """Values from a few levels, so pooling windows hold tied maxima (torch picks the first)."""
    return lambda dtype: torch.randint(-2, 3, shape).to(dtype)


def randint(*shape):
    return lambda dtype: torch.randint(-9, 9, shape, dtype=dtype)


def with_nan_and_inf(*shape):
    def make(dtype):
        x = torch.randn(shape)
        x.view(-1)[::7] = float("nan")
        x.view(-1)[3::11] = float("-inf")
        return x.to(dtype)
    return make


def calls(name, *parts, dtypes=(torch.float32,), ops):
    """One case making several calls: ``parts`` are ``(fn, make_input, ...)``, each ``fn`` taking
    the tensors its ``make_input`` functions make."""
    def make_inputs(dtype):
        return tuple(make(dtype) for _, *makers in parts for make in makers)

    def fn(*args):
        outputs, args = [], list(args)
        for call, *makers in parts:
            outputs.append(call(*args[:len(makers)]))
            del args[:len(makers)]
        return tuple(outputs)

    return OpCase(name, fn, make_inputs, dtypes, ops=ops)


def conv(fn, input_shape, weight_shape, *bias_shape, **kwargs):
    """A convolution call for ``calls``: ``fn(input, weight[, bias], **kwargs)``. The weight is
    scaled by 1/sqrt(fan-in), as nn.Conv's initialization does, so that outputs and gradients
    stay near unit size, where the absolute fp32 tolerance means what it says."""
    fan_in = math.prod(weight_shape[1:])
    return (lambda *args: fn(*args, **kwargs), randn(*input_shape),
            lambda dtype: (torch.randn(weight_shape) / math.sqrt(fan_in)).to(dtype),
            *(randn(*shape) for shape in bias_shape))


def pool(fn, make_input, *args, **kwargs):
    """A pooling call for ``calls``: ``fn(input, *args, **kwargs)``."""
    return (lambda x: fn(x, *args, **kwargs), make_input)


CONVOLUTION = (aten.convolution.default,)
MAX_POOL_2D = (aten.max_pool2d_with_indices.default,)

CONV_CASES = [
    calls("conv1d_bias_stride_padding_dilation_groups",
          conv(F.conv1d, (2, 3, 9), (4, 3, 3), (4,)),
          conv(F.conv1d, (2, 4, 11), (6, 2, 3), stride=2, padding=2, dilation=2, groups=2),
          ops=CONVOLUTION),
    calls("conv2d", conv(F.conv2d, (2, 3, 8, 7), (4, 3, 3, 2), (4,)), dtypes=FLOATS,
          ops=CONVOLUTION),
    calls("conv2d_per_dim_stride_padding_dilation_depthwise_same",
          conv(F.conv2d, (1, 3, 9, 8), (5, 3, 3, 3), stride=(2, 1), padding=(1, 2),
               dilation=(1, 2)),
          conv(F.conv2d, (2, 4, 7, 7), (8, 1, 3, 3), (8,), groups=4, padding=1),
          conv(F.conv2d, (1, 3, 6, 6), (4, 3, 4, 2), padding="same"),  # one more pad at the end
          ops=CONVOLUTION),
    calls("conv3d_stride_padding_groups_dilation",
          conv(F.conv3d, (1, 2, 5, 6, 5), (3, 2, 3, 2, 3), (3,), stride=(1, 2, 2),
               padding=(1, 0, 1)),
          conv(F.conv3d, (1, 4, 5, 5, 5), (4, 2, 2, 2, 2), groups=2, dilation=2),
          ops=CONVOLUTION),
    calls("conv_transpose1d_output_padding_crop",
          conv(F.conv_transpose1d, (2, 3, 7), (3, 4, 3), (4,), stride=2, padding=1,
               output_padding=1),
          conv(F.conv_transpose1d, (1, 2, 5), (2, 3, 1), padding=1),  # crops more than it pads
          ops=CONVOLUTION),
    calls("conv_transpose2d_groups_output_padding",
          conv(F.conv_transpose2d, (1, 4, 5, 4), (4, 3, 3, 3), (6,), stride=(2, 3),
               padding=(1, 0), output_padding=(1, 2), groups=2),
          ops=CONVOLUTION),
    calls("conv_transpose2d_dilation_and_3d",
          conv(F.conv_transpose2d, (1, 2, 4, 5), (2, 3, 3, 2), stride=2, dilation=(2, 1),
               padding=2),
          conv(F.conv_transpose3d, (1, 2, 3, 4, 3), (2, 2, 3, 2, 2), (2,), stride=2, padding=1,
               output_padding=1),
          ops=CONVOLUTION),
    calls("conv2d_unbatched_channels_permuted",
          conv(lambda x, w: F.conv2d(x.permute(2, 0, 1), w, padding=1), (6, 7, 3), (2, 3, 3, 3)),
          ops=CONVOLUTION + (aten.permute.default,)),
]

POOL_CASES = [
    calls("max_pool2d", pool(F.max_pool2d, randn(2, 3, 8, 6), 2), dtypes=FLOATS,
          ops=MAX_POOL_2D),
    calls("max_pool2d_padding_dilation_ceil_ties_1d",
          pool(F.max_pool2d, randn(1, 2, 9, 8), (3, 2), (2, 1), (1, 1), (2, 1), ceil_mode=True,
               return_indices=True),
          pool(F.max_pool2d, with_ties(2, 2, 7, 7), 3, 2, return_indices=True),
          pool(F.max_pool1d, with_ties(2, 3, 10), 3, 2, 1, return_indices=True),
          ops=MAX_POOL_2D),
    calls("max_pool2d_nan_and_inf", pool(F.max_pool2d, with_nan_and_inf(1, 2, 6, 6), 3, 1, 1,
                                         return_indices=True), ops=MAX_POOL_2D),
    calls("max_pool2d_integer_unbatched",
          pool(F.max_pool2d, randint(3, 5, 4), 2, padding=1, return_indices=True),
          dtypes=(torch.int64,), ops=MAX_POOL_2D),
    calls("max_pool2d_tiling_windows_ties_nan_cropped_integer",
          pool(F.max_pool2d, with_ties(2, 3, 9, 8), 2, return_indices=True),
          pool(F.max_pool2d, with_nan_and_inf(1, 2, 6, 6), (3, 2), return_indices=True),
          pool(F.max_pool1d, with_ties(2, 3, 10), 3, return_indices=True),
          pool(F.max_pool2d, randn(2, 2, 3, 3), 1, return_indices=True),   # one-element windows
          ops=MAX_POOL_2D),
    calls("max_pool2d_tiling_windows_integer",
          pool(F.max_pool2d, randint(2, 6, 4), 2, return_indices=True),
          dtypes=(torch.int64,), ops=MAX_POOL_2D),
    calls("max_pool3d_tiling_windows",
          pool(F.max_pool3d, with_ties(1, 2, 4, 6, 5), (2, 3, 2), return_indices=True),
          ops=(aten.max_pool3d_with_indices.default,)),
    calls("max_pool3d", pool(F.max_pool3d, with_ties(1, 2, 5, 6, 5), (2, 3, 2), (2, 2, 1),
                             (1, 1, 0), ceil_mode=True, return_indices=True),
          ops=(aten.max_pool3d_with_indices.default,)),
    calls("avg_pool2d", pool(F.avg_pool2d, randn(2, 3, 8, 6), 2), dtypes=FLOATS,
          ops=(aten.avg_pool2d.default,)),
    calls("avg_pool2d_padding_ceil_include_exclude_pad_divisor_1d",
          pool(F.avg_pool2d, randn(1, 2, 8, 7), 3, 2, 1, ceil_mode=True),
          pool(F.avg_pool2d, randn(1, 2, 8, 7), (3, 2), (2, 2), (1, 1), ceil_mode=True,
               count_include_pad=False),
          pool(F.avg_pool2d, randn(2, 7, 7), 3, 2, 1, divisor_override=5),
          pool(F.avg_pool1d, randn(2, 3, 10), 3, 2, 1, count_include_pad=False),
          ops=(aten.avg_pool2d.default,)),
    calls("avg_pool2d_integer_truncates",
          pool(F.avg_pool2d, randint(1, 2, 5, 4), 2, padding=1, divisor_override=3),
          dtypes=(torch.int64,), ops=(aten.avg_pool2d.default,)),
    calls("avg_pool3d",  # torch has no half-precision avg_pool3d on the CPU
          pool(F.avg_pool3d, randn(1, 2, 5, 6, 5), (2, 3, 2), (1, 2, 2), (1, 1, 0),
               ceil_mode=True, count_include_pad=False),
          ops=(aten.avg_pool3d.default,)),
    calls("adaptive_avg_pool2d_uneven_and_divisible_unbatched",
          pool(F.adaptive_avg_pool2d, randn(2, 3, 8, 7), (3, 5)),
          pool(F.adaptive_avg_pool2d, randn(3, 8, 8), 4),
          dtypes=FLOATS, ops=(aten._adaptive_avg_pool2d.default,)),
    calls("adaptive_avg_pool1d_3d",
          pool(F.adaptive_avg_pool1d, randn(2, 3, 10), 4),
          pool(F.adaptive_avg_pool3d, randn(1, 2, 5, 7, 6), (2, 3, 4)),
          ops=(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default)),
    calls("adaptive_max_pool2d",
          pool(F.adaptive_max_pool2d, with_ties(2, 3, 8, 7), (3, 5), return_indices=True),
          ops=(aten.adaptive_max_pool2d.default,)),
    calls("adaptive_max_pool1d_3d",
          pool(F.adaptive_max_pool1d, randn(2, 3, 10), 4),
          pool(F.adaptive_max_pool3d, with_ties(1, 2, 5, 7, 6), (2, 3, 4), return_indices=True),
          ops=(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)),
]

CASES = CONV_CASES + POOL_CASES


@pytest.mark.parametrize("algorithm", ["xla", "im2col"])
@pytest.mark.parametrize("case,dtype", case_params(CONV_CASES))
def test_convolution(case, dtype, algorithm):
    with lowering_options(conv_algorithm=algorithm):
        check_case(case, dtype)


def _uses_xla_convolution(algorithm: str, channels: int) -> bool:
    """Whether a ``channels``-input convolution traced under ``algorithm`` is XLA's convolution."""
    x, weight = jnp.ones((2, channels, 8, 8)), jnp.ones((4, channels, 3, 3))

    def conv(x, weight):
        return convolution(None, x, weight, None, [1], [0], [1], False, [0], 1)

    with lowering_options(conv_algorithm=algorithm):
        return "conv_general_dilated" in str(jax.make_jaxpr(conv)(x, weight))


def _largest_compiled_concatenate(stride: int) -> int:
    """The most operands of any concatenate in the compiled gradient of a 5×5 im2col convolution."""
    x, weight = jnp.ones((2, 3, 12, 12)), jnp.ones((4, 3, 5, 5))

    def loss(x, weight):
        return jnp.sum(jnp.sin(convolution(None, x, weight, None, [stride], [1], [1], False, [0], 1)))

    with lowering_options(conv_algorithm="im2col"):
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, weight).compile().as_text()
    return max((line.split("concatenate(", 1)[1].split(")")[0].count("%")
                for line in hlo.splitlines() if " concatenate(" in line), default=0)


@pytest.mark.parametrize("stride", [1, 2])
def test_im2col_stacks_at_most_eight_slices_at_once(stride):
    """XLA:CPU fuses a concatenate of at most 8 operands with their producers; 25 kernel offsets
    stacked at once would be a kernel per slice and a copy of them all."""
    assert 1 < _largest_compiled_concatenate(stride) <= 8


@pytest.mark.parametrize("channels,uses_xla", [(1, True), (3, False)])
def test_in_loop_algorithm_keeps_xla_convolution_for_single_channel_input(channels, uses_xla):
    assert _uses_xla_convolution("in_loop", channels) == uses_xla


@pytest.mark.parametrize("channels", [1, 3])
def test_auto_algorithm_is_the_default_and_im2col_on_the_cpu(channels):
    assert current_options().conv_algorithm == "auto"
    assert jax.default_backend() == "cpu"
    assert not _uses_xla_convolution("auto", channels)


@pytest.mark.parametrize("algorithm", ["auto", "in_loop"])
def test_other_backends_get_xla_convolution(algorithm, monkeypatch):
    monkeypatch.setattr(backend, "on_cpu", lambda: False)
    assert _uses_xla_convolution(algorithm, 3)


@pytest.mark.parametrize("case,dtype", case_params(POOL_CASES))
def test_pooling(case, dtype):
    check_case(case, dtype)
