"""Executors called from several threads: calls run one at a time, so every update lands. The
loss's gradient is constant, so N calls from each of two threads must give torch eager's 2N
sequential SGD steps whatever their order; a BatchNorm's batch counter counts every call."""

import copy
from concurrent.futures import ThreadPoolExecutor

import torch

import ipu_backend as poptorch

CALLS = 25


class Constant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(3))
        self.norm = torch.nn.BatchNorm1d(3)

    def forward(self, x):
        return (self.weight * x).sum() + 0 * self.norm(x).sum()


def test_one_executor_from_two_threads_keeps_every_update():
    torch.manual_seed(0)
    model = Constant()
    reference = copy.deepcopy(model)
    x = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0]])
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    for _ in range(2 * CALLS):
        optimizer.zero_grad()
        reference(x).backward()
        optimizer.step()

    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    inference = poptorch.inferenceModel(model)

    def train():
        for _ in range(CALLS):
            ipu(x)

    def read():
        for _ in range(CALLS):
            inference(x)
            model.state_dict()

    with ThreadPoolExecutor(3) as pool:
        for future in [pool.submit(train), pool.submit(train), pool.submit(read)]:
            future.result()
    assert int(model.norm.num_batches_tracked) == 2 * CALLS
    torch.testing.assert_close(model.weight.detach(), reference.weight.detach(), rtol=1e-5, atol=1e-6)
