"""The executors' random state: PopTorch's full 64-bit seed range, one distinct stream per seed."""

import copy

import torch
import torch.nn.functional as F

import ipu_backend as poptorch


class Dropout(torch.nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.5, training=True)


def dropout_mask(seed: int) -> torch.Tensor:
    return poptorch.inferenceModel(Dropout(), poptorch.Options().randomSeed(seed))(torch.ones(64)) != 0


def test_seeds_across_the_64_bit_range_give_distinct_repeatable_streams():
    """Seeds differing only above bit 32, or in bit 63, draw different masks; each seed draws
    the same mask again."""
    seeds = (7, 7 + 2**32, 2**63 + 7, 2**64 - 1)
    masks = [dropout_mask(seed) for seed in seeds]
    for i, first in enumerate(masks):
        assert 0 < int(first.sum()) < 64
        for second in masks[i + 1:]:
            assert not torch.equal(first, second)
    assert torch.equal(dropout_mask(2**64 - 1), masks[-1])


class DropoutRegression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)

    def forward(self, x, y):
        out = self.linear(F.dropout(x, 0.5, training=self.training))
        return out, F.mse_loss(out, y)


def test_rng_state_continues_a_run_in_a_new_executor():
    """``rng_state`` (seed and calls made) saved after a call and set on a fresh executor of the
    saved weights: the next call draws the same dropout masks, so its weights equal bitwise."""
    torch.manual_seed(0)
    model = DropoutRegression()
    x, y = torch.randn(2, 4, 6), torch.randn(2, 4, 3)
    first = poptorch.trainingModel(model, poptorch.Options().randomSeed(2**40 + 3),
                                   torch.optim.SGD(model.parameters(), lr=0.1))
    first(x[0], y[0])
    state, saved = first.rng_state, copy.deepcopy(model.state_dict())
    assert state == [2**40 + 3, 1]
    first(x[1], y[1])

    resumed = DropoutRegression()
    resumed.load_state_dict(saved)
    second = poptorch.trainingModel(resumed, optimizer=torch.optim.SGD(resumed.parameters(), lr=0.1))
    second.compile(x[1], y[1])                      # PopTorch's rng_state needs a compiled model
    second.rng_state = state
    second(x[1], y[1])
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


def test_wrapping_a_model_leaves_torchs_random_stream_as_it_was():
    """PopTorch takes no draw from the script's generator when it wraps or runs a model."""
    model = torch.nn.Linear(2, 2)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    executor = poptorch.inferenceModel(model)
    executor(torch.ones(1, 2))
    poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)
