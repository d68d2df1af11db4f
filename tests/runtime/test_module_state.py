"""What a module says about itself is honoured as torch honours it: parameters with
``requires_grad=False`` (or unused by the loss) are skipped by the optimizer, and each
submodule keeps its own ``training`` flag. Against torch eager, fp32 within 1e-5 relative."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import ipu_backend as poptorch

RTOL, ATOL = 1e-5, 1e-6

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1),
}


class Backbone(torch.nn.Module):
    """PopTorch's requires_grad_test model, with an auxiliary output the loss does not use."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(5))
        self.b = torch.nn.Parameter(torch.randn(5))
        self.c = torch.nn.Parameter(torch.randn(5), requires_grad=False)
        self.d = torch.nn.Parameter(torch.randn(5), requires_grad=False)
        self.aux = torch.nn.Parameter(torch.randn(5))

    def forward(self, target):
        prediction = self.a + self.b + self.c + self.d
        return prediction * self.aux, F.mse_loss(prediction, target)


def assert_same_parameters(model, reference):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=name)


def torch_steps(model, optimizer, targets):
    for target in targets:
        optimizer.zero_grad()
        model(target)[1].backward()
        optimizer.step()


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_parameters_without_gradient_never_move(optimizer):
    """Frozen parameters (and one the loss does not use) get no ``.grad`` in torch, so its
    optimizers skip them: no weight decay, no momentum, no state."""
    torch.manual_seed(42)
    model = Backbone()
    reference = copy.deepcopy(model)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    targets = torch.randn(4, 5)
    torch_optimizer = OPTIMIZERS[optimizer](reference.parameters())
    torch_steps(reference, torch_optimizer, targets)

    ipu_optimizer = OPTIMIZERS[optimizer](model.parameters())
    ipu = poptorch.trainingModel(model, poptorch.Options().deviceIterations(2), ipu_optimizer)
    for half in targets.split(2):
        ipu(half.reshape(-1))
    for name in ("c", "d", "aux"):
        assert torch.equal(getattr(model, name).detach(), initial[name]), name
    assert not torch.equal(model.a.detach(), initial["a"])
    assert_same_parameters(model, reference)
    assert sorted(ipu_optimizer.state_dict()["state"]) == sorted(torch_optimizer.state_dict()["state"])


def test_unfreezing_a_parameter_trains_it_from_then_on():
    torch.manual_seed(42)
    model = Backbone()
    reference = copy.deepcopy(model)
    targets = torch.randn(2, 5)
    torch_optimizer = OPTIMIZERS["sgd"](reference.parameters())
    torch_steps(reference, torch_optimizer, targets[:1])
    reference.c.requires_grad_(True)
    torch_steps(reference, torch_optimizer, targets[1:])

    ipu = poptorch.trainingModel(model, optimizer=OPTIMIZERS["sgd"](model.parameters()))
    ipu(targets[0])
    model.c.requires_grad_(True)
    with pytest.warns(UserWarning, match="compiling again"):
        ipu(targets[1])
    assert_same_parameters(model, reference)


