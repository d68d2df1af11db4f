"""An optimizer whose param groups change between calls, as fine-tuning does (layers frozen, then
unfrozen and given a group of their own with ``add_param_group``, as Lightning's
``BaseFinetuning`` does): each parameter keeps its optimizer state, new ones start fresh, as in
torch. Weights and optimizer state against torch eager, fp32 within 1e-5."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch

RTOL, ATOL = 1e-5, 1e-6


class Net(torch.nn.Module):
    def __init__(self, repeated: bool = False):
        super().__init__()
        self.body = torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(3)]) if repeated \
            else torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x, y):
        out = self.head(torch.relu(self.body(x)))
        return out, F.cross_entropy(out, y)


def batches(count):
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator))
            for _ in range(count)]


def torch_step(model, optimizer, x, y):
    optimizer.zero_grad()
    model(x, y)[1].backward()
    optimizer.step()


def unfreeze_body(model, optimizer):
    """Lightning's ``BaseFinetuning.unfreeze_and_add_param_group``, through references held before
    (nothing on the module is read first)."""
    params = list(model.body.parameters())
    for param in params:
        param.requires_grad_(True)
    optimizer.add_param_group({"params": params, "lr": 0.003})


def drop_head_bias(model, optimizer):
    optimizer.param_groups[0]["params"] = [p for p in optimizer.param_groups[0]["params"] if p is not model.head.bias]


def assert_same(model, reference, optimizer, torch_optimizer):
    """Weights, then the optimizer state of each parameter in a group (reading the module brings
    the device's optimizer state to the host; torch's ``state_dict()`` cannot name the state of a
    parameter that left the groups)."""
    for (name, value), (_, expected) in zip(model.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(value, expected, rtol=RTOL, atol=ATOL, msg=name)
    for group, torch_group in zip(optimizer.param_groups, torch_optimizer.param_groups, strict=True):
        for param, torch_param in zip(group["params"], torch_group["params"], strict=True):
            ours, theirs = optimizer.state[param], torch_optimizer.state[torch_param]
            assert ours.keys() == theirs.keys()
            for slot, expected in theirs.items():
                torch.testing.assert_close(ours[slot], expected, rtol=RTOL, atol=ATOL, msg=slot)


@pytest.mark.parametrize("repeated", [False, True], ids=["one layer", "repeated layers"])
@pytest.mark.parametrize("change", [unfreeze_body, drop_head_bias])
def test_param_groups_changed_between_calls_train_as_torch(repeated, change):
    torch.manual_seed(0)
    model = Net(repeated)
    if change is unfreeze_body:
        model.body.requires_grad_(False)
    reference = copy.deepcopy(model)
    make = lambda m: torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=0.01)  # noqa: E731
    optimizer, torch_optimizer = make(model), make(reference)
    training = poptorch.trainingModel(model, poptorch.Options().enableExecutableCaching(None), optimizer)
    for step, (x, y) in enumerate(batches(4)):
        if step == 2:
            change(model, optimizer)
            change(reference, torch_optimizer)
        training(x, y)
        torch_step(reference, torch_optimizer, x, y)
    assert_same(model, reference, optimizer, torch_optimizer)


def test_the_recompilation_warning_names_the_param_groups_as_what_changed():
    torch.manual_seed(0)
    model = Net()
    model.body.requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    training = poptorch.trainingModel(model, poptorch.Options().enableExecutableCaching(None), optimizer)
    (x, y), = batches(1)
    training(x, y)
    unfreeze_body(model, optimizer)
    with pytest.warns(UserWarning, match=r"^the optimizer's param groups changed since the last call"):
        training(x, y)


def test_momentum_turned_off_and_on_again_takes_up_torchs_kept_buffer():
    """torch's SGD leaves ``momentum_buffer`` in its state while momentum is 0 and uses it again
    when momentum returns; setOptimizer after each change does the same."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, poptorch.Options(), optimizer)
    data = batches(6)
    for phase, momentum in enumerate((0.9, 0.0, 0.9)):
        for group in (*optimizer.param_groups, *reference_optimizer.param_groups):
            group["momentum"] = momentum
        if phase:
            training.setOptimizer(optimizer)
        for x, y in data[2 * phase:2 * phase + 2]:
            training(x, y)
            torch_step(reference, reference_optimizer, x, y)
        kept = [sorted(state) for state in optimizer.state_dict()["state"].values()]
        assert kept == [sorted(state) for state in reference_optimizer.state_dict()["state"].values()]
        assert kept and all(state == ["momentum_buffer"] for state in kept)
    training.copyWeightsToHost()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)


def test_a_new_optimizer_without_state_continues_the_ipus_state_as_in_poptorch():
    """PopTorch keeps the optimizer state on the IPU and writes a new optimizer's only when it
    holds some (a loaded checkpoint): a new SGD of the same layout continues the momentum."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, poptorch.Options(), torch.optim.SGD(model.parameters(), lr=0.1,
                                                                                  momentum=0.9))
    data = batches(4)
    for index, (x, y) in enumerate(data):
        if index == 2:
            training.setOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
            reference_optimizer.param_groups[0]["lr"] = 0.05       # the same state, a new rate
        training(x, y)
        torch_step(reference, reference_optimizer, x, y)
    training.copyWeightsToHost()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)
