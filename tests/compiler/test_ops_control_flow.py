"""Control flow lowerings: torch.cond against torch, both branches, forward and gradients;
torch's run-time data checks."""

import jax
import pytest
import torch
import torch.nn.functional as F

import ipu_backend
from ipu_backend.compiler import compile_module, runtime_checks, to_jax
from ipu_backend.compiler.loops import FOR_LOOP
from tests.compiler.harness import FnModule, OpCase, case_params, check_case


def looped(x, y):
    return ipu_backend.for_loop(3, lambda a, b: (torch.tanh(a * y) + b, b * 0.5), [x, y.exp()])


def gated(x, y):
    return torch.cond(x.sum() > 0, lambda a, b: (a * b).sin(), lambda a, b: a - b.exp(), (x, y))


CASES = [
    OpCase(f"cond_{name}", gated, lambda dtype, s=sign: (torch.rand(3, 4, dtype=dtype) * s, torch.randn(3, 4, dtype=dtype)),
           (torch.float32,), ops=(torch.ops.higher_order.cond,))
    for name, sign in (("true_branch", 1.0), ("false_branch", -1.0))
] + [
    OpCase("for_loop", looped, lambda dtype: (torch.randn(3, 4, dtype=dtype), torch.randn(3, 4, dtype=dtype)),
           ops=(FOR_LOOP,)),
    OpCase("one_hot_checks_class_range", lambda logits, y: (F.one_hot(y, 5) * logits).sum(-1),
           lambda dtype: (torch.randn(6, 5, dtype=dtype), torch.tensor([0, 4, 2, 2, 1, 3])),
           ops=(torch.ops.aten._assert_async.msg,)),
]


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_control_flow(case, dtype):
    check_case(case, dtype)


def one_hot_sum(y):
    return F.one_hot(y, 5).sum(0)


def test_data_checks_raise_after_a_compiled_call_and_op_by_op():
    program = compile_module(FnModule(one_hot_sum), (torch.tensor([1, 2]),))
    key = jax.random.key(0)
    compiled = jax.jit(lambda y: program.fn({}, {}, (y,), key))
    runtime_checks.forget_recorded()
    compiled(to_jax(torch.tensor([1, 4])))
    runtime_checks.raise_recorded()                          # in range: nothing to raise
    compiled(to_jax(torch.tensor([1, 7])))
    with pytest.raises(ipu_backend.Error, match=r"Class values must be smaller than num_classes\. \(at .*:[0-9]+: "):
        runtime_checks.raise_recorded()                      # torch's message, then the line
    with pytest.raises(ipu_backend.Error, match="Class values must be smaller than num_classes"):
        program.fn({}, {}, (to_jax(torch.tensor([1, 7])),), key)
    with pytest.raises(ipu_backend.Error, match="Class values must be smaller than num_classes"):
        ipu_backend.inferenceModel(FnModule(one_hot_sum))(torch.tensor([1, 7]))
