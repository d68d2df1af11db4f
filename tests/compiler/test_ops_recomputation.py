"""PopTorch's recomputationCheckpoint marker against its eager definition (an identity)."""

import pytest
import torch

from ipu_backend.blocks import recomputationCheckpoint
from ipu_backend.compiler.custom_ops import RECOMPUTATION_CHECKPOINT
from tests.compiler.harness import OpCase, case_params, check_case

CASES = [
    OpCase("recomputation_checkpoint", lambda x: recomputationCheckpoint(torch.sin(x)) * 2.0,
           lambda dtype: (torch.randn(3, 4, dtype=dtype),), (torch.float32, torch.float16),
           ops=(RECOMPUTATION_CHECKPOINT,)),
    OpCase("recomputation_checkpoint_pair", lambda x, y: sum(recomputationCheckpoint(x * y, x + y)),
           lambda dtype: (torch.randn(2, 5, dtype=dtype), torch.randn(2, 5, dtype=dtype)),
           ops=(RECOMPUTATION_CHECKPOINT,)),
]


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_recomputation_checkpoint(case, dtype):
    check_case(case, dtype)


def test_checkpoint_of_a_list_returns_a_list_and_rejects_non_tensors():
    x = torch.randn(3, requires_grad=True)
    out = recomputationCheckpoint([x, x * 2])
    assert isinstance(out, list) and len(out) == 2
    out[1].sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    with pytest.raises(ValueError, match="All inputs must be tensors"):
        recomputationCheckpoint(x, 3)
