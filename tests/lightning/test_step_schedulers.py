"""Schedulers with ``interval="step"`` under device iterations: stepped between the optimizer
steps of a call, so each step runs at the CPU's rate; sized in ``configure_optimizers`` by
``estimated_stepping_batches`` and ``accumulate_grad_batches``, which read as on the CPU."""

import warnings

import lightning.pytorch as pl
import pytest
import torch

import ipu_backend
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import QUIET, Recorder, Regressor, assert_same_weights, dataset, loader, twins


class OneCycle(Regressor):
    """A one-cycle schedule over the fit's optimizer steps, stepped after each (``frequency``)."""

    def __init__(self, frequency: int = 1):
        super().__init__()
        self.frequency = frequency

    def configure_optimizers(self):
        self.estimated = self.trainer.estimated_stepping_batches
        self.accumulation = self.trainer.accumulate_grad_batches
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=self.estimated)
        return [optimizer], [{"scheduler": scheduler, "interval": "step", "frequency": self.frequency}]


def _fits(iterations: int, devices: int = 1, accumulation: int = 1, frequency: int = 1):
    """The same two-epoch fit of 48 samples on the CPU (batches of 4) and on IPUs (4 per
    optimizer step over the replicas); the IPU fit's scheduler warnings."""
    ipu, cpu = twins(OneCycle, frequency=frequency)
    cpu_recorder, ipu_recorder = Recorder(), Recorder()
    pl.Trainer(accelerator="cpu", max_epochs=2, accumulate_grad_batches=accumulation, callbacks=[cpu_recorder],
               **QUIET).fit(cpu, loader(dataset(48), 4))
    trainer = pl.Trainer(accelerator="ipu", devices=devices, max_epochs=2, accumulate_grad_batches=accumulation,
                         strategy=IPUStrategy(device_iterations=iterations), callbacks=[ipu_recorder], **QUIET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(ipu, loader(dataset(48), 4 // devices))
    warned = [str(w.message) for w in caught if "stepped once per batch" in str(w.message)]
    return (ipu, ipu_recorder), (cpu, cpu_recorder), warned


@pytest.mark.parametrize("iterations, devices, accumulation", [(2, 1, 1), (3, 2, 1), (2, 1, 2)])
def test_each_optimizer_step_of_a_call_runs_at_the_rate_of_the_cpu(iterations, devices, accumulation):
    (ipu, ipu_recorder), (cpu, cpu_recorder), warned = _fits(iterations, devices, accumulation)
    assert ipu.estimated == cpu.estimated == 24 // accumulation
    assert ipu.accumulation == cpu.accumulation == accumulation
    assert not warned
    assert_same_weights(ipu, cpu)
    batches = iterations * accumulation                  # the CPU's batches per call
    assert ipu_recorder.lrs == pytest.approx(cpu_recorder.lrs[batches - 1::batches])   # after each call


def test_a_scheduler_stepped_every_second_batch_is_stepped_once_per_call_and_warned_of():
    (ipu, ipu_recorder), (cpu, cpu_recorder), warned = _fits(2, frequency=2)
    assert len(warned) == 1 and warned[0].startswith(
        "OneCycleLR (interval='step', frequency=2) is stepped once per batch: the batch's device_iterations=2 "
        "optimizer steps all run at the learning rate it set")
    assert len(set(ipu_recorder.lrs)) > 3 and ipu_recorder.lrs != pytest.approx(cpu_recorder.lrs[1::2])



class ReadsTheRate(OneCycle):
    def training_step(self, batch, batch_idx):
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        return super().training_step(batch, batch_idx)


def test_a_step_reading_a_rate_its_scheduler_changes_within_a_call_is_refused():
    trainer = pl.Trainer(accelerator="ipu", max_epochs=1, strategy=IPUStrategy(device_iterations=2), **QUIET)
    with pytest.raises(ipu_backend.Error, match=r"^the training_step reads SGD.param_groups\[0\]\['lr'\] \(.* -> "
                                                r".*\), which the schedulers stepped between the optimizer steps of "
                                                r"one call change: .*LearningRateMonitor"):
        trainer.fit(ReadsTheRate(), loader(dataset(16), 4))
