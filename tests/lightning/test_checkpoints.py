"""Checkpoints hold what the IPUs have (weights, optimizer moments, schedulers, loop state), and
resuming from one continues with the numbers of an uninterrupted run."""

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.tuner import Tuner

from lightning_ipu.strategy import RANDOM_STATE_KEY
from tests.lightning.helpers import QUIET, Regressor, assert_same_weights, dataset, loader, twins

FLAGS = {**QUIET, "enable_checkpointing": True}


def checkpointed_fit(module, directory, accelerator, batch_size, ckpt_path=None, max_epochs=4, **flags):
    checkpoint = ModelCheckpoint(dirpath=directory, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    trainer = pl.Trainer(accelerator=accelerator, max_epochs=max_epochs, callbacks=[checkpoint], **FLAGS, **flags)
    trainer.fit(module, loader(dataset(32), batch_size), ckpt_path=ckpt_path)
    return trainer


def assert_same_states(got, expected):
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_resume_from_a_checkpoint_equals_the_uninterrupted_run_and_checkpoints_equal_the_cpus(tmp_path):
    kwargs = dict(optimizer="adam", lr=0.05, schedulers=(("exponential", "epoch"),))
    full, resumed = twins(**kwargs)
    cpu, _ = twins(**kwargs)
    trainer = checkpointed_fit(full, tmp_path / "ipu", "ipu", 4, devices=2)
    checkpointed_fit(cpu, tmp_path / "cpu", "cpu", 8)

    saved = torch.load(tmp_path / "ipu" / "epoch=1.ckpt", weights_only=False)
    on_cpu = torch.load(tmp_path / "cpu" / "epoch=1.ckpt", weights_only=False)
    assert saved["global_step"] == on_cpu["global_step"] == 8
    assert_same_states(saved["state_dict"], on_cpu["state_dict"])
    assert_same_states(saved["optimizer_states"][0]["state"], on_cpu["optimizer_states"][0]["state"])
    assert set(saved["optimizer_states"][0]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert saved["lr_schedulers"] == on_cpu["lr_schedulers"]
    assert saved["loops"]["fit_loop"]["epoch_progress"] == on_cpu["loops"]["fit_loop"]["epoch_progress"]

    resumed_trainer = checkpointed_fit(resumed, tmp_path / "resumed", "ipu", 4, devices=2,
                                       ckpt_path=tmp_path / "ipu" / "epoch=1.ckpt")
    assert resumed_trainer.global_step == trainer.global_step == 16
    assert_same_weights(resumed, full)
    assert_same_weights(full, cpu)
    assert_same_states(resumed_trainer.optimizers[0].state_dict()["state"], trainer.optimizers[0].state_dict()["state"])

    trainer.save_checkpoint(tmp_path / "final.ckpt")
    final = torch.load(tmp_path / "final.ckpt", weights_only=False)
    assert_same_states(final["state_dict"], full.state_dict())


class Dropped(Regressor):
    """The regressor with dropout in its training step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout(0.5),
                                       torch.nn.Linear(8, 2))


def test_resume_with_dropout_equals_the_uninterrupted_run_bitwise(tmp_path):
    """The steps' random state is in the checkpoint: a run resumed from an end-of-epoch
    checkpoint, in a fresh module, trainer and strategy (as after kill -9), with another default
    seed, draws the dropout masks of the uninterrupted run."""
    full, resumed = twins(Dropped, optimizer="adam", lr=0.05)
    checkpointed_fit(full, tmp_path / "full", "ipu", 4, devices=2, max_epochs=2)
    saved = torch.load(tmp_path / "full" / "epoch=0.ckpt", weights_only=True)
    assert saved[RANDOM_STATE_KEY]["training_step"][1] == 4       # 4 calls in epoch 0

    torch.manual_seed(1234)                                      # another process's default seed
    checkpointed_fit(resumed, tmp_path / "resumed", "ipu", 4, devices=2, max_epochs=2,
                     ckpt_path=tmp_path / "full" / "epoch=0.ckpt")
    for (name, p), (_, q) in zip(resumed.named_parameters(), full.named_parameters()):
        assert torch.equal(p, q), name


class Tunable(pl.LightningDataModule):
    """Data whose batch size the tuner may change."""

    def __init__(self):
        super().__init__()
        self.batch_size = 4

    def train_dataloader(self):
        return loader(dataset(128), self.batch_size)

    def val_dataloader(self):
        return loader(dataset(32, seed=1), self.batch_size)


def test_the_tuners_checkpoint_before_the_first_step_and_find_the_cpus_values(tmp_path):
    """The learning-rate and batch-size finders save a checkpoint before any step is compiled,
    try steps, and restore it: the suggestion, the losses and the restored weights are the CPU's."""
    found = {}
    for accelerator, module in zip(("ipu", "cpu"), twins(lr=0.1)):
        tuner = Tuner(pl.Trainer(accelerator=accelerator, max_epochs=1, default_root_dir=tmp_path, **QUIET))
        finder = tuner.lr_find(module, datamodule=Tunable(), num_training=16, min_lr=1e-4, max_lr=1.0,
                               update_attr=False)
        batch_size = tuner.scale_batch_size(module, datamodule=Tunable(), max_trials=2, steps_per_trial=1)
        found[accelerator] = module, finder.suggestion(), torch.tensor(finder.results["loss"]), batch_size
    (ipu, ipu_lr, ipu_losses, ipu_batch), (cpu, cpu_lr, cpu_losses, cpu_batch) = found["ipu"], found["cpu"]
    assert ipu_lr is not None and ipu_lr == cpu_lr and ipu_batch == cpu_batch
    torch.testing.assert_close(ipu_losses, cpu_losses, rtol=1e-5, atol=1e-6)
    assert_same_weights(ipu, cpu)
