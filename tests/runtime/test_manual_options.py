"""A manual-optimization step honours the options the automatic step honours, with the same
numbers (master weights, stochastic rounding, the replicas' reduction, the gradient accumulators'
dtype, loss scaling, the optimizer state's location), or refuses them clearly."""

import contextlib
import copy

import jax
import pytest
import torch

import ipu_backend as poptorch
from ipu_backend import lightning_seam


class Scale(torch.nn.Module):
    """``training_step`` is a manual step (backward, then the optimizer's step); ``forward`` the
    same loss for the automatic step."""

    def __init__(self, size=4):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, size))
        self.events = None

    def loss(self, x):
        return ((x * self.weight).sum(-1) ** 2).mean() * 1e-3

    def forward(self, x):
        return poptorch.identity_loss(self.loss(x), "none")

    def training_step(self, x):
        loss = self.loss(x)
        self.events.backward(loss)
        self.events.step(0)
        return loss


@contextlib.contextmanager
def routed(model, events):
    """Route the step's backward and step calls to ``events`` (what Lightning's strategy does)."""
    model.events = events
    try:
        yield
    finally:
        model.events = None


def manual_and_automatic(model, options, make_optimizer, x, calls=1):
    """The model after ``calls`` manual steps and after as many automatic ones; each executor."""
    manual_model, automatic_model = model, copy.deepcopy(model)
    manual_optimizer, automatic_optimizer = make_optimizer(manual_model), make_optimizer(automatic_model)
    manual = lightning_seam.manual_step_executor(manual_model, options.clone(), [manual_optimizer], "training_step",
                                                 lambda events: routed(manual_model, events), None)
    automatic = poptorch.trainingModel(automatic_model, options.clone(), automatic_optimizer)
    for _ in range(calls):
        manual(x)
        automatic(x)
    manual.copyWeightsToHost()
    automatic.copyWeightsToHost()
    return (manual_model, manual_optimizer, manual), (automatic_model, automatic_optimizer, automatic)


def assert_same(manual_model, automatic_model, rtol=0.0, atol=0.0):
    for (name, got), expected in zip(manual_model.named_parameters(), automatic_model.parameters()):
        assert got.dtype == expected.dtype, name
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=name)


def test_master_weights_keep_manual_updates_as_the_automatic_step_does():
    """Each update is far below float16's spacing: lost without float32 master copies."""
    model = Scale().half()
    opts = poptorch.Options(device_iterations=20, master_weights=True)
    x = torch.ones(20, 4).half()
    (manual, _, _), (automatic, _, _) = manual_and_automatic(
        model, opts, lambda m: torch.optim.SGD(m.parameters(), lr=0.01), x, calls=2)
    assert not torch.equal(automatic.weight, torch.linspace(0.5, 1.5, 4).half())
    assert_same(manual, automatic)


def test_master_copies_follow_weights_written_on_the_host_between_manual_steps():
    model = Scale().half()
    optimizer = torch.optim.SGD(model.parameters(), lr=10.0)
    executor = lightning_seam.manual_step_executor(model, poptorch.Options(master_weights=True), [optimizer],
                                                   "training_step", lambda events: routed(model, events), None)
    x = torch.ones(1, 4).half()
    executor(x)
    executor.copyWeightsToHost()
    with torch.no_grad():
        model.weight.fill_(2.0)
    executor(x)
    executor.copyWeightsToHost()
    reference = torch.nn.Parameter(torch.full((4,), 2.0))
    (((x.float() * reference).sum(-1) ** 2).mean() * 1e-3).backward()
    torch.testing.assert_close(model.weight, (reference - 10.0 * reference.grad).half(), rtol=0, atol=0)


def test_stochastic_rounding_rounds_manual_updates_as_the_automatic_step_does():
    model = Scale(64).half()
    opts = poptorch.Options(device_iterations=10, stochastic_rounding=True, random_seed=5)
    x = torch.ones(10, 64).half()
    nearest = copy.deepcopy(model)
    (manual, _, _), (automatic, _, _) = manual_and_automatic(
        model, opts, lambda m: torch.optim.SGD(m.parameters(), lr=0.01), x)
    manual_and_automatic(nearest, poptorch.Options(device_iterations=10),
                         lambda m: torch.optim.SGD(m.parameters(), lr=0.01), x)
    assert not torch.equal(automatic.weight, nearest.weight)       # the rounding is stochastic
    assert_same(manual, automatic)


def test_summed_replicas_give_manual_gradients_as_the_automatic_step_does():
    model = Scale()
    opts = poptorch.Options(replication_factor=2, reduction_type="sum")
    x = torch.arange(8.0).reshape(2, 4)
    reference = copy.deepcopy(model)
    (manual, _, _), (automatic, _, _) = manual_and_automatic(
        model, opts, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), x)
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    sum(reference.loss(half) for half in x.split(1)).backward()    # the replicas' gradients summed
    torch_optimizer.step()
    assert_same(automatic, reference, rtol=1e-5, atol=1e-6)
    assert_same(manual, automatic)


