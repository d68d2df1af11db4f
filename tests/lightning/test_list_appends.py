"""Lightning's epoch-end pattern: a step appends to a list the module holds
(``self.validation_step_outputs.append(loss)``) and an epoch-end hook reads it. The lists get, per
micro-batch and in data order, what the CPU's steps appended on batches of the micro-batch size;
what cannot be emulated is refused by name. fp32: 1e-5 relative (1e-6 absolute)."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

import ipu_backend
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import ATOL, QUIET, RTOL, dataset, loader, twins


class Appends(pl.LightningModule):
    """Appends in every step, as Lightning's docs show, and keeps each epoch's lists."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        self.training_step_outputs, self.validation_step_outputs, self.predictions = [], [], []
        self.epochs = {"train": [], "val": []}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.training_step_outputs.append(loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        loss = F.mse_loss(out, y)
        self.validation_step_outputs.append({"loss": loss, "errors": ((out - y).abs().amax(1), out.argmax(1))})
        self.predictions.extend([out])

    def on_train_epoch_end(self):
        self.epochs["train"].append(list(self.training_step_outputs))
        self.log("train_epoch_mean", torch.stack(self.training_step_outputs).mean())
        self.training_step_outputs.clear()

    def on_validation_epoch_end(self):
        self.epochs["val"].append(list(self.validation_step_outputs))
        self.log("val_epoch_mean", torch.stack([o["loss"] for o in self.validation_step_outputs]).mean())
        self.validation_step_outputs.clear()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def assert_same_items(got: list, expected: list):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        a_leaves, a_spec = torch.utils._pytree.tree_flatten(a)
        b_leaves, b_spec = torch.utils._pytree.tree_flatten(b)
        assert a_spec == b_spec
        for x, y in zip(a_leaves, b_leaves):
            assert x.shape == y.shape and x.dtype == y.dtype
            torch.testing.assert_close(x, y.detach(), rtol=RTOL, atol=ATOL)


def test_validation_appends_each_micro_batch_in_order_over_replicas_and_a_short_last_batch():
    """2 replicas x 2 device iterations of 4 samples a call; 70 samples end in a short batch."""
    ipu, cpu = twins(Appends)
    data = loader(dataset(70, seed=2), 4)
    strategy = IPUStrategy(inference_opts=ipu_backend.Options(device_iterations=2, replication_factor=2))
    got = pl.Trainer(accelerator="ipu", devices=2, strategy=strategy, **QUIET).validate(ipu, data, verbose=False)
    expected = pl.Trainer(accelerator="cpu", **QUIET).validate(cpu, data, verbose=False)
    assert len(ipu.epochs["val"][0]) == 18                      # 17 batches of 4 and one of 2
    assert_same_items(ipu.epochs["val"][0], cpu.epochs["val"][0])
    assert_same_items(ipu.predictions, cpu.predictions)
    assert ipu.validation_step_outputs == []                    # cleared by the hook, as on the CPU
    assert got[0]["val_epoch_mean"] == pytest.approx(expected[0]["val_epoch_mean"], rel=RTOL, abs=ATOL)


@pytest.mark.parametrize("output_mode", ["default", "all"])
def test_training_appends_every_micro_batch_whatever_the_output_mode(output_mode):
    """Device iterations and gradient accumulation: the call returns only its last loss by
    default, but every optimizer step's micro-batches reach the list, as on the CPU."""
    ipu, cpu = twins(Appends)
    options = ipu_backend.Options(device_iterations=2, gradient_accumulation=2, output_mode=output_mode)
    runs = []
    for module, args in ((ipu, {"accelerator": "ipu", "devices": 1, "strategy": IPUStrategy(training_opts=options)}),
                         (cpu, {"accelerator": "cpu"})):
        trainer = pl.Trainer(max_epochs=2, accumulate_grad_batches=2, limit_val_batches=0, **args, **QUIET)
        trainer.fit(module, loader(dataset(32), 4))
        runs.append(trainer)
    assert [len(epoch) for epoch in ipu.epochs["train"]] == [8, 8]
    for got, expected in zip(ipu.epochs["train"], cpu.epochs["train"]):
        assert_same_items(got, expected)
    torch.testing.assert_close(runs[0].callback_metrics["train_epoch_mean"],
                               runs[1].callback_metrics["train_epoch_mean"], rtol=RTOL, atol=ATOL)


class ReadsItsList(Appends):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        if len(self.validation_step_outputs) < 3:
            self.validation_step_outputs.append(F.mse_loss(self.net(x), y))


class AppendsANumber(Appends):
    def validation_step(self, batch, batch_idx):
        self.validation_step_outputs.append(batch[0].shape[0])


class PopsFromItsList(Appends):
    def validation_step(self, batch, batch_idx):
        self.validation_step_outputs.pop()


class AppendsToADictOfLists(Appends):
    def __init__(self):
        super().__init__()
        self.by_loader = {"val": []}

    def validation_step(self, batch, batch_idx):
        self.by_loader["val"].append(self.net(batch[0]))


class ReassignsItsList(Appends):
    def validation_step(self, batch, batch_idx):
        self.validation_step_outputs = self.validation_step_outputs + [self.net(batch[0])]


@pytest.mark.parametrize("module, message", [
    (ReassignsItsList, r"assigns self.validation_step_outputs a longer list.*append to it instead"),
    (AppendsToADictOfLists, r"changes self.by_loader\['val'\], a list inside a list or dict"),
    (ReadsItsList, r"appends to self.validation_step_outputs and reads it \(__len__\)"),
    (AppendsANumber, r"appends a value of type int to self.validation_step_outputs.*torch.tensor"),
    (PopsFromItsList, r"changes self.validation_step_outputs.*with pop"),
])
def test_a_list_the_step_reads_changes_fills_with_numbers_or_holds_deeper_is_refused(module, message):
    trainer = pl.Trainer(accelerator="ipu", devices=1, **QUIET)
    with pytest.raises(ipu_backend.Error, match=message):
        trainer.validate(module(), loader(dataset(8), 4), verbose=False)


class Scaled(torch.nn.Module):
    """Reads a list of numbers it holds; appends to another when told to."""

    def __init__(self, appends: bool):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        self.scales, self.activations, self.appends = [2.0, 3.0], [], appends

    def forward(self, x):
        for scale in self.scales:
            x = self.layer(x) * scale
        if self.appends:
            self.activations.append(x)
        return x


def test_a_models_forward_reads_its_lists_as_guards_but_may_not_append_to_them():
    with pytest.raises(ipu_backend.Error, match=r"forward appends to self.activations.*return the values"):
        ipu_backend.inferenceModel(Scaled(appends=True))(torch.randn(2, 4))
    model, x = Scaled(appends=False), torch.randn(2, 4)
    compiled = ipu_backend.inferenceModel(model)
    torch.testing.assert_close(compiled(x), model(x), rtol=RTOL, atol=ATOL)
    model.scales.append(0.5)                       # a list read at capture: the program follows it
    torch.testing.assert_close(compiled(x), model(x), rtol=RTOL, atol=ATOL)
    assert model.activations == []


class PipelinedAppends(Appends):
    """The layers on two IPUs; the steps append as above."""

    def __init__(self):
        super().__init__()
        ipu_backend.BeginBlock(self.net[0], "hidden", ipu_id=0)
        ipu_backend.BeginBlock(self.net[2], "out", ipu_id=1)


def test_a_pipelined_step_appends_every_micro_batch_whatever_the_output_mode():
    ipu, cpu = twins(PipelinedAppends)
    ipu_backend.removeBlocks(cpu)
    strategy = IPUStrategy(training_opts=ipu_backend.Options(gradient_accumulation=3),
                           inference_opts=ipu_backend.Options(device_iterations=2))
    for module, flags in ((ipu, dict(accelerator="ipu", strategy=strategy)),
                          (cpu, dict(accelerator="cpu", accumulate_grad_batches=3))):
        pl.Trainer(max_epochs=1, num_sanity_val_steps=0, **flags, **QUIET).fit(
            module, loader(dataset(48), 4), loader(dataset(16, seed=1), 4))
    assert len(ipu.epochs["train"][0]) == 12
    assert_same_items(ipu.epochs["train"][0], cpu.epochs["train"][0])
    assert_same_items(ipu.epochs["val"][-1], cpu.epochs["val"][-1])


class ManualAppends(Appends):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizer = self.optimizers()
        loss = F.mse_loss(self.net(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.training_step_outputs.append(loss.detach())


def test_a_manual_step_appends_every_device_iteration():
    ipu, cpu = twins(ManualAppends)
    for module, flags in ((ipu, dict(accelerator="ipu", strategy=IPUStrategy(device_iterations=2))),
                          (cpu, dict(accelerator="cpu"))):
        pl.Trainer(max_epochs=1, limit_val_batches=0, **flags, **QUIET).fit(module, loader(dataset(32), 4))
    assert len(ipu.epochs["train"][0]) == 8
    assert_same_items(ipu.epochs["train"][0], cpu.epochs["train"][0])
