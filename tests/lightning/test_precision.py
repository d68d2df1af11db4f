"""Precision on IPUs against Lightning's CPU precision plugins (half tolerances: bfloat16 keeps 8
bits of mantissa, float16 11, so a few steps agree to about 1e-2), and the device memory report."""

import lightning.pytorch as pl
import pytest
import torch

from tests.lightning.helpers import QUIET, Regressor, assert_same_weights, dataset, loader, twins


class SeesItsInputs(Regressor):
    def training_step(self, batch, batch_idx):
        self.input_dtype = batch[0].dtype
        self.autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        return super().training_step(batch, batch_idx)


class ReportsMemory(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        self.stats = trainer.accelerator.get_device_stats(trainer.strategy.root_device)


@pytest.mark.parametrize("precision, weights, inputs, autocast", [
    ("bf16-mixed", torch.float32, torch.float32, torch.bfloat16), ("16-true", torch.float16, torch.float16, None)])
def test_half_precisions_train_as_lightning_does_on_the_cpu(precision, weights, inputs, autocast):
    ipu, cpu = twins(SeesItsInputs)
    memory = ReportsMemory()
    pl.Trainer(accelerator="ipu", devices=2, precision=precision, max_steps=3, callbacks=[memory],
               **QUIET).fit(ipu, loader(dataset(), 4))
    pl.Trainer(accelerator="cpu", precision=precision, max_steps=3, **QUIET).fit(cpu, loader(dataset(), 8))
    assert ipu.net[0].weight.dtype == cpu.net[0].weight.dtype == weights
    assert ipu.input_dtype == inputs, "inputs are cast on the host in the -true precisions"
    assert ipu.autocast == autocast, "-mixed steps are captured under autocast"
    assert_same_weights(ipu.float(), cpu.float(), rtol=1e-2, atol=1e-3)
    assert set(memory.stats) == {"ipu0/memory_used_bytes", "ipu0/memory_percent",
                                 "ipu1/memory_used_bytes", "ipu1/memory_percent"}
    assert memory.stats["ipu1/memory_used_bytes"] > 0 and 0 < memory.stats["ipu1/memory_percent"] < 100


def test_16_mixed_trains_float32_weights_with_dynamic_loss_scaling():
    ipu, reference = twins()
    trainer = pl.Trainer(accelerator="ipu", precision="16-mixed", max_steps=3, **QUIET)
    trainer.fit(ipu, loader(dataset(), 8))
    assert trainer.strategy.training_opts.Training.auto_loss_scaling
    assert ipu.net[0].weight.dtype == torch.float32
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    pl.Trainer(accelerator="cpu", max_steps=3, **QUIET).fit(reference, loader(dataset(), 8))
    assert_same_weights(ipu, reference, rtol=1e-2, atol=1e-3)
