"""torch.distributions inside a model: their argument checks (``validate_args``, Python ``if``s on
tensor values) are made while the compiled program runs, and a call whose parameters or values
break a constraint raises after it, naming them, where torch raises ``ValueError``; valid ones give
torch eager's numbers. ``validate_args=False`` leaves the checks out, as in torch."""

import copy

import pytest
import torch
from torch.distributions import Distribution, Normal, kl_divergence

import ipu_backend as poptorch



class GaussianHead(torch.nn.Module):
    """A VAE-style head: the data's log-likelihood under a predicted normal, and its KL term."""

    def __init__(self, validate_args=None):
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)
        self.validate_args = validate_args

    def forward(self, x):
        mean, log_scale = self.layer(x).chunk(2, -1)
        posterior = Normal(mean, log_scale.exp(), validate_args=self.validate_args)
        loss = -posterior.log_prob(x[:, :1]).mean() + kl_divergence(posterior, Normal(0.0, 1.0)).mean()
        return posterior.mean, loss


def test_distributions_train_as_torch_with_their_checks_made_while_running():
    torch.manual_seed(0)
    model = GaussianHead()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    default = Distribution._validate_args       # (TorchDynamo's first use in a process turns it off)
    _, loss = training(x)
    assert Distribution._validate_args is default
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    _, expected = reference(x)
    expected.backward()
    optimizer.step()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    training.copyWeightsToHost()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


class Scored(torch.nn.Module):
    def __init__(self, validate_args):
        super().__init__()
        self.validate_args = validate_args

    def forward(self, mean, scale, value):
        return Normal(mean, scale, validate_args=self.validate_args).log_prob(value)


def test_parameters_and_values_outside_their_constraints_raise_after_the_call():
    model = Scored(True)
    executor = poptorch.inferenceModel(model)
    good = torch.zeros(3), torch.ones(3), torch.randn(3)
    torch.testing.assert_close(executor(*good), model(*good), rtol=1e-6, atol=1e-6)
    bad_scale = torch.zeros(3), torch.tensor([1.0, -1.0, 1.0]), torch.randn(3)
    with pytest.raises(ValueError, match="Expected parameter scale"):
        model(*bad_scale)
    with pytest.raises(poptorch.Error, match=r"Expected parameter scale of distribution Normal to satisfy the "
                                             r"constraint GreaterThan\(lower_bound=0.0\).*test_distributions.py"):
        executor(*bad_scale)
    bad_value = torch.zeros(3), torch.ones(3), torch.tensor([0.0, float("nan"), 1.0])
    with pytest.raises(ValueError, match="Expected value argument"):
        model(*bad_value)
    with pytest.raises(poptorch.Error, match=r"Expected value argument to be within the support \(Real\(\)\)"):
        executor(*bad_value)


def test_validate_args_false_leaves_the_checks_out_as_in_torch():
    bad_scale = torch.zeros(3), torch.tensor([1.0, -1.0, 1.0]), torch.zeros(3)
    torch.testing.assert_close(poptorch.inferenceModel(Scored(False))(*bad_scale), Scored(False)(*bad_scale),
                               equal_nan=True)
