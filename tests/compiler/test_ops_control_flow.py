"""Control flow lowerings: torch.cond against torch, both branches, forward and gradients."""

import pytest
import torch

from tests.compiler.harness import OpCase, case_params, check_case


def gated(x, y):
    return torch.cond(x.sum() > 0, lambda a, b: (a * b).sin(), lambda a, b: a - b.exp(), (x, y))


CASES = [
    OpCase(f"cond_{name}", gated, lambda dtype, s=sign: (torch.rand(3, 4, dtype=dtype) * s, torch.randn(3, 4, dtype=dtype)),
           (torch.float32,), ops=(torch.ops.higher_order.cond,))
    for name, sign in (("true_branch", 1.0), ("false_branch", -1.0))
]


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_control_flow(case, dtype):
    check_case(case, dtype)
