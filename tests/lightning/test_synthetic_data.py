"""IPUStrategy(training_opts=Options().enableSyntheticData(True)): the batches are made on the
device while Lightning's counters still come from the host; the weights equal torch eager's on the
generated micro-batch (fp32: 1e-5 relative, 1e-6 absolute). Manual optimization refuses it."""

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import ipu_backend
from ipu_backend.runtime import synthetic_data
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import QUIET, Regressor, assert_same_weights, loader, twins
from tests.lightning.test_manual_optimization import TinyGAN, gan_data


class StepWeighted(Regressor):
    """Its loss grows with global_step: a counter read in the step, which must stay the host's."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y) * (1 + self.global_step)
        self.log("train_loss", loss)
        return loss


def synthetic(seed: int) -> IPUStrategy:
    return IPUStrategy(training_opts=ipu_backend.Options().randomSeed(seed).enableSyntheticData(True))


def test_automatic_optimization_trains_on_the_generated_batch_with_the_host_counters():
    ipu, cpu = twins(StepWeighted)
    nan = TensorDataset(torch.full((8, 4), float("nan")), torch.full((8, 2), float("nan")))
    trainer = pl.Trainer(strategy=synthetic(3), accelerator="ipu", devices=1, max_steps=3, **QUIET)
    trainer.fit(ipu, loader(nan, 4))
    assert trainer.global_step == 3 and trainer.callback_metrics["train_loss"] == 0   # outputs: zeros

    x = torch.from_numpy(np.array(synthetic_data.micro_batch(3, 0, (4, 4), np.float32)))
    y = torch.from_numpy(np.array(synthetic_data.micro_batch(3, 1, (4, 2), np.float32)))
    optimizer = cpu.configure_optimizers()[0][0]
    for step in range(3):
        optimizer.zero_grad()
        (F.mse_loss(cpu.net(x), y) * (1 + step)).backward()
        optimizer.step()
    assert_same_weights(ipu, cpu)


def test_manual_optimization_refuses_synthetic_data():
    trainer = pl.Trainer(strategy=synthetic(0), accelerator="ipu", devices=1, max_steps=1, **QUIET)
    with pytest.raises(ipu_backend.Error, match=r"enableSyntheticData\(True\) is not emulated with manual"):
        trainer.fit(TinyGAN(), loader(gan_data(8), 4))
