"""Phased execution (PopTorch's SerialPhasedExecution / ParallelPhasedExecution / Phase): the
phases run in order on their emulated IPUs with torch eager's numbers, blocks of one phase may
exchange values both ways, the compile report shows what each phase holds on each IPU, and
PopTorch's API errors. fp32 tolerance: 1e-5 relative (1e-6 absolute)."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch
from tests.multi_ipu.models import RTOL, ATOL, FourStagesWithSkip, assert_same_parameters, torch_training, twins


class Crossing(torch.nn.Module):
    """Phase 1's blocks read each other's values, and block "1" is entered again after block "2"."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))

    def forward(self, x, y):
        with poptorch.Block("0"):
            a = F.relu(self.layers[0](x))
        with poptorch.Block("1"):
            b = torch.tanh(self.layers[1](a))
        with poptorch.Block("2"):
            a = F.relu(self.layers[2](b))
        with poptorch.Block("1"):
            out = self.layers[3](a) + b
            loss = F.mse_loss(out, y)
        return out, loss


def test_parallel_phases_train_as_torch_on_alternating_ipus(tmp_path):
    torch.manual_seed(0)
    model, reference = twins(Crossing())
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    strategy = poptorch.ParallelPhasedExecution([poptorch.Stage("0")], [poptorch.Stage("1"), poptorch.Stage("2")])
    opts = poptorch.Options().setExecutionStrategy(strategy).enableProfiling(str(tmp_path))
    executor = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    out, loss = executor(x, y)
    expected_out, expected_loss = torch_training(reference, torch.optim.SGD(reference.parameters(), lr=0.1),
                                                 x, y, accumulation=1, micro=4)
    torch.testing.assert_close(out, expected_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss, expected_loss[0], rtol=RTOL, atol=ATOL)
    assert_same_parameters(model, reference)
    placement = executor.ipuPlacement()       # phase p's k-th stage on IPU 2k + p % 2
    assert [placement[f"layers.{i}.weight"] for i in range(4)] == [0, 1, 3, 1]
    executor.destroy()


def test_serial_phases_on_one_ipu_hold_one_phase_at_a_time(tmp_path):
    torch.manual_seed(0)
    model, reference = twins(FourStagesWithSkip())
    strategy = poptorch.SerialPhasedExecution("B1", "B2", ["B3", "B4"])
    strategy.setTensorsLiveness(poptorch.Liveness.OffChipAfterEachPhase)
    opts = poptorch.Options().setExecutionStrategy(strategy).enableProfiling(str(tmp_path))
    executor = poptorch.inferenceModel(model, opts)
    x, y = torch.randn(6, 5), torch.randint(0, 5, (6,))
    for got, expected in zip(executor(x, y), reference(x, y)):
        torch.testing.assert_close(got, expected.detach(), rtol=RTOL, atol=ATOL)
    assert set(executor.ipuPlacement().values()) == {0}
    executor.destroy()
    with open(os.path.join(tmp_path, "inference", "compile_report.json"), encoding="utf-8") as file:
        [ipu] = json.load(file)["programs"][0]["memory"]
    layer_bytes = (5 * 5 + 5) * 4
    assert {int(p): held["weights"] for p, held in ipu["phases"].items()} == {
        0: layer_bytes, 1: layer_bytes, 2: 2 * layer_bytes}
    assert ipu["weights"] == 2 * layer_bytes                # the largest phase, not the sum
    with open(os.path.join(tmp_path, "inference", "compile_report.html"), encoding="utf-8") as file:
        assert "Residency per phase" in file.read()


def test_phased_api_as_poptorch():
    poptorch.SerialPhasedExecution(poptorch.Phase("layer1"), poptorch.Phase("layer2"))
    poptorch.SerialPhasedExecution(poptorch.Stage("layer1"), poptorch.Stage("layer2"))
    strategy = poptorch.SerialPhasedExecution([poptorch.Stage("a"), poptorch.Stage("a.b")],
                                              [poptorch.Stage("c"), poptorch.Stage("c.b")])
    strategy.phase(1).ipus(2, 3)
    assert strategy.stage("c.b").ipu_id == 3
    with pytest.raises(poptorch.Error, match="no AutoStage for PhasedExecution"):
        poptorch.ParallelPhasedExecution()
    with pytest.raises(poptorch.Error, match="a associated with more than one stage"):
        poptorch.SerialPhasedExecution(["a"], ["a"])
    with pytest.raises(poptorch.Error, match="Phase contains 2 stages but you provided 1 ipus"):
        strategy.phase(0).ipus(1)


def test_a_block_outside_the_phases_is_an_error():
    model = poptorch.inferenceModel(FourStagesWithSkip(), poptorch.Options().setExecutionStrategy(
        poptorch.SerialPhasedExecution("B1", "B2", "B3")))
    with pytest.raises(poptorch.Error, match="Unknown Block 'B4'"):
        model(torch.randn(2, 5), torch.randint(0, 5, (2,)))
