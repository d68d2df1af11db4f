"""The Lightning Trainer on emulated IPUs against Lightning on the CPU, in one run.

The host-bound MLP of ``device_iterations.py`` (64→128→10, batch 32, SGD lr 0.01) as a
LightningModule, trained by ``pl.Trainer(accelerator="ipu",
strategy=IPUStrategy(device_iterations=100))`` and by ``pl.Trainer(accelerator="cpu")``, configured
alike: same module, data and DataLoader (batch 32, no workers), no progress bar, logger, model
summary, checkpoints or sanity check, torch single-threaded (the fastest setting for this tiny
MLP on the CPU: several threads only add synchronisation, and on a busy machine spin-waiting).
Two variants of the module: one that ``self.log``s its loss every step (Lightning's result
collection then costs the CPU Trainer about a third of each step; the IPU Trainer logs once per
host call) and one that logs nothing, the CPU Trainer's best case. Each Trainer first trains a
warm-up epoch (compilation for the IPUs); then the two alternate, epoch by epoch, for
``ROUNDS`` rounds and each keeps its fastest epoch, so load from other processes on the machine
disturbs both alike. Target: ≥ 10× the CPU Trainer's optimizer steps per second.
Writes bench/results/lightning_trainer.json. Run by hand: ``make bench``.
"""

import json
import os
import pathlib
import time

import jax
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ipu import IPUStrategy

RESULTS = pathlib.Path(__file__).parent / "results" / "lightning_trainer.json"
SAMPLES, BATCH, ITERATIONS, ROUNDS = 32 * 100 * 20, 32, 100, 3
FLAGS = dict(enable_progress_bar=False, enable_model_summary=False, logger=False,
             enable_checkpointing=False, num_sanity_val_steps=0)


class MLP(pl.LightningModule):
    def __init__(self, log_loss: bool = True):
        super().__init__()
        self.hidden = nn.Linear(64, 128)
        self.out = nn.Linear(128, 10)
        self.log_loss = log_loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.out(torch.relu(self.hidden(x))), y)
        if self.log_loss:
            self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def epoch_seconds(module, data, accelerator_flags) -> float:
    """Seconds one epoch of training takes with these Trainer flags."""
    trainer = pl.Trainer(max_epochs=1, **accelerator_flags(), **FLAGS)
    start = time.perf_counter()
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    return time.perf_counter() - start


def steps_per_second(data, log_loss: bool) -> dict:
    """Optimizer steps per second of each Trainer: its fastest of ``ROUNDS`` alternating epochs."""
    trainers = {"ipu_trainer": lambda: dict(accelerator="ipu", strategy=IPUStrategy(device_iterations=ITERATIONS)),
                "cpu_trainer": lambda: dict(accelerator="cpu")}
    modules = {name: MLP(log_loss) for name in trainers}
    for name, flags in trainers.items():
        epoch_seconds(modules[name], data, flags)                 # warm-up (and compilation)
    best = dict.fromkeys(trainers, float("inf"))
    for _ in range(ROUNDS):
        for name, flags in trainers.items():
            best[name] = min(best[name], epoch_seconds(modules[name], data, flags))
    return {name: (SAMPLES // BATCH) / seconds for name, seconds in best.items()}


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(SAMPLES, 64), torch.randint(0, 10, (SAMPLES,)))
    variants = {"logs_every_step": steps_per_second(data, log_loss=True),
                "logs_nothing": steps_per_second(data, log_loss=False)}
    ratios = {name: rates["ipu_trainer"] / rates["cpu_trainer"] for name, rates in variants.items()}
    results = {"steps_per_s": variants, "ipu_vs_cpu_trainer": ratios,
               "device_iterations": ITERATIONS, "batch": BATCH, "rounds": ROUNDS,
               "environment": {"jax": jax.__version__, "torch": torch.__version__, "lightning": pl.__version__,
                               "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                               "load_average": os.getloadavg()}}
    for name, rates in variants.items():
        print(f"{name}: Trainer steps/s", {k: round(v) for k, v in rates.items()},
              f"| IPU Trainer vs CPU Trainer {ratios[name]:.1f}x (target >= 10x)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
