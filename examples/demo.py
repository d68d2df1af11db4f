"""Demo: the seed CNN trained by ``pl.Trainer(accelerator="ipu", devices=4)`` on scikit-learn's
handwritten digits (upsampled to 28×28): a 2-stage pipeline (convolutions on one IPU, the
classifier on the next, with ``BeginBlock``) replicated twice — 4 emulated IPUs — with gradient
accumulation and device iterations, a torchmetrics accuracy logged from the compiled steps, the
progress bar and a ModelCheckpoint.

Prints throughput (images/s) and test accuracy.
"""

import tempfile
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import ipu_backend as poptorch
from digits import digits_tensors
from lightning_ipu import IPUStrategy
from seed_cnn import SeedCNN

MICRO_BATCH = 8
EPOCHS = 8


class DigitsCNN(pl.LightningModule):
    """The seed CNN in two pipeline stages, with a torchmetrics accuracy in training and test."""

    def __init__(self, learning_rate: float = 3e-3):
        super().__init__()
        self.learning_rate = learning_rate
        self.net = SeedCNN()
        poptorch.BeginBlock(self.net.conv1, "convolutions", ipu_id=0)
        poptorch.BeginBlock(self.net.fc1, "classifier", ipu_id=1)
        self.train_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.test_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=10)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        logits = self.net(images)
        loss = F.cross_entropy(logits, labels)
        self.train_accuracy(logits, labels)
        self.log("loss", loss, prog_bar=True)
        self.log("train_acc", self.train_accuracy, prog_bar=True, on_step=True, on_epoch=True)
        return loss

    def test_step(self, batch, batch_idx):
        images, labels = batch
        self.test_accuracy.update(self.net(images), labels)
        self.log("test_acc", self.test_accuracy)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.learning_rate)
        return [optimizer], [torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.7)]


class Throughput(pl.Callback):
    """Images per second of each training epoch after the first (which compiles)."""

    def __init__(self, images_per_epoch: int):
        self.images_per_epoch, self.rates = images_per_epoch, []

    def on_train_epoch_start(self, trainer, pl_module):
        self.started = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch > 0:
            self.rates.append(self.images_per_epoch / (time.perf_counter() - self.started))


def main():
    pl.seed_everything(0, verbose=False)
    (train_x, train_y), (test_x, test_y) = digits_tensors()
    # Each replica: 4 accumulated micro-batches of 8 per optimizer step (the pipeline's fill),
    # 2 optimizer steps per host call; the outputs of every micro-batch come back (the metric's).
    training_opts = poptorch.Options().deviceIterations(2).replicationFactor(2)
    training_opts.Training.gradientAccumulation(4)
    training_opts.outputMode(poptorch.OutputMode.All)
    inference_opts = poptorch.Options().deviceIterations(2).replicationFactor(2)
    strategy = IPUStrategy(training_opts=training_opts, inference_opts=inference_opts)
    checkpoints = ModelCheckpoint(dirpath=tempfile.mkdtemp(prefix="demo-checkpoints-"), monitor="train_acc_epoch",
                                  mode="max")
    images_per_call = MICRO_BATCH * 2 * 4 * 2
    throughput = Throughput(len(train_y) // images_per_call * images_per_call)
    trainer = pl.Trainer(accelerator="ipu", devices=4, strategy=strategy, max_epochs=EPOCHS,
                         callbacks=[checkpoints, throughput], logger=False, enable_model_summary=False)
    print(f"2 pipeline stages × 2 replicas = {trainer.num_devices} emulated IPUs; 4 accumulated "
          f"micro-batches of {MICRO_BATCH} × 2 device iterations = {images_per_call} images per call")

    model = DigitsCNN()
    trainer.fit(model, DataLoader(TensorDataset(train_x, train_y), batch_size=MICRO_BATCH, shuffle=True))
    print(f"throughput {sum(throughput.rates) / len(throughput.rates):,.0f} img/s (epochs 2-{EPOCHS}); "
          f"checkpoint {checkpoints.best_model_path}")
    result = trainer.test(model, DataLoader(TensorDataset(test_x, test_y), batch_size=1), verbose=False)
    tested = len(test_y) // 4 * 4
    print(f"test accuracy {result[0]['test_acc']:.1%} on {tested} of {len(test_y)} held-out digits "
          "(whole host calls of 4 images)")


if __name__ == "__main__":
    main()
