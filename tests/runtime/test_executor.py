"""trainingModel/inferenceModel against torch eager on the CPU: device iterations, accumulation,
replication, output modes, weights, errors. fp32 tolerance: 1e-5 relative (1e-6 absolute)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch

RTOL, ATOL = 1e-5, 1e-6


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(6, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x, y=None):
        out = self.out(torch.tanh(self.hidden(x)))
        if y is None:
            return out
        return out, F.mse_loss(out, y)


def data(n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=generator), torch.randn(n, 3, generator=generator)


def assert_params_equal(model, reference):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=name)


def torch_steps(model, batches, lr=0.05):
    """Plain torch: one SGD step per batch, each on the batch's mean loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_device_iterations_equal_torch_steps_and_split_calls():
    torch.manual_seed(0)
    reference = Regression()
    ten, five_twice = copy.deepcopy(reference), copy.deepcopy(reference)
    x, y = data(40)
    expected_losses = torch_steps(reference, zip(x.split(4), y.split(4)))

    opts = poptorch.Options().deviceIterations(10)
    opts.outputMode(poptorch.OutputMode.All)
    model = poptorch.trainingModel(ten, opts, torch.optim.SGD(ten.parameters(), lr=0.05))
    _, losses = model(x, y)
    torch.testing.assert_close(losses, expected_losses, rtol=RTOL, atol=ATOL)
    assert_params_equal(ten, reference)

    model = poptorch.trainingModel(five_twice, poptorch.Options().deviceIterations(5),
                                   torch.optim.SGD(five_twice.parameters(), lr=0.05))
    for half in (slice(0, 20), slice(20, 40)):
        _, final_loss = model(x[half], y[half])
    torch.testing.assert_close(final_loss, expected_losses[-1], rtol=RTOL, atol=ATOL)
    assert final_loss.shape == ()
    assert_params_equal(five_twice, reference)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradient_accumulation_equals_torch_accumulating_loss_over_micro_batches(reduction):
    torch.manual_seed(1)
    reference = Regression()
    ipu = copy.deepcopy(reference)
    x, y = data(24)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(2):
        optimizer.zero_grad()
        for micro in range(4):
            rows = slice(step * 12 + micro * 3, step * 12 + micro * 3 + 3)
            _, loss = reference(x[rows], y[rows])
            (loss / 4 if reduction == "mean" else loss).backward()
        optimizer.step()

    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(4)
    opts.Training.accumulationAndReplicationReductionType(
        poptorch.ReductionType.Mean if reduction == "mean" else poptorch.ReductionType.Sum)
    model = poptorch.trainingModel(ipu, opts, torch.optim.SGD(ipu.parameters(), lr=0.05))
    model(x, y)
    assert_params_equal(ipu, reference)


@pytest.mark.parametrize("replicas", [1, 2, 4, 8])
def test_replication_equals_the_large_batch_torch_step(replicas):
    torch.manual_seed(2)
    reference = Regression()
    ipu = copy.deepcopy(reference)
    x, y = data(4 * replicas * 3)
    torch_steps(reference, zip(x.split(4 * replicas), y.split(4 * replicas)))

    opts = poptorch.Options().deviceIterations(3).replicationFactor(replicas)
    model = poptorch.trainingModel(ipu, opts, torch.optim.SGD(ipu.parameters(), lr=0.05))
    _, loss = model(x, y)
    assert loss.shape == (() if replicas == 1 else (replicas,))
    assert_params_equal(ipu, reference)
