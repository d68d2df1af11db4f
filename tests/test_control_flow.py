"""poptorch.for_loop and poptorch.cond against torch eager (the same functions run eagerly when
the model is called as a plain torch module): inference, training, PopTorch's errors.
fp32 tolerance: 1e-5 relative (1e-6 absolute)."""

import copy

import pytest
import torch

import ipu_backend as poptorch
from ipu_backend.compiler.loops import FOR_LOOP

RTOL, ATOL = 1e-5, 1e-6


class Recurrent(torch.nn.Module):
    """A weight applied in a loop, with an outer tensor read inside the body."""

    def __init__(self, trips=3):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        self.trips = trips

    def forward(self, x, scale, target=None):
        def body(h, steps):
            steps += 1                         # in place: on the body's copy only
            return torch.tanh(self.layer(h)) * scale, steps

        h, steps = poptorch.for_loop(self.trips, body, [x, torch.zeros(x.shape[0], 1)])
        if target is None:
            return h, steps
        return h, torch.nn.functional.mse_loss(h, target)


def test_for_loop_inference_equals_the_eager_loop():
    torch.manual_seed(0)
    model = Recurrent()
    x, scale = torch.randn(2, 4), torch.rand(4)
    x_before = x.clone()
    h, steps = poptorch.inferenceModel(model)(x, scale)
    expected_h, expected_steps = model(x, scale)          # plain torch: the eager loop
    manual = x
    for _ in range(3):
        manual = torch.tanh(model.layer(manual)) * scale
    torch.testing.assert_close(expected_h, manual)
    torch.testing.assert_close(h, expected_h, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(steps, torch.full((2, 1), 3.0))
    torch.testing.assert_close(x, x_before)


def test_for_loop_trains_as_torch_eager():
    torch.manual_seed(0)
    model = Recurrent()
    reference = copy.deepcopy(model)
    x, scale, target = torch.randn(8, 4), torch.rand(8, 4), torch.randn(8, 4)
    opts = poptorch.Options().deviceIterations(2)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    _, loss = training(x, scale, target)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for xs, ss, ts in zip(x.split(4), scale.split(4), target.split(4)):
        optimizer.zero_grad()
        _, expected = reference(xs, ss, ts)
        expected.backward()
        optimizer.step()
    torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=ATOL)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)


class Nested(torch.nn.Module):
    def forward(self, x):
        def inner(y):
            return y * 2 + 1

        def outer(y, total):
            (y,) = poptorch.for_loop(2, inner, [y])
            return y - 3, total + y.sum()

        return poptorch.for_loop(3, outer, [x, torch.zeros(())])


def test_nested_loops_and_one_body_in_the_graph():
    x = torch.randn(5)
    model = poptorch.inferenceModel(Nested())
    out = model(x)
    for got, expected in zip(out, Nested()(x)):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    loops = [n for n in model.last_program.graph_module.graph.nodes if n.target is FOR_LOOP]
    assert len(loops) == 1                              # the inner loop lives in the outer body


class Draws(torch.nn.Module):
    def forward(self, x):
        def body(total, last):
            draw = torch.rand(4)
            return total + draw, draw

        return poptorch.for_loop(2, body, [x, torch.zeros(4)])


def test_random_numbers_differ_per_trip():
    total, last = poptorch.inferenceModel(Draws())(torch.zeros(4))
    assert not torch.allclose(total, 2 * last)          # two trips, two draws


class BadBody(torch.nn.Module):
    def __init__(self, body, inputs):
        super().__init__()
        self.body, self.inputs = body, inputs

    def forward(self, x):
        return poptorch.for_loop(2, self.body, self.inputs(x))


@pytest.mark.parametrize("inputs,error,match", [
    (lambda x: x, ValueError, r"\(Object is not list\)"),
    (lambda x: [x, 5], ValueError, r"\(Object contained in list at index 1 is not torch.tensor\)"),
])
def test_for_loop_checks_inputs_as_poptorch(inputs, error, match):
    with pytest.raises(error, match=match):
        poptorch.inferenceModel(BadBody(lambda *t: t, inputs))(torch.ones(2))


def test_for_loop_body_must_keep_shapes():
    model = poptorch.inferenceModel(BadBody(lambda t: t.sum(), lambda x: [x]))
    with pytest.raises(poptorch.Error, match="body output 0 has shape"):
        model(torch.ones(2))


class Leaky(torch.nn.Module):
    def forward(self, x):
        inside = []

        def body(y):
            inside.append(y * 2)
            return inside[-1] + 1

        out = poptorch.for_loop(2, body, [x])[0]
        return out + inside[0]


def test_a_body_value_used_after_the_loop_is_an_error():
    with pytest.raises(poptorch.Error, match="inside the poptorch.for_loop body .* is used outside"):
        poptorch.inferenceModel(Leaky())(torch.ones(2))


class Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)

    def forward(self, flag, x, y, target=None):
        def then_body(a):
            return self.layer(a) * y, a.sum()

        def else_body(a, b):
            return self.layer(a - b), b.mean()

        out, stat = poptorch.cond(flag, then_body, [x], else_body, [x, y])
        if target is None:
            return out, stat
        return out, ((out - target) ** 2).mean() + stat


@pytest.mark.parametrize("flag", [True, False])
def test_cond_inference_and_training_equal_torch_eager(flag):
    torch.manual_seed(0)
    model = Branches()
    reference = copy.deepcopy(model)
    condition = torch.tensor([flag])
    x, y, target = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    for got, expected in zip(poptorch.inferenceModel(model)(condition, x, y), model(condition, x, y)):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    _, loss = training(condition, x, y, target)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    _, expected = reference(condition, x, y, target)
    expected.backward()
    optimizer.step()
    torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=ATOL)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)


def test_cond_checks_inputs_as_poptorch():
    with pytest.raises(ValueError, match=r"then_inps and else_inps .*\(Object is not list\)"):
        poptorch.cond(torch.tensor([True]), lambda a: a, (torch.ones(1),), lambda a: a, [torch.ones(1)])
