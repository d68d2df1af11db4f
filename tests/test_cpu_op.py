"""poptorch.CPU: a Python function called on the host inside a compiled model, against torch eager
(fp32 at 1e-5 relative)."""

import pytest
import torch

import ipu_backend as poptorch

RTOL, ATOL = 1e-5, 1e-6


class Scaled(torch.nn.Module):
    """A host op between two device layers; it records each call's batch (run per micro-batch)."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(3, 4)
        self.second = torch.nn.Linear(4, 2)
        self.cpu = poptorch.CPU(self.on_host, "OnHost")
        self.calls = []

    def on_host(self, x, index):
        self.calls.append(x.shape[0])
        assert x.device.type == "cpu" and index.dtype == torch.int64
        return torch.sort(x, dim=-1).values * 2, index + 1

    def forward(self, x, index):
        sorted_, shifted = self.cpu(torch.relu(self.first(x)), index)
        return self.second(sorted_), shifted


def test_a_host_function_in_an_inference_model_gives_torch_eager_numbers():
    torch.manual_seed(0)
    model = Scaled()
    x, index = torch.randn(8, 3), torch.arange(8)
    expected = model(x, index)
    model.calls.clear()
    options = poptorch.Options().deviceIterations(2).replicationFactor(2)
    out, shifted = poptorch.inferenceModel(model, options)(x, index)
    torch.testing.assert_close(out, expected[0], rtol=RTOL, atol=ATOL)
    assert torch.equal(shifted, expected[1])
    assert model.calls[-4:] == [2, 2, 2, 2]         # each replica's micro-batch of each iteration


def test_a_single_output_stays_a_tensor_and_reads_new_inputs_each_call():
    class Product(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cpu = poptorch.CPU(torch.mul, "Mul")

        def forward(self, x, y):
            return self.cpu(x, y) * 3.0

    model = poptorch.inferenceModel(Product())
    x = torch.randn(5, 2)
    torch.testing.assert_close(model(x, torch.tensor([2.0])), x * 6.0)
    torch.testing.assert_close(model(x, torch.tensor([4.0])), x * 12.0)


def test_outside_a_compiled_model_the_function_is_called_directly():
    cpu = poptorch.CPU(lambda x: x + 1, "AddOne")
    assert torch.equal(cpu(torch.zeros(2)), torch.ones(2))


def test_a_gradient_through_a_host_op_is_refused():
    class Trained(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)
            self.cpu = poptorch.CPU(lambda x: x * 2, "Double")

        def forward(self, x):
            return poptorch.identity_loss(self.cpu(self.linear(x)).sum(), reduction="sum")

    with pytest.raises(poptorch.Error, match="CPU op 'Double' is in the gradient of the loss"):
        poptorch.trainingModel(Trained())(torch.randn(2, 2))
