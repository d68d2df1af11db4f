"""Pipelined and sharded training equal plain torch (and so single-IPU) training: SGD with
momentum, AdamW, BatchNorm; each stage's weights and optimizer state live on its IPU's device.
fp32 tolerance: 1e-5 relative, 1e-6 absolute."""

import jax
import pytest
import torch

import ipu_backend as poptorch
from ipu_backend.runtime.weights import weight_store
from tests.multi_ipu.models import (
    ATOL,
    RTOL,
    FourStagesWithSkip,
    TwoStages,
    assert_same_parameters,
    regression_data,
    torch_training,
    twins,
)

STRATEGIES = {"pipelined": poptorch.PipelinedExecution, "sharded": poptorch.ShardedExecution}
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.1),
}


def options(strategy, accumulation=3, device_iterations=2):
    opts = poptorch.Options().deviceIterations(device_iterations).outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(accumulation)
    return opts.setExecutionStrategy(strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_two_stage_training_equals_torch(strategy, optimizer):
    torch.manual_seed(0)
    model, reference = twins(TwoStages(batch_norm=optimizer == "sgd"))
    x, y = regression_data(2 * 2 * 3 * 4)                    # 2 calls × 2 iterations × 3 micro-batches of 4
    expected_out, expected_loss = torch_training(reference, OPTIMIZERS[optimizer](reference.parameters()),
                                                 x, y, accumulation=3, micro=4)
    ipu = poptorch.trainingModel(model, options(STRATEGIES[strategy]("B1", "B2")),
                                 OPTIMIZERS[optimizer](model.parameters()))
    halves = [(x[:24], y[:24]), (x[24:], y[24:])]
    results = [ipu(*half) for half in halves]
    torch.testing.assert_close(torch.cat([out for out, _ in results]), expected_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.cat([loss for _, loss in results]), expected_loss, rtol=RTOL, atol=ATOL)
    assert_same_parameters(model, reference)


def test_four_stages_with_a_skip_connection_and_auto_stages():
    torch.manual_seed(1)
    model, reference = twins(FourStagesWithSkip())
    x = torch.randn(2 * 7 * 2, 5)
    y = torch.randint(0, 5, (2 * 7 * 2,))
    optimizer = torch.optim.AdamW
    expected_out, expected_loss = torch_training(reference, optimizer(reference.parameters(), lr=0.01),
                                                 x, y, accumulation=7, micro=2)
    opts = options(poptorch.PipelinedExecution(*(poptorch.Stage(f"B{i + 1}").ipu(i) for i in range(4))),
                   accumulation=7)
    ipu = poptorch.trainingModel(model, opts, optimizer(model.parameters(), lr=0.01))
    out, loss = ipu(x, y)
    torch.testing.assert_close(out, expected_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    assert_same_parameters(model, reference)
    assert set(ipu.ipuPlacement().values()) == {0, 1, 2, 3}


def test_weights_and_optimizer_state_live_on_their_ipu():
    model = TwoStages(batch_norm=True)
    ipu = poptorch.trainingModel(model, options(poptorch.PipelinedExecution("B1", "B2")),
                                 torch.optim.AdamW(model.parameters(), lr=0.01))
    ipu(*regression_data(24))
    placement = ipu.ipuPlacement()
    assert placement == {"fc1.weight": 0, "fc1.bias": 0, "norm.weight": 0, "norm.bias": 0,
                         "fc2.weight": 1, "fc2.bias": 1}
    store = weight_store(model)
    devices = jax.devices()
    for name, ipu_index in placement.items():
        assert store.params[name].devices() == {devices[ipu_index]}, name
        for slot in ipu._opt_state[name].values():
            assert slot.devices() == {devices[ipu_index]}, name
    for name, buffer in store.buffers.items():
        assert buffer.devices() == {devices[0]}, name


def test_pipelined_inference_equals_torch_and_shares_trained_weights():
    torch.manual_seed(2)
    model = TwoStages()
    ipu = poptorch.trainingModel(model, options(poptorch.PipelinedExecution("B1", "B2")),
                                 torch.optim.SGD(model.parameters(), lr=0.1))
    ipu(*regression_data(24))
    opts = poptorch.Options().deviceIterations(4).setExecutionStrategy(poptorch.PipelinedExecution("B1", "B2"))
    inference = poptorch.inferenceModel(model, opts)
    x, _ = regression_data(12, seed=3)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(inference(x), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["sum", "every_n"])
def test_output_modes_select_as_on_one_ipu(mode):
    torch.manual_seed(6)
    model, reference = twins(TwoStages())
    x, y = regression_data(4 * 3 * 2)                         # 4 iterations × 3 micro-batches of 2
    expected_out, expected_loss = torch_training(reference, torch.optim.SGD(reference.parameters(), lr=0.1),
                                                 x, y, accumulation=3, micro=2)
    opts = options(poptorch.PipelinedExecution("B1", "B2"), accumulation=3, device_iterations=4)
    opts.outputMode(poptorch.OutputMode.Sum if mode == "sum" else poptorch.OutputMode.EveryN, 2)
    out, loss = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))(x, y)
    if mode == "sum":
        torch.testing.assert_close(loss, expected_loss.sum(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(out, expected_out.view(12, 2, 3).sum(0), rtol=RTOL, atol=ATOL)
    else:                                                     # every micro-batch of iterations 2 and 4
        torch.testing.assert_close(loss, expected_loss[[3, 4, 5, 9, 10, 11]], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(out, expected_out.view(4, 3, 2, 3)[[1, 3]].reshape(12, 3),
                                   rtol=RTOL, atol=ATOL)


class Dropout(TwoStages):
    def forward(self, x, y):
        with poptorch.Block("B1", ipu_id=0):
            h = torch.nn.functional.dropout(torch.tanh(self.fc1(x)), 0.5)
        with poptorch.Block("B2", ipu_id=1):
            out = torch.nn.functional.dropout(self.fc2(h), 0.3)
            return out, torch.nn.functional.mse_loss(out, y)


def test_random_operations_draw_the_numbers_of_the_single_ipu_program():
    x, y = regression_data(2 * 3 * 4)
    results = []
    for strategy in (poptorch.PipelinedExecution(poptorch.Stage("B1", "B2").ipu(0)),    # one IPU
                     poptorch.PipelinedExecution("B1", "B2")):
        torch.manual_seed(7)
        model = Dropout()
        opts = options(strategy).randomSeed(11)
        results.append(poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))(x, y))
    torch.testing.assert_close(results[1], results[0], rtol=RTOL, atol=ATOL)
    assert (results[1][0] == 0).any()


@pytest.mark.parametrize("loss_scaling", [None, 3e38])
def test_dynamic_loss_scaling_skips_and_scales_as_on_one_ipu(loss_scaling):
    """From torch's default scale (no overflow: the numbers of unscaled training) and from one
    so large that the first step overflows (skipped, the scale halved)."""
    x, y = regression_data(3 * 3 * 4)
    runs = []
    for strategy in (poptorch.PipelinedExecution(poptorch.Stage("B1", "B2").ipu(0)),
                     poptorch.PipelinedExecution("B1", "B2")):
        torch.manual_seed(8)
        model = TwoStages()
        opts = options(strategy, device_iterations=3)
        opts.Training.setAutomaticLossScaling(True)
        optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=loss_scaling or 1.0)
        ipu = poptorch.trainingModel(model, opts, optimizer)
        out, loss = ipu(x, y)
        runs.append((out, loss, ipu.loss_scale(), [p.detach().clone() for p in model.parameters()]))
    (out, loss, scale, params), (p_out, p_loss, p_scale, p_params) = runs
    torch.testing.assert_close(p_out, out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(p_loss, loss, rtol=RTOL, atol=ATOL)
    assert p_scale == scale == pytest.approx(2.0 ** 16 if loss_scaling is None else 3e38 / 2)
    for p, q in zip(p_params, params):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


class Powered(TwoStages):
    """A non-tensor argument used on the second IPU (a constant of the compiled programs)."""

    def forward(self, x, y, power):
        with poptorch.Block("B1", ipu_id=0):
            h = torch.tanh(self.fc1(x))
        with poptorch.Block("B2", ipu_id=1):
            out = self.fc2(h) ** power
            return out, torch.nn.functional.mse_loss(out, y)


def test_non_tensor_arguments_are_constants_of_the_stage_programs():
    torch.manual_seed(9)
    model, reference = twins(Powered())
    x, y = regression_data(2 * 3 * 4)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected_out, expected_loss = torch_training(lambda *batch: reference(*batch, 2), optimizer, x, y,
                                                 accumulation=3, micro=4)
    ipu = poptorch.trainingModel(model, options(poptorch.ShardedExecution("B1", "B2")),
                                 torch.optim.SGD(model.parameters(), lr=0.1))
    out, loss = ipu(x, y, 2)
    torch.testing.assert_close(out, expected_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    assert_same_parameters(model, reference)


class RegionsInALaterStage(torch.nn.Module):
    """The second stage holds a cumulative batch norm and a running mean updated under no_grad,
    both of which the capture records as grad-mode regions."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        self.norm = torch.nn.BatchNorm1d(8, momentum=None)
        self.register_buffer("running_out", torch.zeros(3))
        poptorch.BeginBlock(self.norm, "B2", ipu_id=1)

    def forward(self, x, y):
        out = self.fc2(torch.tanh(self.norm(torch.relu(self.fc1(x)))))
        with torch.no_grad():
            self.running_out.mul_(0.5).add_(out.mean(0))
        return out, torch.nn.functional.mse_loss(out, y)


def test_grad_mode_regions_stay_in_their_stage():
    torch.manual_seed(0)
    model, reference = twins(RegionsInALaterStage())
    poptorch.removeBlocks(reference)
    x, y = regression_data(2 * 3 * 4)
    expected_out, _ = torch_training(reference, torch.optim.SGD(reference.parameters(), lr=0.1), x, y,
                                     accumulation=3, micro=4)
    ipu = poptorch.trainingModel(model, options(poptorch.PipelinedExecution(), device_iterations=2),
                                 torch.optim.SGD(model.parameters(), lr=0.1))
    out, _ = ipu(x, y)
    torch.testing.assert_close(out, expected_out, rtol=RTOL, atol=ATOL)
    ipu.copyWeightsToHost()
    assert_same_parameters(model, reference)
    assert int(model.norm.num_batches_tracked) == 6
    assert ipu.ipuPlacement() == {"fc1.weight": 0, "fc1.bias": 0, "norm.weight": 1, "norm.bias": 1,
                                  "fc2.weight": 1, "fc2.bias": 1}
