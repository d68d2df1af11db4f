"""Batch norms with ``momentum=None`` (a cumulative moving average of the batches' statistics)
train as in torch eager: weights, running statistics and the batch count after several steps, and
the eval-mode output that uses them (fp32 within 1e-5)."""

import copy

import pytest
import torch

import ipu_backend as poptorch

RTOL, ATOL = 1e-5, 1e-5


class Normalized(torch.nn.Module):
    def __init__(self, images: bool):
        super().__init__()
        self.layer = torch.nn.Conv2d(4, 4, 1) if images else torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm2d(4, momentum=None) if images else torch.nn.BatchNorm1d(4, momentum=None)

    def forward(self, x):
        out = self.norm(self.layer(x))
        return out, (out ** 3).mean()


@pytest.mark.parametrize("images", [False, True], ids=["BatchNorm1d", "BatchNorm2d"])
def test_cumulative_batch_norm_trains_as_torch(images):
    torch.manual_seed(0)
    model = Normalized(images)
    reference = copy.deepcopy(model)
    options = poptorch.Options().deviceIterations(3).enableExecutableCaching(None)
    training = poptorch.trainingModel(model, options, torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    shape = (4, 4, 5, 5) if images else (8, 4)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        xs = torch.randn(3 * shape[0], *shape[1:], generator=generator) * 3 + 1
        training(xs)
        for x in xs.chunk(3):
            optimizer.zero_grad()
            reference(x)[1].backward()
            optimizer.step()
    for (name, value), (_, expected) in zip(model.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(value, expected, rtol=RTOL, atol=ATOL, msg=name)
    assert int(model.norm.num_batches_tracked) == 6
    x = torch.randn(*shape, generator=generator)
    torch.testing.assert_close(poptorch.inferenceModel(model.eval())(x)[0], reference.eval()(x)[0],
                               rtol=RTOL, atol=ATOL)
