"""A tiny LightningModule and the runs that compare it on emulated IPUs with Lightning on the CPU."""

import copy

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_ipu  # noqa: F401  (registers accelerator "ipu")

RTOL, ATOL = 1e-5, 1e-6
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False,
             enable_checkpointing=False)


class Regressor(pl.LightningModule):
    """Two linear layers; logs in every step; optimizer and schedulers chosen by name."""

    def __init__(self, optimizer: str = "sgd", lr: float = 0.1, schedulers: tuple = ()):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        self.optimizer_name, self.lr, self.schedulers = optimizer, lr, schedulers

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        self.log("val_loss", F.mse_loss(out, y), prog_bar=True)
        self.log("val_max_error", (out - y).abs().max(), reduce_fx="max")
        self.log("val_constant", 0.5)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self.net(x), y))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        schedulers = []
        for kind, interval in self.schedulers:
            if kind == "step":
                scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            else:
                scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.8)
            schedulers.append({"scheduler": scheduler, "interval": interval})
        return [optimizer], schedulers


def dataset(n: int = 64, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=generator), torch.randn(n, 2, generator=generator))


def loader(data: TensorDataset, batch_size: int, **kwargs) -> DataLoader:
    return DataLoader(data, batch_size=batch_size, **kwargs)


def twins(factory=Regressor, **kwargs):
    """Two identical modules: one for the IPUs, one for the CPU."""
    torch.manual_seed(0)
    module = factory(**kwargs)
    return module, copy.deepcopy(module)


def assert_same_weights(module, reference, rtol=RTOL, atol=ATOL):
    for (name, p), (_, q) in zip(module.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol, msg=name)


def assert_same_metrics(metrics, reference, names, rtol=RTOL, atol=ATOL):
    for name in names:
        torch.testing.assert_close(metrics[name], reference[name], rtol=rtol, atol=atol, msg=name)


class Recorder(pl.Callback):
    """What the loop shows after each training batch: the step's output, logged values, lrs."""

    def __init__(self):
        self.outputs, self.losses, self.lrs, self.steps, self.validations = [], [], [], [], 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.outputs.append(outputs)
        self.losses.append(trainer.callback_metrics["train_loss"].clone())
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        self.steps.append(trainer.global_step)

    def on_validation_end(self, trainer, pl_module):
        self.validations += 1


class RandomData(pl.LightningDataModule):
    """The regression data as a data module (for configs)."""

    def __init__(self, batch_size: int = 4, samples: int = 32):
        super().__init__()
        self.batch_size, self.samples = batch_size, samples

    def train_dataloader(self):
        return loader(dataset(self.samples), self.batch_size)

    def val_dataloader(self):
        return loader(dataset(self.samples, seed=1), self.batch_size)
