"""Comparison, where and logical lowerings against torch, with ties, NaN and mixed dtypes
(torch compares in the promoted dtype: an int tensor against 2.5 as float, a float16 tensor
against 0.1 in float16)."""

import pytest
import torch

from tests.compiler.harness import OpCase, case_params, check_case

aten = torch.ops.aten
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)


def with_ties(dtype):
    x = torch.cat([torch.tensor([0.1, 0.5, -0.0, float("nan")]), torch.randn(8)]).view(3, 4)
    y = torch.cat([torch.tensor([0.1, -1.0, 0.0, 1.0])])
    return x.to(dtype), y.to(dtype), torch.tensor(0.5).to(dtype)


def small_integers(dtype):
    if dtype == torch.bool:
        return torch.rand(3, 4) < 0.5, torch.rand(4) < 0.5
    return torch.randint(-3, 4, (3, 4), dtype=dtype), torch.randint(-3, 4, (4,), dtype=dtype)


def mixed_dtypes(dtype):
    return (torch.randint(-2, 3, (3, 4)), torch.tensor([0.5, -1.0, 2.0, 0.0]), torch.randn(3, 4).half(),
            torch.randn(4).bfloat16(), torch.tensor(0.25))


def where_inputs(dtype):
    x = torch.randn(3, 4).to(dtype)
    return x, torch.randn(4).to(dtype), torch.randn(()).to(dtype), torch.rand(3, 1) < 0.5


def logical_inputs(dtype):
    if dtype == torch.bool:
        return torch.rand(3, 4) < 0.5, torch.rand(4) < 0.5
    if dtype.is_floating_point:
        x = torch.tensor([[0.0, -0.0, float("nan"), 2.0], [0.5, 0.0, -1.0, 0.0], [3.0, 0.0, 0.0, -0.25]])
        return x.to(dtype), torch.tensor([0.0, 1.0, float("nan"), 0.0]).to(dtype)
    return torch.randint(-1, 2, (3, 4), dtype=dtype), torch.randint(-1, 2, (4,), dtype=dtype)


def _comparisons(x, y, s):
    return x == y, x != y, x < y, x <= y, x > y, x >= y, x >= s, x == 0.1, x != 0.5, x < 0.1, x <= 0.5, x > 0, x >= -0.0


CASES = [
    OpCase("comparisons", _comparisons, with_ties, FLOATS,
           ops=(aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor,
                aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar)),
    OpCase("integer_comparisons",
           lambda a, b: (a == b, a != b, a < b, a <= b, a > b, a >= b, a < 2.5, a >= 1, a == 1, a > -0.5),
           small_integers, INTS + (torch.bool,),
           ops=(aten.eq.Tensor, aten.lt.Tensor, aten.lt.Scalar, aten.ge.Scalar, aten.eq.Scalar, aten.gt.Scalar)),
    OpCase("mixed_dtype_comparisons",
           lambda i, f, h, b, s: (i < f, i == f, h > b, h <= s, b >= s, i > s, h < f),
           mixed_dtypes, (torch.float32,), ops=(aten.lt.Tensor, aten.gt.Tensor, aten.ge.Tensor)),
    OpCase("where",
           lambda x, y, s, c: (torch.where(c, x, y), torch.where(c, y, s), torch.where(x > 0, x, s),
                               torch.where(c, x, 0.5), x.masked_fill(c, -2.0), torch.where(c, 1.5, y)),
           where_inputs, FLOATS, ops=(aten.where.self,)),
    OpCase("where_mixed_dtypes",
           lambda c, i, x, h: (torch.where(c, i, x), torch.where(c, h, x), torch.where(c, i, 2.5),
                               torch.where(c, i, 3), i.masked_fill(c, -7)),
           lambda dtype: (torch.rand(3, 4) < 0.5, torch.randint(-5, 5, (3, 4), dtype=dtype), torch.randn(4),
                          torch.randn(3, 1).half()),
           INTS, ops=(aten.where.self,)),
    OpCase("logical",
           lambda x, y: (torch.logical_and(x, y), torch.logical_or(x, y), torch.logical_xor(x, y),
                         torch.logical_not(x), torch.logical_not(y)),
           logical_inputs, FLOATS + INTS + (torch.bool,),
           ops=(aten.logical_and.default, aten.logical_or.default, aten.logical_xor.default,
                aten.logical_not.default)),
]


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_comparison(case, dtype):
    check_case(case, dtype)
