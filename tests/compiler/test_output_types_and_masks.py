"""Outputs of torch's named-tuple types (``torch.return_types.*``) keep their structure;
boolean-mask indexing (a data-dependent shape) is refused with a clear error; attention rows
whose every key is masked give torch's zeros and zero gradients."""

import jax
import pytest
import torch
import torch.nn.functional as F

import ipu_backend
from ipu_backend import Error
from ipu_backend.compiler import compile_module, to_jax
from tests.compiler.harness import assert_close, line_of
from tests.compiler.model_harness import check_model

THIS_FILE = __file__


class NamedTupleOutputs(torch.nn.Module):
    def forward(self, x):
        return torch.max(x, 1), {"top": x.topk(2, dim=1)}, torch.sort(x, 0, descending=True)


def assert_same_named_tuple(got, want):
    assert type(got) is type(want)
    assert len(got) == len(want) == 2
    assert_close(got.values, want.values, 0, 0)
    assert_close(got.indices, want.indices, 0, 0)


def distinct_values():
    """Ties would leave torch's index choice unspecified: a permutation has none."""
    return torch.randperm(20, generator=torch.Generator().manual_seed(0)).float().reshape(4, 5)


def test_return_types_come_back_from_the_program_with_their_structure():
    module, x = NamedTupleOutputs(), distinct_values()
    program = compile_module(module, (x,))
    got = jax.jit(program.fn)({}, {}, (to_jax(x),), jax.random.key(0))[0]
    want = module(x)
    assert_same_named_tuple(got[0], want[0])
    assert list(got[1]) == ["top"]
    assert_same_named_tuple(got[1]["top"], want[1]["top"])
    assert_same_named_tuple(got[2], want[2])


def test_return_types_reach_the_user_as_torch_named_tuples():
    module, x = NamedTupleOutputs(), distinct_values()
    got = ipu_backend.inferenceModel(module)(x)
    want = module(x)
    assert isinstance(got[0].values, torch.Tensor)
    for got_tuple, want_tuple in ((got[0], want[0]), (got[1]["top"], want[1]["top"]), (got[2], want[2])):
        assert_same_named_tuple(got_tuple, want_tuple)
        assert got_tuple.indices.dtype == want_tuple.indices.dtype


class MaskedSum(torch.nn.Module):
    def forward(self, x):
        return x[x > 0].sum()  # boolean-mask indexing


def test_boolean_mask_indexing_names_the_op_the_line_and_the_fix():
    with pytest.raises(Error) as error:
        compile_module(MaskedSum(), (torch.randn(3, 4),))
    message = str(error.value)
    assert "aten.index.Tensor" in message and "boolean mask" in message
    assert f"{THIS_FILE}:{line_of(THIS_FILE, '# boolean-mask indexing')}" in message
    assert "torch.where" in message and "masked_fill" in message


class SelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, mask):
        q = self.proj(x).view(2, 5, 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def test_attention_row_with_every_key_masked_gives_zeros_and_zero_gradients():
    torch.manual_seed(0)
    mask = torch.rand(5, 5) < 0.6
    mask[2] = False
    check_model(SelfAttention(), (torch.randn(2, 5, 8), mask))
