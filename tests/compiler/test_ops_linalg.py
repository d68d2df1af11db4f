"""Matrix-product lowerings against torch: mm, bmm, addmm, addmv, addbmm, _trilinear, and what
torch.matmul, F.linear, einsum, baddbmm and F.bilinear decompose to.

Half-precision products accumulate in float32 and round once on both sides, so the harness's
default fp16/bf16 tolerances hold.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ipu_backend.compiler import to_jax
from ipu_backend.compiler import backend
from ipu_backend.compiler.lowerings.linalg import matrix_product
from tests.compiler.harness import OpCase, case_params, check_case

aten = torch.ops.aten
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTEGERS = (torch.int64, torch.int32)


def randn(*shapes):
    return lambda dtype: tuple(torch.randn(s).to(dtype) for s in shapes)


def randint(*shapes):
    return lambda dtype: tuple(torch.randint(-5, 6, s, dtype=dtype) for s in shapes)


def nan_bias_then_randn(bias_shape, *shapes):
    """A bias full of NaN, which beta=0 must ignore, then normal inputs."""
    return lambda dtype: (torch.full(bias_shape, float("nan"), dtype=dtype),
                          *randn(*shapes)(dtype))


def randn_then_nan_product(bias_shape, *shapes):
    """A normal bias, then product operands full of NaN, which alpha=0 must ignore."""
    return lambda dtype: (*randn(bias_shape)(dtype),
                          *(torch.full(shape, float("nan"), dtype=dtype) for shape in shapes))


CASES = [
    OpCase("mm", torch.mm, randn((3, 4), (4, 5)), FLOATS, ops=(aten.mm.default,)),
    OpCase("mm_transposed_operands", lambda x, y: torch.mm(x.t(), y.t()), randn((6, 3), (5, 6)),
           ops=(aten.mm.default, aten.permute.default)),
    OpCase("mm_integer", torch.mm, randint((3, 4), (4, 2)), INTEGERS, ops=(aten.mm.default,)),
    OpCase("bmm", torch.bmm, randn((2, 3, 4), (2, 4, 5)), FLOATS, ops=(aten.bmm.default,)),
    OpCase("bmm_integer", torch.bmm, randint((2, 3, 4), (2, 4, 2)), INTEGERS,
           ops=(aten.bmm.default,)),
    OpCase("addmm", torch.addmm, randn((3, 5), (3, 4), (4, 5)), ops=(aten.addmm.default,)),
    OpCase("addmm_beta_alpha_broadcast_bias",
           lambda b, x, y: torch.addmm(b, x, y, beta=0.5, alpha=-2.0),
           randn((5,), (3, 4), (4, 5)), FLOATS, ops=(aten.addmm.default,)),
    OpCase("addmm_column_bias", lambda b, x, y: torch.addmm(b, x, y, alpha=3.0),
           randn((3, 1), (3, 4), (4, 5)), ops=(aten.addmm.default,)),
    OpCase("addmm_beta_zero_ignores_nan_bias", lambda b, x, y: torch.addmm(b, x, y, beta=0),
           nan_bias_then_randn((3, 5), (3, 4), (4, 5)), ops=(aten.addmm.default,)),
    OpCase("addmm_integer", lambda b, x, y: torch.addmm(b, x, y, beta=2, alpha=3),
           randint((5,), (3, 4), (4, 5)), INTEGERS, ops=(aten.addmm.default,)),
    OpCase("addmv", lambda b, m, v: torch.addmv(b, m, v, beta=1.5, alpha=0.5),
           randn((3,), (3, 4), (4,)), FLOATS, ops=(aten.addmv.default,)),
    OpCase("addmv_scalar_bias", torch.addmv, randn((), (3, 4), (4,)), ops=(aten.addmv.default,)),
    OpCase("addmv_beta_zero_ignores_nan_bias", lambda b, m, v: torch.addmv(b, m, v, beta=0),
           nan_bias_then_randn((3,), (3, 4), (4,)), ops=(aten.addmv.default,)),
    OpCase("alpha_zero_ignores_a_nan_product",
           lambda b, m, v, x: (torch.addmv(b, m, v, alpha=0, beta=0.5), torch.addmm(b[:, None], m, x, alpha=0),
                               torch.addbmm(b[:, None], m[None], x[None], alpha=0, beta=2)),
           randn_then_nan_product((3,), (3, 4), (4,), (4, 2)), grad=False,
           ops=(aten.addmv.default, aten.addmm.default, aten.addbmm.default)),
    OpCase("addbmm", lambda b, x, y: torch.addbmm(b, x, y, beta=0.5, alpha=2.0),
           randn((3, 5), (2, 3, 4), (2, 4, 5)), FLOATS, ops=(aten.addbmm.default,)),
    OpCase("baddbmm", lambda b, x, y: torch.baddbmm(b, x, y, beta=0.5, alpha=2.0),
           randn((2, 3, 5), (2, 3, 4), (2, 4, 5)), ops=(aten.bmm.default,)),
    OpCase("linear", F.linear, randn((3, 4), (5, 4), (5,)), FLOATS,
           ops=(aten.addmm.default, aten.permute.default)),
    OpCase("linear_no_bias", F.linear, randn((3, 4), (5, 4)), ops=(aten.mm.default,)),
    OpCase("linear_batched_input", F.linear, randn((2, 3, 4), (5, 4), (5,)),
           ops=(aten.addmm.default, aten.view.default)),
    OpCase("matmul_batched_by_matrix", torch.matmul, randn((2, 3, 4), (4, 5)),
           ops=(aten.mm.default,)),
    OpCase("matmul_broadcast_batches", torch.matmul, randn((2, 1, 3, 4), (5, 4, 6)),
           ops=(aten.bmm.default, aten.expand.default)),
    OpCase("linear_permuted_batched_input", lambda x, w, b: F.linear(x.permute(1, 0, 2), w, b),
           randn((3, 2, 4), (5, 4), (5,)), FLOATS, ops=(aten.bmm.default, aten.expand.default)),
    OpCase("matmul_matrix_by_permuted_batch", lambda w, x: torch.matmul(w, x.permute(0, 2, 1)),
           randn((5, 4), (2, 3, 4)), ops=(aten.bmm.default, aten.expand.default)),
    OpCase("matmul_vector_by_matrix", torch.matmul, randn((4,), (4, 6)), ops=(aten.mm.default,)),
    # MultiheadAttention's output projection: rows taken sequence-first from (batch, heads,
    # sequence, head dim), projected, turned batch-first again. The rows are multiplied in the
    # order of the permute after the product (and the bias added there).
    OpCase("linear_rows_permuted_then_permuted_back",
           lambda a, w, b: F.linear(a.permute(2, 0, 1, 3).reshape(4 * 2, 3 * 5), w, b)
           .view(4, 2, 7).transpose(0, 1),
           randn((2, 3, 4, 5), (7, 15), (7,)), FLOATS, ops=(aten.addmm.default, aten.permute.default)),
    OpCase("mm_rows_permuted_then_split_and_permuted",
           lambda a, w: torch.mm(a.permute(1, 0, 2).reshape(24, 5), w).view(2, 2, 6, 7)
           .permute(2, 0, 1, 3),
           randn((6, 4, 5), (5, 7)), ops=(aten.mm.default, aten.permute.default)),
    OpCase("addmm_rows_permuted_full_bias",
           lambda a, b, w: torch.addmm(b, a.permute(1, 0, 2).reshape(12, 5), w, beta=0.5)
           .view(4, 3, 7).transpose(0, 1),
           randn((3, 4, 5), (12, 7), (5, 7)), ops=(aten.addmm.default, aten.permute.default)),
    OpCase("matmul_batch_and_heads", torch.matmul, randn((2, 3, 4, 5), (2, 3, 5, 6)), FLOATS,
           ops=(aten.bmm.default,)),
    OpCase("matmul_heads_broadcast_over_batch", torch.matmul, randn((2, 3, 4, 5), (3, 5, 6)),
           ops=(aten.bmm.default, aten.expand.default)),
    OpCase("einsum_batched", lambda a, b: torch.einsum("bij,bjk->bik", a, b),
           randn((2, 3, 4), (2, 4, 5)), ops=(aten.bmm.default,)),
    OpCase("einsum_contract_two_dims", lambda a, b: torch.einsum("bij,cji->bc", a, b),
           randn((2, 3, 4), (5, 4, 3)), ops=(aten.bmm.default,)),
    # Gradients sum products of magnitude ~10 whose half-precision intermediates torch's
    # _trilinear backward rounds in its own order: absolute errors within one ulp at that scale.
    OpCase("bilinear", F.bilinear, randn((3, 4), (3, 5), (6, 4, 5), (6,)), FLOATS,
           tolerances={torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 6e-2)},
           ops=(aten._trilinear.default,)),
]


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_linalg(case, dtype):
    check_case(case, dtype)


def _compiled_gradient_text(fn, *args) -> str:
    return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=(0, 1))).lower(*args) \
        .compile().as_text()


def _dots_contracting_left_rows(hlo: str) -> list[str]:
    """The compiled dots whose left operand is contracted on its first axis, which XLA:CPU's
    fast matrix kernel does not take."""
    return [line for line in hlo.splitlines()
            if " dot(" in line and "lhs_contracting_dims={0}" in line]


@pytest.mark.parametrize("b_transposed", [False, True])
def test_cpu_matrix_product_gradients_are_rows_times_columns_and_equal_torch(b_transposed):
    torch.manual_seed(0)
    a, b = torch.randn(40, 32, requires_grad=True), torch.randn(24, 32, requires_grad=True)
    cotangent = torch.randn(40, 24)
    (torch.mm(a, b.t()) * cotangent).sum().backward()

    def product(x, w):
        return matrix_product(x, w.T if b_transposed else w, b_transposed=b_transposed)

    jax_a, jax_b = to_jax(a.detach()), to_jax(b.detach() if b_transposed else b.detach().t())
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(product(x, w) * to_jax(cotangent)),
                             argnums=(0, 1)))(jax_a, jax_b)
    b_grad = grads[1] if b_transposed else grads[1].T
    torch.testing.assert_close(torch.from_numpy(np.asarray(grads[0])), a.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.from_numpy(np.asarray(b_grad)), b.grad, rtol=1e-5, atol=1e-5)
    assert not _dots_contracting_left_rows(_compiled_gradient_text(product, jax_a, jax_b))


def test_jax_gradient_of_a_product_contracts_left_rows():
    """What :func:`matrix_product` avoids: the check above can fail."""
    x, w = jnp.ones((40, 32)), jnp.ones((32, 24))
    assert _dots_contracting_left_rows(_compiled_gradient_text(jnp.matmul, x, w))


def test_other_backends_get_jax_gradients_of_products(monkeypatch):
    monkeypatch.setattr(backend, "on_cpu", lambda: False)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x, w: matrix_product(x, w).sum()))(
        jnp.ones((4, 3)), jnp.ones((3, 2))))
    assert "custom_vjp" not in jaxpr and "optimization_barrier" not in jaxpr
