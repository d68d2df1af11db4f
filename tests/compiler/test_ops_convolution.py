"""Convolution and pooling lowerings against torch.

Every convolution case runs under both convolution algorithms (XLA's convolution and im2col).
Half-precision convolutions accumulate in float32 and round once, like torch's CPU kernels, so
the harness's default fp16/bf16 tolerances hold.
"""

import pytest
import torch
import torch.nn.functional as F

from ipu_backend.compiler.lowering_options import CONV_ALGORITHMS, lowering_options
from tests.compiler.harness import OpCase, case_params, check_case

aten = torch.ops.aten
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
CONVOLUTION = (aten.convolution.default,)


def randn(*shapes):
    return lambda dtype: tuple(torch.randn(s).to(dtype) for s in shapes)


def with_ties(*shape):
    """Values from a few levels, so pooling windows hold tied maxima (torch picks the first)."""
    return lambda dtype: (torch.randint(-2, 3, shape).to(dtype),)


def with_nan_and_inf(*shape):
    def make(dtype):
        x = torch.randn(shape)
        x.view(-1)[::7] = float("nan")
        x.view(-1)[3::11] = float("-inf")
        return (x.to(dtype),)
    return make


def conv(fn, *shapes, dtypes=(torch.float32,), **kwargs):
    """A case named after its arguments: ``conv2d_stride2x1_padding1x2``."""
    name = fn.__name__ + "".join(
        f"_{k}{'x'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in kwargs.items())
    return OpCase(name, lambda *args: fn(*args, **kwargs), randn(*shapes), dtypes,
                  ops=CONVOLUTION)


CONV_CASES = [
    conv(F.conv1d, (2, 3, 9), (4, 3, 3), (4,)),
    conv(F.conv1d, (2, 4, 11), (6, 2, 3), stride=2, padding=2, dilation=2, groups=2),
    conv(F.conv2d, (2, 3, 8, 7), (4, 3, 3, 2), (4,), dtypes=FLOATS),
    conv(F.conv2d, (1, 3, 9, 8), (5, 3, 3, 3), stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
    conv(F.conv2d, (2, 4, 7, 7), (8, 1, 3, 3), (8,), groups=4, padding=1),  # depthwise, x2
    conv(F.conv2d, (1, 3, 6, 6), (4, 3, 4, 2), padding="same"),  # pads one more at the end
    conv(F.conv3d, (1, 2, 5, 6, 5), (3, 2, 3, 2, 3), (3,), stride=(1, 2, 2), padding=(1, 0, 1)),
    conv(F.conv3d, (1, 4, 5, 5, 5), (4, 2, 2, 2, 2), groups=2, dilation=2),
    conv(F.conv_transpose1d, (2, 3, 7), (3, 4, 3), (4,), stride=2, padding=1,
         output_padding=1),
    conv(F.conv_transpose1d, (1, 2, 5), (2, 3, 1), padding=1),  # crops more than it pads
    conv(F.conv_transpose2d, (1, 4, 5, 4), (4, 3, 3, 3), (6,), dtypes=FLOATS, stride=(2, 3),
         padding=(1, 0), output_padding=(1, 2), groups=2),
    conv(F.conv_transpose2d, (1, 2, 4, 5), (2, 3, 3, 2), stride=2, dilation=(2, 1), padding=2),
    conv(F.conv_transpose3d, (1, 2, 3, 4, 3), (2, 2, 3, 2, 2), (2,), stride=2, padding=1,
         output_padding=1),
    OpCase("conv2d_unbatched_channels_permuted",
           lambda x, w: F.conv2d(x.permute(2, 0, 1), w, padding=1),
           randn((6, 7, 3), (2, 3, 3, 3)), ops=CONVOLUTION + (aten.permute.default,)),
]

POOL_CASES = [
    OpCase("max_pool2d", lambda x: F.max_pool2d(x, 2), randn((2, 3, 8, 6)), FLOATS,
           ops=(aten.max_pool2d_with_indices.default,)),
    OpCase("max_pool2d_indices_padding_dilation_ceil",
           lambda x: F.max_pool2d(x, (3, 2), (2, 1), (1, 1), (2, 1), ceil_mode=True,
                                  return_indices=True),
           randn((1, 2, 9, 8)), ops=(aten.max_pool2d_with_indices.default,)),
    OpCase("max_pool2d_ties_first_index", lambda x: F.max_pool2d(x, 3, 2, return_indices=True),
           with_ties(2, 2, 7, 7), ops=(aten.max_pool2d_with_indices.default,)),
    OpCase("max_pool2d_nan_inf", lambda x: F.max_pool2d(x, 3, 1, 1, return_indices=True),
           with_nan_and_inf(1, 2, 6, 6), ops=(aten.max_pool2d_with_indices.default,)),
    OpCase("max_pool2d_integer_unbatched",
           lambda x: F.max_pool2d(x, 2, padding=1, return_indices=True),
           lambda dtype: (torch.randint(-9, 9, (3, 5, 4), dtype=dtype),), (torch.int64,),
           ops=(aten.max_pool2d_with_indices.default,)),
    OpCase("max_pool1d", lambda x: F.max_pool1d(x, 3, 2, 1, return_indices=True),
           with_ties(2, 3, 10), ops=(aten.max_pool2d_with_indices.default,)),
    OpCase("max_pool3d", lambda x: F.max_pool3d(x, (2, 3, 2), (2, 2, 1), (1, 1, 0),
                                                ceil_mode=True, return_indices=True),
           with_ties(1, 2, 5, 6, 5), ops=(aten.max_pool3d_with_indices.default,)),
    OpCase("avg_pool2d", lambda x: F.avg_pool2d(x, 2), randn((2, 3, 8, 6)), FLOATS,
           ops=(aten.avg_pool2d.default,)),
    OpCase("avg_pool2d_padding_ceil_include_pad",
           lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True), randn((1, 2, 8, 7)),
           ops=(aten.avg_pool2d.default,)),
    OpCase("avg_pool2d_padding_ceil_exclude_pad",
           lambda x: F.avg_pool2d(x, (3, 2), (2, 2), (1, 1), ceil_mode=True,
                                  count_include_pad=False), randn((1, 2, 8, 7)),
           ops=(aten.avg_pool2d.default,)),
    OpCase("avg_pool2d_divisor_override",
           lambda x: F.avg_pool2d(x, 3, 2, 1, divisor_override=5), randn((2, 7, 7)),
           ops=(aten.avg_pool2d.default,)),
    OpCase("avg_pool2d_integer_truncates",
           lambda x: F.avg_pool2d(x, 2, padding=1, divisor_override=3),
           lambda dtype: (torch.randint(-9, 9, (1, 2, 5, 4), dtype=dtype),), (torch.int64,),
           ops=(aten.avg_pool2d.default,)),
    OpCase("avg_pool1d", lambda x: F.avg_pool1d(x, 3, 2, 1, count_include_pad=False),
           randn((2, 3, 10)), ops=(aten.avg_pool2d.default,)),
    OpCase("avg_pool3d", lambda x: F.avg_pool3d(x, (2, 3, 2), (1, 2, 2), (1, 1, 0),
                                                ceil_mode=True, count_include_pad=False),
           randn((1, 2, 5, 6, 5)), ops=(aten.avg_pool3d.default,)),  # no half kernel in torch
    OpCase("adaptive_avg_pool2d", lambda x: F.adaptive_avg_pool2d(x, (3, 5)),
           randn((2, 3, 8, 7)), FLOATS, ops=(aten._adaptive_avg_pool2d.default,)),
    OpCase("adaptive_avg_pool2d_divisible_unbatched", lambda x: F.adaptive_avg_pool2d(x, 4),
           randn((3, 8, 8)), ops=(aten._adaptive_avg_pool2d.default,)),
    OpCase("adaptive_avg_pool1d", lambda x: F.adaptive_avg_pool1d(x, 4), randn((2, 3, 10)),
           ops=(aten._adaptive_avg_pool2d.default,)),
    OpCase("adaptive_avg_pool3d", lambda x: F.adaptive_avg_pool3d(x, (2, 3, 4)),
           randn((1, 2, 5, 7, 6)), ops=(aten._adaptive_avg_pool3d.default,)),
    OpCase("adaptive_max_pool2d", lambda x: F.adaptive_max_pool2d(x, (3, 5), return_indices=True),
           with_ties(2, 3, 8, 7), ops=(aten.adaptive_max_pool2d.default,)),
    OpCase("adaptive_max_pool1d", lambda x: F.adaptive_max_pool1d(x, 4), randn((2, 3, 10)),
           ops=(aten.adaptive_max_pool2d.default,)),
    OpCase("adaptive_max_pool3d",
           lambda x: F.adaptive_max_pool3d(x, (2, 3, 4), return_indices=True),
           with_ties(1, 2, 5, 7, 6), ops=(aten.adaptive_max_pool3d.default,)),
]

CASES = CONV_CASES + POOL_CASES


@pytest.mark.parametrize("algorithm", CONV_ALGORITHMS)
@pytest.mark.parametrize("case,dtype", case_params(CONV_CASES))
def test_convolution(case, dtype, algorithm):
    with lowering_options(conv_algorithm=algorithm):
        check_case(case, dtype)


@pytest.mark.parametrize("case,dtype", case_params(POOL_CASES))
def test_pooling(case, dtype):
    check_case(case, dtype)