class Normalized(torch.nn.Module):
    """PopTorch's norms_test model for a BatchNorm put in eval() during training."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x, target):
        y = self.dropout(self.norm(self.linear(x)))
        return y, F.mse_loss(y, target)


def test_submodule_in_eval_mode_stays_in_eval_mode_while_training():
    torch.manual_seed(0)
    model = Normalized()
    model.norm.running_mean.uniform_(-1, 1)
    model.norm.eval()
    model.dropout.eval()
    reference = copy.deepcopy(model)
    x, target = torch.randn(16, 6), torch.randn(16, 6)
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for _ in range(2):
        torch_optimizer.zero_grad()
        out, loss = reference(x, target)
        loss.backward()
        torch_optimizer.step()
        expected.append(out.detach())

    ipu = poptorch.trainingModel(model, poptorch.Options().outputMode(poptorch.OutputMode.All),
                                 torch.optim.SGD(model.parameters(), lr=0.1))
    outputs = [ipu(x, target)[0] for _ in range(2)]
    torch.testing.assert_close(torch.stack(outputs), torch.stack(expected), rtol=RTOL, atol=ATOL)
    assert_same_parameters(model, reference)
    torch.testing.assert_close(model.norm.running_mean, reference.norm.running_mean, rtol=0, atol=0)
    assert model.training and not model.norm.training and not model.dropout.training


def test_modes_changed_between_training_calls_train_as_torch_does_in_them():
    """``model.eval()`` (or one submodule's) between calls: the next call normalizes with the
    running statistics and leaves them alone, as torch's step does; back in ``train()``, the
    batch statistics again."""
    torch.manual_seed(0)
    model = Normalized()
    model.dropout.p = 0.0          # its draws are not torch's
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    xs, targets = torch.randn(5, 16, 6, generator=generator), torch.randn(5, 16, 6, generator=generator)
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    modes = [lambda m: m.train(), lambda m: m.eval(), lambda m: m.train(), lambda m: m.norm.eval(),
             lambda m: m.train()]
    for set_mode, x, target in zip(modes, xs, targets):
        set_mode(model)
        set_mode(reference)
        torch_optimizer.zero_grad()
        expected, loss = reference(x, target)
        loss.backward()
        torch_optimizer.step()
        torch.testing.assert_close(ipu(x, target)[0], expected, rtol=RTOL, atol=ATOL)
    assert_same_parameters(model, reference)
    torch.testing.assert_close(model.norm.running_mean, reference.norm.running_mean, rtol=RTOL, atol=ATOL)


def test_inference_model_runs_everything_in_eval_mode_and_leaves_the_flags():
    torch.manual_seed(0)
    model = Normalized()
    model.linear.eval()
    x = torch.randn(8, 6)
    expected = copy.deepcopy(model).eval()(x, x)[0]
    out = poptorch.inferenceModel(model)(x, x)[0]
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
    assert model.training and model.norm.training and not model.linear.training


class PartlyNoGrad(torch.nn.Module):
    """A step with a ``torch.no_grad()`` block: a scale computed from a parameter, and a buffer
    updated in place (an exponential moving average)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((3,), 0.5))
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("average", torch.zeros(3))

    def forward(self, x):
        with torch.no_grad():
            frozen_scale = self.scale * 2
            self.average.mul_(0.9).add_(0.1 * x.mean(0))
        return (x * frozen_scale * self.weight * self.scale).sum()


def trained_as_torch(model: torch.nn.Module, batches: torch.Tensor, lr: float) -> torch.nn.Module:
    """Train ``model`` with SGD, one step per batch, as a trainingModel running all the batches
    in one call, and return a copy trained likewise by torch eager."""
    reference = copy.deepcopy(model)
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    for batch in batches:
        torch_optimizer.zero_grad()
        reference(batch).backward()
        torch_optimizer.step()
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    assert moved > 1e-2, "torch eager did not train"
    ipu = poptorch.trainingModel(model, poptorch.Options().deviceIterations(len(batches)),
                                 torch.optim.SGD(model.parameters(), lr=lr))
    ipu(batches.flatten(0, 1))
    return reference


def test_no_grad_block_passes_no_gradient_as_in_torch():
    torch.manual_seed(0)
    model = PartlyNoGrad()
    reference = trained_as_torch(model, torch.randn(2, 4, 3), lr=0.1)
    assert_same_parameters(model, reference)
    torch.testing.assert_close(model.average, reference.average, rtol=RTOL, atol=ATOL)


