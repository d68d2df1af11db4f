"""Lightning for IPUs, the tutorial: an ordinary LightningModule on emulated IPUs.

The steps of Graphcore's "PyTorch Lightning for IPU" tutorial, on scikit-learn's digits upsampled
to 28×28:

1. ``pl.Trainer(accelerator="ipu", devices=2)``: the model replicated on 2 IPUs. Nothing in the
   module changes: loss, optimizer and scheduler are written as for the CPU or a GPU.
2. PopTorch ``Options`` for training and for inference, given to ``IPUStrategy(training_opts=...,
   inference_opts=...)``: device iterations (several optimizer steps per host call, to keep the
   IPUs busy), gradient accumulation, the replication factor.
3. Model parallelism: ``poptorch.BeginBlock`` in ``__init__`` puts the convolutions on one IPU and
   the classifier on another, pipelined; with 2 replicas the run uses 2 × 2 = 4 IPUs.
4. ``--profile``: ``IPUStrategy(autoreport=True, autoreport_dir=...)`` writes each compiled model's
   compile and execution reports (what PopVision shows for real IPUs) into ``--profile-dir``.

    python lightning_tutorial.py                       # 3 epochs on 4 IPUs
    python lightning_tutorial.py --profile             # also writes the reports to ipu_reports/
    python lightning_tutorial.py --epochs 1 --train-images 384 --test-images 32 \
        --device-iterations 1 --gradient-accumulation 3 --profile     # CI's reduced run

Prints the training loss of the first and last batch, the validation accuracy per epoch and the
test accuracy.
"""

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn

import ipu_backend as poptorch
from lightning_digits import DigitsDataModule
from lightning_ipu import IPUStrategy


class DigitsClassifier(pl.LightningModule):
    """A conv net in two blocks: "convolutions" on IPU 0, "classifier" on IPU 1."""

    def __init__(self, learning_rate: float = 2e-3):
        super().__init__()
        self.learning_rate = learning_rate
        self.convolutions = nn.Sequential(
            nn.Conv2d(1, 10, 5), nn.MaxPool2d(2), nn.ReLU(),
            nn.Conv2d(10, 20, 5), nn.MaxPool2d(2), nn.ReLU(), nn.Flatten())
        self.classifier = nn.Sequential(nn.Linear(320, 256), nn.ReLU(), nn.Linear(256, 10))
        poptorch.BeginBlock(self.convolutions, "convolutions", ipu_id=0)
        poptorch.BeginBlock(self.classifier, "classifier", ipu_id=1)  # the loss joins this last block

    def forward(self, x):
        return self.classifier(self.convolutions(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self(x).argmax(-1) == y).float().mean() * 100, prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(-1) == y).float().mean() * 100)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.learning_rate)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)]


class PrintProgress(Callback):
    """The training loss of the first and last batch, and the validation accuracy of each epoch."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train_loss"].item())

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            print(f"epoch {trainer.current_epoch + 1}: validation accuracy "
                  f"{trainer.callback_metrics['val_acc']:.2f}%, step {trainer.global_step}")


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2, help="copies of the 2-IPU pipeline")
    parser.add_argument("--batch-size", type=int, default=4, help="micro-batch size")
    parser.add_argument("--device-iterations", type=int, default=2, help="optimizer steps per host call")
    parser.add_argument("--gradient-accumulation", type=int, default=4,
                        help="micro-batches per optimizer step (≥ 3 for a 2-stage pipeline)")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--train-images", type=int, default=None, help="train on the first N images only")
    parser.add_argument("--test-images", type=int, default=None, help="validate and test on the first N only")
    parser.add_argument("--profile", action="store_true", help="write compile and execution reports")
    parser.add_argument("--profile-dir", default="ipu_reports")
    return parser.parse_args(argv)


def main(argv=None) -> float:
    args = parse_arguments(argv)
    pl.seed_everything(0)
    training_opts = poptorch.Options().deviceIterations(args.device_iterations).replicationFactor(args.replicas)
    training_opts.Training.gradientAccumulation(args.gradient_accumulation)
    inference_opts = poptorch.Options().deviceIterations(2).replicationFactor(args.replicas)  # 2 ≥ 2 stages
    strategy = IPUStrategy(training_opts=training_opts, inference_opts=inference_opts,
                           autoreport=args.profile, autoreport_dir=args.profile_dir)
    progress = PrintProgress()
    trainer = pl.Trainer(accelerator="ipu", devices=args.replicas, strategy=strategy, max_epochs=args.epochs,
                         callbacks=[progress], num_sanity_val_steps=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = DigitsClassifier(args.learning_rate)
    data = DigitsDataModule(args.batch_size, args.train_images, args.test_images)
    print(f"2 pipeline stages × {args.replicas} replicas = {2 * args.replicas} IPUs; each optimizer step "
          f"sees {args.gradient_accumulation} × {args.replicas} micro-batches of {args.batch_size}")
    trainer.fit(model, data)
    print(f"train loss: first batch {progress.losses[0]:.4f}, last batch {progress.losses[-1]:.4f} "
          f"({trainer.global_step} optimizer steps)")
    result = trainer.test(model, data, verbose=False)[0]
    print(f"test accuracy {result['test_acc']:.2f}%")
    if args.profile:
        print(f"reports written to {args.profile_dir}/")
    return result["test_acc"]


if __name__ == "__main__":
    main()
