"""The executors' random state: PopTorch's full 64-bit seed range, one distinct stream per seed."""

import torch
import torch.nn.functional as F

import ipu_backend as poptorch


class Dropout(torch.nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.5, training=True)


def dropout_mask(seed: int) -> torch.Tensor:
    return poptorch.inferenceModel(Dropout(), poptorch.Options().randomSeed(seed))(torch.ones(64)) != 0


def test_seeds_across_the_64_bit_range_are_accepted_and_repeatable():
    for seed in (0, 2**31 + 5, 2**63 + 7, 2**64 - 1):
        mask = dropout_mask(seed)
        assert 0 < int(mask.sum()) < 64
        assert torch.equal(mask, dropout_mask(seed))


def test_seeds_differing_in_any_bit_give_distinct_streams():
    masks = [dropout_mask(seed) for seed in (7, 7 + 2**32, 7 + 2**63, 2**31 + 7)]
    for i, first in enumerate(masks):
        for second in masks[i + 1:]:
            assert not torch.equal(first, second)
