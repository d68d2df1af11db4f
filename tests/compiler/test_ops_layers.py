"""Repeated layers against torch: a chain of identical layers lowered as one loop, and calls of
identical layers that do not feed each other lowered one by one from their template."""

import pytest
import torch
from torch import nn

from ipu_backend.compiler.layer_calls import REPEATED_LAYER
from ipu_backend.compiler.layer_loops import layer_loop
from tests.compiler.harness import OpCase, case_params, check_case


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        return x + torch.tanh(self.norm(self.linear(x)))


class Heads(nn.Module):
    """Identical layers all reading the same input: calls, not a chain."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        return torch.stack([head(x) for head in self.heads])


torch.manual_seed(0)
CASES = [
    OpCase("repeated_layers_loop", nn.Sequential(*(Block() for _ in range(3))),
           lambda dtype: (torch.randn(4, 6, dtype=dtype),), ops=(layer_loop,)),
    OpCase("repeated_layer_calls", Heads(), lambda dtype: (torch.randn(4, 6, dtype=dtype),),
           ops=(REPEATED_LAYER,)),
]


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_repeated_layers(case, dtype):
    check_case(case, dtype)
