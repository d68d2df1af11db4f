"""Device state and the host's view of it: a new executor starts from the module's current host
weights and buffers, a host write is never overwritten by device state computed before it, an
existing executor takes host writes at its next call (as torch computes with them), and reading an
optimizer's ``state_dict()`` gives the device's state. Against torch eager, fp32 within 1e-5."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch
from tests.runtime.test_precision import Scale

RTOL, ATOL = 1e-5, 1e-6


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4)
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x, y=None):
        out = self.linear(self.norm(x))
        return out if y is None else (out, F.mse_loss(out, y))


OPTIMIZERS = {
    "torch.optim.Adam": lambda params: torch.optim.Adam(params, lr=0.05),
    "poptorch.optim.AdamW": lambda params: poptorch.optim.AdamW(params, lr=0.05, weight_decay=0.1),
    "torch.optim.SGD": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def data(steps=3):
    generator = torch.Generator().manual_seed(3)
    return torch.randn(steps, 8, 4, generator=generator), torch.randn(steps, 8, 3, generator=generator)


def torch_steps(model, optimizer, xs, ys):
    model.train()
    for x, y in zip(xs, ys):
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()


def assert_same_state(model, reference):
    for (name, value), (_, expected) in zip(model.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(value, expected, rtol=RTOL, atol=ATOL, msg=name)


def trained(optimizer="torch.optim.Adam"):
    """A module trained for 3 steps on the device, its optimizer, and torch's twins of both."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    xs, ys = data()
    torch_optimizer = OPTIMIZERS[optimizer](reference.parameters())
    torch_steps(reference, torch_optimizer, xs, ys)
    ipu_optimizer = OPTIMIZERS[optimizer](model.parameters())
    ipu = poptorch.trainingModel(model, poptorch.Options().deviceIterations(3), ipu_optimizer)
    ipu(xs.reshape(-1, 4), ys.reshape(-1, 3))
    return model, ipu, ipu_optimizer, reference, torch_optimizer


def test_new_executor_starts_from_weights_loaded_on_the_host():
    torch.manual_seed(1)
    saved = Net().state_dict()
    model, *_ = trained()
    model.load_state_dict(saved)
    x = torch.randn(8, 4)
    expected = copy.deepcopy(model).eval()(x)
    torch.testing.assert_close(poptorch.inferenceModel(model)(x), expected, rtol=RTOL, atol=ATOL)
    for name, value in model.state_dict().items():     # the module does not snap back
        assert torch.equal(value, saved[name]), name


def test_new_executor_starts_from_buffers_reset_on_the_host():
    model, *_ = trained()
    model.norm.reset_running_stats()
    x = torch.randn(8, 4)
    expected = copy.deepcopy(model).eval()(x)
    torch.testing.assert_close(poptorch.inferenceModel(model)(x), expected, rtol=RTOL, atol=ATOL)
    assert torch.equal(model.norm.running_var, torch.ones(4))


def test_host_write_survives_reading_the_module_before_copy_to_device():
    model, _, _, reference, _ = trained()
    edited = {name: value * 2 for name, value in reference.state_dict().items()}
    model.load_state_dict(edited)          # straight after a call: the device holds newer weights
    for name, value in model.state_dict().items():
        assert torch.equal(value, edited[name]), name


def continued_in_torch(reference, torch_optimizer):
    """torch's twins of a trained module and its optimizer, to train on from where they are."""
    continued = copy.deepcopy(reference)
    continued_optimizer = OPTIMIZERS["torch.optim.SGD"](continued.parameters())
    continued_optimizer.load_state_dict(torch_optimizer.state_dict())
    return continued, continued_optimizer


HOST_WRITES = {
    "in place under no_grad": lambda m: m.linear.weight.mul_(0.5),
    "copy_": lambda m: m.linear.bias.copy_(torch.ones(3)),
    "a buffer reset": lambda m: m.norm.reset_running_stats(),
    "load_state_dict": lambda m: m.load_state_dict({k: v * 0.5 for k, v in m.state_dict().items()}),
    "a new tensor as .data": lambda m: setattr(m.linear.weight, "data", torch.full((3, 4), 0.25)),
    "in place through .data": lambda m: m.linear.weight.data.clamp_(-0.1, 0.1),
}


@pytest.mark.parametrize("write", HOST_WRITES)
def test_host_writes_reach_an_existing_executor_at_its_next_call(write):
    """A write on the host between calls is what the next call computes with, as in torch (PopTorch
    would run from the device's weights until copyWeightsToDevice)."""
    model, ipu, _, reference, torch_optimizer = trained("torch.optim.SGD")
    continued, continued_optimizer = continued_in_torch(reference, torch_optimizer)
    xs, ys = data()
    with torch.no_grad():
        HOST_WRITES[write](model)
        HOST_WRITES[write](continued)
    ipu(xs.reshape(-1, 4), ys.reshape(-1, 3))
    torch_steps(continued, continued_optimizer, xs, ys)
    assert_same_state(model, continued)


