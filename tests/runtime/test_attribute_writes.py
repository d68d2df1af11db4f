"""Python values a PopTorch model's forward assigns on its modules are made on the host after each
call, as torch eager leaves them (a flag it reads and flips captures the model again); a counter,
an assigned tensor, and a value read and changed by a call of several iterations are refused by
name; so are those it assigns in a configuration record (a dataclass, a namespace) or a dict
nested in what it holds. fp32: 1e-5 relative (1e-6 absolute)."""

import argparse
import dataclasses
import types

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


def twins(make=WarmsUp):
    """``make()`` twice, with the same weights: the compiled model and torch's reference."""
    torch.manual_seed(0)
    model, reference = make(), make()
    reference.load_state_dict(model.state_dict())
    return model, reference


def test_a_flag_a_forward_flips_reaches_the_host_and_infers_as_torch():
    model, reference = twins()
    x = torch.randn(3, 4)
    compiled = poptorch.inferenceModel(model)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), reference(x), rtol=RTOL, atol=ATOL)
        assert (model.warm, model.shape) == (reference.warm, reference.shape) == (False, (3, 4))


def train_alike(model, reference, held):
    """Three training calls of ``model`` and three torch steps of ``reference``: equal losses,
    equal ``held(model)`` after each, equal weights."""
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
        assert held(model) == held(reference)
    compiled.copyWeightsToHost()
    torch.testing.assert_close(model.linear.weight, reference.linear.weight, rtol=RTOL, atol=ATOL)


def test_a_flag_a_forward_flips_trains_as_torch():
    model, reference = twins()
    train_alike(model, reference, lambda m: m.warm)
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


@dataclasses.dataclass
class Schedule:
    warm: bool = True
    scale: float = 2.0
    seen: int = 0


class Configured(torch.nn.Module):
    """Reads and flips a flag it holds in a configuration record, not as an attribute of its own,
    by name (as generic code does: the name is not in the source)."""

    def __init__(self, config, flag="warm"):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.config, self.flag = config, flag

    def forward(self, x, target=None):
        y = self.linear(x) * getattr(self.config, "scale")
        if getattr(self.config, self.flag):
            y = y * 2
            setattr(self.config, self.flag, False)
        return y if target is None else (y, F.mse_loss(y, target))


class Phased(torch.nn.Module):
    """Reads and flips a flag in a dict it holds in a list."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.phases = [{"warm": True}]

    def forward(self, x, target=None):
        y = self.linear(x)
        if self.phases[0]["warm"]:
            y, self.phases[0]["warm"] = y * 3, False
        return y if target is None else (y, F.mse_loss(y, target))


def held_flag(model):
    return model.phases if isinstance(model, Phased) else model.config.warm


@pytest.mark.parametrize("make", [lambda: Configured(Schedule()),
                                  lambda: Configured(types.SimpleNamespace(warm=True, scale=2.0)),
                                  lambda: Configured(argparse.Namespace(warm=True, scale=2.0)), Phased],
                         ids=["dataclass", "namespace", "argparse", "nested-dict"])
def test_a_flag_held_in_a_configuration_record_or_a_nested_dict_trains_as_torch(make):
    model, reference = twins(make)
    train_alike(model, reference, held_flag)
    assert held_flag(model) in (False, [{"warm": False}])


def test_a_configuration_value_changed_on_the_host_between_calls_infers_as_torch():
    model, reference = twins(lambda: Configured(Schedule(warm=False)))
    x = torch.randn(3, 4)
    compiled = poptorch.inferenceModel(model)
    for scale in (2.0, 0.5, 0.5):
        model.config.scale = reference.config.scale = scale
        torch.testing.assert_close(compiled(x), reference(x), rtol=RTOL, atol=ATOL)


class CountsInItsConfiguration(WarmsUp):
    def forward(self, x):
        self.config.seen += 1
        return self.linear(x)


def test_a_counter_in_a_configuration_record_is_refused():
    model = CountsInItsConfiguration()
    model.config = Schedule()
    with pytest.raises(poptorch.Error, match=r"the model's forward changes self.config.seen \(0 -> 1\): "):
        poptorch.inferenceModel(model)(torch.randn(3, 4))


def test_a_configuration_flag_read_and_flipped_in_a_call_of_several_iterations_is_refused():
    model = poptorch.inferenceModel(Configured(Schedule()), poptorch.Options().deviceIterations(2))
    with pytest.raises(poptorch.Error, match=r"the model reads self.config.warm and changes it: "):
        model(torch.randn(6, 4))
