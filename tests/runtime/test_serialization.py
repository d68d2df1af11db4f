"""save / compileAndExport / loadExecutable / poptorch.load: the saved executable is loaded, not
compiled, and gives torch eager's numbers; random state, errors and program checks as PopTorch.
fp32 tolerance: 1e-5 relative (1e-6 absolute)."""

import copy
import os

import pytest
import torch

import jax

import ipu_backend as poptorch
from tests.multi_ipu.models import TwoStages, regression_data, torch_training

RTOL, ATOL = 1e-5, 1e-6


class Regression(torch.nn.Module):
    def __init__(self, hidden=4):
        super().__init__()
        self.layer = torch.nn.Linear(3, hidden)
        self.out = torch.nn.Linear(hidden, 1)

    def forward(self, x, y):
        prediction = self.out(torch.tanh(self.layer(x)))
        return prediction, torch.nn.functional.mse_loss(prediction, y)


def no_compilation(lowered, *args, **kwargs):
    raise AssertionError("the saved executables should be loaded, not compiled")


def test_exported_training_model_loads_without_compiling_and_trains_as_torch(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = Regression()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    executor = poptorch.trainingModel(model, poptorch.Options().deviceIterations(2), optimizer)
    path = os.path.join(tmp_path, "sub", "model.poptorch")             # missing folders are made
    executor.compileAndExport(path, x, y)
    executor.destroy()

    monkeypatch.setattr(jax.stages.Lowered, "compile", no_compilation)
    loaded = poptorch.load(path, edit_opts_fn=lambda opts: opts.logCycleCount(True))
    assert loaded.options.log_cycle_count and loaded.isCompiled()
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        _, loss = loaded(x, y)
        for xs, ys in zip(x.split(2), y.split(2)):
            torch_optimizer.zero_grad()
            _, expected = reference(xs, ys)
            expected.backward()
            torch_optimizer.step()
        torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=ATOL)
    for p, q in zip(loaded.model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)


class Noisy(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.dropout(x, 0.5)


def test_load_restores_the_random_state(tmp_path):
    executor = poptorch.inferenceModel(Noisy())
    x = torch.ones(8, 4)
    executor(x)
    executor.save(str(tmp_path))                                    # a folder: model.poptorch inside
    expected = executor(x)
    loaded = poptorch.load(os.path.join(tmp_path, "model.poptorch"))
    torch.testing.assert_close(loaded(x), expected, rtol=0, atol=0)


def test_load_executable_checks_the_program_and_poptorch_errors(tmp_path):
    path = str(tmp_path / "inference.poptorch")
    x, y = torch.randn(2, 3), torch.randn(2, 1)
    executor = poptorch.inferenceModel(Regression())
    with pytest.raises(poptorch.Error, match="Model has not been compiled or has been destroyed."):
        executor.save(path)
    executor.compileAndExport(path, x, y, export_model=False)
    with pytest.raises(AssertionError, match="was created with 'export_model=False'"):
        poptorch.load(path)
    same = Regression()
    same.load_state_dict(executor.model.state_dict())
    fresh = poptorch.inferenceModel(same)
    fresh.loadExecutable(path)
    for got, expected in zip(fresh(x, y), executor(x, y)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(poptorch.Error, match="compiled for another program"):
        poptorch.inferenceModel(Regression(hidden=5)).loadExecutable(path)
    with pytest.raises(poptorch.Error, match="was saved from a poptorch.inferenceModel; load it into one"):
        poptorch.trainingModel(Regression()).loadExecutable(path)
    (tmp_path / "junk").write_bytes(b"not a program")
    with pytest.raises(poptorch.Error, match="Invalid file"):
        poptorch.load(str(tmp_path / "junk"))


def test_a_wrapped_model_pickles_as_its_own_class_with_the_device_weights(tmp_path):
    model = Regression()
    executor = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    executor(torch.ones(2, 3), torch.zeros(2, 1))
    path = tmp_path / "model.pt"
    torch.save(model, path)
    restored = torch.load(path, weights_only=False)
    assert type(restored) is Regression and type(copy.deepcopy(model)) is Regression
    for p, q in zip(restored.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_a_pipelined_model_saves_and_loads_each_stage_program(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = TwoStages()
    reference = copy.deepcopy(model)
    x, y = regression_data(8)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    executor = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    path = str(tmp_path / "pipeline.poptorch")
    executor.compileAndExport(path, x, y)
    executor.destroy()
    monkeypatch.setattr(jax.stages.Lowered, "compile", no_compilation)
    loaded = poptorch.load(path)
    assert set(loaded.ipuPlacement().values()) == {0, 1}
    _, loss = loaded(x, y)
    _, expected = torch_training(reference, torch.optim.SGD(reference.parameters(), lr=0.1), x, y,
                                 accumulation=4, micro=2)
    torch.testing.assert_close(loss, expected[-1], rtol=RTOL, atol=ATOL)
    for p, q in zip(loaded.model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)


class DividesByInput(torch.nn.Module):
    def forward(self, x, divisor):
        return x // divisor


def test_a_program_that_calls_back_into_python_cannot_be_exported_and_says_why(tmp_path):
    executor = poptorch.inferenceModel(DividesByInput())      # an integer division by an input: checked
    with pytest.raises(poptorch.Error, match="calls back into Python while it runs.*cannot be saved to a file"):
        executor.compileAndExport(str(tmp_path / "model.poptorch"), torch.tensor([4, 6]), torch.tensor([2, 3]))
    assert not (tmp_path / "model.poptorch").exists()
