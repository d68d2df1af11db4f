"""The Lightning run that several nodes share (``lightning_node.py``) and its single-process twins.

With several processes Lightning's ``DistributedSampler`` shuffles the training data (as with DDP):
in epoch 0 of seed 0 it permutes the samples as ``DISTRIBUTED_ORDER`` and gives rank ``r`` the
samples ``r, r + 2, ...`` of it. So each step of 2 nodes x 2 replicas (batch 2 per replica) covers
the 8 consecutive samples of that order that one process with 4 replicas reads from a loader
taking the samples in that order; the validation data are not shuffled.
"""

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from tests.lightning.helpers import QUIET, Regressor, dataset, loader, twins

FLAGS = {**QUIET, "enable_checkpointing": True}
BATCH_SIZE = 2
SAMPLES = 32
DISTRIBUTED_ORDER = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()


def module() -> Regressor:
    return twins(optimizer="adam", lr=0.05, schedulers=(("exponential", "epoch"),))[0]


def checkpoints(directory) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=directory, save_top_k=-1, every_n_epochs=1, filename="{epoch}")


def fit(trainer: pl.Trainer, net: Regressor, batch_size: int = BATCH_SIZE, order: list[int] | None = None,
        ckpt_path=None) -> None:
    """Fit on the regression data, in ``order`` (a sampler) or as the loader gives them."""
    train = loader(dataset(SAMPLES), batch_size, sampler=order)
    trainer.fit(net, train, loader(dataset(SAMPLES, seed=1), batch_size), ckpt_path=ckpt_path)


class CountingCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, counting what this process writes."""

    def __init__(self):
        super().__init__()
        self.saves = 0

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.saves += 1
        super().save_checkpoint(checkpoint, path, storage_options)


class MetricsAfterValidation(pl.Callback):
    """What the loop shows after each epoch's validation: the last logged values."""

    def __init__(self):
        self.epochs: list[dict[str, torch.Tensor]] = []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.epochs.append({name: value.clone() for name, value in trainer.callback_metrics.items()})