def test_copy_weights_to_device_after_host_writes_changes_nothing_more():
    model, ipu, _, reference, torch_optimizer = trained("torch.optim.SGD")
    continued, continued_optimizer = continued_in_torch(reference, torch_optimizer)
    xs, ys = data()
    with torch.no_grad():
        model.linear.weight.zero_()
        continued.linear.weight.zero_()
    ipu.copyWeightsToDevice()
    ipu(xs.reshape(-1, 4), ys.reshape(-1, 3))
    torch_steps(continued, continued_optimizer, xs, ys)
    assert_same_state(model, continued)


class Stack(torch.nn.Module):
    """Three identical layers: trained as one loop over their stacked weights."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x, y):
        out = self.layers(x)
        return out, F.mse_loss(out, y)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_host_write_to_one_of_repeated_layers_reaches_its_row_of_the_stack(replicas):
    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model)
    options = poptorch.Options().deviceIterations(2).replicationFactor(replicas)
    ipu = poptorch.trainingModel(model, options, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(5)
    for call in range(2):
        x = torch.randn(2 * replicas * 8, 4, generator=generator)
        y = torch.randn(2 * replicas * 8, 4, generator=generator)
        if call == 1:
            with torch.no_grad():
                model.layers[1].weight.mul_(-1.0)
                reference.layers[1].weight.mul_(-1.0)
        ipu(x, y)
        for step_x, step_y in zip(x.chunk(2), y.chunk(2)):     # a step is a batch of every replica
            torch_optimizer.zero_grad()
            reference(step_x, step_y)[1].backward()
            torch_optimizer.step()
    assert_same_state(model, reference)


def test_an_implicit_copy_is_the_training_models_copy_weights_to_host():
    """As in PopTorch, a host access after a training call copies through the executor's own
    ``copyWeightsToHost`` (a wrapper on it counts the implicit copies), once per device update."""
    model, ipu, _, reference, _ = trained()
    copies = []
    copy_weights_to_host = ipu.copyWeightsToHost
    ipu.copyWeightsToHost = lambda: (copies.append(1), copy_weights_to_host())
    assert_same_state(model, reference)
    assert len(copies) == 1
    list(model.parameters())
    assert len(copies) == 1, "nothing new on the device: no copy"
    xs, ys = data()
    ipu(xs.reshape(-1, 4), ys.reshape(-1, 3))
    assert len(copies) == 1, "a call copies nothing to the host"
    model.eval()(xs[0])
    assert len(copies) == 2


def test_an_inference_call_after_training_first_makes_the_implicit_copy():
    """As in PopTorch, an inference model of a module trained by another executor copies that
    executor's weights to the host (its ``copyWeightsToHost``) before its first call after
    training, and only then; its outputs are torch's after the same steps."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    xs, ys = data()
    inference = poptorch.inferenceModel(model)
    inference(xs[0])
    ipu = poptorch.trainingModel(model, poptorch.Options().deviceIterations(3),
                                 torch.optim.SGD(model.parameters(), lr=0.1))
    copies = []
    copy_weights_to_host = ipu.copyWeightsToHost
    ipu.copyWeightsToHost = lambda: (copies.append(1), copy_weights_to_host())
    ipu(xs.reshape(-1, 4), ys.reshape(-1, 3))
    assert not copies
    out = inference(xs[0])
    assert len(copies) == 1
    inference(xs[0])
    assert len(copies) == 1, "nothing new trained: no copy"
    torch_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1), xs, ys)
    torch.testing.assert_close(out, reference.eval()(xs[0]), rtol=RTOL, atol=ATOL)


