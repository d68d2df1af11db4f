"""Blocks in a LightningModule trained through IPUStrategy: set in ``__init__``, in a ``setup``
hook or inside ``training_step``, the model runs pipelined over two IPUs with the numbers of
Lightning on the CPU (fp32: 1e-5 relative, 1e-6 absolute)."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import QUIET, Regressor, assert_same_weights, dataset, loader
from tests.lightning.test_manual_optimization import TinyGAN, gan_data


class PipelinedRegressor(Regressor):
    """``net`` = Linear, Tanh, Linear: the last Linear and the loss on IPU 1."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where
        if where == "init":
            poptorch.BeginBlock(self.net[2], "B2", ipu_id=1)

    def setup(self, stage):
        if self.where == "setup" and not self.net[2]._forward_pre_hooks:
            poptorch.BeginBlock(self.net[2], "B2", ipu_id=1)

    def training_step(self, batch, batch_idx):
        if self.where != "step":
            return super().training_step(batch, batch_idx)
        x, y = batch
        with poptorch.Block("B1", ipu_id=0):
            h = self.net[1](self.net[0](x))
        with poptorch.Block("B2", ipu_id=1):
            loss = F.mse_loss(self.net[2](h), y)
            self.log("train_loss", loss)
        return loss


@pytest.mark.parametrize("where", ["init", "setup", "step"])
def test_blocks_in_a_lightning_module_pipeline_with_cpu_numbers(where):
    torch.manual_seed(0)
    ipu, cpu = PipelinedRegressor(where), PipelinedRegressor(where)
    cpu.load_state_dict(ipu.state_dict())
    data = dataset(24)
    pl.Trainer(accelerator="cpu", max_epochs=1, accumulate_grad_batches=3, **QUIET).fit(cpu, loader(data, 4))
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(3)
    placements = []
    trainer = pl.Trainer(accelerator="ipu", devices=1, strategy=IPUStrategy(training_opts=opts), max_epochs=1,
                         callbacks=[PlacementRecorder(placements)], **QUIET)
    trainer.fit(ipu, loader(data, 4))
    assert trainer.global_step == 2
    assert_same_weights(ipu, cpu)
    assert placements[-1] == {"net.0.weight": 0, "net.0.bias": 0, "net.2.weight": 1, "net.2.bias": 1}


class PlacementRecorder(pl.Callback):
    def __init__(self, placements: list):
        self.placements = placements

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.placements.append(trainer.strategy._executors["training_step"].ipuPlacement())


def test_a_manual_optimization_step_too_large_for_its_ipu_raises_out_of_memory():
    options = poptorch.Options(ipu_spec=poptorch.IpuSpec(memory_bytes=1000, tiles=4, name="tiny"))
    trainer = pl.Trainer(accelerator="ipu", devices=1, max_steps=1, strategy=IPUStrategy(training_opts=options),
                         **QUIET)
    with pytest.raises(poptorch.OutOfMemoryError, match=r"Out of memory on 1 of 1 IPU\(s\) \(tiny"):
        trainer.fit(TinyGAN(), loader(gan_data(), 4))


class LogsEpochValues(Regressor):
    """Two IPUs; the step logs a mean and a maximum aggregated over the epoch."""

    def __init__(self):
        super().__init__()
        poptorch.BeginBlock(self.net[2], "B2", ipu_id=1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        error = self.net(x) - y
        loss = error.pow(2).mean()
        self.log("loss", loss, on_step=True, on_epoch=True)
        self.log("max_error", error.abs().max(), on_step=False, on_epoch=True, reduce_fx="max")
        return loss


@pytest.mark.parametrize("execution, replicas, mode", [("pipelined", 2, poptorch.OutputMode.Final),
                                                       ("sharded", 1, poptorch.OutputMode.Sum)])
def test_epoch_logs_of_a_split_step_cover_every_micro_batch(execution, replicas, mode):
    """Each call runs 2 device iterations of 3 accumulated micro-batches: the epoch values
    aggregate all 6 whatever the output mode returns, as Lightning on the CPU does batch by batch."""
    torch.manual_seed(0)
    ipu, cpu = LogsEpochValues(), LogsEpochValues()
    cpu.load_state_dict(ipu.state_dict())
    poptorch.removeBlocks(cpu)
    data = dataset(48)
    cpu_trainer = pl.Trainer(accelerator="cpu", max_epochs=1, accumulate_grad_batches=3, **QUIET)
    cpu_trainer.fit(cpu, loader(data, 4 * replicas))
    opts = poptorch.Options().deviceIterations(2).replicationFactor(replicas).outputMode(mode)
    opts.Training.gradientAccumulation(3)
    if execution == "sharded":
        opts.setExecutionStrategy(poptorch.ShardedExecution())
    trainer = pl.Trainer(accelerator="ipu", strategy=IPUStrategy(training_opts=opts), max_epochs=1, **QUIET)
    trainer.fit(ipu, loader(data, 4))
    assert_same_weights(ipu, cpu)
    assert trainer.global_step == cpu_trainer.global_step == 4 // replicas
    for name in ("loss_epoch", "loss_step", "max_error"):
        torch.testing.assert_close(trainer.callback_metrics[name], cpu_trainer.callback_metrics[name],
                                   rtol=1e-5, atol=1e-6, msg=name)
