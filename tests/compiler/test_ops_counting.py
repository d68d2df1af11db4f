"""The bincount lowering (fixed minlength, weights) against torch, including the symbolic-size
checks torch.export adds around bincount's data-dependent length."""

import operator

import pytest
import torch

from tests.compiler.harness import OpCase, case_params, check_case

aten = torch.ops.aten


def class_indices(dtype):
    return torch.randint(0, 6, (20,)), torch.rand(20).to(dtype)


def _counts(x, weights):
    plain = torch.bincount(x, minlength=8)
    flat = torch.bincount(x * 6 + x.flip(0), minlength=36).reshape(6, 6)    # a confusion matrix
    return plain, flat, torch.bincount(x, weights=weights, minlength=8)


CASES = [
    OpCase("bincount", _counts, class_indices, (torch.float32,), grad=False,
           ops=(aten.bincount.default, aten.sym_size.int, operator.eq, operator.ge, operator.le,
                aten._assert_scalar.default)),
]


@pytest.mark.parametrize("case, dtype", case_params(CASES))
def test_counting(case, dtype):
    check_case(case, dtype)
