"""Python values a PopTorch model's forward assigns on its modules are made on the host after each
call, as torch eager leaves them (a flag it reads and flips captures the model again); a counter,
an assigned tensor, and a value read and changed by a call of several iterations are refused by
name. fp32: 1e-5 relative (1e-6 absolute)."""

import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch

RTOL, ATOL = 1e-5, 1e-6


class WarmsUp(torch.nn.Module):
    """Doubles its output on the first call only; notes the shape it saw."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.warm, self.shape, self.calls = True, None, 0

    def forward(self, x, target=None):
        y = self.linear(x)
        if self.warm:
            y, self.warm = y * 2, False
        self.shape = tuple(x.shape)
        return y if target is None else (y, F.mse_loss(y, target))


def twins():
    torch.manual_seed(0)
    model = WarmsUp()
    reference = WarmsUp()
    reference.load_state_dict(model.state_dict())
    return model, reference


def test_a_flag_a_forward_flips_reaches_the_host_and_infers_as_torch():
    model, reference = twins()
    x = torch.randn(3, 4)
    compiled = poptorch.inferenceModel(model)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), reference(x), rtol=RTOL, atol=ATOL)
        assert (model.warm, model.shape) == (reference.warm, reference.shape) == (False, (3, 4))


def test_a_flag_a_forward_flips_trains_as_torch():
    model, reference = twins()
    x, target = torch.randn(3, 4), torch.randn(3, 2)
    compiled = poptorch.trainingModel(model, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        _, loss = compiled(x, target)
        optimizer.zero_grad()
        _, expected = reference(x, target)
        expected.backward()
        optimizer.step()
        torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=ATOL)
    compiled.copyWeightsToHost()
    torch.testing.assert_close(model.linear.weight, reference.linear.weight, rtol=RTOL, atol=ATOL)
    assert model.warm is reference.warm is False


class Counts(WarmsUp):
    def forward(self, x):
        self.calls += 1
        return self.linear(x)


class KeepsAttention(WarmsUp):
    def forward(self, x):
        y = self.linear(x)
        self.attention = y.detach()
        return y


@pytest.mark.parametrize("model, message", [
    (Counts(), r"the model's forward changes self.calls \(0 -> 1\): .*return it from forward"),
    (KeepsAttention(), r"the model's forward assigns a tensor to self.attention: .*buffer in place"),
])
def test_a_forward_that_counts_or_keeps_a_tensor_is_refused(model, message):
    with pytest.raises(poptorch.Error, match=message):
        poptorch.inferenceModel(model)(torch.randn(3, 4))


def test_a_flag_read_and_flipped_in_a_call_of_several_iterations_is_refused():
    model = poptorch.inferenceModel(WarmsUp(), poptorch.Options().deviceIterations(2))
    with pytest.raises(poptorch.Error, match=r"the model reads self.warm and changes it: .*2 forwards one call runs"):
        model(torch.randn(6, 4))
