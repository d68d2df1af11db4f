"""Trainer(accelerator="ipu") against the same LightningModule trained by Lightning on the CPU:
weights, logged values and loop behaviour. fp32: 1e-5 relative (1e-6 absolute)."""

import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import ipu_backend
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import (
    QUIET,
    Recorder,
    Regressor,
    assert_same_metrics,
    assert_same_weights,
    dataset,
    loader,
    twins,
)


def fit_pair(ipu_module, cpu_module, ipu_batch, cpu_batch, data=None, val=True, ipu_args=None, **trainer_args):
    data = data or dataset()
    runs = []
    for module, batch, accelerator_args in ((ipu_module, ipu_batch, {"accelerator": "ipu", **(ipu_args or {})}),
                                            (cpu_module, cpu_batch, {"accelerator": "cpu"})):
        recorder = Recorder()
        trainer = pl.Trainer(callbacks=[recorder], **accelerator_args, **{**QUIET, **trainer_args})
        trainer.fit(module, loader(data, batch), loader(data, batch) if val else None)
        runs.append((trainer, recorder))
    return runs


def test_four_replicas_with_batch_b_equal_the_cpu_with_batch_4b_in_all_four_loops():
    ipu, cpu = twins()
    (ipu_trainer, ipu_rec), (cpu_trainer, cpu_rec) = fit_pair(
        ipu, cpu, 4, 16, ipu_args={"devices": 4}, max_epochs=2, num_sanity_val_steps=1)
    assert ipu_trainer.num_devices == 4 and ipu_trainer.strategy.replicas == 4
    assert_same_weights(ipu, cpu)
    assert ipu_trainer.global_step == cpu_trainer.global_step == 8
    assert_same_metrics(ipu_trainer.callback_metrics, cpu_trainer.callback_metrics,
                        ["train_loss", "val_loss", "val_max_error", "val_constant"])
    assert set(ipu_trainer.progress_bar_metrics) == set(cpu_trainer.progress_bar_metrics)
    torch.testing.assert_close(torch.stack(ipu_rec.losses), torch.stack(cpu_rec.losses), rtol=1e-5, atol=1e-6)
    assert ipu_rec.outputs[0].keys() == {"loss"} and ipu_rec.outputs[0]["loss"].shape == ()
    assert ipu_rec.validations == cpu_rec.validations == 3       # sanity check + 2 epochs

    data = dataset(32, seed=1)
    for stage in ("validate", "test"):
        got = getattr(ipu_trainer, stage)(ipu, loader(data, 4), verbose=False)
        expected = getattr(cpu_trainer, stage)(cpu, loader(data, 16), verbose=False)
        assert got[0].keys() == expected[0].keys()
        for name in got[0]:
            assert got[0][name] == pytest.approx(expected[0][name], rel=1e-5, abs=1e-6), name
    got = ipu_trainer.predict(ipu, loader(data, 4))
    expected = cpu_trainer.predict(cpu, loader(data, 16))
    assert [p.shape for p in got] == [p.shape for p in expected] == [(16, 2), (16, 2)]
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), rtol=1e-5, atol=1e-6)


class PreparesBatches(Regressor):
    def on_before_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return x * 2, y - 1

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("epoch_loss", loss, on_step=True, on_epoch=True)
        return loss


