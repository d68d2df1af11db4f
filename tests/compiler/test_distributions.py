"""torch.distributions inside a model: their argument checks (``validate_args``, Python ``if``s on
tensor values) are left out of the compiled program with a warning, and the numbers equal torch
eager, which runs them; a distribution given ``validate_args=True`` keeps its checks and fails to
capture on them."""

import copy

import pytest
import torch
from torch.distributions import Distribution, Normal, kl_divergence

import ipu_backend as poptorch

SKIPPED = r"torch.distributions' argument checks \(validate_args\) are not evaluated in the compiled program"


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


def test_distributions_train_as_torch_with_their_checks_left_out_and_said_so():
    torch.manual_seed(0)
    model = GaussianHead()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match=SKIPPED):
        _, loss = training(x)
    assert Distribution._validate_args is True            # torch's default, restored
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    _, expected = reference(x)
    expected.backward()
    optimizer.step()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    training.copyWeightsToHost()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_distribution_that_asks_for_its_checks_fails_to_capture_on_them():
    model = poptorch.inferenceModel(GaussianHead(validate_args=True))
    with pytest.raises(poptorch.Error, match="branches on the value of a tensor"):
        model(torch.randn(4, 3))
    assert Distribution._validate_args is True
