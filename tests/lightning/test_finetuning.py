"""Lightning's fine-tuning callbacks on emulated IPUs: ``BackboneFinetuning`` freezes the backbone,
then unfreezes it at an epoch and adds it to the optimizer as a param group of its own; the IPU
run reaches the CPU run's weights (fp32 within 1e-5)."""

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning

from lightning_ipu import IPUStrategy
from tests.lightning.helpers import QUIET, assert_same_weights, dataset, loader, twins


class WithBackbone(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
        self.head = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.01)


def fine_tuned(factory):
    """The module fitted for 3 epochs with its backbone unfrozen at the second, on the IPUs and on
    the CPU (twins)."""
    ipu, cpu = twins(factory)
    for module, accelerator in ((ipu, {"accelerator": "ipu", "strategy": IPUStrategy(device_iterations=2)}),
                                (cpu, {"accelerator": "cpu"})):
        finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5)
        trainer = pl.Trainer(**accelerator, **QUIET, callbacks=[finetuning], max_epochs=3)
        trainer.fit(module, loader(dataset(32), 4))
    return ipu, cpu


def test_backbone_finetuning_unfreezes_the_backbone_as_on_the_cpu():
    ipu, cpu = fine_tuned(WithBackbone)
    assert_same_weights(ipu, cpu)
    moved = [torch.equal(p, q) for p, q in zip(ipu.backbone.parameters(), twins(WithBackbone)[0].backbone.parameters())]
    assert not any(moved), "the backbone trained once unfrozen"


class ManualWithBackbone(WithBackbone):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


def test_backbone_finetuning_with_manual_optimization_as_on_the_cpu():
    ipu, cpu = fine_tuned(ManualWithBackbone)
    assert_same_weights(ipu, cpu)
