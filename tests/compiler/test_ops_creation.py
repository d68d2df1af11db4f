"""Creation and cast lowerings against torch: full/zeros/ones and their *_like/new_* forms,
empty (zeros here), scalar_tensor, arange (torch's length rule), linspace/eye/tril/triu (which
decompose to arange and comparisons), and dtype casts."""

import numpy as np
import pytest
import torch

from ipu_backend.compiler import compile_module, to_jax
from tests.compiler.harness import FnModule, OpCase, case_params, check_case

aten = torch.ops.aten
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)


def randn(*shapes):
    return lambda dtype: tuple(torch.randn(*s).to(dtype) for s in shapes)


def fractional_values(dtype):
    """Both signs around integers, and values that wrap when narrowed to int8/uint8."""
    values = torch.tensor([1.7, -1.7, 0.5, -0.5, 2.9, -2.9, 0.0, -0.0, 100.3, -100.3, 255.9, -1.0])
    return values.view(3, 4).to(dtype),


def integer_values(dtype):
    if dtype == torch.bool:
        return torch.tensor([[True, False, True], [False, False, True]]),
    return torch.tensor([[0, 1, -1, 200], [-200, 70000, -5, 3]], dtype=dtype),


CASES = [
    OpCase("full_zeros_ones",
           lambda x: (torch.full((2, 3), 1.5), torch.full((2,), 7), torch.full((2,), True), torch.zeros(2, 3),
                      torch.ones(2, dtype=torch.int64), torch.full((2,), float("-inf")), x.new_zeros(2),
                      x.new_ones((2, 2)), x.new_full((3,), -2.5), torch.zeros_like(x), torch.ones_like(x),
                      torch.full_like(x, 3), torch.full_like(x, 7, dtype=torch.int32), x + torch.ones(3, 1)),
           randn((3, 4)), FLOATS, ops=(aten.full.default, aten.full_like.default)),
    OpCase("empty_then_filled",
           lambda x: (torch.empty(2, 3).fill_(2.0), torch.empty_like(x).fill_(1), x.new_empty(3).fill_(0.5),
                      torch.empty_strided((2, 3), (3, 1)).fill_(3), x.new_empty_strided((2,), (1,)).fill_(1),
                      torch.empty(2, 2).copy_(x[:2, :2])),
           randn((3, 4)), (torch.float32,),
           ops=(aten.empty.memory_format, aten.empty_permuted.default, aten.empty_strided.default,
                aten.new_empty_strided.default)),
    OpCase("scalar_tensor",
           lambda x: (torch.where(x > 0, x, 0.5), torch.where(x > 0, 2, x), x.masked_fill(x < 0, -1.0),
                      torch.where(x > 0, 1.0, 0.0)),
           randn((3, 4)), FLOATS, ops=(aten.scalar_tensor.default,)),
    OpCase("arange",
           lambda x: (torch.arange(5), torch.arange(1, 7, 2), torch.arange(-1, -10, -3), torch.arange(0, 1, 0.1),
                      torch.arange(1, 2, 0.3), torch.arange(1, 2.5, 0.5), torch.arange(5.0), torch.arange(2.5, -1, -0.7),
                      torch.arange(0.5, 5.5, 1.5, dtype=torch.int64), torch.arange(x.shape[0], dtype=x.dtype),
                      torch.arange(0, 1, 0.1, dtype=x.dtype), torch.arange(-3, 300, 7, dtype=x.dtype)),
           randn((3, 4)), FLOATS, ops=(aten.arange.start_step,)),
    OpCase("linspace_eye_tril_triu",
           lambda x: (torch.linspace(0, 1, 5), torch.linspace(-2, 3, 7, dtype=x.dtype), torch.linspace(0, 10, 4,
                      dtype=torch.int64), torch.eye(3), torch.eye(2, 4, dtype=x.dtype), torch.tril(x),
                      torch.triu(x, 1), torch.tril(x, -1), x.triu(diagonal=-1)),
           randn((3, 4)), FLOATS, ops=(aten.arange.start_step,)),
    OpCase("casts_from_float",
           lambda x: (x.int(), x.long(), x.to(torch.int16), x.to(torch.int8), x.to(torch.uint8), x.bool(),
                      x.half() * 2, x.bfloat16() * 2, x.float() * 2, x.double() * 2, x.to(torch.float32)),
           fractional_values, FLOATS, ops=(aten._to_copy.default, aten._assert_tensor_metadata.default)),
    OpCase("casts_from_integer",
           lambda a: (a.float(), a.half(), a.bfloat16(), a.bool(), a.int(), a.long(), a.to(torch.int8),
                      a.to(torch.uint8), a.double()),
           integer_values, INTS + (torch.bool,), ops=(aten._to_copy.default,)),
]


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_creation(case, dtype):
    check_case(case, dtype)


def _run(fn, *inputs):
    program = compile_module(FnModule(fn), inputs)
    outputs, _ = program.fn({}, {}, tuple(to_jax(x) for x in inputs), None)
    return outputs


def test_empty_is_zeros():
    """torch's empty tensors are uninitialized; here they are zeros, so programs are deterministic."""
    x = torch.randn(3, 4)
    outputs = _run(lambda x: (torch.empty(2, 3), torch.empty_like(x), x.new_empty(3, dtype=torch.int32),
                              torch.empty_strided((2, 3), (1, 2)), x.new_empty_strided((2,), (1,))), x)
    shapes = [(2, 3), (3, 4), (3,), (2, 3), (2,)]
    assert [tuple(out.shape) for out in outputs] == shapes
    assert outputs[2].dtype == np.int32
    for out in outputs:
        np.testing.assert_array_equal(np.asarray(out), 0)


def test_int64_fill_values_saturate():
    """int64 is carried as int32: int64 sentinels become the int32 extremes rather than wrapping."""
    low, high = _run(lambda x: (torch.full((2,), torch.iinfo(torch.int64).min), x.new_full((2,), 2 ** 40,
                                                                                          dtype=torch.long)),
                     torch.randn(2))
    np.testing.assert_array_equal(np.asarray(low), np.iinfo(np.int32).min)
    np.testing.assert_array_equal(np.asarray(high), np.iinfo(np.int32).max)


def test_non_finite_float_to_int_is_int32_min():
    """NaN, infinities and out-of-range values cast to integers give INT32_MIN, as torch gives
    INT_MIN on x86 (the value is undefined in C++ and differs on other CPUs)."""
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e9, -3e9, 2.5])
    (as_int,) = _run(lambda x: (x.int(),), x)
    np.testing.assert_array_equal(np.asarray(as_int), [np.iinfo(np.int32).min] * 5 + [2])
