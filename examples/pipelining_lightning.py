"""The pipelining tutorial's conv net as a LightningModule: its four layers become blocks B1–B4
with ``poptorch.BeginBlock``, one per emulated IPU, and ``IPUStrategy`` trains them pipelined (or
sharded) with AdamW and gradient accumulation 10 on the digits upsampled to 28×28.

    python pipelining_lightning.py [--strategy sharded] [--epochs 15] [--offload-optimiser]
    python pipelining_lightning.py --epochs 2 --train-images 560 --test-images 80 --learning-rate 0.003 \
        --device-iterations 1 --gradient-accumulation 7        # CI's reduced run
"""

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ipu_backend as poptorch
from digits import digits_tensors
from lightning_ipu import IPUStrategy
from pipelining import ConvLayer, execution_strategy


class DigitsClassifier(pl.LightningModule):
    def __init__(self, learning_rate: float = 0.001):
        super().__init__()
        self.learning_rate = learning_rate
        self.layer1 = ConvLayer(1, 10, 5, 2)
        self.layer2 = ConvLayer(10, 20, 5, 2)
        self.layer3 = nn.Sequential(nn.Flatten(), nn.Linear(320, 256), nn.ReLU())
        self.layer4 = nn.Linear(256, 10)
        for index, layer in enumerate((self.layer1, self.layer2, self.layer3, self.layer4)):
            poptorch.BeginBlock(layer, f"B{index + 1}")     # the loss joins B4, the last block started

    def forward(self, x):
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_accuracy", (self(x).argmax(-1) == y).float().mean() * 100)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=("pipelined", "sharded"), default="pipelined")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=0.001)
    parser.add_argument("--offload-optimiser", action="store_true")
    parser.add_argument("--device-iterations", type=int, default=2)
    parser.add_argument("--gradient-accumulation", type=int, default=10, help="≥ 7 for a 4-stage pipeline")
    parser.add_argument("--train-images", type=int, default=None, help="train on the first N images only")
    parser.add_argument("--test-images", type=int, default=None, help="test on the first N images only")
    args = parser.parse_args(argv)

    pl.seed_everything(0)
    (train_x, train_y), (test_x, test_y) = digits_tensors(train_images=args.train_images,
                                                          test_images=args.test_images)
    training_opts = poptorch.Options().deviceIterations(args.device_iterations)
    training_opts.Training.gradientAccumulation(args.gradient_accumulation)
    training_opts.setExecutionStrategy(execution_strategy(args.strategy))
    if args.offload_optimiser:
        training_opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useOnChipStorage(False))
    inference_opts = poptorch.Options().deviceIterations(5).setExecutionStrategy(execution_strategy(args.strategy))
    trainer = pl.Trainer(accelerator="ipu", devices=1, max_epochs=args.epochs, enable_checkpointing=False,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, strategy=IPUStrategy(training_opts=training_opts,
                                                            inference_opts=inference_opts))
    model = DigitsClassifier(args.learning_rate)
    trainer.fit(model, DataLoader(TensorDataset(train_x, train_y), batch_size=args.batch_size, shuffle=True))
    train_loss = trainer.callback_metrics["train_loss"].item()  # trainer.test clears callback_metrics
    result = trainer.test(model, DataLoader(TensorDataset(test_x, test_y), batch_size=8), verbose=False)
    print(f"train loss {train_loss:.4f}; test accuracy "
          f"{result[0]['test_accuracy']:.2f}% on the test batches that fill whole host calls")
    return result[0]["test_accuracy"]


if __name__ == "__main__":
    main()
