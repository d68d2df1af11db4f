"""A training model's torch optimizer, whose state lives on the device: reading
``optimizer.state`` gives torch eager's state after the same steps, and what the host writes into
it (a moment reset in place, a step count replaced, an entry removed) is what the next step
starts from, as in torch eager. fp32: 1e-5 relative (1e-6 absolute)."""

import copy
import pickle

import torch
import torch.nn.functional as F

import ipu_backend as poptorch

RTOL, ATOL = 1e-5, 1e-6


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(3, 4)
        self.second = torch.nn.Linear(4, 2)

    def forward(self, x, y):
        out = self.second(torch.tanh(self.first(x)))
        return out, F.mse_loss(out, y)


def _batches(n):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, generator=generator), torch.randn(4, 2, generator=generator)) for _ in range(n)]


def _pair():
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.05)
    return model, optimizer, poptorch.trainingModel(model, optimizer=optimizer), reference, reference_optimizer


def _torch_step(model, optimizer, x, y):
    optimizer.zero_grad()
    model(x, y)[1].backward()
    optimizer.step()


def _assert_same_state(ours, torchs):
    assert len(ours.state) == len(torchs.state)
    for param, reference in zip(ours.param_groups[0]["params"], torchs.param_groups[0]["params"]):
        assert ours.state[param].keys() == torchs.state[reference].keys()
        for key, value in torchs.state[reference].items():
            torch.testing.assert_close(ours.state[param][key], value, rtol=RTOL, atol=ATOL)


def test_the_state_read_after_calls_is_torchs_after_the_same_steps():
    model, optimizer, training, reference, reference_optimizer = _pair()
    for step, (x, y) in enumerate(_batches(3)):
        training(x, y)
        _torch_step(reference, reference_optimizer, x, y)
        _assert_same_state(optimizer, reference_optimizer)      # current after every call
        assert float(next(iter(optimizer.state.values()))["step"]) == step + 1


def test_host_writes_to_the_state_are_what_the_next_step_starts_from():
    model, optimizer, training, reference, reference_optimizer = _pair()
    writes = [
        lambda o, m: o.state[m.first.weight]["exp_avg"].zero_(),                 # in place
        lambda o, m: o.state[m.second.weight].__setitem__("step", torch.tensor(50.0)),   # replaced
        lambda o, m: o.state.pop(m.second.bias),                                 # removed: starts afresh
        lambda o, m: None,
    ]
    for write, (x, y) in zip(writes, _batches(4)):
        training(x, y)
        _torch_step(reference, reference_optimizer, x, y)
        write(optimizer, model)
        write(reference_optimizer, reference)
    training.copyWeightsToHost()
    for ours, torchs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.detach(), torchs.detach(), rtol=RTOL, atol=ATOL)
    _assert_same_state(optimizer, reference_optimizer)


def test_a_copied_or_pickled_state_is_a_plain_one_with_the_devices_values():
    model, optimizer, training, reference, reference_optimizer = _pair()
    (x, y), = _batches(1)
    training(x, y)
    _torch_step(reference, reference_optimizer, x, y)
    for state in (copy.copy(optimizer.state), pickle.loads(pickle.dumps(optimizer.state))):
        assert type(state) is type(reference_optimizer.state)
        steps = sorted(float(entry["step"]) for entry in state.values())
        assert steps == [1.0] * 4
    training.destroy()
    assert type(optimizer.state) is type(reference_optimizer.state)
    _assert_same_state(optimizer, reference_optimizer)
