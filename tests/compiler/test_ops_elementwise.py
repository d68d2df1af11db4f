"""Elementwise lowerings against torch."""

import pytest
import torch

from tests.compiler.harness import OpCase, case_params, check_case

aten = torch.ops.aten
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def randn(*shape):
    return lambda dtype: tuple(torch.randn(*s).to(dtype) for s in shape)


CASES = [
    OpCase("add", torch.add, randn((3, 4), (3, 4)), FLOATS, ops=(aten.add.Tensor,)),
    OpCase("add_broadcast_alpha", lambda x, y: torch.add(x, y, alpha=2.5), randn((3, 4), (4,)), FLOATS),
    OpCase("mul_scalar", lambda x: x * 3.0, randn((2, 5)), FLOATS, ops=(aten.mul.Tensor,)),
    OpCase("relu", torch.relu, randn((4, 4)), FLOATS, ops=(aten.relu.default,)),
]


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_elementwise(case, dtype):
    check_case(case, dtype)
