"""torchmetrics objects inside compiled steps: step and epoch values logged through the Trainer on
two replicas with two device iterations equal Lightning's on the CPU (batch 2b, twice the steps)."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch.utils.data import TensorDataset

import ipu_backend
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import QUIET, assert_same_weights, loader, twins


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 3)
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        self.train_mse = torchmetrics.MeanSquaredError()
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3, average="macro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.train_acc(logits, y)
        self.train_mse.update(logits.softmax(-1), (y[:, None] == torch.arange(3)).float())
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("train_mse", self.train_mse, on_step=False, on_epoch=True)
        return F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_acc.update(self.net(x), y)
        self.log("val_acc", self.val_acc)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class StepValues(pl.Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(trainer.callback_metrics["train_acc_step"].clone())


def classes(n=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


def fit_on_both(ipu, cpu, validation_samples: int, make_callbacks=list) -> list:
    """``(trainer, callbacks)`` of the same two-epoch fit on 2 replicas x 2 device iterations
    (batches of 4) and on the CPU (batches of 8)."""
    runs = []
    for module, flags, batch in ((ipu, dict(accelerator="ipu", devices=2,
                                             strategy=IPUStrategy(device_iterations=2)), 4),
                                 (cpu, dict(accelerator="cpu"), 8)):
        callbacks = make_callbacks()
        trainer = pl.Trainer(max_epochs=2, callbacks=callbacks, num_sanity_val_steps=0, **flags, **QUIET)
        trainer.fit(module, loader(classes(), batch), loader(classes(validation_samples, seed=1), batch))
        runs.append((trainer, callbacks))
    return runs


def test_metric_objects_log_the_cpu_step_and_epoch_values_with_replicas_and_device_iterations():
    ipu, cpu = twins(Classifier)
    (ipu_trainer, [ipu_steps]), (cpu_trainer, [cpu_steps]) = fit_on_both(ipu, cpu, 32, lambda: [StepValues()])
    ipu_steps, cpu_steps = ipu_steps.values, cpu_steps.values
    assert_same_weights(ipu, cpu)
    assert len(ipu_steps) * 2 == len(cpu_steps) == 16
    # an IPU batch is two optimizer steps: its step value is the last step's, as on the CPU
    torch.testing.assert_close(torch.stack(ipu_steps), torch.stack(cpu_steps[1::2]))
    assert len(set(float(v) for v in cpu_steps)) > 2            # the values do change
    for name in ("train_acc_epoch", "train_mse", "val_acc"):
        torch.testing.assert_close(ipu_trainer.callback_metrics[name], cpu_trainer.callback_metrics[name],
                                   rtol=1e-5, atol=1e-6, msg=name)
    # Lightning reset them at epoch end, as on the CPU
    assert int(ipu.train_acc.tp.sum()) == int(cpu.train_acc.tp.sum()) == 0


class Collected(Classifier):
    """Metric collections: compute groups (precision and recall share their states on the CPU)
    and a prefix, called in training and updated in validation."""

    def __init__(self):
        super().__init__()
        scores = {"precision": torchmetrics.classification.MulticlassPrecision(3),
                  "recall": torchmetrics.classification.MulticlassRecall(3),
                  "acc": torchmetrics.classification.MulticlassAccuracy(3, average="macro")}
        self.train_scores = torchmetrics.MetricCollection(scores, prefix="train_")
        self.val_scores = self.train_scores.clone(prefix="val_")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.train_scores(logits, y)
        self.log_dict(self.train_scores, on_step=True, on_epoch=True)
        return F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_scores.update(self.net(x), y)
        self.log_dict(self.val_scores)


def test_metric_collections_log_the_cpu_values_with_replicas_and_device_iterations():
    ipu, cpu = twins(Collected)
    metrics = [trainer.callback_metrics for trainer, _ in fit_on_both(ipu, cpu, 30)]
    assert_same_weights(ipu, cpu)
    assert [sorted(group) for group in cpu.val_scores.compute_groups.values()] == [["acc", "precision", "recall"]]
    for name in ("train_precision_step", "train_recall_step", "train_acc_epoch", "val_precision", "val_recall",
                 "val_acc"):
        torch.testing.assert_close(metrics[0][name], metrics[1][name], rtol=1e-5, atol=1e-6, msg=name)


class CollectsPredictions(Classifier):
    def __init__(self):
        super().__init__()
        self.seen = torchmetrics.CatMetric()

    def training_step(self, batch, batch_idx):
        self.seen.update(batch[1].float())
        return super().training_step(batch, batch_idx)


def test_a_metric_with_list_states_is_refused_by_name():
    with pytest.raises(ipu_backend.Error, match=r"self\.seen \(CatMetric\) keeps list states \(value\)"):
        pl.Trainer(accelerator="ipu", max_steps=1, **QUIET).fit(CollectsPredictions(), loader(classes(), 4))


class PipelinedClassifier(Classifier):
    """The classifier's layers on two IPUs: the metrics are updated in the second stage."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        ipu_backend.BeginBlock(self.net[0], "hidden", ipu_id=0)
        ipu_backend.BeginBlock(self.net[2], "classes", ipu_id=1)


def test_metrics_in_a_pipelined_training_step_give_the_cpu_values():
    """The call returns the last micro-batch's outputs (OutputMode.Final); the metric states'
    totals still cover every micro-batch."""
    ipu, cpu = twins(PipelinedClassifier)
    ipu_backend.removeBlocks(cpu)
    training = ipu_backend.Options()
    training.Training.gradientAccumulation(3)
    metrics = []
    for module, flags in ((ipu, dict(accelerator="ipu", strategy=IPUStrategy(training_opts=training))),
                          (cpu, dict(accelerator="cpu", accumulate_grad_batches=3))):
        trainer = pl.Trainer(max_epochs=1, **flags, **QUIET)
        trainer.fit(module, loader(classes(48), 4))
        metrics.append(trainer.callback_metrics)
    assert_same_weights(ipu, cpu)
    for name in ("train_acc_epoch", "train_mse"):
        torch.testing.assert_close(metrics[0][name], metrics[1][name], rtol=1e-5, atol=1e-6, msg=name)
