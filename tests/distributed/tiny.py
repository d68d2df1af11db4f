"""A small regression trained by several instances (a script ipu-run starts) and compared in the test
process with one instance of all the replicas and with torch eager."""

import numpy as np
import torch

import ipu_backend as poptorch

ITERATIONS, ACCUMULATION, REPLICAS, MICRO = 2, 2, 4, 2
CALLS = 2
ROWS = ITERATIONS * ACCUMULATION * REPLICAS * MICRO
"""Rows of one call's global combined batch."""


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x, y):
        prediction = self.out(torch.tanh(self.hidden(x)))
        noise = torch.rand_like(y)               # random numbers, each replica its own
        return prediction, torch.nn.functional.mse_loss(prediction, y), noise


def model() -> Regression:
    torch.manual_seed(0)
    return Regression()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """The global combined batches of every call, concatenated."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(CALLS * ROWS, 4, generator=generator)
    return x, x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(CALLS * ROWS, 1, generator=generator)


def share(batch: torch.Tensor, offset: int, replicas: int) -> torch.Tensor:
    """An instance's rows of a global combined batch: its replicas' micro-batches, in order."""
    layout = batch.reshape(ITERATIONS, ACCUMULATION, REPLICAS, MICRO, *batch.shape[1:])
    return layout[:, :, offset:offset + replicas].reshape(-1, *batch.shape[1:])


def optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), lr=0.05)


def options(opts: poptorch.Options) -> poptorch.Options:
    opts.deviceIterations(ITERATIONS).Training.gradientAccumulation(ACCUMULATION)
    return opts.outputMode(poptorch.OutputMode.All)


def train(opts: poptorch.Options, offset: int, replicas: int) -> tuple[Regression, list[np.ndarray],
                                                                     list[np.ndarray]]:
    """Train on this instance's share of each call's global batch; the weights, each call's losses
    and each call's random numbers."""
    net = model()
    training = poptorch.trainingModel(net, options(opts), optimizer(net))
    x, y = data()
    losses, noises = [], []
    for call in range(CALLS):
        rows = slice(call * ROWS, (call + 1) * ROWS)
        _, loss, noise = training(share(x[rows], offset, replicas), share(y[rows], offset, replicas))
        losses.append(loss.numpy())
        noises.append(noise.numpy())
    return net, losses, noises


def torch_eager() -> Regression:
    """Every optimizer step on one iteration's rows of the global batch (the mean loss over them)."""
    net = model()
    adamw = optimizer(net)
    x, y = data()
    for step in range(CALLS * ITERATIONS):
        rows = slice(step * ROWS // ITERATIONS, (step + 1) * ROWS // ITERATIONS)
        adamw.zero_grad()
        net(x[rows], y[rows])[1].backward()
        adamw.step()
    return net
