"""Indices outside the dimension they select from, which torch refuses, raise: those that are
inputs of the call (through views) on the host before it, with torch's error type, and those the
program computes after the call, naming the line. Indices that fit give torch's numbers, and
indices that cannot leave their dimension are not checked."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ipu_backend as poptorch
from ipu_backend.compiler import integer_ranges, program


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 4)

    def forward(self, x, target):
        return F.cross_entropy(self.linear(x), target, ignore_index=-1)


def test_loss_targets_outside_the_classes_raise_before_the_call():
    torch.manual_seed(0)
    model, reference = Classifier(), Classifier()
    reference.load_state_dict(model.state_dict())
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 3)
    for bad in (4, -2):
        with pytest.raises(IndexError, match=f"Target {bad} is out of bounds.*4 classes.*F.cross_entropy"):
            training(x, torch.tensor([0, bad, 1, 3]))
    target = torch.tensor([0, -1, 1, 3])              # -1: ignored, as torch ignores it
    loss = training(x, target)
    reference_loss = reference(x, target)
    reference_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    torch.testing.assert_close(loss, reference_loss.detach(), rtol=1e-6, atol=1e-6)
    training.copyWeightsToHost()
    torch.testing.assert_close(model.linear.weight, reference.linear.weight, rtol=1e-6, atol=1e-6)


class Pick(nn.Module):
    def forward(self, x, rows, columns):
        return x[rows], x.gather(1, columns), x.index_select(0, rows.abs())


def test_input_indices_outside_their_dimension_raise_before_the_call_as_torch():
    x = torch.randn(5, 4)
    rows, columns = torch.tensor([0, -4, 4]), torch.tensor([[0], [3], [1], [2], [0]])
    executor = poptorch.inferenceModel(Pick())
    for ours, torchs in zip(executor(x, rows, columns), Pick()(x, rows, columns)):
        torch.testing.assert_close(ours, torchs, rtol=0, atol=0)
    for bad_rows, bad_columns, message in (
            (torch.tensor([0, 5, 1]), columns, "index 5 is out of bounds for dimension 0 with size 5"),
            (torch.tensor([0, -6, 1]), columns, "index -6 is out of bounds for dimension 0 with size 5"),
            (rows, torch.tensor([[0], [4], [1], [2], [0]]), "index 4 is out of bounds for dimension 1 with size 4")):
        with pytest.raises((IndexError, RuntimeError)):
            Pick()(x, bad_rows, bad_columns)
        with pytest.raises(IndexError, match=message + ".*test_index_bounds.py"):
            executor(x, bad_rows, bad_columns)


class Computed(nn.Module):
    def forward(self, x, i):
        shifted = x[i + 2]
        spread = x.gather(1, (i * 2).view(-1, 1).expand(-1, 2))
        placed = x.index_put((i - 1,), torch.zeros(2, 4))
        return shifted, spread, placed


@pytest.mark.parametrize("line,i", [("shifted = x[i + 2]", [0, 3]), ("x.gather(1, (i * 2)", [1, 2]),
                                    ("x.index_put((i - 1,)", [-5, 1])])
def test_computed_indices_outside_their_dimension_raise_after_the_call(line, i):
    x = torch.randn(5, 4)
    executor = poptorch.inferenceModel(Computed())
    good = torch.tensor([0, 1])
    for ours, torchs in zip(executor(x, good), Computed()(x, good)):
        torch.testing.assert_close(ours, torchs, rtol=0, atol=0)
    with pytest.raises((IndexError, RuntimeError)):
        Computed()(x, torch.tensor(i))
    with pytest.raises(poptorch.Error, match=r"index out of range: [^\n]*" + re.escape(line)):
        executor(x, torch.tensor(i))


class Lookups(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(10, 3)
        self.positions = nn.Embedding(6, 3)

    def forward(self, ids, scores, target):
        hidden = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        best = scores.gather(-1, scores.argmax(-1, keepdim=True))
        return F.cross_entropy(hidden.sum(1), target) + best.sum()


def test_indices_that_cannot_leave_their_dimension_are_not_checked_while_running():
    ids, scores, target = torch.randint(0, 10, (2, 6)), torch.randn(2, 5), torch.tensor([0, 2])
    captured = program.compile_module(Lookups(), (ids, scores, target))
    assert integer_ranges.checks(captured.graph_module) == {}
    assert sorted(i.kind for i in captured.index_inputs) == ["rows", "target"]    # inputs: on the host
