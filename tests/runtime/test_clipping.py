"""Gradient clipping inside the compiled step (runtime/clipping.py) against torch's
clip_grad_norm_ / clip_grad_value_ between backward and step. fp32: 1e-5 relative."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch
from ipu_backend.runtime.clipping import GradientClipping
from ipu_backend.runtime.executor import PoplarExecutor

RTOL, ATOL = 1e-5, 1e-6


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(6, 8)
        self.out = torch.nn.Linear(8, 3)
        self.unused = torch.nn.Linear(2, 2)   # no gradient: torch skips it, it adds 0 here

    def forward(self, x, y):
        out = self.out(torch.tanh(self.hidden(x)))
        return out, F.mse_loss(out, y) * 10


def torch_clipped_steps(model, batches, clip):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad()
        model(x, y)[1].backward()
        if clip.algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip.value)
        else:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip.value)
        optimizer.step()


@pytest.mark.parametrize("clip", [GradientClipping(0.5, "norm"), GradientClipping(0.02, "value")],
                         ids=["norm", "value"])
def test_clipped_steps_equal_torch_clipping_between_backward_and_step(clip):
    torch.manual_seed(0)
    reference = Regression()
    ipu = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 6, generator=generator), torch.randn(24, 3, generator=generator)
    torch_clipped_steps(reference, zip(x.split(8), y.split(8)), clip)
    unclipped = copy.deepcopy(ipu)
    torch_clipped_steps(unclipped, zip(x.split(8), y.split(8)), GradientClipping(1e9, clip.algorithm))
    assert not torch.allclose(unclipped.out.weight, reference.out.weight), "the clip must bite"

    options = poptorch.Options(device_iterations=3, replication_factor=2)
    model = PoplarExecutor(ipu, options, True, torch.optim.SGD(ipu.parameters(), lr=0.05, momentum=0.9),
                           gradient_clipping=clip)
    model(x, y)
    for (name, p), (_, q) in zip(ipu.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("value, algorithm", [(0.0, "norm"), (float("inf"), "norm"), (1.0, "l1")])
def test_invalid_clipping_is_an_error(value, algorithm):
    with pytest.raises(poptorch.Error, match="gradient clipping"):
        GradientClipping(value, algorithm)
