"""Hyper-parameters read once per device iteration, schedulers stepped between the iterations
(``runtime/hyperparameters.py``): each optimizer step of a call runs at torch's rate."""

import copy

import pytest
import torch

import ipu_backend as poptorch
from ipu_backend.runtime.executor import PoplarExecutor


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.second(torch.tanh(self.first(x)))
        return out, torch.nn.functional.mse_loss(out, y)


def _one_cycle(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=12)


@pytest.mark.parametrize("output_mode, sharded", [("final", False), ("all", False), ("final", True)])
def test_each_device_iteration_runs_at_the_rate_its_scheduler_set(output_mode, sharded):
    torch.manual_seed(0)
    model = TwoLayers()
    reference = copy.deepcopy(model)
    options = poptorch.Options().deviceIterations(3).outputMode(output_mode)
    if sharded:
        model.second = poptorch.BeginBlock(model.second, ipu_id=1)
        options.setExecutionStrategy(poptorch.ShardedExecution())
    optimizer, scheduler = _one_cycle(model)
    executor = PoplarExecutor(model, options, True, optimizer=optimizer, step_schedulers=scheduler.step)
    x, y = torch.randn(12, 2, 4), torch.randn(12, 2, 3)
    executor.compile(x[:3].reshape(6, 4), y[:3].reshape(6, 3))
    assert scheduler.last_epoch == 0                       # compiling steps nothing
    for call in range(3):
        executor(x[3 * call:3 * call + 3].reshape(6, 4), y[3 * call:3 * call + 3].reshape(6, 3))
        scheduler.step()                                  # after the call's last step, as Lightning's loop
    reference_optimizer, reference_scheduler = _one_cycle(reference)
    for step in range(9):
        reference_optimizer.zero_grad()
        reference(x[step], y[step])[1].backward()
        reference_optimizer.step()
        reference_scheduler.step()
    executor.copyWeightsToHost()
    assert [compiled.multi_ipu for compiled in executor._compiled.values()] == [sharded]
    assert optimizer.param_groups[0]["lr"] == reference_optimizer.param_groups[0]["lr"]
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
