"""A step's writes to its module's attributes: the host never sees them (the step's Python runs
once, at capture), so a changed counter or an assigned tensor is refused by name, while writes
the compiled step keeps (a tensor attribute changed in place) equal the CPU's."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

import ipu_backend
from tests.lightning.helpers import ATOL, QUIET, RTOL, dataset, loader, twins


class Writes(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.seen, self.last, self.stats, self.total, self.shape = 0, None, {}, torch.zeros(()), None

    def loss(self, batch):
        return F.mse_loss(self.net(batch[0]), batch[1])


class CountsSamples(Writes):
    def validation_step(self, batch, batch_idx):
        self.seen += batch[0].shape[0]


class KeepsTheLastLoss(Writes):
    def validation_step(self, batch, batch_idx):
        self.last = self.loss(batch)


class KeepsItInADict(Writes):
    def validation_step(self, batch, batch_idx):
        self.stats["loss"] = self.loss(batch)


class SumsInPlace(Writes):
    def validation_step(self, batch, batch_idx):
        self.shape = tuple(batch[0].shape)              # a Python value computed alike at every capture
        self.total += self.loss(batch).detach()


@pytest.mark.parametrize("module, message", [
    (CountsSamples, r"the step changes self.seen \(0 -> 4\).*hook that runs on the host"),
    (KeepsTheLastLoss, r"the step assigns a tensor to self.last:.*append it to a list"),
    (KeepsItInADict, r"the step assigns a tensor to self.stats\['loss'\]:.*buffer in place"),
])
def test_a_step_that_changes_a_counter_or_assigns_a_tensor_is_refused(module, message):
    with pytest.raises(ipu_backend.Error, match=message):
        pl.Trainer(accelerator="ipu", devices=1, **QUIET).validate(module(), loader(dataset(8), 4), verbose=False)


def test_a_tensor_attribute_changed_in_place_and_a_cached_python_value_are_kept():
    ipu, cpu = twins(SumsInPlace)
    for module, accelerator in ((ipu, "ipu"), (cpu, "cpu")):
        pl.Trainer(accelerator=accelerator, devices=1, **QUIET).validate(module, loader(dataset(16), 4), verbose=False)
    torch.testing.assert_close(ipu.total, cpu.total, rtol=RTOL, atol=ATOL)
    assert cpu.total > 0