def test_destroying_an_inference_executor_keeps_the_training_one_in_sync():
    """The module's weights stay shared, and shown on the host, while any executor of it lives:
    training after an inference executor sharing them was destroyed ends where torch does."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    xs, ys = data()
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    inference = poptorch.inferenceModel(model)
    ipu(xs[0], ys[0])
    inference(xs[0])
    inference.destroy()
    ipu(xs[1], ys[1])
    torch_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1), xs[:2], ys[:2])
    assert_same_state(model, reference)
    ipu.destroy()
    assert type(model) is Net


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_state_dict_read_first_is_the_devices(optimizer, tmp_path):
    model, _, ipu_optimizer, reference, torch_optimizer = trained(optimizer)
    torch.save({"opt": ipu_optimizer.state_dict(), "model": model.state_dict()}, tmp_path / "checkpoint.pt")
    saved = torch.load(tmp_path / "checkpoint.pt")
    expected = torch_optimizer.state_dict()
    assert sorted(saved["opt"]["state"]) == sorted(expected["state"])
    for index, slots in expected["state"].items():
        assert sorted(saved["opt"]["state"][index]) == sorted(slots)
        for slot, value in slots.items():
            torch.testing.assert_close(saved["opt"]["state"][index][slot], value, rtol=RTOL, atol=ATOL,
                                       msg=f"{index}.{slot}")
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(saved["model"][name], value, rtol=RTOL, atol=ATOL, msg=name)


def test_optimizer_state_loaded_on_the_host_reaches_the_device():
    """Resuming from a checkpoint into a live executor: the optimizer's loaded state, and the
    module's weights once copied to the device, are what the next call starts from."""
    model, ipu, ipu_optimizer, reference, torch_optimizer = trained()
    checkpoint = copy.deepcopy({"opt": torch_optimizer.state_dict(), "model": reference.state_dict()})
    xs, ys = data()
    ipu(xs.reshape(-1, 4), ys.reshape(-1, 3))          # moves on from the checkpoint
    torch_steps(reference, torch_optimizer, xs, ys)

    ipu_optimizer.load_state_dict(checkpoint["opt"])
    ipu.load_state_dict(checkpoint["model"])
    ipu(xs.reshape(-1, 4), ys.reshape(-1, 3))
    assert_same_state(model, reference)
    for index, slots in torch_optimizer.state_dict()["state"].items():
        for slot, value in slots.items():
            torch.testing.assert_close(ipu_optimizer.state_dict()["state"][index][slot], value,
                                       rtol=RTOL, atol=ATOL)


def test_a_host_write_to_a_half_weight_becomes_its_master_copy():
    """With master weights the device updates a float32 copy: a host write replaces it too."""
    model = Scale().half()
    training = poptorch.trainingModel(model, poptorch.Options(device_iterations=50, master_weights=True),
                                      torch.optim.SGD(model.parameters(), lr=1e-4))
    training(torch.ones(50, 4).half())
    with torch.no_grad():
        model.weight.fill_(2.0)
    training(torch.ones(50, 4).half())
    expected = 2.0 - 50 * 1e-4        # each step's 1e-4 is kept by the float32 master copy
    torch.testing.assert_close(model.weight.float(), torch.full((4,), expected), rtol=0, atol=2 ** -10)


def test_an_inference_executor_computes_with_weights_trained_on_the_host_since():
    """PopTorch's inference model would keep the weights of its first call (its
    ``test_implicit_first_time_copy_negative``); torch's module computes with the trained ones."""
    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    inference = poptorch.inferenceModel(model)
    inference(x)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch_steps(model, optimizer, x[None], y[None])
    expected = copy.deepcopy(model).eval()(x)
    torch.testing.assert_close(inference(x), expected, rtol=RTOL, atol=ATOL)


class InstanceNormed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.InstanceNorm1d(3, affine=True, track_running_stats=True)
        self.linear = torch.nn.Linear(5, 2)

    def forward(self, x, y=None):
        out = self.linear(self.norm(x))
        return out if y is None else (out, F.mse_loss(out, y))


HOST_STATISTICS_WRITES = {
    "a forward in training mode": lambda m, x: m.train()(x),
    "in place through .data": lambda m, x: m.norm.running_var.data.mul_(2.0),
}


@pytest.mark.parametrize("write", HOST_STATISTICS_WRITES)
def test_an_instance_norms_running_statistics_written_on_the_host_reach_the_next_call(write):
    """Some torch versions' instance-norm kernels update the running statistics without a
    version-counter bump, as a write through ``.data`` does: their values are compared."""
    torch.manual_seed(0)
    model = InstanceNormed()
    reference = copy.deepcopy(model)
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(4)
    xs, ys = torch.randn(2, 4, 3, 5, generator=generator), torch.randn(2, 4, 3, 2, generator=generator)
    host_x = 3 * torch.randn(4, 3, 5, generator=generator) + 1
    ipu(xs[0], ys[0])
    torch_steps(reference, torch_optimizer, xs[:1], ys[:1])
    for module in (model, reference):
        with torch.no_grad():
            HOST_STATISTICS_WRITES[write](module, host_x)
    ipu(xs[1], ys[1])
    torch_steps(reference, torch_optimizer, xs[1:], ys[1:])
    assert_same_state(model, reference)