def test_accumulate_grad_batches_and_on_before_batch_transfer_give_the_cpu_numbers():
    ipu, cpu = twins(PreparesBatches)
    (ipu_trainer, ipu_rec), (cpu_trainer, cpu_rec) = fit_pair(
        ipu, cpu, 4, 8, val=False, ipu_args={"devices": 2}, max_epochs=1, accumulate_grad_batches=2)
    assert_same_weights(ipu, cpu)
    assert ipu_trainer.global_step == cpu_trainer.global_step == 4
    assert ipu_trainer.accumulate_grad_batches == 2, "the Trainer's flag is given back after fit"
    assert ipu_trainer.strategy.training_opts.Training.gradient_accumulation == 2
    # One IPU batch holds both micro-batches of a step; its logged loss is the last one's, the
    # epoch's mean covers both, and the step's output is divided by the accumulation.
    torch.testing.assert_close(torch.stack(ipu_rec.losses), torch.stack(cpu_rec.losses[1::2]), rtol=1e-5, atol=1e-6)
    assert_same_metrics(ipu_trainer.callback_metrics, cpu_trainer.callback_metrics,
                        ["epoch_loss_epoch", "epoch_loss_step"])
    torch.testing.assert_close(torch.stack([out["loss"] for out in ipu_rec.outputs]),
                               torch.stack([out["loss"] for out in cpu_rec.outputs[1::2]]), rtol=1e-5, atol=1e-6)



