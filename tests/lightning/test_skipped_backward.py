"""Training epochs without backward against Lightning on the CPU: StochasticWeightAveraging's last
epoch over a module with batch norms recomputes their statistics forward only, and its last batch
steps the optimizer with the gradients the last backward left (``lightning_ipu/_skipped_backward.py``)."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import ipu_backend
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import QUIET, Regressor, assert_same_weights, dataset, loader, twins


class Normalized(Regressor):
    """A batch norm after a linear layer without bias (whose gradient would be rounding noise
    that Adam scales up); records the first layer's ``.grad`` that each optimizer step sees."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 2))
        self.seen = []

    def on_before_optimizer_step(self, optimizer):
        grad = self.net[0].weight.grad
        self.seen.append(None if grad is None else grad.clone())


class ManualNormalized(Normalized):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.log("train_loss", loss)
        return loss


def averaging():
    return [StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2)]


def fit_both(factory=Normalized, options=None, optimizer="sgd", validation=False, **flags):
    ipu, cpu = twins(factory, optimizer=optimizer)
    strategy = {} if options is None else {"strategy": IPUStrategy(training_opts=options)}
    ipu_trainer = pl.Trainer(accelerator="ipu", devices=1, max_epochs=4, callbacks=averaging(), **strategy,
                             **flags, **QUIET)
    val = [loader(dataset(16, seed=1), 8)] if validation else []
    ipu_trainer.fit(ipu, loader(dataset(), 8), *val)
    cpu_trainer = pl.Trainer(accelerator="cpu", max_epochs=4, callbacks=averaging(), **flags, **QUIET)
    cpu_trainer.fit(cpu, loader(dataset(), 8), *val)
    return (ipu_trainer, ipu), (cpu_trainer, cpu)


def assert_same_fit(ipu_fit, cpu_fit):
    (ipu_trainer, ipu), (cpu_trainer, cpu) = ipu_fit, cpu_fit
    assert_same_weights(ipu, cpu)
    for name, buffer in ipu.net[1].named_buffers():
        torch.testing.assert_close(buffer, getattr(cpu.net[1], name), rtol=1e-5, atol=1e-6, msg=name)
    assert ipu_trainer.global_step == cpu_trainer.global_step
    torch.testing.assert_close(ipu_trainer.callback_metrics["train_loss"], cpu_trainer.callback_metrics["train_loss"],
                               rtol=1e-5, atol=1e-6)
    assert ipu_trainer.optimizers[0].param_groups[0]["lr"] == cpu_trainer.optimizers[0].param_groups[0]["lr"]


@pytest.mark.parametrize("options, optimizer, flags", [
    (None, "sgd", {}),
    (ipu_backend.Options(device_iterations=2), "sgd", {"gradient_clip_val": 0.05}),
    (None, "adam", {"accumulate_grad_batches": 2, "gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
], ids=["sgd", "device-iterations-norm-clipping", "adam-accumulation-value-clipping"])
def test_the_batch_norm_epoch_of_weight_averaging_ends_as_on_the_cpu(options, optimizer, flags):
    ipu_fit, cpu_fit = fit_both(options=options, optimizer=optimizer, **flags)
    assert_same_fit(ipu_fit, cpu_fit)
    (ipu_trainer, ipu), (_, cpu) = ipu_fit, cpu_fit
    assert ipu_trainer.current_epoch == 5, "the batch-norm epoch ran"
    assert ipu.net[1].num_batches_tracked == cpu.net[1].num_batches_tracked == 8
    # The last optimizer step, at the end of the epoch without backward, saw the CPU's left gradients
    # (within the weights' tolerance: they come from weights five epochs of Adam took there).
    torch.testing.assert_close(ipu.seen[-1], cpu.seen[-1], rtol=1e-5, atol=1e-6)
    iterations = 1 if options is None else options.device_iterations
    assert len(ipu.seen) - 1 == (len(cpu.seen) - 1) // iterations, "one hook call per host call, and the last step"


def test_a_validation_before_the_batch_norm_epoch_releases_the_gradients_as_on_the_cpu():
    """Lightning zeroes the gradients before each validation: the epoch's last step then finds
    no ``.grad`` and leaves the weights alone."""
    ipu_fit, cpu_fit = fit_both(validation=True)
    assert_same_fit(ipu_fit, cpu_fit)
    assert ipu_fit[1].seen[-1] is None and cpu_fit[1].seen[-1] is None


def test_a_manual_step_trains_through_the_batch_norm_epoch_as_on_the_cpu():
    assert_same_fit(*fit_both(ManualNormalized))


def test_the_batch_norm_epoch_under_float16_mixed_precision_is_refused():
    ipu, _ = twins(Normalized)
    trainer = pl.Trainer(accelerator="ipu", precision="16-mixed", max_epochs=4, callbacks=averaging(), **QUIET)
    with pytest.raises(MisconfigurationException, match=r"16-mixed.*GradScaler.*bf16-mixed.*update_bn"):
        trainer.fit(ipu, loader(dataset(), 8))


class SkipsBackward(pl.Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        trainer.fit_loop._skip_backward = trainer.current_epoch == 1


def test_an_epoch_without_backward_set_by_another_callback_is_refused():
    ipu, _ = twins()
    trainer = pl.Trainer(accelerator="ipu", max_epochs=2, callbacks=[SkipsBackward()], **QUIET)
    with pytest.raises(MisconfigurationException, match=r"without backward.*did not keep"):
        trainer.fit(ipu, loader(dataset(), 8))
