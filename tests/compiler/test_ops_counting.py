"""The bincount lowering (fixed minlength, weights) against torch, including the symbolic-size
checks torch.export adds around bincount's data-dependent length."""

import operator

import jax
import pytest
import torch

from ipu_backend import Error
from ipu_backend.compiler import compile_module, to_jax
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


class CountsWithoutMinlength(torch.nn.Module):
    def forward(self, x):
        return torch.bincount(x)


def test_bincount_without_minlength_is_poptorchs_error():
    x = torch.tensor([0, 3, 3, 7])
    program = compile_module(CountsWithoutMinlength(), (x,))
    with pytest.raises(Error, match=r"^Bincount `minlength` must be specified and must be a constant\. On the "
                                    r"IPU MK2 platform the minimum length is also the maximum length\. "
                                    r"\(torch\.bincount at .*test_ops_counting\.py"):
        jax.jit(program.logged_fn)({}, {}, (to_jax(x),), jax.random.key(0))
