"""A second Trainer.fit of a module whose step reads a changed attribute runs the changed step,
as Lightning on the CPU does. fp32: 1e-5 relative (1e-6 absolute)."""

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from tests.lightning.helpers import QUIET, Regressor, assert_same_weights, dataset, loader, twins


class Weighted(Regressor):
    """The loss weighted by a plain attribute the step reads."""

    def __init__(self):
        super().__init__(optimizer="sgd", lr=0.1)
        self.alpha = 1.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.alpha * F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss


def test_a_second_fit_runs_the_step_with_the_attribute_it_reads_now():
    ipu, cpu = twins(Weighted)
    for alpha in (1.0, 0.25):
        for module, accelerator in ((ipu, "ipu"), (cpu, "cpu")):
            module.alpha = alpha
            pl.Trainer(accelerator=accelerator, max_epochs=1, **QUIET).fit(module, loader(dataset(), 8))
        assert_same_weights(ipu, cpu)
