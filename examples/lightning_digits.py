"""Demo: an ordinary LightningModule trained on 4 emulated IPUs by changing one Trainer flag.

The seed CNN classifies scikit-learn's handwritten digits (upsampled to 28×28) with
``pl.Trainer(accelerator="ipu", devices=4)``: 4 replicas, each with micro-batches of 8, so each
optimizer step sees 32 images, exactly as the CPU would with ``batch_size=32``. Loss and a
torchmetrics accuracy are logged with ``self.log`` from the compiled steps (progress bar and
``callback_metrics``), the learning rate follows a scheduler, and the best checkpoint is kept.

    cd examples && python lightning_digits.py

The same run from a config, with no script: ``cd examples && lightning-ipu fit --config
lightning_digits.yaml``.
"""

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.functional import accuracy

import lightning_ipu  # noqa: F401  (registers accelerator "ipu")
from digits import digits_tensors
from seed_cnn import SeedCNN


class DigitsDataModule(pl.LightningDataModule):
    """scikit-learn's digits: 80% training (shuffled), 20% validation and test; ``train_images``
    and ``test_images`` cut them down for quick runs."""

    def __init__(self, batch_size: int = 8, train_images: int | None = None, test_images: int | None = None):
        super().__init__()
        self.batch_size, self.train_images, self.test_images = batch_size, train_images, test_images

    def setup(self, stage: str) -> None:
        (train_x, train_y), (test_x, test_y) = digits_tensors(train_images=self.train_images,
                                                              test_images=self.test_images)
        self.train, self.test = TensorDataset(train_x, train_y), TensorDataset(test_x, test_y)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.test, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=self.batch_size)


class DigitsClassifier(pl.LightningModule):
    """The seed CNN with cross-entropy, AdamW and a step learning-rate schedule."""

    def __init__(self, lr: float = 2e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = SeedCNN()

    def forward(self, x):
        return self.net(x)

    def _loss_and_accuracy(self, batch):
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits, y), accuracy(logits, y, task="multiclass", num_classes=10)

    def training_step(self, batch, batch_idx):
        loss, acc = self._loss_and_accuracy(batch)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", acc, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, acc = self._loss_and_accuracy(batch)
        self.log_dict({"val_loss": loss, "val_acc": acc}, prog_bar=True)

    def test_step(self, batch, batch_idx):
        loss, acc = self._loss_and_accuracy(batch)
        self.log_dict({"test_loss": loss, "test_acc": acc})

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return [optimizer], [scheduler]


def main():
    pl.seed_everything(0)
    checkpoint = ModelCheckpoint(monitor="val_acc", mode="max", filename="digits-{epoch}-{val_acc:.3f}")
    trainer = pl.Trainer(accelerator="ipu", devices=4, max_epochs=4, callbacks=[checkpoint],
                         logger=False, default_root_dir="lightning_digits_run")
    model, data = DigitsClassifier(), DigitsDataModule()
    trainer.fit(model, data)
    print(f"{type(trainer.strategy).__name__} with {trainer.num_devices} replicas, "
          f"{trainer.global_step} optimizer steps; best checkpoint: {checkpoint.best_model_path}")
    result = trainer.test(model, data, ckpt_path="best", verbose=False)[0]
    print(f"test accuracy {result['test_acc']:.3f} (loss {result['test_loss']:.3f})")


if __name__ == "__main__":
    main()
