"""Validation, test and predict evaluate every sample: the short last batch of an epoch (70
samples in batches of 4, 16 samples a host call) gives the CPU's epoch metrics, torchmetrics
values and predictions, with 2 replicas x 2 device iterations."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics

import ipu_backend
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import ATOL, QUIET, RTOL, dataset, loader, twins

SAMPLES, BATCH = 70, 4


class Evaluated(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        self.val_mse = torchmetrics.MeanSquaredError()
        self.test_mae = torchmetrics.MeanAbsoluteError()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        self.log("val_loss", F.mse_loss(out, y))
        self.val_mse.update(out, y)
        self.log("val_mse", self.val_mse)

    def test_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        self.log("test_loss", F.mse_loss(out, y))
        self.log("test_max", (out - y).abs().max(), reduce_fx="max")
        self.test_mae(out, y)
        self.log("test_mae", self.test_mae)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(accelerator, inference_opts=None):
    if accelerator == "cpu":
        return pl.Trainer(accelerator="cpu", max_epochs=1, **QUIET)
    strategy = IPUStrategy(device_iterations=2, inference_opts=inference_opts)
    return pl.Trainer(accelerator="ipu", devices=2, strategy=strategy, max_epochs=1, **QUIET)


def assert_same(got: dict, expected: dict, names):
    for name in names:
        torch.testing.assert_close(got[name], expected[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("output_mode", [None, "final"])
def test_test_metrics_over_a_short_last_batch_equal_the_cpus(output_mode):
    ipu, cpu = twins(Evaluated)
    opts = None if output_mode is None else ipu_backend.Options(
        device_iterations=2, replication_factor=2, output_mode=output_mode)
    data = loader(dataset(SAMPLES, seed=2), BATCH)
    got = trainer("ipu", opts).test(ipu, data, verbose=False)[0]
    expected = trainer("cpu").test(cpu, data, verbose=False)[0]
    # OutputMode.Final logs each host call's last micro-batch; its metric states cover them all
    assert_same(got, expected, ["test_loss", "test_max", "test_mae"] if output_mode is None else ["test_mae"])


def test_fits_validation_over_a_short_last_batch_equals_the_cpus():
    """Training steps on 2 replicas x 4 samples equal the CPU's on 8; validation as above."""
    ipu, cpu = twins(Evaluated)
    val = loader(dataset(SAMPLES, seed=2), BATCH)
    runs = []
    for module, accelerator, batch in ((ipu, "ipu", BATCH), (cpu, "cpu", 2 * BATCH)):
        run = trainer(accelerator)
        run.fit(module, loader(dataset(32), batch), val)
        runs.append(run.callback_metrics)
    assert_same(runs[0], runs[1], ["val_loss", "val_mse"])


def test_predictions_cover_every_sample():
    ipu, cpu = twins(Evaluated)
    data = loader(dataset(SAMPLES, seed=2), BATCH)
    got = torch.cat(trainer("ipu").predict(ipu, data))
    expected = torch.cat(trainer("cpu").predict(cpu, data))
    assert got.shape == (SAMPLES, 2)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


class WeighsBatches(Evaluated):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        error = (self.net(x) - y).abs().mean()
        self.log("each_batch_alike", error, batch_size=5)
        self.log("by_twice_the_samples", error, batch_size=2 * len(x))
        self.log("largest", error, batch_size=5, reduce_fx="max")


def test_values_logged_with_an_explicit_batch_size_weigh_each_batch_as_on_the_cpu():
    ipu, cpu = twins(WeighsBatches)
    data = loader(dataset(SAMPLES, seed=2), BATCH)
    got = trainer("ipu").validate(ipu, data, verbose=False)[0]
    expected = trainer("cpu").validate(cpu, data, verbose=False)[0]
    assert_same(got, expected, ["each_batch_alike", "by_twice_the_samples", "largest"])


class Written(pl.callbacks.BasePredictionWriter):
    """Each call's predictions with the dataset indices Lightning gives a prediction writer."""

    def __init__(self):
        super().__init__("batch")
        self.rows = {}

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        assert len(batch_indices) == len(prediction)
        self.rows.update(zip(batch_indices, prediction))


def test_a_prediction_writer_gets_each_predictions_dataset_index():
    ipu, cpu = twins(Evaluated)
    data = loader(dataset(SAMPLES, seed=2), BATCH, shuffle=True, generator=torch.Generator().manual_seed(1))
    written = Written(), Written()
    for module, accelerator, writer in zip((ipu, cpu), ("ipu", "cpu"), written):
        run = trainer(accelerator)
        run.callbacks.append(writer)
        run.predict(module, data, return_predictions=False)
    assert sorted(written[0].rows) == list(range(SAMPLES))
    for index, row in written[1].rows.items():
        torch.testing.assert_close(written[0].rows[index], row, rtol=RTOL, atol=ATOL)


class IndexLogged(Evaluated):
    def test_step(self, batch, batch_idx):
        self.log("test_batch_idx", batch_idx * torch.ones(()))


def test_the_short_last_batch_sees_the_cpus_batch_idx():
    """37 samples, 4 device iterations of 4: the last host call runs one whole micro-batch
    (CPU batch 8) and then the short one (CPU batch 9)."""
    data = loader(dataset(37, seed=2), BATCH)
    ipu_trainer = pl.Trainer(accelerator="ipu", devices=1, strategy=IPUStrategy(device_iterations=4), **QUIET)
    got = ipu_trainer.test(IndexLogged(), data, verbose=False)[0]
    expected = pl.Trainer(accelerator="cpu", **QUIET).test(IndexLogged(), data, verbose=False)[0]
    assert expected["test_batch_idx"] == pytest.approx((4 * sum(range(9)) + 9) / 37)
    assert_same(got, expected, ["test_batch_idx"])
