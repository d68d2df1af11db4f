"""The Lightning Trainer on emulated IPUs against Lightning on the CPU, in one run.

The host-bound MLP of ``device_iterations.py`` (64→128→10, batch 32, SGD lr 0.01) as a
LightningModule that logs its loss, trained by ``pl.Trainer(accelerator="ipu",
strategy=IPUStrategy(device_iterations=100))`` and by ``pl.Trainer(accelerator="cpu")`` with the same
flags (no progress bar, logger or checkpoints), after one warm-up epoch each (compilation for the
IPUs). torch runs single-threaded: the fastest setting for this tiny MLP on the CPU (several
threads only add synchronisation, and on a busy machine spin-waiting). Target: ≥ 10× the CPU
Trainer's optimizer steps per second.
Writes bench/results/lightning_trainer.json. Run by hand: ``make bench``.
"""

import json
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
SAMPLES, BATCH, ITERATIONS, EPOCHS = 32 * 100 * 20, 32, 100, 3
FLAGS = dict(enable_progress_bar=False, enable_model_summary=False, logger=False,
             enable_checkpointing=False, num_sanity_val_steps=0)


class MLP(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(64, 128)
        self.out = nn.Linear(128, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.out(torch.relu(self.hidden(x))), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def steps_per_second(module, data, make_flags) -> float:
    """Optimizer steps per second of ``EPOCHS`` epochs, after a warm-up epoch."""
    pl.Trainer(max_epochs=1, **make_flags(), **FLAGS).fit(module, DataLoader(data, batch_size=BATCH))
    trainer = pl.Trainer(max_epochs=EPOCHS, **make_flags(), **FLAGS)
    start = time.perf_counter()
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    elapsed = time.perf_counter() - start
    return EPOCHS * (SAMPLES // BATCH) / elapsed


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(SAMPLES, 64), torch.randint(0, 10, (SAMPLES,)))
    rates = {
        "ipu_trainer": steps_per_second(MLP(), data, lambda: dict(
            accelerator="ipu", strategy=IPUStrategy(device_iterations=ITERATIONS))),
        "cpu_trainer": steps_per_second(MLP(), data, lambda: dict(accelerator="cpu")),
    }
    results = {"steps_per_s": rates, "ipu_vs_cpu_trainer": rates["ipu_trainer"] / rates["cpu_trainer"],
               "device_iterations": ITERATIONS, "batch": BATCH, "epochs": EPOCHS,
               "environment": {"jax": jax.__version__, "torch": torch.__version__, "lightning": pl.__version__,
                               "torch_threads": torch.get_num_threads()}}
    print("Trainer steps/s:", {k: round(v) for k, v in rates.items()},
          f"| IPU Trainer vs CPU Trainer {results['ipu_vs_cpu_trainer']:.1f}x (target >= 10x)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