class CountsSamples(Regressor):
    """Logs Python numbers summed over the epoch: a sample count and a batch count."""

    def training_step(self, batch, batch_idx):
        self.log("samples", float(batch[0].shape[0]), on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("batches", 1, on_step=False, on_epoch=True, reduce_fx="sum")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("val_samples", batch[0].shape[0], reduce_fx="sum")


def test_python_numbers_logged_as_sums_count_every_micro_batch():
    """An IPU batch of 2 device iterations x 2 accumulated micro-batches is 4 CPU batches."""
    ipu, cpu = twins(CountsSamples)
    strategy = IPUStrategy(training_opts=ipu_backend.Options(device_iterations=2, gradient_accumulation=2),
                           inference_opts=ipu_backend.Options(device_iterations=2))
    (ipu_trainer, _), (cpu_trainer, _) = fit_pair(
        ipu, cpu, 4, 4, data=dataset(48), ipu_args={"strategy": strategy},
        max_epochs=1, accumulate_grad_batches=2)
    assert int(cpu_trainer.callback_metrics["samples"]) == 48 and int(cpu_trainer.callback_metrics["batches"]) == 12
    assert_same_metrics(ipu_trainer.callback_metrics, cpu_trainer.callback_metrics,
                        ["samples", "batches", "val_samples"])

def test_accumulation_changed_during_the_fit_is_refused():
    """Lightning's GradientAccumulationScheduler sets the Trainer's flag at each epoch start; the
    IPUs' accumulation is fixed for the fit, so a change would silently train otherwise."""
    scheduler = pl.callbacks.GradientAccumulationScheduler({0: 1, 1: 2})
    trainer = pl.Trainer(accelerator="ipu", devices=1, max_epochs=2, callbacks=[scheduler], **QUIET)
    with pytest.raises(MisconfigurationException, match="accumulate_grad_batches changed to 2 during the fit .*"
                                                        "gradient_accumulation=1 micro-batches fixed"):
        trainer.fit(Regressor(), loader(dataset(16), 4))
    assert trainer.global_step == 4                 # the first epoch trained


@pytest.mark.parametrize("algorithm, value", [("norm", 0.05), ("value", 0.01)])
def test_gradient_clipping_happens_inside_the_compiled_step(algorithm, value):
    ipu, cpu = twins()
    fit_pair(ipu, cpu, 8, 16, val=False, ipu_args={"devices": 2}, max_steps=3,
             gradient_clip_val=value, gradient_clip_algorithm=algorithm)
    assert_same_weights(ipu, cpu)


def test_lr_schedulers_step_and_epoch_intervals_change_the_lr_without_recompiling(caplog, tmp_path):
    ipu, cpu = twins(schedulers=(("step", "step"), ("exponential", "epoch")))
    strategy = IPUStrategy(autoreport=True, autoreport_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="ipu_backend"):
        (trainer, ipu_rec), (_, cpu_rec) = fit_pair(ipu, cpu, 16, 16, data=dataset(48), val=False, max_epochs=2,
                                                    ipu_args={"strategy": strategy})
    assert_same_weights(ipu, cpu)
    assert ipu_rec.lrs == pytest.approx(cpu_rec.lrs) and len(set(ipu_rec.lrs)) > 3
    assert sum(r.getMessage().startswith(("compiled the training", "reused the training"))
               for r in caplog.records) == 1
    assert trainer.strategy.training_opts.profiling_dir == str(tmp_path)


@pytest.mark.parametrize("every, warned", [(3, True), (4, False)])
def test_checkpoints_every_n_steps_not_a_multiple_of_the_device_iterations_are_warned_of(every, warned, tmp_path):
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every, save_top_k=-1)
    trainer = pl.Trainer(accelerator="ipu", devices=1, max_steps=12, callbacks=[checkpoints],
                         strategy=IPUStrategy(training_opts=ipu_backend.Options(device_iterations=2)),
                         **{**QUIET, "enable_checkpointing": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Regressor(), loader(dataset(48), 4))
    messages = [str(w.message) for w in caught if "every_n_train_steps" in str(w.message)]
    saved = sorted(int(path.stem.split("step=")[1]) for path in tmp_path.glob("*.ckpt"))
    if warned:       # the CPU saves at 3, 6, 9, 12
        assert saved == [6, 12] and len(messages) == 1 and "saves only at multiples of 6" in messages[0]
    else:
        assert saved == [4, 8, 12] and not messages

class StepSized(Regressor):
    """Reads the schedule length ``configure_optimizers`` sizes a per-step scheduler by."""

    def configure_optimizers(self):
        self.estimated = self.trainer.estimated_stepping_batches
        return super().configure_optimizers()


def test_estimated_stepping_batches_counts_the_optimizer_steps_a_fit_with_max_steps_runs():
    ipu, _ = twins(StepSized)
    recorder = Recorder()
    options = ipu_backend.Options(device_iterations=2)
    trainer = pl.Trainer(accelerator="ipu", devices=1, strategy=IPUStrategy(training_opts=options),
                         max_steps=6, log_every_n_steps=2, callbacks=[recorder], **QUIET)
    trainer.fit(ipu, loader(dataset(64), 4))
    assert recorder.steps == [2, 4, 6]                  # three batches of two optimizer steps
    assert ipu.estimated == 6 and trainer.max_steps == 6


class LoggedMetrics(pl.loggers.Logger):
    """Every ``log_metrics`` call a fit makes, as ``(step, names)``."""

    name, version = "memory", 0

    def __init__(self):
        super().__init__()
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, sorted(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_a_learning_rate_monitor_logs_at_the_cpus_steps():
    """It logs in on_train_batch_start, before the call's optimizer steps are counted."""
    rows = {}
    for accelerator, strategy in (("cpu", "auto"), ("ipu", IPUStrategy(device_iterations=4))):
        logger = LoggedMetrics()
        trainer = pl.Trainer(accelerator=accelerator, devices=1, strategy=strategy, max_epochs=1, logger=logger,
                             log_every_n_steps=4, callbacks=[pl.callbacks.LearningRateMonitor("step")],
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Regressor(), loader(dataset(32), 4))
        rows[accelerator] = [step for step, names in logger.rows if "lr-SGD" in names]
    assert rows["ipu"] == rows["cpu"] == [3, 7]


def test_device_iterations_run_several_optimizer_steps_per_batch_and_count_them():
    cpu_recorder = Recorder()
    cpu_trainer = pl.Trainer(accelerator="cpu", max_steps=6, callbacks=[cpu_recorder], **QUIET)
    _, cpu = twins()
    cpu_trainer.fit(cpu, loader(dataset(), 8))
    cpu_losses = torch.stack(cpu_recorder.losses)
    for output_mode in ("default", "all"):
        ipu, _ = twins()
        recorder = Recorder()
        options = ipu_backend.Options(device_iterations=3, replication_factor=2, output_mode=output_mode)
        trainer = pl.Trainer(accelerator="ipu", devices=2, strategy=IPUStrategy(training_opts=options),
                             max_steps=6, callbacks=[recorder], log_every_n_steps=3, **QUIET)
        trainer.fit(ipu, loader(dataset(), 4))
        assert_same_weights(ipu, cpu)
        assert trainer.global_step == cpu_trainer.global_step == 6
        assert recorder.steps == [3, 6]                 # two host calls of three optimizer steps
        # Whatever the output mode, a host call's step value is its last optimizer step's loss.
        torch.testing.assert_close(torch.stack(recorder.losses), cpu_losses[2::3], rtol=1e-5, atol=1e-6)


def test_limits_val_check_interval_and_max_steps_behave_as_on_the_cpu():
    ipu, cpu = twins()
    flags = dict(limit_train_batches=5, limit_val_batches=2, val_check_interval=2, max_steps=7,
                 num_sanity_val_steps=0)
    (ipu_trainer, ipu_rec), (cpu_trainer, cpu_rec) = fit_pair(ipu, cpu, 4, 8, ipu_args={"devices": 2}, **flags)
    assert_same_weights(ipu, cpu)
    assert ipu_trainer.global_step == cpu_trainer.global_step == 7
    assert ipu_trainer.current_epoch == cpu_trainer.current_epoch
    assert ipu_rec.validations == cpu_rec.validations == 3
    assert_same_metrics(ipu_trainer.callback_metrics, cpu_trainer.callback_metrics, ["val_loss", "train_loss"])


def test_fast_dev_run_runs_one_batch_of_each_loop():
    ipu, _ = twins()
    recorder = Recorder()
    trainer = pl.Trainer(accelerator="ipu", devices=2, fast_dev_run=True, callbacks=[recorder], **QUIET)
    trainer.fit(ipu, loader(dataset(), 4), loader(dataset(), 4))
    assert recorder.steps == [1] and recorder.validations == 1


class HalveFirstLayer(pl.Callback):
    """Writes the weights between steps, as weight constraints and averaging callbacks do."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            pl_module.net[0].weight.mul_(0.5)


def test_weights_written_by_a_callback_reach_the_next_step():
    ipu, cpu = twins(lr=0.05)
    for module, accelerator, batch in ((ipu, "ipu", 4), (cpu, "cpu", 8)):
        trainer = pl.Trainer(accelerator=accelerator, max_epochs=1, callbacks=[HalveFirstLayer()],
                             **({"devices": 2} if accelerator == "ipu" else {}), **QUIET)
        trainer.fit(module, loader(dataset(32), batch))
    assert_same_weights(ipu, cpu)


class LogsNumbers(Regressor):
    """Logs Python numbers read from tensors, as many tutorials do."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        loss = torch.nn.functional.mse_loss(out, y)
        self.log("train_loss", loss)
        self.log("loss_item", loss.item())
        self.log("close", ((out - y).abs() < 0.5).sum().item(), reduce_fx="sum")
        return loss


def test_numbers_read_with_item_log_the_tensors_values():
    ipu, cpu = twins(LogsNumbers)
    (ipu_trainer, _), (cpu_trainer, _) = fit_pair(ipu, cpu, 8, 8, max_epochs=1)
    assert_same_weights(ipu, cpu)
    assert_same_metrics(ipu_trainer.callback_metrics, cpu_trainer.callback_metrics, ["loss_item", "close"])


def test_a_throughput_monitor_reading_the_module_under_inference_mode_trains_as_on_the_cpu():
    """ThroughputMonitor reads the module inside torch.inference_mode, which brings the optimizer
    state to the host there: it must stay made of tensors whose versions show host writes."""
    ipu, cpu = twins()
    for module, accelerator in ((ipu, "ipu"), (cpu, "cpu")):
        monitor = pl.callbacks.ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0))
        pl.Trainer(accelerator=accelerator, devices=1, max_epochs=2, callbacks=[monitor], **QUIET).fit(
            module, loader(dataset(16), 4))
    assert_same_weights(ipu, cpu)
