"""int64 on a device that carries it as int32: values int32 holds are exact, values it cannot hold
are refused where they cross to the device (never wrapped), and embedding indices are checked as
torch checks them: before the call where they are inputs, after it where computed. float64,
carried as float32, is refused where a finite value would become infinite."""

import pytest
import torch

import ipu_backend as poptorch


class AddOne(torch.nn.Module):
    def forward(self, ids):
        return ids + 1


class Lookup(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 3)

    def forward(self, ids):
        return self.embedding(ids.view(-1))


def test_int64_inputs_within_int32_are_exact():
    ids = torch.tensor([2**31 - 2, -2**31, 7])
    out = poptorch.inferenceModel(AddOne())(ids)
    assert out.dtype == torch.int64
    assert torch.equal(out, AddOne()(ids))


def test_int64_input_outside_int32_is_refused_not_wrapped():
    with pytest.raises(poptorch.Error, match=r"input tensor 0 .* int64 value 1000000000000"):
        poptorch.inferenceModel(AddOne())(torch.tensor([10**12, 5]))


def test_int64_buffer_outside_int32_is_refused():
    class Offset(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("offset", torch.tensor([2**40]))

        def forward(self, ids):
            return ids + self.offset

    with pytest.raises(poptorch.Error, match=r"buffer offset holds the int64 value 1099511627776"):
        poptorch.inferenceModel(Offset())(torch.tensor([1, 2]))


def test_int64_constant_outside_int32_is_refused():
    class AddLarge(torch.nn.Module):
        def forward(self, ids):
            return ids + 10**12

    with pytest.raises(poptorch.Error, match=r"aten.add.Tensor at .*test_integers.py.*int32"):
        poptorch.inferenceModel(AddLarge())(torch.tensor([1, 2]))


def test_float64_values_beyond_float32_are_refused_not_made_infinite():
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.tensor([2.0], dtype=torch.float64))

        def forward(self, x):
            return x * self.scale

    executor = poptorch.inferenceModel(Scale())
    within = torch.tensor([1e38, -1e-300, float("inf"), 1.0 / 3], dtype=torch.float64)
    torch.testing.assert_close(executor(within), Scale()(within), rtol=1e-7, atol=1e-38)
    with pytest.raises(poptorch.Error, match=r"input tensor 0 .* float64 value 1e\+300.*infinite"):
        executor(torch.tensor([1.0, 1e300], dtype=torch.float64))
    model = Scale()
    model.scale.fill_(-5e40)
    with pytest.raises(poptorch.Error, match=r"buffer scale holds the float64 value -5e\+40"):
        poptorch.inferenceModel(model)(torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("index", [2**32 + 3, 10, -1])
def test_embedding_index_out_of_range_raises_as_torch(index):
    torch.manual_seed(0)
    model = Lookup()
    ids = torch.tensor([[2, index]])
    with pytest.raises(IndexError):
        model(ids)
    with pytest.raises(IndexError, match=r"index out of range.*has 10 rows"):
        poptorch.inferenceModel(model)(ids)


def test_embedding_indices_in_range_match_torch():
    torch.manual_seed(0)
    model = Lookup()
    ids = torch.tensor([[0, 9], [3, 3]])
    torch.testing.assert_close(poptorch.inferenceModel(model)(ids), model(ids), rtol=0, atol=0)


def test_computed_embedding_index_out_of_range_raises_after_the_call():
    """Indices computed on the device cannot be checked before the call: the call raises once
    it is over, as torch raises (never another row read silently)."""
    class Shifted(Lookup):
        def forward(self, ids):
            return self.embedding(ids - 5)

    model = Shifted()
    executor = poptorch.inferenceModel(model)
    with pytest.raises(poptorch.Error, match=r"index out of range: aten.embedding.default .*ids - 5.* size 10"):
        executor(torch.tensor([2, 7]))
    torch.testing.assert_close(executor(torch.tensor([5, 7])), model(torch.tensor([5, 7])), rtol=0, atol=0)
