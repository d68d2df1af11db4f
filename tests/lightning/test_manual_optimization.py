"""Manual optimization with two optimizers (a GAN), compiled whole, against Lightning on the CPU:
toggled optimizers, detached fakes, clip_gradients, zero_grad and a scheduler stepped in the step;
several training steps per call (device iterations) and 16-mixed loss scaling."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import TensorDataset

import ipu_backend
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import QUIET, Recorder, assert_same_weights, loader, twins


class TinyGAN(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.generator = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        self.discriminator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        real, noise = batch
        g_opt, d_opt = self.optimizers()
        fake = self.generator(noise)

        self.toggle_optimizer(g_opt)
        verdict = self.discriminator(fake)
        g_loss = F.binary_cross_entropy_with_logits(verdict, torch.ones_like(verdict))
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        self.untoggle_optimizer(g_opt)

        self.toggle_optimizer(d_opt)
        on_real, on_fake = self.discriminator(real), self.discriminator(fake.detach())
        d_loss = (F.binary_cross_entropy_with_logits(on_real, torch.ones_like(on_real))
                  + F.binary_cross_entropy_with_logits(on_fake, torch.zeros_like(on_fake))) / 2
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        self.clip_gradients(d_opt, gradient_clip_val=0.1, gradient_clip_algorithm="norm")
        d_opt.step()
        self.untoggle_optimizer(d_opt)

        self.lr_schedulers().step()
        self.log_dict({"train_loss": g_loss, "d_loss": d_loss}, prog_bar=True)

    def configure_optimizers(self):
        g_opt = torch.optim.Adam(self.generator.parameters(), lr=0.02)
        d_opt = torch.optim.SGD(self.discriminator.parameters(), lr=0.1, momentum=0.9)
        return [g_opt, d_opt], [torch.optim.lr_scheduler.StepLR(g_opt, step_size=1, gamma=0.7)]


def gan_data(n=32):
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=generator) + 2, torch.randn(n, 3, generator=generator))


def test_a_gan_with_two_optimizers_trains_as_on_the_cpu():
    ipu, cpu = twins(TinyGAN)
    runs = []
    for module, flags, batch in ((ipu, dict(accelerator="ipu", devices=2), 4), (cpu, dict(accelerator="cpu"), 8)):
        recorder = Recorder()
        trainer = pl.Trainer(max_epochs=2, callbacks=[recorder], **flags, **QUIET)
        trainer.fit(module, loader(gan_data(), batch))
        runs.append((trainer, recorder))
    (ipu_trainer, ipu_rec), (cpu_trainer, cpu_rec) = runs
    assert_same_weights(ipu, cpu)
    assert ipu_trainer.global_step == cpu_trainer.global_step == 16          # two optimizer steps per batch
    assert ipu_rec.lrs == pytest.approx(cpu_rec.lrs)
    torch.testing.assert_close(torch.stack(ipu_rec.losses), torch.stack(cpu_rec.losses), rtol=1e-5, atol=1e-6)
    for name in ("train_loss", "d_loss"):
        torch.testing.assert_close(ipu_trainer.callback_metrics[name], cpu_trainer.callback_metrics[name],
                                   rtol=1e-5, atol=1e-6)
    for got, expected in zip(ipu_trainer.optimizers, cpu_trainer.optimizers):
        torch.testing.assert_close(got.state_dict()["state"], expected.state_dict()["state"], rtol=1e-5, atol=1e-6)


class StepsWithAClosure(TinyGAN):
    def training_step(self, batch, batch_idx):
        g_opt, _ = self.optimizers()
        g_opt.step(closure=lambda: self.manual_backward(self.generator(batch[1]).sum()))


def test_an_optimizer_closure_in_a_manual_step_is_refused():
    with pytest.raises(pl.utilities.exceptions.MisconfigurationException, match=r"step\(closure=...\)"):
        pl.Trainer(accelerator="ipu", max_steps=1, **QUIET).fit(StepsWithAClosure(), loader(gan_data(), 4))


def fit_gan_pair(ipu_flags, data, cpu_flags=None):
    ipu, cpu = twins(TinyGAN)
    runs = []
    for module, accelerator, batch in ((ipu, dict(accelerator="ipu", devices=2, **ipu_flags), 4),
                                       (cpu, dict(accelerator="cpu", **(cpu_flags or {})), 8)):
        recorder = Recorder()
        callbacks = [recorder, *accelerator.pop("callbacks", [])]
        trainer = pl.Trainer(max_epochs=2, callbacks=callbacks, **accelerator, **QUIET)
        trainer.fit(module, loader(data, batch))
        runs.append((module, trainer, recorder))
    return runs


def test_device_iterations_run_several_manual_steps_per_call_with_the_cpu_learning_rates():
    (ipu, ipu_trainer, ipu_rec), (cpu, cpu_trainer, cpu_rec) = fit_gan_pair(
        dict(strategy=IPUStrategy(device_iterations=2)), gan_data())
    assert_same_weights(ipu, cpu)
    assert ipu_trainer.global_step == cpu_trainer.global_step == 16
    assert len(ipu_rec.lrs) * 2 == len(cpu_rec.lrs) == 8
    assert ipu_rec.lrs == pytest.approx(cpu_rec.lrs[1::2])        # a call is two training steps
    torch.testing.assert_close(torch.stack(ipu_rec.losses), torch.stack(cpu_rec.losses[1::2]),
                               rtol=1e-5, atol=1e-6)


class LossScale(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        self.value = trainer.strategy._executors["training_step"].loss_scale()


def test_16_mixed_scales_manual_losses_and_skips_an_overflowed_step_as_lightning_does():
    data = gan_data()
    data.tensors[0][:8] *= 1e5          # the first batch's real samples overflow float16
    # Lightning's CPU flag would fall back to bf16-mixed: its float16 plugin, with a GradScaler, given
    scale = LossScale()
    (ipu, ipu_trainer, _), (cpu, cpu_trainer, _) = fit_gan_pair(
        dict(precision="16-mixed", callbacks=[scale]), data, dict(plugins=[MixedPrecision("16-mixed", "cpu")]))
    assert_same_weights(ipu, cpu, rtol=1e-2, atol=1e-3)
    cpu_scale = cpu_trainer.precision_plugin.scaler.get_scale()
    assert cpu_scale < 2.0 ** 16                        # overflowed steps were skipped, the scale halved
    assert scale.value == cpu_scale


class SchedulesFirst(TinyGAN):
    def training_step(self, batch, batch_idx):
        g_opt, _ = self.optimizers()
        self.lr_schedulers().step()
        self.manual_backward(self.generator(batch[1]).sum())
        g_opt.step()


def test_a_scheduler_stepped_before_the_optimizer_is_refused():
    with pytest.raises(ipu_backend.Error, match=r"lr_scheduler.step\(\) after the optimizer steps"):
        pl.Trainer(accelerator="ipu", max_steps=1, **QUIET).fit(SchedulesFirst(), loader(gan_data(), 4))


class ManualClassifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.linear = torch.nn.Linear(3, 4)

    def training_step(self, batch, batch_idx):
        x, target = batch
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(F.cross_entropy(self.linear(x), target))
        optimizer.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_manual_step_refuses_targets_outside_the_classes_as_on_the_cpu():
    data = TensorDataset(torch.randn(8, 3), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]))
    with pytest.raises(IndexError, match="Target 4 is out of bounds"):
        pl.Trainer(max_epochs=1, **QUIET).fit(ManualClassifier(), loader(data, 8))
    with pytest.raises(IndexError, match="Target 4 is out of bounds"):
        pl.Trainer(max_epochs=1, accelerator="ipu", devices=1, **QUIET).fit(ManualClassifier(), loader(data, 8))
