"""A call's arguments reach the program as Python binds them to ``forward``: positional
parameters given by keyword, defaults, keyword-only and ``**kwargs`` arguments, for inference and
training (their batch dimension split like any input). Against torch eager."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch

RTOL, ATOL = 1e-5, 1e-6


class Keywords(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x, *, scale, offset=1.0, **extra):
        out = self.linear(x) * scale + offset
        for name in sorted(extra):
            out = out + extra[name] * len(name)
        return out


def test_keyword_only_and_var_keyword_arguments_reach_the_program():
    torch.manual_seed(0)
    model = Keywords()
    x, scale = torch.randn(4, 3), torch.randn(4, 2)
    extra = {"shift": torch.randn(4, 2), "t": torch.randn(4, 2)}
    ipu = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
    torch.testing.assert_close(ipu(x, scale=scale, **extra), model(x, scale=scale, **extra), rtol=RTOL, atol=ATOL)
    with pytest.warns(UserWarning, match="compiling again"):
        out = ipu(x, offset=3.0, scale=scale)
    torch.testing.assert_close(out, model(x, scale=scale, offset=3.0), rtol=RTOL, atol=ATOL)


class Delegating(torch.nn.Module):
    """A wrapper whose ``forward(*args, **kwargs)`` hands everything to the module it wraps."""

    def __init__(self):
        super().__init__()
        self.inner = Regression()

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_arguments_forwarded_through_var_keyword_reach_the_program():
    torch.manual_seed(0)
    model = Delegating()
    x, target = torch.randn(4, 3), torch.randn(4, 2)
    expected = model(x=x, target=target)
    out, loss = poptorch.inferenceModel(model)(x=x, target=target)
    torch.testing.assert_close(out, expected[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss, expected[1], rtol=RTOL, atol=ATOL)


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x, target, weight=2.0):
        out = self.linear(x)
        return out, weight * F.mse_loss(out, target)


def test_positional_parameters_given_by_keyword_train_as_in_torch():
    torch.manual_seed(0)
    model = Regression()
    reference = copy.deepcopy(model)
    x, target = torch.randn(8, 3), torch.randn(8, 2)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for half in range(2):
        optimizer.zero_grad()
        reference(x[half * 4:(half + 1) * 4], target[half * 4:(half + 1) * 4], weight=0.5)[1].backward()
        optimizer.step()

    ipu = poptorch.trainingModel(model, poptorch.Options().deviceIterations(2),
                                 torch.optim.SGD(model.parameters(), lr=0.1))
    ipu(target=target, weight=0.5, x=x)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)


def test_arguments_python_cannot_bind_are_pythons_error():
    ipu = poptorch.inferenceModel(Regression())
    with pytest.raises(TypeError, match="missing a required argument: 'target'"):
        ipu(torch.randn(2, 3), wieght=1.0)
