"""Lightning's gradient hooks (``on_after_backward``, ``on_before_optimizer_step``) read ``.grad``
on IPUs as on the CPU: the gradients the optimizer step used; a hook that changes them is refused
(the update already ran on the device), and so is one that reads the weights, which the CPU
shows as they were before the update. fp32: 1e-5 relative (1e-6 absolute)."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities import grad_norm
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import ipu_backend
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import QUIET, Regressor, assert_same_weights, dataset, loader, twins


class LogsGradientNorms(Regressor):
    """Lightning's documented use: log the gradients' norms before each optimizer step."""

    def __init__(self):
        super().__init__()
        self.norms = []

    def on_before_optimizer_step(self, optimizer):
        norms = grad_norm(self.net, norm_type=2)
        self.log_dict(norms)
        self.norms.append(norms["grad_2.0_norm_total"])


class SumsGradients(pl.Callback):
    def __init__(self):
        self.sums = []

    def on_after_backward(self, trainer, pl_module):
        self.sums.append(torch.stack([p.grad.abs().sum() for p in pl_module.parameters()]))


def fit(module, accelerator, batch, **trainer_args):
    watcher = SumsGradients()
    trainer = pl.Trainer(accelerator=accelerator, callbacks=[watcher], max_epochs=1, **{**QUIET, **trainer_args})
    trainer.fit(module, loader(dataset(32), batch))
    return trainer, watcher


def test_hooks_read_the_gradients_the_cpu_shows_and_grad_norm_logs_them():
    ipu, cpu = twins(LogsGradientNorms)
    ipu_trainer, ipu_watcher = fit(ipu, "ipu", 4)
    cpu_trainer, cpu_watcher = fit(cpu, "cpu", 4)
    assert len(ipu.norms) == len(cpu.norms) == 8
    torch.testing.assert_close(torch.stack(ipu.norms), torch.stack(cpu.norms), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(ipu_watcher.sums), torch.stack(cpu_watcher.sums), rtol=1e-5, atol=1e-6)
    assert "grad_2.0_norm/0.weight" in ipu_trainer.callback_metrics
    torch.testing.assert_close(ipu_trainer.callback_metrics["grad_2.0_norm_total"],
                               cpu_trainer.callback_metrics["grad_2.0_norm_total"], rtol=1e-5, atol=1e-6)
    assert_same_weights(ipu, cpu)


def test_replicas_and_accumulation_show_the_averaged_gradients_of_each_step():
    ipu, cpu = twins(LogsGradientNorms)
    fit(ipu, "ipu", 4, devices=2, accumulate_grad_batches=2)
    fit(cpu, "cpu", 8, accumulate_grad_batches=2)
    assert len(ipu.norms) == len(cpu.norms) == 2
    torch.testing.assert_close(torch.stack(ipu.norms), torch.stack(cpu.norms), rtol=1e-5, atol=1e-6)
    assert_same_weights(ipu, cpu)


def test_device_iterations_show_the_last_steps_gradients_once_per_batch():
    ipu, cpu = twins(LogsGradientNorms)
    fit(ipu, "ipu", 4, strategy=IPUStrategy(device_iterations=2))
    fit(cpu, "cpu", 4)
    assert len(ipu.norms) == 4 and len(cpu.norms) == 8
    torch.testing.assert_close(torch.stack(ipu.norms), torch.stack(cpu.norms[1::2]), rtol=1e-5, atol=1e-6)


class ClampsGradients(Regressor):
    def on_after_backward(self):
        for p in self.parameters():
            if p.grad is not None:
                p.grad.clamp_(-0.01, 0.01)


class ReplacesGradients(Regressor):
    def on_before_optimizer_step(self, optimizer):
        self.net[0].weight.grad = torch.zeros_like(self.net[0].weight)


@pytest.mark.parametrize("module", [ClampsGradients, ReplacesGradients])
def test_a_hook_that_changes_gradients_is_refused(module):
    with pytest.raises(MisconfigurationException, match=r"the \.grad of net\.0\.weight was changed in a gradient "
                                                         rf"hook \({module.__name__}\.on_.*before these hooks"):
        fit(module(), "ipu", 4)


class AveragesWeights(pl.Callback):
    """An exponential moving average of the weights, updated in ``hook``."""

    def __init__(self, hook: str):
        self.average = None
        setattr(self, hook, self.update)

    def update(self, trainer, pl_module, *args):
        weights = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        self.average = weights.clone() if self.average is None else 0.9 * self.average + 0.1 * weights


@pytest.mark.parametrize("hook", ["on_before_zero_grad", "on_after_backward", "on_before_optimizer_step"])
def test_a_hook_between_the_step_and_the_update_that_reads_the_weights_is_refused(hook):
    with pytest.raises(ipu_backend.Error, match=r"net\.0\.weight was read in a hook that runs between the training "
                                                r"step and the optimizer step .*on_train_batch_end"):
        pl.Trainer(accelerator="ipu", callbacks=[AveragesWeights(hook)], max_epochs=1, **QUIET).fit(
            Regressor(), loader(dataset(8), 4))


def test_weights_read_after_the_update_are_the_cpus():
    ipu, cpu = twins(Regressor)
    averages = {}
    for module, accelerator in ((ipu, "ipu"), (cpu, "cpu")):
        averages[accelerator] = AveragesWeights("on_train_batch_end")
        pl.Trainer(accelerator=accelerator, callbacks=[averages[accelerator]], max_epochs=1, **QUIET).fit(
            module, loader(dataset(32), 4))
    torch.testing.assert_close(averages["ipu"].average, averages["cpu"].average, rtol=1e-5, atol=1e-6)
    assert_same_weights(ipu, cpu)