def test_float16_gradient_accumulators_hold_manual_gradients_as_the_automatic_step_does():
    model = Scale()
    x = torch.full((2, 4), 1.0 / 3)
    (manual, manual_opt, _), (automatic, automatic_opt, _) = manual_and_automatic(
        model, poptorch.Options(replication_factor=2),
        lambda m: poptorch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, accum_type=torch.float16), x)
    assert_same(manual, automatic)
    got, expected = (next(iter(o.state_dict()["state"].values()))["momentum_buffer"]
                     for o in (manual_opt, automatic_opt))
    assert torch.equal(got, expected)


def test_static_loss_scaling_keeps_manual_float16_gradients_from_underflowing():
    """Unscaled, these float16 gradients are below float16's smallest number."""
    model = Scale().half()
    x = torch.full((1, 4), 1e-3).half()
    (manual, manual_opt, _), (automatic, automatic_opt, _) = manual_and_automatic(
        model, poptorch.Options(),
        lambda m: poptorch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, loss_scaling=2.0 ** 12), x)
    got, expected = (next(iter(o.state_dict()["state"].values()))["momentum_buffer"]
                     for o in (manual_opt, automatic_opt))
    assert expected.abs().min() > 0
    assert torch.equal(got, expected)
    assert_same(manual, automatic)


def test_automatic_loss_scaling_starts_from_the_optimizers_loss_scaling():
    model = Scale().half()
    opts = poptorch.Options()
    opts.Training.setAutomaticLossScaling(True)
    x = torch.full((1, 4), 300.0).half()
    (manual, _, manual_executor), (automatic, _, automatic_executor) = manual_and_automatic(
        model, opts, lambda m: poptorch.optim.SGD(m.parameters(), lr=0.1, loss_scaling=2.0 ** 10), x)
    assert automatic_executor.loss_scale() == 2.0 ** 9           # the first step overflowed
    assert manual_executor.loss_scale() == automatic_executor.loss_scale()
    assert_same(manual, automatic)


def test_optimizers_of_different_loss_scaling_in_one_manual_step_are_refused():
    model = torch.nn.Linear(2, 1)
    optimizers = [poptorch.optim.SGD([model.weight], lr=0.1, loss_scaling=4.0),
                  poptorch.optim.SGD([model.bias], lr=0.1, loss_scaling=8.0)]

    def step(x):
        events = model.events
        events.backward(model(x).sum())
        events.step(0)
        events.step(1)

    model.events, model.training_step = None, step
    executor = lightning_seam.manual_step_executor(model, poptorch.Options(), optimizers, "training_step",
                                                   lambda events: routed(model, events), None)
    with pytest.raises(poptorch.Error, match=r"loss_scaling.*4\.0.*8\.0"):
        executor(torch.ones(1, 2))


def test_offloaded_optimizer_state_of_a_manual_step_lives_in_host_memory():
    model = Scale()
    opts = poptorch.Options(replication_factor=2)
    opts.TensorLocations.setOptimizerLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
    x = torch.arange(8.0).reshape(2, 4)
    (manual, _, executor), (automatic, _, _) = manual_and_automatic(
        model, opts, lambda m: torch.optim.AdamW(m.parameters(), lr=0.01), x, calls=2)
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(executor._opt_states)}
    assert kinds == {"pinned_host"}
    assert_same(manual, automatic)


def manual_executor(model, options):
    return lightning_seam.manual_step_executor(model, options, [torch.optim.SGD(model.parameters(), lr=0.1)],
                                               "training_step", lambda events: routed(model, events), None)


def test_per_replica_buffers_are_refused_by_a_manual_step():
    with pytest.raises(poptorch.Error, match=r"broadcastBuffers\(False\)"):
        manual_executor(Scale(), poptorch.Options().broadcastBuffers(False))


def test_a_replica_count_that_is_not_a_power_of_two_is_refused_by_a_manual_step():
    with pytest.raises(poptorch.Error, match="power of 2|power of two"):
        manual_executor(Scale(), poptorch.Options(replication_factor=3))(torch.ones(3, 4))


def test_a_manual_step_of_a_model_split_over_ipus_is_refused():
    model = Scale()
    model.weight2 = torch.nn.Linear(4, 4)
    poptorch.BeginBlock(model.weight2, ipu_id=1)

    def step(x):
        model.events.backward(model.loss(model.weight2(x)))
        model.events.step(0)

    model.training_step = step
    with pytest.raises(poptorch.Error, match="split over IPUs"):
        manual_executor(model, poptorch.Options())(torch.ones(1, 4))
