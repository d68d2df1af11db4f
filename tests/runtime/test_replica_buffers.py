"""Per-replica buffers (Options.broadcastBuffers(False)): each replica keeps its own buffers from
call to call, as torch would with one model copy per replica."""

import copy

import pytest
import torch

import ipu_backend as poptorch
from ipu_backend import Error


class Accumulate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(1, 2))

    def forward(self, x):
        self.total.copy_(self.total + x)
        return self.total * 1


def test_each_replica_accumulates_its_own_inputs():
    options = poptorch.Options().replicationFactor(2).broadcastBuffers(False)
    model = Accumulate()
    inference = poptorch.inferenceModel(model, options)
    x = torch.tensor([[9.0], [2.0]])
    for _ in range(5):
        out = inference(x)
    torch.testing.assert_close(out, torch.tensor([[45.0, 45.0], [10.0, 10.0]]))
    torch.testing.assert_close(model.total, torch.tensor([[45.0, 45.0]]))     # the host reads replica 0's


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.loss = torch.nn.MSELoss()

    def forward(self, x, y):
        out = self.norm(self.linear(x))
        return out, self.loss(out, y)


def test_batch_norm_statistics_stay_per_replica_and_weights_equal_torch():
    # torch: two model copies with the same weights, each its own half of every batch and its own
    # running statistics; the gradients averaged over the copies drive one SGD step.
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    copies = [copy.deepcopy(reference) for _ in range(2)]
    batches = [(torch.randn(8, 3) * (1 + i), torch.randn(8, 4)) for i in range(3)]
    for x, y in batches:
        grads = []
        for r, replica in enumerate(copies):
            replica.zero_grad()
            replica(x[4 * r:4 * r + 4], y[4 * r:4 * r + 4])[1].backward()
            grads.append([p.grad for p in replica.parameters()])
        with torch.no_grad():
            for r in range(2):
                for p, g0, g1 in zip(copies[r].parameters(), grads[0], grads[1]):
                    p -= 0.1 * (g0 + g1) / 2
    options = poptorch.Options().replicationFactor(2).broadcastBuffers(False)
    training = poptorch.trainingModel(model, options, torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in batches:
        training(x, y)
    training.copyWeightsToHost()
    for mine, theirs in zip(model.parameters(), copies[0].parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.norm.running_mean, copies[0].norm.running_mean, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(copies[0].norm.running_mean, copies[1].norm.running_mean)


def test_buffers_copied_to_the_device_start_every_replica_again():
    options = poptorch.Options().replicationFactor(2).broadcastBuffers(False)
    model = Accumulate()
    inference = poptorch.inferenceModel(model, options)
    x = torch.tensor([[9.0], [2.0]])
    inference(x)
    inference.copyWeightsToHost()
    model.total.fill_(100.0)
    inference.copyWeightsToDevice()
    torch.testing.assert_close(inference(x), torch.tensor([[109.0, 109.0], [102.0, 102.0]]))


def test_per_replica_buffers_in_a_model_split_over_ipus_are_refused():
    class Split(Accumulate):
        def forward(self, x):
            with poptorch.Block(ipu_id=0):
                y = x * 2
            with poptorch.Block(ipu_id=1):
                return super().forward(y)

    options = poptorch.Options().replicationFactor(2).deviceIterations(2).broadcastBuffers(False)
    with pytest.raises(Error, match=r"keep per-replica buffers \(broadcastBuffers\(False\)\)"):
        poptorch.inferenceModel(Split(), options)(torch.ones(4, 1))
