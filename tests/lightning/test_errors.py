"""Everything the IPU strategy cannot do fails with a message that says why and what to do."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import ipu_backend
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import QUIET, Regressor, assert_same_weights, dataset, loader, twins


def fit(module, data=None, batch_size=4, **flags):
    flags = {"accelerator": "ipu", "max_steps": 2, **flags}
    pl.Trainer(**QUIET, **flags).fit(module, data if data is not None else loader(dataset(), batch_size))


class MovesBatches(Regressor):
    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch


class EditsBatchesAfterTransfer(Regressor):
    def on_after_batch_transfer(self, batch, dataloader_idx):
        return batch


@pytest.mark.parametrize("module, hook", [(MovesBatches(), "transfer_batch_to_device"),
                                          (EditsBatchesAfterTransfer(), "on_after_batch_transfer")])
def test_overriding_device_transfer_hooks_is_refused(module, hook):
    with pytest.raises(MisconfigurationException,
                       match=rf"^Overriding `{hook}` is not supported with IPUs .*on_before_batch_transfer"):
        fit(module)


class UsesLBFGS(Regressor):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


def test_lbfgs_is_refused():
    with pytest.raises(MisconfigurationException, match="LBFGS re-evaluates the loss"):
        fit(UsesLBFGS())


def test_max_steps_must_be_a_multiple_of_device_iterations():
    with pytest.raises(MisconfigurationException, match=r"max_steps=5\) is not a multiple of device_iterations=2"):
        fit(Regressor(), strategy=IPUStrategy(device_iterations=2), max_steps=5)


class NotADataLoader:
    def __iter__(self):
        return iter([(torch.randn(4, 4), torch.randn(4, 2))])

    def __len__(self):
        return 1


@pytest.mark.parametrize("data, message", [
    (NotADataLoader(), "the train dataloader is a NotADataLoader"),
    (loader(dataset(), None), "batch_size=None"),
    (ipu_backend.DataLoader(ipu_backend.Options(device_iterations=2), dataset(), batch_size=4),
     "combines 2 micro-batches per item, but the train options run 1"),
])
def test_dataloaders_that_cannot_make_combined_batches_are_refused(data, message):
    with pytest.raises(ipu_backend.Error, match=message):
        fit(Regressor(), data)


class ClipsItsOwnWay(Regressor):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="value")


def test_clipping_other_than_the_trainer_flags_is_refused():
    with pytest.raises(MisconfigurationException, match=r"differs from what the IPU training step was "
                                                        r"compiled with \(no clipping\)"):
        fit(ClipsItsOwnWay())


class ReturnsNothing(Regressor):
    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)


def test_a_training_step_without_a_loss_is_refused():
    with pytest.raises(ipu_backend.Error, match="training_step must return the loss"):
        fit(ReturnsNothing())



class ReadsNumpy(Regressor):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("numpy_loss", float(loss.detach().numpy()))
        return loss


def test_numpy_in_a_step_is_refused_naming_why():
    with pytest.raises(ipu_backend.Error, match=r"\.numpy\(\) reads a tensor's values into NumPy.*logged as the "
                                                r"tensor itself\)\n\(while capturing the program, at .*test_errors"):
        fit(ReadsNumpy())


class WeightsLogsByBatchIndex(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, on_epoch=True, batch_size=1 + batch_idx % 2)
        return loss


def test_a_log_batch_size_computed_from_tensors_is_refused_naming_the_line():
    with pytest.raises(ipu_backend.Error, match=r"self.log\('loss', ..., batch_size=...\) at .*test_errors.py:\d+: "
                                                r"self.log\(.*read once, at capture"):
        fit(WeightsLogsByBatchIndex())


def test_the_learning_rate_finder_is_refused_with_several_optimizer_steps_per_batch():
    trainer = pl.Trainer(accelerator="ipu", max_epochs=1, strategy=IPUStrategy(device_iterations=2), **QUIET)
    with pytest.raises(MisconfigurationException, match=r"^Tuner.lr_find records one loss per batch, .*"
                                                        r"IPUStrategy\(device_iterations=1\)"):
        Tuner(trainer).lr_find(Regressor(), loader(dataset(64), 4), num_training=5)


class SkipsTheStep(Regressor):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer_closure()


def test_a_closure_run_without_the_optimizer_step_is_refused():
    with pytest.raises(MisconfigurationException, match=r"^the training step's closure ran without optimizer.step\(\)"):
        fit(SkipsTheStep())


class WarmsUpInOptimizerStep(Regressor):
    """Lightning's documented warm-up: the learning rate set after each optimizer step."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)
        for group in optimizer.param_groups:
            group["lr"] = 0.1 * min(1.0, (self.trainer.global_step + 1) / 4)


def test_a_warm_up_set_once_per_batch_of_several_optimizer_steps_is_refused():
    with pytest.raises(MisconfigurationException, match=r"^the optimizer's param_groups\[0\]\['lr'\] \(.*\) was set "
                                                        r"after its optimizer step by the training hooks"):
        fit(WarmsUpInOptimizerStep(), strategy=IPUStrategy(device_iterations=2), max_steps=4)


def test_a_warm_up_in_optimizer_step_trains_as_on_the_cpu_with_one_step_per_batch():
    ipu, cpu = twins(WarmsUpInOptimizerStep)
    pl.Trainer(accelerator="cpu", max_steps=6, **QUIET).fit(cpu, loader(dataset(), 4))
    fit(ipu, max_steps=6)
    assert_same_weights(ipu, cpu)


class KeepsGradients(Regressor):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        if batch_idx % 2 == 0:
            optimizer.zero_grad()


def test_an_optimizer_zero_grad_override_is_warned_of():
    with pytest.warns(UserWarning, match=r"KeepsGradients.optimizer_zero_grad is overridden but changes nothing"):
        fit(KeepsGradients())
