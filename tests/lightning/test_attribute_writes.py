"""A step's writes to its module's attributes: the step's Python runs once, at capture, so the
Python values it assigns, as attributes or inside the dicts, lists and records (configuration
namespaces, ``hparams``) its module holds, are made on the host after each call (a flag it reads
and flips captures the step again), equal to the CPU's; a counter, an assigned tensor, a list
held inside them that grows, and a value read and changed by a call of several steps are
refused by name."""

import types

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

import ipu_backend
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import ATOL, QUIET, RTOL, assert_same_weights, dataset, loader, twins


class Writes(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.seen, self.last, self.stats, self.total, self.shape = 0, None, {}, torch.zeros(()), None

    def loss(self, batch):
        return F.mse_loss(self.net(batch[0]), batch[1])


class CountsSamples(Writes):
    def validation_step(self, batch, batch_idx):
        self.seen += batch[0].shape[0]


class KeepsTheLastLoss(Writes):
    def validation_step(self, batch, batch_idx):
        self.last = self.loss(batch)


class KeepsItInADict(Writes):
    def validation_step(self, batch, batch_idx):
        self.stats["loss"] = self.loss(batch)


class SumsInPlace(Writes):
    def validation_step(self, batch, batch_idx):
        self.shape = tuple(batch[0].shape)              # a Python value computed alike at every capture
        self.total += self.loss(batch).detach()


class CountsInADict(Writes):
    def validation_step(self, batch, batch_idx):
        self.stats["seen"] = self.stats.get("seen", 0) + batch[0].shape[0]


class CountsInItsHparams(Writes):
    def __init__(self, seen=0):
        super().__init__()
        self.save_hyperparameters()

    def validation_step(self, batch, batch_idx):
        self.hparams.seen += batch[0].shape[0]


class AppendsInItsConfiguration(Writes):
    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(losses=[])

    def validation_step(self, batch, batch_idx):
        self.config.losses.append(self.loss(batch))


class KeepsItPrivately(Writes):
    def validation_step(self, batch, batch_idx):
        self._last = self.loss(batch)


@pytest.mark.parametrize("module, message", [
    (CountsSamples, r"the step changes self.seen \(0 -> 4\).*hook that runs on the host"),
    (KeepsTheLastLoss, r"the step assigns a tensor to self.last:.*append it to a list"),
    (KeepsItInADict, r"the step assigns a tensor to self.stats\['loss'\]:.*buffer in place"),
    (KeepsItPrivately, r"the step assigns a tensor to self._last:"),
    (CountsInItsHparams, r"the step changes self._hparams\['seen'\] \(0 -> 4\)"),
    (AppendsInItsConfiguration, r"the step changes the length of self.config.losses, a list held in what the "
                                r"module holds: .*append it to a list the module holds"),
])
def test_a_step_that_changes_a_counter_or_assigns_a_tensor_is_refused(module, message):
    with pytest.raises(ipu_backend.Error, match=message):
        pl.Trainer(accelerator="ipu", devices=1, **QUIET).validate(module(), loader(dataset(8), 4), verbose=False)


def test_a_tensor_attribute_changed_in_place_and_a_cached_python_value_are_kept():
    ipu, cpu = twins(SumsInPlace)
    for module, accelerator in ((ipu, "ipu"), (cpu, "cpu")):
        pl.Trainer(accelerator=accelerator, devices=1, **QUIET).validate(module, loader(dataset(16), 4), verbose=False)
    torch.testing.assert_close(ipu.total, cpu.total, rtol=RTOL, atol=ATOL)
    assert cpu.total > 0


class Flags(pl.LightningModule):
    """Python values a training step assigns: read and flipped once, or only set."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.warm, self._private_warm, self.phase, self.options, self.gone = True, True, "start", {"warm": True}, 1
        self.sub = torch.nn.Module()
        self.sub.seen = False
        self.config = types.SimpleNamespace(schedule=types.SimpleNamespace(warm=True))
        self.listed = [{"warm": True}]

    def loss(self, batch):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def state(self):
        return (self.warm, self._private_warm, self.phase, dict(self.options), hasattr(self, "gone"),
                getattr(self, "batch", None), self.sub.seen, self.config.schedule.warm, self.listed[0]["warm"])


class FlipsAFlag(Flags):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.warm:
            loss, self.warm = loss * 0.1, False
        return loss


class FlipsAPrivateFlag(Flags):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self._private_warm:
            loss, self._private_warm = loss * 0.1, False
        return loss


class MovesToAPhase(Flags):
    def training_step(self, batch, batch_idx):
        scale = 0.1 if self.phase == "start" else 1.0
        self.phase = "running"
        return self.loss(batch) * scale


class FlipsADictEntry(Flags):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.options["warm"]:
            loss, self.options["warm"] = loss * 0.1, False
        return loss


class FlipsAFlagInANestedRecord(Flags):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.config.schedule.warm:
            loss, self.config.schedule.warm = loss * 0.1, False
        return loss


class FlipsAFlagInAListedDict(Flags):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.listed[0]["warm"]:
            loss, self.listed[0]["warm"] = loss * 0.1, False
        return loss


class OnlySets(Flags):
    def training_step(self, batch, batch_idx):
        self.sub.seen, self.batch = True, batch[0].shape[0]
        return self.loss(batch)


class DeletesOne(Flags):
    def training_step(self, batch, batch_idx):
        if hasattr(self, "gone"):
            del self.gone
        return self.loss(batch)


@pytest.mark.parametrize("module", [FlipsAFlag, FlipsAPrivateFlag, MovesToAPhase, FlipsADictEntry,
                                    FlipsAFlagInANestedRecord, FlipsAFlagInAListedDict, OnlySets, DeletesOne])
def test_python_values_a_step_assigns_reach_the_host_and_train_as_on_the_cpu(module):
    ipu, cpu = twins(module)
    for model, accelerator in ((ipu, "ipu"), (cpu, "cpu")):
        pl.Trainer(accelerator=accelerator, devices=1, max_epochs=1, **QUIET).fit(model, loader(dataset(16), 4))
    assert ipu.state() == cpu.state() != Flags().state()
    assert_same_weights(ipu, cpu)


def test_a_value_only_set_reaches_the_host_from_a_call_of_several_steps():
    ipu, cpu = twins(OnlySets)
    pl.Trainer(accelerator="ipu", devices=1, max_epochs=1, strategy=IPUStrategy(device_iterations=2),
               **QUIET).fit(ipu, loader(dataset(16), 4))
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, **QUIET).fit(cpu, loader(dataset(16), 4))
    assert ipu.state() == cpu.state()
    assert_same_weights(ipu, cpu)


@pytest.mark.parametrize("module", [FlipsAFlag, FlipsADictEntry, FlipsAFlagInANestedRecord])
def test_a_value_read_and_changed_in_a_call_of_several_steps_is_refused(module):
    read = r"self\.(warm|options\['warm'\]|config\.schedule\.warm)"
    with pytest.raises(ipu_backend.Error, match=rf"training_step reads {read} and changes it: .*2 steps one call "
                                                r"runs.*on_train_batch_start"):
        pl.Trainer(accelerator="ipu", devices=1, max_epochs=1, strategy=IPUStrategy(device_iterations=2),
                   **QUIET).fit(module(), loader(dataset(16), 4))


class TagsTheFirstBatch(Flags):
    def training_step(self, batch, batch_idx):
        self.phase = "first" if batch_idx == 0 else "later"
        return self.loss(batch)


def test_branches_on_batch_idx_that_assign_different_values_are_refused():
    with pytest.raises(ipu_backend.Error, match=r"the Python `if` .* differ: they leave self.phase different"):
        pl.Trainer(accelerator="ipu", devices=1, max_epochs=1, **QUIET).fit(TagsTheFirstBatch(), loader(dataset(16), 4))


class Pruned(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _pruned(linear):
    torch.nn.utils.prune.l1_unstructured(linear, "weight", amount=0.3)


@pytest.mark.parametrize("reparametrize", [_pruned, torch.nn.utils.weight_norm, torch.nn.utils.spectral_norm])
def test_a_model_reparametrized_before_the_fit_trains_as_on_the_cpu(reparametrize):
    """torch.nn.utils.prune, weight_norm and spectral_norm set ``weight`` (``weight_orig *
    weight_mask``, ``g * v / |v|``...) in a forward pre-hook at every call: a value of the
    program, not a tensor the step hands the host."""
    ipu, cpu = twins(Pruned)
    for module in (ipu, cpu):
        torch.manual_seed(1)                                # spectral_norm draws its first vectors
        reparametrize(module.net[0])
    for module, accelerator in ((ipu, "ipu"), (cpu, "cpu")):
        pl.Trainer(accelerator=accelerator, devices=1, max_epochs=2, **QUIET).fit(module, loader(dataset(16), 4))
    assert_same_weights(ipu, cpu)
    for (name, buffer), (_, expected) in zip(ipu.net[0].named_buffers(), cpu.net[0].named_buffers()):
        torch.testing.assert_close(buffer, expected, rtol=RTOL, atol=ATOL, msg=name)   # masks, u and v


def test_pruning_during_the_fit_is_refused_by_name():
    pruning = pl.callbacks.ModelPruning("l1_unstructured", amount=0.3, verbose=0)
    with pytest.raises(ipu_backend.Error, match=r"parameters \['net.0.weight_orig'.* are not among the weights the "
                                                r"device holds: .*ModelPruning.*before the first call"):
        pl.Trainer(accelerator="ipu", devices=1, max_epochs=2, callbacks=[pruning],
                   **QUIET).fit(Pruned(), loader(dataset(16), 4))