class ChangedUnderNoGrad(torch.nn.Module):
    """Tensors changed in place under ``torch.no_grad()``, themselves or through views, keep their
    history in torch: the new values flow on, the gradient passes to the old ones unchanged
    (``clone`` then ``clamp_``, as ``F.gaussian_nll_loss`` clamps its variance; ``copy_``; a
    column clamped or set through indexing)."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.second = torch.nn.Linear(4, 4)

    def forward(self, x):
        clamped = self.first(x).clone()
        doubled = self.second(x)
        with torch.no_grad():
            clamped.clamp_(min=0.1)
            doubled.copy_(doubled * 2)
        viewed = self.first(x * 2)
        with torch.no_grad():
            viewed[:, 0].clamp_(max=0.2)
            viewed[:, 1] = 0.5
        return (clamped * doubled).sum() + (clamped ** 2).mean() + (viewed ** 2).sum()


def test_values_changed_in_place_under_no_grad_keep_their_gradient_as_in_torch():
    torch.manual_seed(0)
    model = ChangedUnderNoGrad()
    reference = trained_as_torch(model, torch.randn(2, 6, 4), lr=0.05)
    assert_same_parameters(model, reference)


class ChangedThroughDetach(torch.nn.Module):
    """A tensor changed in place through ``detach()`` and used afterwards: the layer's output
    (torch keeps its gradient history) or a copy of the input (no history to keep)."""

    def __init__(self, change_output: bool):
        super().__init__()
        self.change_output = change_output
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        copy_of_x = x * 1
        (y if self.change_output else copy_of_x).detach()[:, 1:].clamp_(min=0.1)   # through a view too
        return ((y + copy_of_x) ** 2).mean()


def test_a_tensor_with_history_changed_through_detach_is_refused():
    torch.manual_seed(0)
    model = ChangedThroughDetach(change_output=True)
    ipu = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    with pytest.raises(poptorch.Error, match=r"through \.detach\(\) at .*test_module_state.py.*torch.no_grad"):
        ipu(torch.randn(6, 4))
    model = ChangedThroughDetach(change_output=False)
    reference = trained_as_torch(model, torch.randn(2, 6, 4), lr=0.05)
    assert_same_parameters(model, reference)


class ChangesItsWeight(torch.nn.Module):
    """A parameter changed in forward: clamped under no_grad, or an embedding's rows renormalized
    by ``max_norm``."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.embedding = torch.nn.Embedding(10, 4, max_norm=1.0 if how == "max_norm" else None)

    def forward(self, indices):
        if self.how == "clamp":
            with torch.no_grad():
                self.embedding.weight.clamp_(-0.1, 0.1)
        return (self.embedding(indices) ** 2).mean()


@pytest.mark.parametrize("how, message", [
    ("clamp", r"forward changes the parameter embedding\.weight in place.*only through the optimizer.*on the host"),
    ("max_norm", r"max_norm of nn\.Embedding.*at .*test_module_state\.py.*Remove max_norm, or renormalize the weight "
                 r"on the host"),
])
def test_a_parameter_changed_in_forward_is_refused_naming_it_and_the_fix(how, message):
    model = ChangesItsWeight(how)
    for ipu in (poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05)),
                poptorch.inferenceModel(model)):
        with pytest.raises(poptorch.Error, match=message):
            ipu(torch.randint(0, 10, (6,)))
        ipu.destroy()


class Checkpointed(torch.nn.Module):
    """Activation checkpointing the reentrant way, which runs the block under no_grad and again
    with gradients in torch's backward: on the input (the block gets no gradient in torch: no
    input of the checkpoint requires one) or on a layer's output."""

    def __init__(self, after_layer: bool):
        super().__init__()
        self.after_layer = after_layer
        self.first = torch.nn.Linear(4, 4)
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        hidden = torch.utils.checkpoint.checkpoint(self.block, self.first(x) if self.after_layer else x,
                                                   use_reentrant=True)
        return (self.head(hidden) ** 2).mean()


@pytest.mark.parametrize("after_layer", [True, False], ids=["after_a_layer", "on_the_input"])
def test_a_reentrant_activation_checkpoint_trains_as_in_torch(after_layer):
    torch.manual_seed(0)
    model = Checkpointed(after_layer)
    block = copy.deepcopy(model.block)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "None of the inputs have requires_grad")
        reference = trained_as_torch(model, torch.randn(2, 6, 4), lr=0.1)
    assert_same_parameters(model, reference)
    moved = any(not torch.equal(p, q) for p, q in zip(model.block.parameters(), block.parameters()))
    assert moved == after_layer, "torch trains the block only through an input that requires a gradient"


def test_a_module_backward_hook_is_refused_in_training_but_not_for_inference():
    torch.manual_seed(0)
    model = Checkpointed(after_layer=True)
    model.head.register_full_backward_hook(lambda module, grad_input, grad_output: None)
    x = torch.randn(6, 4)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match="head has a backward hook .*would never be called"):
        training(x)
    training.destroy()
    inference = poptorch.inferenceModel(model)
    torch.testing.assert_close(inference(x), model(x), rtol=RTOL, atol=ATOL)
