"""torch's Adagrad, Adadelta, Adamax, NAdam and RAdam in a training model against torch eager:
weights and ``optimizer.state`` after 40 steps (RAdam's rectified steps start at the sixth), the
repeated layers' weights updated stacked. fp32: 1e-5 relative (1e-6 absolute)."""

import copy
import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch
from ipu_backend.runtime.torch_algorithms import _radam_length, _RAdamRule
from ipu_backend.runtime.weights import weight_store

RTOL, ATOL = 1e-5, 1e-6
STEPS, ITERATIONS = 40, 4


class Blocks(torch.nn.Module):
    """Three identical blocks (one loop over stacked weights) between two layers of their own."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(3, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3))
        self.last = torch.nn.Linear(8, 2)

    def forward(self, x, y):
        hidden = torch.tanh(self.first(x))
        for block in self.blocks:
            hidden = block(hidden)
        out = self.last(hidden)
        return out, F.mse_loss(out, y)


OPTIMIZERS = {
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01, weight_decay=0.01,
                                             initial_accumulator_value=0.1),
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0, rho=0.9, weight_decay=0.01),
    "adamax": lambda p: torch.optim.Adamax(p, lr=0.01, weight_decay=0.01),
    "nadam": lambda p: torch.optim.NAdam(p, lr=0.01, weight_decay=0.01, decoupled_weight_decay=True),
    "radam": lambda p: torch.optim.RAdam(p, lr=0.01, betas=(0.9, 0.99), weight_decay=0.01),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_torchs_other_optimizers_train_as_torch_does(name):
    torch.manual_seed(0)
    model = Blocks()
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](reference.parameters())
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(STEPS, 4, 3, generator=generator), torch.randn(STEPS, 4, 2, generator=generator)
    for step in range(STEPS):
        reference_optimizer.zero_grad()
        reference(x[step], y[step])[1].backward()
        reference_optimizer.step()
    training = poptorch.trainingModel(model, poptorch.Options().deviceIterations(ITERATIONS), optimizer=optimizer)
    for call in range(STEPS // ITERATIONS):
        rows = slice(call * ITERATIONS, (call + 1) * ITERATIONS)
        training(x[rows].reshape(-1, 3), y[rows].reshape(-1, 2))
    assert weight_store(model).packing.stacks, "the blocks' weights are updated stacked"
    for (key, param), reference_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param, reference_param, rtol=RTOL, atol=ATOL, msg=key)
        ours, torchs = optimizer.state[param], reference_optimizer.state[reference_param]
        assert list(ours) == list(torchs), key
        for slot, value in torchs.items():
            torch.testing.assert_close(ours[slot], value, rtol=RTOL, atol=ATOL, msg=f"{key} {slot}")


@pytest.mark.parametrize("beta2", [0.999, 0.99, 0.9])
def test_radams_rectifier_length_does_not_cancel(beta2):
    steps = np.array([1, 2, 5, 6, 7, 50, 499, 501, 1000, 10 ** 5], np.float32)
    hyper = torch.optim.RAdam([torch.nn.Parameter(torch.zeros(1))], betas=(0.9, beta2)).param_groups[0]
    values = {key: np.float32(value) for key, value in _RAdamRule._group_hyper(None, hyper).items()}
    ours = np.asarray(_radam_length(jnp.asarray(steps), values))
    rho_inf = 2 / (1 - beta2) - 1
    exact = [rho_inf - 2 * t * beta2 ** t / (1 - beta2 ** t) for t in steps.astype(float)]
    np.testing.assert_allclose(ours, exact, rtol=1e-6, atol=2e-6)
    assert math.isclose(float(ours[0]), 1.0, abs_tol=1e-5), "rho_1 = 1 whatever beta2"
