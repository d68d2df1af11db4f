"""A plain Python attribute that a model reads (``self.scale``) is baked into its program; when
it changes, an existing executor captures the model again, so every call equals torch eager.
fp32: 1e-5 relative (1e-6 absolute)."""

import copy
import enum
import logging
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.scale = 1.0

    def forward(self, x, y=None):
        out = self.linear(x) * self.scale
        return out if y is None else F.mse_loss(out, y) * self.scale


def test_a_training_model_follows_a_changed_loss_weight():
    torch.manual_seed(0)
    model, x, y = Scaled(), torch.randn(4, 4), torch.randn(4, 2)
    reference = copy.deepcopy(model)
    expected_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for scale in (1.0, 0.0, 2.0):
        model.scale = reference.scale = scale
        step_both(training, reference, expected_optimizer, x, y)
    assert_trained_alike(training, model, reference)


def step_both(training, reference, optimizer, x, y):
    """One call of ``training`` and torch eager's step of ``reference``: the losses are equal."""
    loss = training(x, y)
    optimizer.zero_grad()
    expected = reference(x, y)
    expected.backward()
    optimizer.step()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)


def assert_trained_alike(training, model, reference):
    training.copyWeightsToHost()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_an_attribute_of_a_submodule_is_guarded_too():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LeakyReLU(0.1))
    x = torch.randn(4, 4)
    inference = poptorch.inferenceModel(model)
    torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
    model[1].negative_slope = 0.5
    torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)


def test_an_attribute_that_keeps_changing_warns_and_stays_equal_to_torch():
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(4, 4)
    inference = poptorch.inferenceModel(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(9):
            model.scale = float(step)
            torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
    messages = [str(w.message) for w in caught if "keep changing" in str(w.message)]
    assert len(messages) == 1 and "scale (7.0 -> 8.0)" in messages[0]


class Configured(torch.nn.Module):
    """Reads a mapping of settings and an optional tensor, as a config or ``hparams`` holds them."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.settings = {"scale": 1.0, "shift": (0.0, 0.5)}
        self.offset = None

    def forward(self, x):
        out = self.linear(x) * self.settings["scale"] + self.settings["shift"][1]
        return out if self.offset is None else out + self.offset


def test_settings_in_a_mapping_and_an_attribute_that_stops_being_none_are_guarded():
    torch.manual_seed(0)
    model, x = Configured(), torch.randn(4, 4)
    inference = poptorch.inferenceModel(model)
    torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
    model.settings["shift"] = (0.0, -1.0)
    torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
    model.offset = torch.ones(2)
    torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)


def shifted(x, config):
    return x + config.shift


class ConfiguredByRecord(torch.nn.Module):
    """Hands its configuration record to a helper, which reads a field off it."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.config = types.SimpleNamespace(shift=0.5)

    def forward(self, x):
        return shifted(self.linear(x), self.config)


def test_a_configuration_record_a_helper_reads_is_guarded_and_shown_as_written(caplog):
    torch.manual_seed(0)
    model, x = ConfiguredByRecord(), torch.randn(4, 4)
    inference = poptorch.inferenceModel(model)
    torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
    model.config.shift = -1.0
    with caplog.at_level(logging.INFO, logger="ipu_backend"):
        torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
    assert any("config (SimpleNamespace(shift=0.5) -> namespace(shift=-1.0))" in r.getMessage()
               for r in caplog.records)


class Gated(torch.nn.Module):
    """Its layers run inside ``torch.cond`` branches, which torch traces with its compiler."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.scale = 1.0

    def forward(self, x):
        out = torch.cond(x.sum() > 0, lambda v: self.linear(v), lambda v: -self.linear(v), (x,))
        return out * self.scale


def test_an_attribute_read_beside_torch_cond_is_guarded_too():
    torch.manual_seed(0)
    model, x = Gated(), torch.randn(4, 4)
    inference = poptorch.inferenceModel(model)
    torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
    model.scale = 3.0
    torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)


def test_hooks_added_or_removed_after_a_call_are_followed(caplog):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    unrelated, x = torch.nn.Linear(2, 2), torch.randn(3, 4)
    inference = poptorch.inferenceModel(model)
    torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
    changes = [lambda: model[0].register_forward_hook(lambda m, i, out: out * 2),
               lambda: model[2].register_forward_pre_hook(lambda m, i: (i[0] + 1,)),
               lambda: torch.nn.modules.module.register_module_forward_hook(lambda m, i, out: out),
               lambda: unrelated.register_forward_hook(lambda m, i, out: out)]     # not the model's
    handles = []
    with caplog.at_level(logging.INFO, logger="ipu_backend"):
        for change in changes:
            handles.append(change())
            torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
        for handle in handles:
            handle.remove()
            torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
    captures = [r.getMessage() for r in caplog.records if "again" in r.getMessage()]
    assert len(captures) == 6 and all("hooks (a hook added or removed)" in m for m in captures)


def test_a_backward_hook_added_to_a_training_model_after_a_call_is_refused():
    torch.manual_seed(0)
    model, x, y = Scaled(), torch.randn(4, 4), torch.randn(4, 2)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    training(x, y)
    model.linear.register_full_backward_hook(lambda m, grad_in, grad_out: None)
    with pytest.raises(poptorch.Error, match="backward hook"):
        training(x, y)


class Precision(enum.Enum):
    FULL = "full"
    HALF = "half"


class Selectable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.precision, self.dtype = Precision.FULL, torch.float32

    def forward(self, x):
        out = self.linear(x)
        if self.precision is Precision.HALF:
            out = out.to(torch.bfloat16).float()
        return out.to(self.dtype)


def test_an_enum_member_and_a_dtype_held_as_attributes_are_guarded():
    torch.manual_seed(0)
    model, x = Selectable(), torch.randn(4, 4)
    inference = poptorch.inferenceModel(model)
    for precision, dtype in ((Precision.FULL, torch.float32), (Precision.HALF, torch.float32),
                             (Precision.HALF, torch.float16)):
        model.precision, model.dtype = precision, dtype
        ours, torchs = inference(x), model(x)
        assert ours.dtype == torchs.dtype
        torch.testing.assert_close(ours, torchs, rtol=1e-5, atol=1e-6)


class Skipping(torch.nn.Module):
    """Skips the layers whose indices its attributes name: a list that starts empty and a set."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.skipped, self.negated = [], {1}

    def forward(self, x):
        for index, layer in enumerate(self.layers):
            if index not in self.skipped:
                x = torch.tanh(layer(x))
                x = -x if index in self.negated else x
        return x


def test_an_attribute_list_that_starts_empty_and_a_set_are_guarded():
    torch.manual_seed(0)
    model, x = Skipping(), torch.randn(4, 4)
    inference = poptorch.inferenceModel(model)
    changes = [lambda: None, lambda: model.skipped.append(0), lambda: model.negated.add(2),
               lambda: model.negated.clear()]
    for change in changes:
        change()
        torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
