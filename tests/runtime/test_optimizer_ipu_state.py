"""PopTorch's ``ipu_state`` / ``ipu_param`` entries of a ``poptorch.optim`` optimizer's
``state_dict()``: absent (None) until a training model compiles with it, then the optimizer state
and hyper-parameters per parameter name, equal to torch eager's after the same steps (fp32, 1e-5);
loading them sets what the next training model starts from (also when loaded before any)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch

RTOL, ATOL = 1e-5, 1e-6


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x, y):
        out = self.lin(x)
        return out, F.mse_loss(out, y)


def batches(n=3):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, generator=generator), torch.randn(4, 2, generator=generator)) for _ in range(n)]


def eager(model, optimizer, data):
    for x, y in data:
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()


def test_entries_are_none_until_compiled_then_name_the_state_and_hyper_parameters():
    model = Net()
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9), weight_decay=0.1)
    state = optimizer.state_dict()
    assert state["ipu_state"] is None and state["ipu_param"] is None
    executor = poptorch.trainingModel(model, optimizer=optimizer)
    executor.compile(*batches(1)[0])
    state = optimizer.state_dict()
    assert state["ipu_state"] == {}
    assert state["ipu_param"]["lr___lin.weight"] == torch.tensor(0.01)
    torch.testing.assert_close(state["ipu_param"]["betas___lin.bias"], torch.tensor([0.8, 0.9]))
    assert state["ipu_param"]["weight_decay___lin.bias"] == torch.tensor(0.1)
    assert "amsgrad___lin.bias" not in state["ipu_param"], "flags are not hyper-parameters"


def test_ipu_state_is_the_device_state_and_equals_torch_eager():
    model, reference = Net(), Net()
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=0.05)
    executor = poptorch.trainingModel(model, optimizer=optimizer)
    for x, y in batches():
        executor(x, y)
    executor.copyWeightsToHost()
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    eager(reference, torch_optimizer, batches())
    state, expected = optimizer.state_dict(), torch_optimizer.state_dict()["state"]
    for index, name in enumerate(("lin.weight", "lin.bias")):
        for slot in ("exp_avg", "exp_avg_sq", "step"):
            value = state["ipu_state"][f"{slot}___{name}"]
            assert value is state["state"][index][slot], "the same tensors as torch's entry"
            torch.testing.assert_close(value, expected[index][slot], rtol=RTOL, atol=ATOL)


def test_loaded_entries_set_what_the_next_training_model_starts_from():
    model = Net()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    executor = poptorch.trainingModel(model, optimizer=optimizer)
    executor(*batches(1)[0])
    executor.copyWeightsToHost()
    saved = copy.deepcopy(optimizer.state_dict())
    saved["ipu_param"]["lr___lin.weight"] = saved["ipu_param"]["lr___lin.bias"] = torch.tensor(0.02)
    saved["ipu_state"]["momentum_buffer___lin.bias"] = torch.tensor([0.5, -0.5])
    reference = copy.deepcopy(model)

    optimizer.load_state_dict(saved)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.02)
    reread = optimizer.state_dict()
    for entry in ("ipu_state", "ipu_param"):
        assert reread[entry].keys() == saved[entry].keys()
        for key, value in saved[entry].items():
            torch.testing.assert_close(reread[entry][key], value)

    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.02, momentum=0.9)
    torch_optimizer.load_state_dict({"state": {0: {"momentum_buffer": saved["state"][0]["momentum_buffer"]},
                                               1: {"momentum_buffer": torch.tensor([0.5, -0.5])}},
                                     "param_groups": torch_optimizer.state_dict()["param_groups"]})
    executor.destroy()    # one training wrapper of a module at a time, as in PopTorch
    continued = poptorch.trainingModel(model, optimizer=optimizer)
    data = batches(3)[1:]
    for x, y in data:
        continued(x, y)
    eager(reference, torch_optimizer, data)
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), expected.detach(), rtol=RTOL, atol=ATOL, msg=name)


def test_entries_loaded_before_any_training_model_apply_when_one_is_built():
    model = Net()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    poptorch.trainingModel(model, optimizer=optimizer)(*batches(1)[0])
    saved = copy.deepcopy(optimizer.state_dict())
    saved["ipu_param"]["lr___lin.weight"] = saved["ipu_param"]["lr___lin.bias"] = torch.tensor(0.02)
    fresh_model = Net()
    fresh = poptorch.optim.SGD(fresh_model.parameters(), lr=0.1, momentum=0.9)
    fresh.load_state_dict(saved)
    assert fresh.state_dict()["ipu_param"].keys() == saved["ipu_param"].keys()
    assert fresh.param_groups[0]["lr"] == 0.1, "names are known once a training program is built"
    poptorch.trainingModel(fresh_model, optimizer=fresh).compile(*batches(1)[0])
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.02)


def test_a_torch_state_dict_still_loads_and_bad_entries_are_clear_errors():
    model = Net()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    poptorch.trainingModel(model, optimizer=optimizer).compile(*batches(1)[0])
    cpu_state = torch.optim.SGD(Net().parameters(), lr=0.3, momentum=0.9).state_dict()
    optimizer.load_state_dict(cpu_state)
    assert optimizer.param_groups[0]["lr"] == 0.3
    state = optimizer.state_dict()
    with pytest.raises(poptorch.Error, match=r"'lr___lin.nope' names no parameter.*'lin.bias', 'lin.weight'"):
        optimizer.load_state_dict({**state, "ipu_param": {"lr___lin.nope": torch.tensor(0.1)}})
    with pytest.raises(poptorch.Error, match="param group 0 several values of 'lr'"):
        optimizer.load_state_dict({**state, "ipu_param": {"lr___lin.weight": torch.tensor(0.1),
                                                          "lr___lin.bias": torch.tensor(0.2)}})
    with pytest.raises(poptorch.Error, match="has no hyper-parameter 'nesterov'"):
        optimizer.load_state_dict({**state, "ipu_param": {"nesterov___lin.bias": torch.tensor(1.0)}})
