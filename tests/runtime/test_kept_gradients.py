"""An executor made with ``keep_gradients`` hands the host its last optimizer step's gradients, one
tensor per parameter, stacked weights of repeated layers included, as torch computes them."""

import copy

import torch

import ipu_backend as poptorch
from ipu_backend.runtime.executor import PoplarExecutor


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
                                            for _ in range(3)])
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.head(self.blocks(x)), y)


def test_the_gradients_of_the_last_step_equal_torchs_stacked_layers_included():
    torch.manual_seed(0)
    model = Blocks()
    reference = copy.deepcopy(model)
    options = poptorch.Options()
    options.Training.gradientAccumulation(2)
    executor = PoplarExecutor(model, options, True, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              keep_gradients=True)
    assert executor.gradients() == {}
    x, y = torch.randn(2, 3, 4), torch.randn(2, 3, 1)
    for _ in range(2):
        executor(x.reshape(6, 4), y.reshape(6, 1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        for micro in range(2):
            (reference(x[micro], y[micro]) / 2).backward()
        expected = {name: p.grad.clone() for name, p in reference.named_parameters()}
        optimizer.step()
    got = executor.gradients()
    assert got.keys() == expected.keys()
    for name, gradient in expected.items():
        torch.testing.assert_close(got[name], gradient, rtol=1e-5, atol=1e-6, msg=name)


def test_half_precision_gradients_reach_the_host_in_their_parameters_dtype():
    """A bfloat16 model's gradients (accumulated in float32 on the device) reach the host in the
    parameters' dtype, as torch's do."""
    torch.manual_seed(0)
    model = Blocks().to(torch.bfloat16)
    reference = copy.deepcopy(model)
    executor = PoplarExecutor(model, poptorch.Options(), True,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1), keep_gradients=True)
    x, y = torch.randn(3, 4).to(torch.bfloat16), torch.randn(3, 1).to(torch.bfloat16)
    executor(x, y)
    reference(x, y).backward()
    got = executor.gradients()
    for name, param in reference.named_parameters():
        assert got[name].dtype == torch.bfloat16, name
        torch.testing.assert_close(got[name], param.grad, rtol=2e-2, atol=1e-2, msg=name)


def test_gradients_accumulated_in_half_precision_are_kept_over_device_iterations():
    """PopTorch's ``accum_type=torch.float16``: the kept gradients are the half-precision
    accumulation the update took, over a loop of two device iterations (the last one's)."""
    torch.manual_seed(0)
    model = Blocks()
    reference = copy.deepcopy(model)
    options = poptorch.Options()
    options.deviceIterations(2)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, accum_type=torch.float16)
    executor = PoplarExecutor(model, options, True, optimizer=optimizer, keep_gradients=True)
    x, y = torch.randn(2, 3, 4), torch.randn(2, 3, 1)
    executor(x.reshape(6, 4), y.reshape(6, 1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        reference(x[step], y[step]).backward()
        expected = {name: p.grad.clone() for name, p in reference.named_parameters()}
        optimizer.step()
    got = executor.gradients()
    for name, gradient in expected.items():
        torch.testing.assert_close(got[name], gradient, rtol=1e-2, atol=1e-3, msg=name)
