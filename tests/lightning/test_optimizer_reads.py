"""A step that reads its optimizer's learning rate in Python (to log it, or to scale its loss),
from the param groups or from the scheduler, sees the rate the scheduler set, as on the CPU: the value read is a guard of the compiled step,
which is captured again when it changes. fp32: 1e-5 relative (1e-6 absolute)."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

import ipu_backend
from tests.lightning.helpers import ATOL, QUIET, RTOL, assert_same_weights, dataset, loader, twins


class ScalesByTheRate(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.rates = []

    def rate(self):
        return self.optimizers().param_groups[0]["lr"]

    def training_step(self, batch, batch_idx):
        rate = self.rate()
        self.log("lr", rate)
        return F.mse_loss(self.net(batch[0]), batch[1]) * (rate * 10)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.rates.append(float(self.trainer.callback_metrics["lr"]))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


class AsksTheScheduler(ScalesByTheRate):
    def rate(self):
        return self.lr_schedulers().get_last_lr()[0]


@pytest.mark.parametrize("module", [ScalesByTheRate, AsksTheScheduler])
def test_a_learning_rate_read_in_the_step_follows_the_scheduler(module):
    ipu, cpu = twins(module)
    for module, accelerator in ((ipu, "ipu"), (cpu, "cpu")):
        pl.Trainer(accelerator=accelerator, devices=1, max_epochs=3, **QUIET).fit(module, loader(dataset(8), 4))
    assert cpu.rates == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025])
    assert ipu.rates == cpu.rates
    assert_same_weights(ipu, cpu, rtol=RTOL, atol=ATOL)


class WarmsUp(pl.LightningModule):
    """A linear warm-up of the learning rate over the first five steps."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def warmed_up_rate(self):
        return 0.1 * min(1.0, (self.global_step + 1) / 5)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class WarmsUpInTheStep(WarmsUp):
    def training_step(self, batch, batch_idx):
        self.optimizers().param_groups[0]["lr"] = self.warmed_up_rate()
        return super().training_step(batch, batch_idx)


class WarmsUpInAManualStep(WarmsUp):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.param_groups[0].update(lr=self.warmed_up_rate())
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


@pytest.mark.parametrize("module", [WarmsUpInTheStep, WarmsUpInAManualStep])
def test_a_step_that_sets_a_hyper_parameter_is_refused(module):
    with pytest.raises(ipu_backend.Error, match=r"the step sets the optimizer's param_groups\[0\]\['lr'\] while it "
                                                r"is captured: .*would be lost.*on_train_batch_start"):
        pl.Trainer(accelerator="ipu", devices=1, max_epochs=1, **QUIET).fit(module(), loader(dataset(8), 4))


class WarmsUpInAHook(WarmsUp):
    def on_train_batch_start(self, batch, batch_idx):
        self.optimizers().param_groups[0]["lr"] = self.warmed_up_rate()


class WarmsUpInOptimizerStep(WarmsUp):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        optimizer.param_groups[0]["lr"] = self.warmed_up_rate()


@pytest.mark.parametrize("module", [WarmsUpInAHook, WarmsUpInOptimizerStep])
def test_a_hyper_parameter_set_on_the_host_before_the_step_trains_as_on_the_cpu(module):
    ipu, cpu = twins(module)
    for module, accelerator in ((ipu, "ipu"), (cpu, "cpu")):
        pl.Trainer(accelerator=accelerator, devices=1, max_epochs=1, **QUIET).fit(module, loader(dataset(32), 4))
    assert ipu.optimizers().param_groups[0]["lr"] == cpu.optimizers().param_groups[0]["lr"] == pytest.approx(0.1)
    assert_same_weights(ipu, cpu, rtol=RTOL, atol=ATOL)
