"""PopTorch's marker ops against their eager definition."""

import pytest
import torch

import ipu_backend as poptorch
from ipu_backend import Error
from ipu_backend.compiler.custom_ops import IDENTITY_LOSS, NO_GRAD_UPDATE, UNSUPPORTED_GRADIENT, identity_loss
from ipu_backend.compiler.hints import HINT
from ipu_backend.compiler.host_calls import HOST_CALL
from ipu_backend.compiler.tensor_print import PRINT_TENSOR
from tests.compiler.harness import OpCase, case_params, check_case


def _clamped_under_no_grad(x):
    """torch keeps the history of a tensor changed in place under no_grad: the gradient passes
    the clamp unchanged."""
    y = x.exp().clone()
    with torch.no_grad():
        y.clamp_(max=2.0)
    return y * x


class Doubled(torch.autograd.Function):
    """A Function with a backward of its own: its forward runs in a compiled program."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, gradient):
        return gradient * 2


_SORT_ON_HOST = poptorch.CPU(lambda x: (torch.sort(x, dim=-1).values * 2, x.sum()), "SortOnHost")

CASES = [
    OpCase(f"identity_loss_{reduction}", lambda x, r=reduction: identity_loss(x * 2.0, r),
           lambda dtype: (torch.randn(3, 4, dtype=dtype),), (torch.float32, torch.float16), ops=(IDENTITY_LOSS,))
    for reduction in ("sum", "mean", "none")
] + [
    OpCase("hints_are_identities", lambda x: poptorch.nop(poptorch.set_available_memory(x.exp(), 0.5)) * 3,
           lambda dtype: (torch.randn(3, 4, dtype=dtype),), ops=(HINT,)),
    OpCase("ipu_print_tensor_is_an_identity", lambda x: poptorch.ipu_print_tensor(x.sin(), "x") * 2,
           lambda dtype: (torch.randn(3, 4, dtype=dtype),), ops=(PRINT_TENSOR,)),
    OpCase("cpu_op_runs_on_the_host", lambda x: [y + 1 for y in _SORT_ON_HOST(x.cos())],
           lambda dtype: (torch.randn(3, 4, dtype=dtype),), (torch.float32, torch.float16), grad=False,
           ops=(HOST_CALL,)),
    OpCase("custom_function_forward_runs", lambda x: Doubled.apply(x.sin()) + 1,
           lambda dtype: (torch.randn(3, 4, dtype=dtype),), grad=False, ops=(UNSUPPORTED_GRADIENT,)),
    OpCase("no_grad_update_keeps_the_history", _clamped_under_no_grad,
           lambda dtype: (torch.randn(3, 4, dtype=dtype),), ops=(NO_GRAD_UPDATE,)),
]


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_markers(case, dtype):
    check_case(case, dtype)


def test_identity_loss_eager_reduction_and_gradient():
    x = torch.randn(3, 4, requires_grad=True)
    loss = identity_loss(x, "mean")
    loss.backward()
    torch.testing.assert_close(loss, x.mean())
    torch.testing.assert_close(x.grad, torch.full_like(x, 1 / 12))


def test_identity_loss_rejects_unknown_reduction():
    with pytest.raises(Error, match="reduction must be one of"):
        identity_loss(torch.ones(2), "max")
