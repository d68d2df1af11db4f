"""Small block-annotated models and plain-torch references for the multi-IPU tests."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import ipu_backend as poptorch

RTOL, ATOL = 1e-5, 1e-6


class TwoStages(nn.Module):
    """Linear(6→8) [+BatchNorm] + tanh on IPU 0, Linear(8→3) and the loss on IPU 1."""

    def __init__(self, batch_norm: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8) if batch_norm else nn.Identity()
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x, y=None):
        with poptorch.Block("B1", ipu_id=0):
            h = torch.tanh(self.norm(self.fc1(x)))
        with poptorch.Block("B2", ipu_id=1):
            out = self.fc2(h)
            if y is None:
                return out
            loss = F.mse_loss(out, y)
        return out, loss


class FourStagesWithSkip(nn.Module):
    """Four blocks; block 3 also reads block 1's output (a value crossing two IPUs)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(5, 5) for _ in range(4))

    def forward(self, x, y):
        with poptorch.Block("B1"):
            h1 = torch.relu(self.layers[0](x))
        with poptorch.Block("B2"):
            h2 = torch.sigmoid(self.layers[1](h1))
        with poptorch.Block("B3"):
            h3 = self.layers[2](h2) + h1
        with poptorch.Block("B4"):
            out = self.layers[3](torch.tanh(h3))
            loss = F.cross_entropy(out, y)
        return out, loss


def regression_data(n: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=generator), torch.randn(n, 3, generator=generator)


def torch_training(model, optimizer, x, y, accumulation: int, micro: int):
    """Plain torch: one optimizer step per ``accumulation`` micro-batches of ``micro`` samples,
    gradients of the mean loss over micro-batches. Returns every micro-batch's output and loss."""
    outputs, losses = [], []
    steps = x.shape[0] // (accumulation * micro)
    for step in range(steps):
        optimizer.zero_grad()
        for a in range(accumulation):
            start = (step * accumulation + a) * micro
            out, loss = model(x[start:start + micro], y[start:start + micro])
            (loss / accumulation).backward()
            outputs.append(out.detach())
            losses.append(loss.detach())
        optimizer.step()
    return torch.cat(outputs), torch.stack(losses)


def assert_same_parameters(model, reference):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=name)
    for (name, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(b, c, rtol=RTOL, atol=ATOL, msg=name)


def twins(model):
    return model, copy.deepcopy(model)
