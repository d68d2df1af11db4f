"""Parameters held outside the module (a list taken before training, an optimizer's param groups)
show the device's weights, and writes through them or through ``.data`` (weight clipping) reach
the next call, as torch computes with them. Against torch eager, fp32 within 1e-5."""

import copy
import pickle

import pytest
import torch

import ipu_backend as poptorch
from tests.runtime.test_host_sync import RTOL, ATOL, Net, assert_same_state, data, torch_steps


def models():
    torch.manual_seed(0)
    model = Net()
    return model, copy.deepcopy(model)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_weight_clipping_through_data_between_calls_is_what_the_next_call_trains():
    """A WGAN critic's clipping, ``p.data.clamp_`` after each step: no version counter sees it."""
    model, reference = models()
    held = list(model.parameters())
    ipu = poptorch.trainingModel(model, optimizer=sgd(model))
    torch_optimizer = sgd(reference)
    xs, ys = data(4)
    for step, (x, y) in enumerate(zip(xs, ys)):
        ipu(x, y)
        torch_steps(reference, torch_optimizer, x[None], y[None])
        for parameter in (held if step % 2 else model.parameters()):
            parameter.data.clamp_(-0.2, 0.2)
        for parameter in reference.parameters():
            parameter.data.clamp_(-0.2, 0.2)
    assert_same_state(model, reference)
    assert any(bool((p.abs() == 0.2).any()) for p in reference.parameters()), "the clipping clipped"


def test_a_parameter_held_before_training_shows_the_devices_weights():
    model, reference = models()
    weight, (bias,) = model.linear.weight, [p for n, p in model.named_parameters() if n == "linear.bias"]
    optimizer = sgd(model)
    ipu = poptorch.trainingModel(model, poptorch.Options().deviceIterations(3), optimizer)
    xs, ys = data()
    ipu(xs.reshape(-1, 4), ys.reshape(-1, 3))
    torch_steps(reference, sgd(reference), xs, ys)
    torch.testing.assert_close(weight * 1, reference.linear.weight, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(bias.detach(), reference.linear.bias.detach(), rtol=RTOL, atol=ATOL)
    held_by_optimizer = optimizer.param_groups[0]["params"]
    torch.testing.assert_close(torch.cat([p.detach().flatten() for p in held_by_optimizer]),
                               torch.cat([p.detach().flatten() for p in reference.parameters()]),
                               rtol=RTOL, atol=ATOL)


def test_a_write_to_a_held_parameter_reaches_the_next_call():
    model, reference = models()
    weight = model.linear.weight
    ipu = poptorch.trainingModel(model, optimizer=sgd(model))
    torch_optimizer = sgd(reference)
    xs, ys = data()
    for x, y in zip(xs, ys):
        ipu(x, y)
        torch_steps(reference, torch_optimizer, x[None], y[None])
        with torch.no_grad():
            weight.mul_(0.5)
            reference.linear.weight.mul_(0.5)
    assert_same_state(model, reference)


def test_a_training_loop_that_leaves_its_held_parameters_alone_copies_nothing_to_the_host():
    """Nor does reading what is not a weight's value: its shape, its gradient (``zero_grad``)."""
    model, _ = models()
    held = list(model.parameters())
    optimizer = sgd(model)
    ipu = poptorch.trainingModel(model, optimizer=optimizer)
    copies = []
    copy_weights_to_host = ipu.copyWeightsToHost
    ipu.copyWeightsToHost = lambda: (copies.append(1), copy_weights_to_host())
    xs, ys = data()
    for x, y in zip(xs, ys):
        ipu(x, y)
        optimizer.zero_grad()
        assert held[0].grad is None and held[0].shape == (4,) and held[0].requires_grad
    assert not copies
    held[0].sum()
    assert len(copies) == 1
    held[1].sum()
    assert len(copies) == 1, "nothing new on the device: no copy"


def test_a_parameter_assigned_between_calls_is_held_too():
    """A new parameter, and a new optimizer holding it (``setOptimizer``), as torch trains it."""
    model, reference = models()
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    xs, ys = data()
    ipu(xs[0], ys[0])
    torch_steps(reference, torch_optimizer, xs[:1], ys[:1])
    model.linear.bias = torch.nn.Parameter(torch.zeros(3))
    reference.linear.bias = torch.nn.Parameter(torch.zeros(3))
    ipu.setOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    bias = model.linear.bias
    for step in (1, 2):
        ipu(xs[step], ys[step])
        torch_steps(reference, torch_optimizer, xs[step:step + 1], ys[step:step + 1])
        bias.data.add_(0.5)
        reference.linear.bias.data.add_(0.5)
    assert_same_state(model, reference)
    torch.testing.assert_close(bias.detach(), reference.linear.bias.detach(), rtol=RTOL, atol=ATOL)


def test_a_parameter_replaced_under_its_optimizer_is_refused():
    """torch's optimizer would go on updating the old tensor, which no longer gets a gradient,
    and leave the new one alone; a program that trains the new one in the old one's place
    would not, so the next call names the tensor the optimizer holds."""
    model, _ = models()
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    xs, ys = data()
    ipu(xs[0], ys[0])
    model.linear.bias = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(poptorch.Error, match=r"holds a tensor of shape \(3,\) that is not a parameter of the model"):
        ipu(xs[1], ys[1])


class Tagged(torch.nn.Parameter):
    """A user's own parameter class."""


def test_held_parameters_copy_pickle_and_come_back_as_the_users_classes():
    model, reference = models()
    model.linear.weight = Tagged(model.linear.weight.detach().clone())
    ipu = poptorch.trainingModel(model, poptorch.Options().deviceIterations(3), sgd(model))
    xs, ys = data()
    ipu(xs.reshape(-1, 4), ys.reshape(-1, 3))
    torch_steps(reference, sgd(reference), xs, ys)
    weight = model.linear.weight
    assert isinstance(weight, Tagged)
    assert repr(model.linear.bias) == repr(torch.nn.Parameter(model.linear.bias.detach().clone()))
    copied = copy.deepcopy(weight)
    assert type(copied) is Tagged
    torch.testing.assert_close(copied.detach(), reference.linear.weight.detach(), rtol=RTOL, atol=ATOL)
    assert type(pickle.loads(pickle.dumps(model.linear.bias))) is torch.nn.Parameter
    assert all(type(value) is torch.Tensor for value in model.state_dict().values())
    ipu.destroy()
    assert type(model.linear.weight) is Tagged and type(model.linear.bias) is torch.nn.Parameter
