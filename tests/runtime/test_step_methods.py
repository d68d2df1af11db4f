"""Executor on LightningModule step methods: outputs that hold None, logged values per replica."""

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

import ipu_backend
from ipu_backend.runtime.executor import PoplarExecutor


class Logs(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        return {"out": self.layer(x), "nothing": None}


def test_a_step_returning_none_still_returns_its_logged_values():
    torch.manual_seed(0)
    module = Logs()
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    executor = PoplarExecutor(module, ipu_backend.Options(replication_factor=2), False,
                              step_method="validation_step")
    assert executor((x, y), 0) is None
    expected = torch.stack([F.mse_loss(module.layer(x[i:i + 4]), y[i:i + 4]) for i in (0, 4)]).detach()
    torch.testing.assert_close(executor.last_logs["val_loss"], expected, rtol=1e-5, atol=1e-6)
    assert [call.name for call in executor.last_program.logs] == ["val_loss"]


def test_none_leaves_of_a_step_output_come_back_as_none():
    module = Logs()
    x = torch.randn(4, 3)
    out = PoplarExecutor(module, ipu_backend.Options(), False, step_method="test_step")((x, x[:, :2]), 0)
    assert out["nothing"] is None
    torch.testing.assert_close(out["out"], module.layer(x).detach(), rtol=1e-5, atol=1e-6)
