"""``F.embedding_bag`` against torch: sum, mean and max bags from 2-D inputs and from offsets
(empty bags, ``include_last_offset``), ``padding_idx`` and ``per_sample_weights``:
forward and gradients (of the weight and of the sample weights); ``scale_grad_by_freq``, where
torch's kernel does not follow its documentation, is refused."""

import pytest
import torch
import torch.nn.functional as F

import ipu_backend

from tests.compiler.harness import OpCase, case_params, check_case

aten = torch.ops.aten
INDICES = torch.tensor([3, 0, 2, 2, 7, 1, 0, 5, 3, 3])
OFFSETS = torch.tensor([0, 3, 3, 7])          # the second bag is empty


def weight(dtype, trained=True):
    """A weight the capture sees as trained (``_embedding_bag``) or not (its forward-only form)."""
    return torch.randn(8, 5).to(dtype).requires_grad_(trained)


CASES = [
    OpCase("embedding_bag_2d",
           lambda w: tuple(F.embedding_bag(INDICES.view(2, 5), w, mode=mode) for mode in ("sum", "mean", "max")),
           lambda dtype: (weight(dtype, trained=False),), (torch.float32, torch.float16),
           ops=(aten._embedding_bag_forward_only.default,)),
    OpCase("embedding_bag_offsets",
           lambda w: (*(F.embedding_bag(INDICES, w, OFFSETS, mode=mode) for mode in ("sum", "mean", "max")),
                      F.embedding_bag(INDICES, w, torch.tensor([0, 3, 3, 7, 10]), mode="mean", include_last_offset=True),
                      F.embedding_bag(INDICES, w, OFFSETS, mode="mean", padding_idx=3),
                      F.embedding_bag(INDICES, w, OFFSETS, mode="max", padding_idx=0)),
           lambda dtype: (weight(dtype),), ops=(aten._embedding_bag.default,)),
    OpCase("embedding_bag_sample_weights",
           lambda w, s: F.embedding_bag(INDICES, w, OFFSETS, mode="sum", per_sample_weights=s),
           lambda dtype: (weight(dtype), torch.rand(10).to(dtype).requires_grad_()), ops=(aten._embedding_bag.default,)),
]


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_embedding_bags(case, dtype):
    check_case(case, dtype)


def test_scale_grad_by_freq_is_refused_with_the_reason():
    class Bags(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bags = torch.nn.EmbeddingBag(8, 5, mode="sum", scale_grad_by_freq=True)

        def forward(self, indices):
            return self.bags(indices)

    model = ipu_backend.inferenceModel(Bags())
    with pytest.raises(ipu_backend.Error, match=r"scale_grad_by_freq=True\) is not lowered: torch's CPU kernel"):
        model(INDICES.view(2, 5))


def test_an_index_past_the_rows_is_refused_before_the_call_as_torch_refuses_it():
    model = ipu_backend.inferenceModel(torch.nn.EmbeddingBag(8, 3, mode="mean"))
    with pytest.raises(IndexError, match=r"holds the index 99, but the embedding at .* has 8 rows"):
        model(torch.tensor([[1, 2], [3, 99]]))
