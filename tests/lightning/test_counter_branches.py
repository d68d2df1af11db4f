"""A Python ``if`` on ``batch_idx``, ``self.current_epoch`` or ``self.global_step`` in a compiled
step takes, in every micro-batch, the branch Lightning on the CPU takes: device iterations and
accumulation included, where the micro-batches of one call go different ways. Weights and
logged values against the CPU: fp32, 1e-5 relative (1e-6 absolute)."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

import ipu_backend
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import ATOL, QUIET, RTOL, Regressor, assert_same_weights, dataset, loader, twins


def fit_both(factory, strategy, batch=2, samples=16, validate=False, **trainer_args):
    """The module trained on the IPUs and on the CPU (twins), and each run's logged values."""
    modules, metrics = twins(factory), []
    for module, accelerator in zip(modules, ({"accelerator": "ipu", "strategy": strategy}, {"accelerator": "cpu"})):
        trainer = pl.Trainer(**accelerator, **QUIET, num_sanity_val_steps=0, **trainer_args)
        trainer.fit(module, loader(dataset(samples), batch),
                    loader(dataset(samples, seed=1), batch) if validate else None)
        metrics.append(dict(trainer.callback_metrics))
    assert_same_weights(*modules)
    assert metrics[0].keys() == metrics[1].keys()
    for name in metrics[1]:
        torch.testing.assert_close(metrics[0][name], metrics[1][name], rtol=RTOL, atol=ATOL, msg=name)
    return modules


class OnEvenBatches(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if batch_idx % 2 == 0:
            loss = loss * 2
        self.log("train_loss", loss)
        return loss


def test_a_branch_on_batch_idx_goes_its_own_way_in_each_device_iteration():
    fit_both(OnEvenBatches, IPUStrategy(device_iterations=2), max_epochs=2)


def test_a_branch_on_batch_idx_goes_its_own_way_in_each_accumulated_micro_batch():
    fit_both(OnEvenBatches, IPUStrategy(device_iterations=2), max_epochs=1, accumulate_grad_batches=2)


class FromEpochOne(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        if self.current_epoch >= 1:
            loss = F.l1_loss(out, y)
        else:
            loss = F.mse_loss(out, y)
        self.log("train_loss", loss)
        return loss


def test_a_branch_on_the_epoch_follows_the_cpu_over_three_epochs():
    fit_both(FromEpochOne, IPUStrategy(device_iterations=2), max_epochs=3, batch=4)


class WarmUp(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if self.global_step < 3:        # the second call's two steps go different ways
            loss = loss * 0.1
        self.log("train_loss", loss)
        return loss


def test_a_branch_on_global_step_changes_way_inside_a_call():
    fit_both(WarmUp, IPUStrategy(device_iterations=2), max_epochs=2)


class Nested(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if batch_idx % 2 == 0:
            if self.current_epoch >= 1:
                loss = loss * 3
            else:
                loss = loss + 1
        elif batch_idx % 3 == 1:
            loss = loss / 2
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if batch_idx % 2 == 1:
            loss = loss * 10
        self.log("val_loss", loss, reduce_fx="sum")


def test_nested_branches_in_training_and_validation_follow_the_cpu():
    strategy = IPUStrategy(device_iterations=2, inference_opts={"device_iterations": 2})
    fit_both(Nested, strategy, max_epochs=2, validate=True, accumulate_grad_batches=2)


class LogsInOneBranch(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if batch_idx % 2 == 0:
            self.log("even_loss", loss)
        return loss


def test_branches_that_log_differently_name_the_line_and_the_fix():
    trainer = pl.Trainer(accelerator="ipu", strategy=IPUStrategy(device_iterations=2), max_steps=2, **QUIET)
    with pytest.raises(ipu_backend.Error, match=r"test_counter_branches.py:\d+: if batch_idx % 2 == 0:.* "
                                                r"one logs \['even_loss'\], the other \[\].*torch.where"):
        trainer.fit(LogsInOneBranch(), loader(dataset(16), 2))


class SkipsSomeBatches(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx % 3 == 1:
            return None
        return F.mse_loss(self.net(x), y)


def test_a_step_returning_none_to_skip_a_batch_is_refused_naming_the_alternative():
    trainer = pl.Trainer(accelerator="ipu", strategy=IPUStrategy(device_iterations=2), max_steps=2, **QUIET)
    with pytest.raises(ipu_backend.Error, match=r"if batch_idx % 3 == 1:.*\(one returns None.*out of the dataloader"):
        trainer.fit(SkipsSomeBatches(), loader(dataset(16), 2))


class LogsTheBatchIndex(Regressor):
    def training_step(self, batch, batch_idx):
        self.log("batch", float(batch_idx))
        return F.mse_loss(self.net(batch[0]), batch[1])


class LogsTheBatchIndexAsATensor(Regressor):
    def training_step(self, batch, batch_idx):
        self.log("batch", torch.as_tensor(batch_idx, dtype=torch.float32), reduce_fx="max")
        return F.mse_loss(self.net(batch[0]), batch[1])


def test_a_number_taken_from_a_counter_and_logged_names_the_line_and_the_fix():
    trainer = pl.Trainer(accelerator="ipu", strategy=IPUStrategy(device_iterations=2), max_steps=2, **QUIET)
    with pytest.raises(ipu_backend.Error, match=r"each value of the Python number float\(\.\.\.\) takes from "
                                                r"a tensor at .*test_counter_branches.py:\d+: self.log\(.*"
                                                r"torch.as_tensor"):
        trainer.fit(LogsTheBatchIndex(), loader(dataset(16), 2))
    trainers = {}
    for accelerator in ("ipu", "cpu"):
        trainers[accelerator] = pl.Trainer(accelerator=accelerator, max_epochs=1, **QUIET)
        trainers[accelerator].fit(LogsTheBatchIndexAsATensor(), loader(dataset(16), 4))
    assert float(trainers["ipu"].callback_metrics["batch"]) == float(trainers["cpu"].callback_metrics["batch"]) == 3


class BranchesOnData(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if batch_idx + x.sum() > 0:
            return loss * 2
        return loss


def test_a_branch_on_a_counter_mixed_with_data_names_its_line():
    trainer = pl.Trainer(accelerator="ipu", max_steps=2, **QUIET)
    with pytest.raises(ipu_backend.Error, match=r"test_counter_branches.py:\d+: if batch_idx \+ x.sum\(\) > 0.*"
                                                r"torch.where.*mixed with other tensors"):
        trainer.fit(BranchesOnData(), loader(dataset(16), 4))


class TrainsAHeadInOneBranch(Regressor):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        if self.current_epoch >= 1:
            out = self.head(out)
        return F.mse_loss(out, y)


def test_a_parameter_trained_in_one_branch_only_is_refused():
    trainer = pl.Trainer(accelerator="ipu", max_epochs=2, **QUIET)
    with pytest.raises(ipu_backend.Error, match=r"\['head.bias', 'head.weight'\].*"
                                                r"test_counter_branches.py:\d+: if self.current_epoch >= 1:"):
        trainer.fit(TrainsAHeadInOneBranch(), loader(dataset(8), 4))
