"""A plain Python value outside the model that its code reads (a global, a closure variable, a
setting of a Python module, a field of a config object a module holds) is baked into the program
as the model's own attributes are: when it changes, the executor captures the model again, so
every call equals torch eager; one that the model's code does not read as a global leaves the
program alone. fp32: 1e-5 relative (1e-6 absolute)."""

import argparse
import copy
import dataclasses
import logging
import types

import torch
import torch.nn.functional as F

import ipu_backend as poptorch
from tests.runtime.test_python_reads import assert_trained_alike, step_both

LOSS_WEIGHT = 1.0
settings = types.ModuleType("settings")
settings.SHIFT = 0.0
args = argparse.Namespace(scale=1.0)
calls = [0]
shape = 0


def weighted(loss):
    return loss * LOSS_WEIGHT


class GloballyWeighted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x, y):
        return weighted(F.mse_loss(self.linear(x) * args.scale + settings.SHIFT, y))


def test_a_training_model_follows_a_global_its_helper_reads_and_settings_read_off_globals():
    global LOSS_WEIGHT
    torch.manual_seed(0)
    model, x, y = GloballyWeighted(), torch.randn(4, 4), torch.randn(4, 2)
    reference = copy.deepcopy(model)
    expected_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        for weight, shift, scale in ((1.0, 0.0, 1.0), (0.0, 0.0, 1.0), (2.0, 0.0, 1.0), (2.0, 1.5, 1.0),
                                     (2.0, 1.5, -0.5)):
            LOSS_WEIGHT, settings.SHIFT, args.scale = weight, shift, scale
            step_both(training, reference, expected_optimizer, x, y)
        assert_trained_alike(training, model, reference)
    finally:
        LOSS_WEIGHT, settings.SHIFT, args.scale = 1.0, 0.0, 1.0


def _tempered(temperature):
    class Tempered(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, x):
            return torch.softmax(self.linear(x) / temperature, -1)

    def set_temperature(value):
        nonlocal temperature
        temperature = value

    return Tempered(), set_temperature


def test_a_closure_variable_is_guarded():
    torch.manual_seed(0)
    model, set_temperature = _tempered(1.0)
    x = torch.randn(4, 4)
    inference = poptorch.inferenceModel(model)
    for temperature in (1.0, 0.25):
        set_temperature(temperature)
        torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)


class Counting(torch.nn.Module):
    """Changes a global each time it runs: the program runs no Python, so it is captured again."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x):
        calls[0] += 1
        return self.linear(x) * calls[0]


def test_a_global_the_model_changes_as_it_runs_gives_torchs_sequence(caplog):
    torch.manual_seed(0)
    model, x = Counting(), torch.randn(4, 4)
    reference = copy.deepcopy(model)
    inference = poptorch.inferenceModel(model)
    calls[0] = 0
    with caplog.at_level(logging.INFO, logger="ipu_backend"):
        ours = [inference(x) for _ in range(3)]
    assert sum(f"{__name__}.calls" in r.getMessage() for r in caplog.records) == 2
    calls[0] = 0
    for got in ours:
        torch.testing.assert_close(got, reference(x), rtol=1e-5, atol=1e-6)


class ReadsShapes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.linear(x) * x.shape[0]


def test_a_global_named_like_an_attribute_the_model_reads_is_not_a_guard(caplog):
    global shape
    torch.manual_seed(0)
    model, x = ReadsShapes(), torch.randn(4, 4)
    inference = poptorch.inferenceModel(model)
    with caplog.at_level(logging.INFO, logger="ipu_backend"):
        for shape in range(3):
            torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
    assert not [r for r in caplog.records if "again" in r.getMessage()]


class Tempered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.softmax(self.linear(x) / args.temperature, -1)


def test_a_setting_read_off_a_global_that_is_bound_to_a_new_object_is_followed():
    """``args = parser.parse_args(...)`` again: the guard reads the global's new object."""
    global args
    torch.manual_seed(0)
    model, x, kept = Tempered(), torch.randn(4, 4), args
    inference = poptorch.inferenceModel(model)
    try:
        for temperature in (1.0, 0.25):
            args = argparse.Namespace(temperature=temperature)
            torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
    finally:
        args = kept


OFFSET = torch.tensor([1.0, 2.0, 3.0, 4.0])


class Masked(torch.nn.Module):
    """Reads a global tensor and a tensor held as a plain attribute (not a buffer): constants."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.mask = torch.ones(4)

    def forward(self, x):
        return self.linear(x - OFFSET) * self.mask


def test_a_tensor_constant_replaced_or_changed_in_place_on_the_host_is_followed(caplog):
    global OFFSET
    torch.manual_seed(0)
    model, x, kept = Masked(), torch.randn(2, 4), OFFSET
    inference = poptorch.inferenceModel(model)
    changes = [lambda: None, lambda: OFFSET.mul_(3), lambda: model.mask.__setitem__(0, 0.0),
               lambda: setattr(model, "mask", torch.full((4,), 2.0))]
    try:
        with caplog.at_level(logging.INFO, logger="ipu_backend"):
            for change in changes:
                change()
                torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
            OFFSET = torch.zeros(4)
            torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
    finally:
        OFFSET = kept
    messages = [r.getMessage() for r in caplog.records if "again" in r.getMessage()]
    assert len(messages) == 4
    assert "mask (a tensor, changed in place)" in messages[1] and "OFFSET (a tensor, replaced)" in messages[3]


@dataclasses.dataclass
class Settings:
    scale: float = 1.0
    activation: str = "tanh"


class Configured(torch.nn.Module):
    """Holds a config object and reads its fields, as models built from a config do."""

    def __init__(self, config: Settings):
        super().__init__()
        self.config = config
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x):
        out = self.linear(x) * self.config.scale
        return torch.tanh(out) if self.config.activation == "tanh" else torch.relu(out)


def test_fields_of_a_config_object_a_module_holds_are_guarded():
    torch.manual_seed(0)
    model, x = Configured(Settings()), torch.randn(4, 4)
    inference = poptorch.inferenceModel(model)
    changes = [lambda: None, lambda: setattr(model.config, "scale", 3.0),
               lambda: setattr(model.config, "activation", "relu"),
               lambda: setattr(model, "config", Settings(scale=-2.0))]
    for change in changes:
        change()
        torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
