"""Half precision on emulated IPUs: fp16/bf16 models, static and dynamic loss scaling,
stochastic rounding."""

import copy

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch
from ipu_backend.runtime.rounding import stochastic_round


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(8, 32)
        self.out = torch.nn.Linear(32, 3)

    def forward(self, x, labels):
        logits = self.out(torch.relu(self.hidden(x)))
        return logits, F.cross_entropy(logits.float(), labels)


def separable(n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(3, 8, generator=generator) * 3
    labels = torch.randint(0, 3, (n,), generator=generator)
    return centres[labels] + torch.randn(n, 8, generator=generator) * 0.5, labels


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model_with_static_loss_scaling_converges(dtype):
    torch.manual_seed(0)
    model = Classifier().to(dtype)
    x, labels = separable(16 * 40)
    opts = poptorch.Options(device_iterations=40, output_mode="all")
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.05, loss_scaling=128.0)
    training = poptorch.trainingModel(model, opts, optimizer)
    _, losses = training(x.to(dtype), labels)
    first = losses[0]
    for _ in range(2):
        _, losses = training(x.to(dtype), labels)
    assert model.hidden.weight.dtype == dtype
    assert torch.isfinite(losses).all() and losses[-1] < 0.25 * first, (first, losses[-1])


def test_static_loss_scaling_leaves_fp32_numbers_unchanged():
    torch.manual_seed(1)
    model = Classifier()
    reference = copy.deepcopy(model)
    x, labels = separable(8)
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(x, labels)[1].backward()
    torch_optimizer.step()
    training = poptorch.trainingModel(model, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1,
                                                                          loss_scaling=1024.0))
    training(x, labels)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_automatic_loss_scaling_skips_overflowing_steps_and_backs_off():
    torch.manual_seed(2)
    model = Classifier().half()
    before = copy.deepcopy(model.state_dict())
    x, labels = separable(8)
    opts = poptorch.Options()
    opts.Training.setAutomaticLossScaling(True)
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.05,
                                                                      loss_scaling=2.0 ** 30))
    training(x.half(), labels)        # 2^30 overflows float16: the step is skipped
    assert training.loss_scale() == 2.0 ** 29
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed on an overflowing step"
    for _ in range(40):
        training(x.half(), labels)    # the scale backs off until steps are finite again
    assert training.loss_scale() <= 2.0 ** 16
    assert not torch.equal(model.hidden.weight, before["hidden.weight"])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours():
    x = jnp.full((200_000,), 1.0 + 2.0 ** -12, jnp.float32)   # a quarter of the way to the next fp16
    rounded = stochastic_round(x, jnp.float16, jax.random.key(0))
    values = set(map(float, jnp.unique(rounded)))
    assert values == {1.0, 1.0 + 2.0 ** -10}
    assert abs(float(rounded.astype(jnp.float32).mean()) - float(x[0])) < 2e-6
    exact = jnp.array([1.0, -3.5, 0.0, 2.0 ** -3], jnp.float32)
    assert jnp.array_equal(stochastic_round(exact, jnp.bfloat16, jax.random.key(1)).astype(jnp.float32), exact)


def test_stochastic_rounding_option_trains_half_weights():
    torch.manual_seed(3)
    model = Classifier().half()
    x, labels = separable(16 * 20)
    opts = poptorch.Options(device_iterations=20, stochastic_rounding=True, random_seed=0)
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.05,
                                                                      loss_scaling=64.0))
    _, first = training(x.half(), labels)
    _, last = training(x.half(), labels)
    assert last < first


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return poptorch.identity_loss(x * self.weight, "sum")


@pytest.mark.parametrize("master_weights", [False, True])
def test_master_weights_keep_updates_that_half_precision_would_lose(master_weights):
    """Each step changes the weight by 1e-4, below half of float16's spacing at 1.0 (2^-11)."""
    model = Scale().half()
    opts = poptorch.Options(device_iterations=50, master_weights=master_weights)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=1e-4))
    training(torch.ones(50, 4).half())
    expected = 1.0 - 50 * 1e-4                     # float32 weights would reach 0.995
    if master_weights:
        torch.testing.assert_close(model.weight.float(), torch.full((4,), expected), rtol=0, atol=2 ** -11)
    else:
        assert torch.equal(model.weight, torch.ones(4).half())


class HalfInto(torch.nn.Module):
    """A float16 activation into float32 products: ``F.linear`` and a 1-D ``matmul`` (a dot)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 3)
        self.vector = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.layer(x.half()) @ self.vector


def test_products_of_mixed_dtypes_are_refused_as_torch_refuses_them():
    x = torch.randn(4)
    with pytest.raises(RuntimeError, match="same dtype"):
        HalfInto()(x)
    with pytest.raises(poptorch.Error, match=r"aten.linear.default at .*test_precision.py:\d+: .*multiplies "
                                             r"tensors of different dtypes \(float16, float32, float32\)"):
        poptorch.inferenceModel(HalfInto())(x)


def test_products_under_autocast_are_cast_and_compiled_as_torch_computes_them():
    model = HalfInto()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(torch.randn(4, generator=torch.Generator().manual_seed(0)))
        got = poptorch.inferenceModel(model)(torch.randn(4, generator=torch.Generator().manual_seed(0)))
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected)
