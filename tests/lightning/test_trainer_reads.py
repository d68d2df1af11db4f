"""What a compiled step reads off its trainer is what Lightning on the CPU gives it: plain values
(``self.trainer.sanity_checking``) are guards of the program, captured again when they change, and
``self.trainer.is_last_batch`` is an input, true for the last batch's micro-batches only. fp32: 1e-5
relative (1e-6 absolute)."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

import ipu_backend
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import QUIET, assert_same_weights, dataset, loader, twins


class ReadsItsTrainer(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.outputs = []

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        return loss * 0.25 if self.trainer.is_last_batch else loss

    def validation_step(self, batch, batch_idx):
        if not self.trainer.sanity_checking:
            self.outputs.append(F.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_sanity_checking_and_the_last_batch_read_in_steps_are_those_of_the_cpu():
    ipu, cpu = twins(ReadsItsTrainer)
    for module, accelerator in ((ipu, "ipu"), (cpu, "cpu")):
        pl.Trainer(accelerator=accelerator, devices=1, max_epochs=2, num_sanity_val_steps=2,
                   **QUIET).fit(module, loader(dataset(16), 4), loader(dataset(8, seed=1), 4))
    assert len(ipu.outputs) == len(cpu.outputs) == 4            # two epochs of two batches, no sanity check
    torch.testing.assert_close(torch.stack(ipu.outputs), torch.stack(cpu.outputs), rtol=1e-5, atol=1e-6)
    assert_same_weights(ipu, cpu)


@pytest.mark.parametrize("iterations, accumulation", [(2, 1), (2, 2)])
def test_the_last_batch_is_the_last_micro_batches_of_a_call_of_several_steps(iterations, accumulation):
    ipu, cpu = twins(ReadsItsTrainer)
    options = ipu_backend.Options(device_iterations=iterations, gradient_accumulation=accumulation)
    pl.Trainer(accelerator="ipu", devices=1, max_epochs=2, accumulate_grad_batches=accumulation,
               strategy=IPUStrategy(training_opts=options), limit_val_batches=0,
               **QUIET).fit(ipu, loader(dataset(32), 4))
    pl.Trainer(accelerator="cpu", max_epochs=2, accumulate_grad_batches=accumulation, limit_val_batches=0,
               **QUIET).fit(cpu, loader(dataset(32), 4))
    assert_same_weights(ipu, cpu)
