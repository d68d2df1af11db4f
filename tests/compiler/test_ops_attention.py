"""``F.scaled_dot_product_attention`` kept whole and lowered to JAX's fused attention: which
calls the capture keeps whole, and, with ``lowering_options(attention="fused")`` on the CPU (JAX's
XLA attention, the form cuDNN's replaces on GPUs), the outputs and gradients of torch eager."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ipu_backend.compiler import compile_module
from ipu_backend.compiler.lowering_options import lowering_options
from ipu_backend.compiler import backend
from tests.compiler.harness import OpCase, case_params, check_case
from tests.compiler.model_harness import check_model

ATTENTION = torch.ops.aten.scaled_dot_product_attention.default


class Attention(nn.Module):
    """Projections of ``x`` (and of ``memory`` for the keys and values, when given) into
    ``heads`` query heads and ``kv_heads`` key/value heads of size 8, then one attention call."""

    def __init__(self, heads=4, kv_heads=4, no_head_axis=False, **call):
        super().__init__()
        self.heads, self.kv_heads, self.no_head_axis, self.call = heads, kv_heads, no_head_axis, call
        self.q, self.k, self.v = nn.Linear(8, 8 * heads), nn.Linear(8, 8 * kv_heads), nn.Linear(8, 8 * kv_heads)

    def _split(self, x, heads):
        if self.no_head_axis:
            return x
        return x.view(*x.shape[:-1], heads, 8).transpose(-2, -3)

    def forward(self, x, memory=None, mask=None):
        memory = x if memory is None else memory
        q = self._split(self.q(x), self.heads)
        k, v = self._split(self.k(memory), self.kv_heads), self._split(self.v(memory), self.kv_heads)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.call)


def _mask_with_an_empty_row(*shape):
    mask = torch.rand(*shape) < 0.6
    mask[..., 0] = True
    mask[..., 2, :] = False             # a query that sees no key: zeros, zero gradients
    return mask


MODEL_CASES = {
    "causal": lambda: (Attention(is_causal=True), (torch.randn(2, 6, 8),)),
    "causal_scaled": lambda: (Attention(is_causal=True, scale=0.3), (torch.randn(2, 6, 8),)),
    "grouped_query": lambda: (Attention(heads=4, kv_heads=2, is_causal=True, enable_gqa=True),
                              (torch.randn(2, 6, 8),)),
    "cross_causal_top_left": lambda: (Attention(is_causal=True), (torch.randn(2, 3, 8), torch.randn(2, 5, 8))),
    "bool_mask_per_batch_and_head": lambda: (Attention(),
                                             (torch.randn(2, 5, 8), None, _mask_with_an_empty_row(2, 4, 5, 5))),
    "bool_mask_shared": lambda: (Attention(),
                                 (torch.randn(2, 5, 8), torch.randn(2, 7, 8), _mask_with_an_empty_row(5, 7))),
    "no_head_axis": lambda: (Attention(no_head_axis=True, heads=1, kv_heads=1),
                             (torch.randn(3, 5, 8), None, _mask_with_an_empty_row(3, 5, 5))),
    "two_batch_dims": lambda: (Attention(is_causal=True), (torch.randn(2, 3, 4, 8),)),
}
"""Each case built when its test runs, under its seed (not at import, where the random state
depends on which modules were collected first)."""


def _qkv(*shapes):
    return lambda dtype: tuple(torch.randn(*shape, dtype=dtype) for shape in shapes)


CASES = [
    OpCase("sdpa_causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
           _qkv((2, 3, 6, 8), (2, 3, 6, 8), (2, 3, 6, 8)), dtypes=(torch.float32, torch.bfloat16),
           ops=(ATTENTION,)),
    OpCase("sdpa_grouped_query_scaled",
           lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.5, enable_gqa=True),
           _qkv((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)), ops=(ATTENTION,)),
]


@pytest.mark.parametrize("case, dtype", case_params(CASES))
def test_fused_attention_op(case, dtype):
    with lowering_options(attention="fused"):
        check_case(case, dtype)


def _kept_whole(program) -> bool:
    return any(node.target is ATTENTION for node in program.graph_module.graph.nodes)


@pytest.mark.parametrize("case", MODEL_CASES)
def test_fused_attention_in_models_gives_torch_outputs_and_gradients(case):
    torch.manual_seed(0)
    module, inputs = MODEL_CASES[case]()
    with lowering_options(attention="fused"):
        run = check_model(module, inputs)
    assert _kept_whole(run.program)


def _program(module, inputs, dtype=torch.float32, **options):
    with lowering_options(**options):
        return compile_module(module.to(dtype), tuple(x if x is None else x.to(dtype) for x in inputs))


def test_calls_the_fused_form_does_not_take_are_decomposed():
    x = torch.randn(2, 5, 8)
    assert not _kept_whole(_program(Attention(dropout_p=0.1), (x,), attention="fused"))
    float_mask = Attention()
    assert not _kept_whole(_program(float_mask, (x, None, torch.randn(5, 5)), attention="fused"))
    assert not _kept_whole(_program(Attention(is_causal=True), (x,), attention="decomposed"))


def test_auto_keeps_half_precision_attention_whole_off_the_cpu_only(monkeypatch):
    x = (torch.randn(2, 5, 8),)
    assert not _kept_whole(_program(Attention(is_causal=True), x, torch.bfloat16))
    monkeypatch.setattr(backend, "on_cpu", lambda: False)
    assert _kept_whole(_program(Attention(is_causal=True), x, torch.bfloat16))
    assert not _kept_whole(_program(Attention(is_causal=True), x, torch.float32))
