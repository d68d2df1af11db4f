"""registerCustomArgParser: models take and return objects of a registered type, with the
numbers of torch eager, one compilation for objects of one structure, and the parser replaced or
removed as PopTorch does."""

import warnings

import pytest
import torch

import ipu_backend as poptorch


class Pair:
    def __init__(self, a, b, scale=1.0):
        self.a, self.b, self.scale = a, b, scale


class PairParser(poptorch.ICustomArgParser):
    def yieldTensors(self, struct):  # noqa: N802
        yield struct.a
        yield struct.b

    def reconstruct(self, original, tensor_iterator):
        return Pair(next(tensor_iterator), next(tensor_iterator), original.scale)


class Mixer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)

    def forward(self, pair):
        pair.extra = "set by the model"          # a model may change its input object
        return Pair(self.layer(pair.a) * pair.scale, pair.a + pair.b)


@pytest.fixture
def registered():
    poptorch.registerCustomArgParser(Pair, PairParser())
    yield
    poptorch.registerCustomArgParser(Pair, None)


def test_custom_objects_in_and_out_equal_torch(registered):
    torch.manual_seed(0)
    model = Mixer()
    executor = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)          # no recompilation for a new object
        for step in range(2):
            pair = Pair(torch.randn(4, 3), torch.full((4, 3), float(step)), scale=2.0)
            out = executor(pair)
            expected = model(Pair(pair.a, pair.b, 2.0))
            assert isinstance(out, Pair)
            torch.testing.assert_close(out.a, expected.a.detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out.b, expected.b)
    with pytest.warns(UserWarning, match="compiling again"):   # another scale: another program
        executor(Pair(torch.randn(4, 3), torch.randn(4, 3), scale=3.0))


def test_parsers_must_implement_the_interface_and_can_be_removed(registered):
    with pytest.raises(poptorch.Error, match="arg_parser must inherit from ICustomArgParser"):
        poptorch.registerCustomArgParser(Pair, object())
    poptorch.registerCustomArgParser(Pair, None)
    assert len(torch.utils._pytree.tree_leaves(Pair(torch.ones(1), torch.ones(1)))) == 1   # a leaf again


class Record(dict):
    """A dict subclass: PopTorch takes it as a container without a parser."""


class Items(list):
    pass


class Containers(torch.nn.Module):
    def forward(self, record):
        return Items([Record(total=record["a"] + record["b"]), record["a"] * 2])


def test_dict_and_list_subclasses_are_containers_in_and_out():
    model = poptorch.inferenceModel(Containers())
    record = Record(a=torch.randn(2, 2), b=torch.randn(2, 2))
    out = model(record)
    expected = Containers()(record)
    assert type(out) is Items and type(out[0]) is Record
    torch.testing.assert_close(out[0]["total"], expected[0]["total"])
    torch.testing.assert_close(out[1], expected[1])
