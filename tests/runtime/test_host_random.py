"""Random numbers a model draws on the host in Python (``random``, NumPy) while it is captured are
refused by name: the program would reuse the one draw made at capture on every call. A
``poptorch.CPU`` function, which runs on the host at every call, draws as in torch eager."""

import random

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch
from tests.lightning.helpers import QUIET, dataset, loader


class FlipsAtRandom(torch.nn.Module):
    def __init__(self, draw):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.draw = draw

    def forward(self, x):
        return self.linear(x.flip(-1) if self.draw(self) < 0.5 else x)


class HoldsAGenerator(FlipsAtRandom):
    def __init__(self):
        super().__init__(lambda module: module.rng.random())
        self.rng = np.random.default_rng(0)


@pytest.mark.parametrize("model, named", [
    (FlipsAtRandom(lambda module: random.random()), "Python's random module"),
    (FlipsAtRandom(lambda module: np.random.uniform()), r"NumPy's global generator \(np.random\)"),
    (HoldsAGenerator(), r"self.rng"),
])
def test_a_forward_drawing_python_random_numbers_is_refused(model, named):
    with pytest.raises(poptorch.Error, match=f"the model's forward draws random numbers from {named} while it is "
                                             "captured: .*reuse that one draw.*torch.rand"):
        poptorch.inferenceModel(model)(torch.randn(2, 4))


class ScalesAtRandom(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0] * float(np.random.uniform(0.5, 1.5))), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_lightning_step_drawing_numpy_random_numbers_is_refused():
    with pytest.raises(poptorch.Error, match="the training_step draws random numbers from NumPy's global"):
        pl.Trainer(accelerator="ipu", devices=1, max_epochs=1, **QUIET).fit(ScalesAtRandom(), loader(dataset(8), 4))


class NoisyOnHost(torch.nn.Module):
    """A host function that adds Python random noise at every call."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.cpu = poptorch.CPU(lambda x: x + random.random(), "Noise")

    def forward(self, x):
        return self.cpu(self.linear(x))


def test_a_host_function_draws_the_same_numbers_as_in_torch_eager():
    torch.manual_seed(0)
    model, x = NoisyOnHost(), torch.randn(2, 4)
    random.seed(0)
    expected = [model(x) for _ in range(3)]
    random.seed(0)
    compiled = poptorch.inferenceModel(model)
    for want in expected:
        torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-6)
