"""What a compiled step reads is current in every optimizer step, against Lightning on the CPU:
``self.current_epoch``, ``self.global_step`` and ``batch_idx`` (program inputs, device
iterations and accumulation included), and plain attributes of the module changed between calls
(the step is captured again). fp32: 1e-5 relative (1e-6 absolute)."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

import ipu_backend
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import QUIET, Regressor, assert_same_weights, dataset, loader, twins


def fit_pair(factory, ipu_strategy, batch=4, samples=16, callbacks=(), **trainer_args):
    """The module trained on the IPUs and on the CPU (twins)."""
    ipu, cpu = twins(factory)
    for module, accelerator in ((ipu, {"accelerator": "ipu", "strategy": ipu_strategy}), (cpu, {"accelerator": "cpu"})):
        trainer = pl.Trainer(**accelerator, **QUIET, callbacks=[c() for c in callbacks], **trainer_args)
        trainer.fit(module, loader(dataset(samples), batch))
    return ipu, cpu


class WeightedByEpoch(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y) * (1 + self.current_epoch)


class WeightedByStep(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y) * (1 + 0.5 * self.trainer.global_step)


class WeightedByBatchIndex(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y) * (1 + batch_idx % 2) * (1 + 0.25 * (batch_idx % 3))


def test_a_loss_weighted_by_the_epoch_trains_as_on_the_cpu_over_three_epochs():
    ipu, cpu = fit_pair(WeightedByEpoch, IPUStrategy(device_iterations=2), max_epochs=3)
    assert_same_weights(ipu, cpu)


def test_global_step_counts_every_optimizer_step_of_a_call_with_accumulation():
    ipu, cpu = fit_pair(WeightedByStep, IPUStrategy(device_iterations=2), batch=2, max_epochs=2,
                        accumulate_grad_batches=2)
    assert_same_weights(ipu, cpu)


class BranchesWithCond(Regressor):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return torch.cond(batch_idx % 2 == 1, lambda value: value * 2, lambda value: value / 2, (loss,))


@pytest.mark.parametrize("factory", [WeightedByBatchIndex, BranchesWithCond])
def test_batch_idx_is_the_cpu_batch_index_of_each_micro_batch(factory):
    ipu, cpu = fit_pair(factory, IPUStrategy(device_iterations=2), batch=2, max_epochs=1,
                        accumulate_grad_batches=2)
    assert_same_weights(ipu, cpu)


class ManualTwoSteps(Regressor):
    """Two optimizer steps per training step, each weighted by ``global_step`` as it stands."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        first, second = self.optimizers()
        for optimizer in (first, second):
            loss = F.mse_loss(self.net(x), y) * (1 + 0.5 * self.global_step)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()

    def configure_optimizers(self):
        return (torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                torch.optim.SGD(self.net[2].parameters(), lr=0.1))


def test_manual_optimization_counts_each_optimizer_step_in_global_step():
    ipu, cpu = fit_pair(ManualTwoSteps, IPUStrategy(device_iterations=2), max_epochs=1)
    assert_same_weights(ipu, cpu)


class LogsCounters(Regressor):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("weighted", F.mse_loss(self.net(x), y) * (1 + self.current_epoch) + self.global_step
                 + batch_idx, reduce_fx="sum")


def test_validation_reads_the_counters_of_the_cpu():
    metrics = []
    for accelerator in ({"accelerator": "ipu", "strategy": IPUStrategy(device_iterations=2,
                                                                      inference_opts={"device_iterations": 2})},
                        {"accelerator": "cpu"}):
        trainer = pl.Trainer(**accelerator, **QUIET, max_epochs=2, num_sanity_val_steps=0)
        _, module = twins(LogsCounters)
        trainer.fit(module, loader(dataset(16), 4), loader(dataset(16, seed=1), 4))
        metrics.append(trainer.callback_metrics["weighted"])
    torch.testing.assert_close(metrics[0], metrics[1], rtol=1e-5, atol=1e-6)


class ScaledByAttribute(Regressor):
    def __init__(self):
        super().__init__()
        self.alpha = 1.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y) * self.alpha


class HalvesAlphaEachEpoch(pl.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        pl_module.alpha = pl_module.alpha / 2


def test_an_attribute_changed_between_calls_is_captured_again():
    ipu, cpu = fit_pair(ScaledByAttribute, IPUStrategy(device_iterations=2), callbacks=[HalvesAlphaEachEpoch],
                        max_epochs=3)
    assert ipu.alpha == cpu.alpha == 0.125
    assert_same_weights(ipu, cpu)
