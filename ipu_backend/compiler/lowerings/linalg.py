"""Lowerings: matrix products (mm, bmm, addmm, addmv, addbmm, _trilinear).

torch.matmul, F.linear, einsum, baddbmm, mv, dot, outer and addr decompose to these (or to
view/permute/mul/sum) before they reach us.
"""

import string

import jax.numpy as jnp
from jax import lax
import torch

from ipu_backend.compiler.registry import lowering

aten = torch.ops.aten


def accumulation_dtype(dtype):
    """float32 for half-precision floats (torch's CPU kernels accumulate and round once, in
    float32), else None: the inputs' own dtype."""
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        return jnp.float32
    return None


def einsum(subscripts, *operands):
    """``jnp.einsum`` at full float32 precision on every backend (no TF32 or bf16 passes, which
    torch's CPU numbers do not have), accumulating half precision in float32."""
    return jnp.einsum(subscripts, *operands, precision=lax.Precision.HIGHEST,
                      preferred_element_type=accumulation_dtype(operands[0].dtype))


def _scaled_sum(bias, product, beta, alpha):
    """``beta * bias + alpha * product``; beta == 0 ignores bias entirely, so NaN or inf in it
    do not propagate (torch's documented addmm/addmv/addbmm semantics)."""
    if alpha != 1:
        product = alpha * product
    if beta == 0:
        return product
    bias = bias.astype(product.dtype)
    return product + (bias if beta == 1 else beta * bias)


def _rows_product(ctx, x, y):
    """``x @ y`` for 2-D ``x``. Where ``x`` is a view of a tensor of higher rank (``F.linear`` on
    N-D inputs decomposes so), its rows are multiplied as that tensor's first dim by the rest:
    the weight's gradient then contracts two dims, which XLA:CPU lays out for its fast matrix
    kernels, where contracting the rows of one 2-D operand it does not."""
    node = ctx.node.args[1 if ctx.node.target is aten.addmm.default else 0]
    if isinstance(node, torch.fx.Node) and node.target is aten.view.default \
            and node.args[0].meta["val"].ndim > 2:
        rows, outer = x.shape[0], node.args[0].meta["val"].shape[0]
        if 1 < outer < rows and rows % outer == 0:
            batched = jnp.reshape(x, (outer, rows // outer, x.shape[1]))
            return jnp.reshape(einsum("abj,jk->abk", batched, y), (rows, y.shape[1]))
    return einsum("ij,jk->ik", x, y)


@lowering(aten.mm.default)
def mm(ctx, x, y):
    return _rows_product(ctx, x, y)


def _repeated_matrix(ctx, index: int, value):
    """The one matrix a bmm operand repeats over the batch — an ``expand`` of a tensor without a
    real batch dimension, as ``F.linear`` on 3-D inputs decomposes — or None. Multiplying by
    that matrix is one large product (and one large gradient product) instead of a batch of
    small ones. The matrix is taken from before the ``expand`` where that value is at hand, so
    its gradient is the product itself rather than a batch of zeros summed over."""
    node = ctx.node.args[index]
    matrix_shape = tuple(value.shape[1:])
    while isinstance(node, torch.fx.Node) and node.target is aten.view.default \
            and tuple(node.args[0].meta["val"].shape[-2:]) == matrix_shape:
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.target is aten.expand.default):
        return None
    source = node.args[0]
    if any(size != 1 for size in source.meta["val"].shape[:-2]):
        return None
    matrix = ctx.value_of(source)
    return value[0] if matrix is None else jnp.reshape(matrix, matrix_shape)


@lowering(aten.bmm.default)
def bmm(ctx, x, y):
    shared_y = _repeated_matrix(ctx, 1, y)
    if shared_y is not None:
        return einsum("bij,jk->bik", x, shared_y)
    shared_x = _repeated_matrix(ctx, 0, x)
    if shared_x is not None:
        return einsum("ij,bjk->bik", shared_x, y)
    return einsum("bij,bjk->bik", x, y)


@lowering(aten.addmm.default)
def addmm(ctx, bias, x, y, beta=1, alpha=1):
    return _scaled_sum(bias, _rows_product(ctx, x, y), beta, alpha)


@lowering(aten.addmv.default)
def addmv(ctx, bias, matrix, vector, beta=1, alpha=1):
    return _scaled_sum(bias, einsum("ij,j->i", matrix, vector), beta, alpha)


@lowering(aten.addbmm.default)
def addbmm(ctx, bias, x, y, beta=1, alpha=1):
    return _scaled_sum(bias, einsum("bij,bjk->ik", x, y), beta, alpha)


@lowering(aten._trilinear.default)
def trilinear(ctx, x1, x2, x3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """``sum(x1' * x2' * x3', sumdim)`` where each ``xi'`` is ``xi`` unsqueezed at ``expandi``
    (F.bilinear becomes this). Like torch, contract x1 with x2 first over the summed dims x3
    lacks, round that to the inputs' dtype, then contract with x3."""
    letters = string.ascii_letters[:x1.ndim + len(expand1)]

    def subscript(expanded):
        return "".join(letter for dim, letter in enumerate(letters) if dim not in expanded)

    s1, s2, s3 = subscript(expand1), subscript(expand2), subscript(expand3)
    summed = {letters[dim] for dim in sumdim}
    s12 = "".join(letter for letter in letters
                  if letter in s1 + s2 and (letter in s3 or letter not in summed))
    out = "".join(letter for letter in letters
                  if letter in s12 + s3 and letter not in summed)
    pair = einsum(f"{s1},{s2}->{s12}", x1, x2).astype(x1.dtype)
    return jnp.reshape(einsum(f"{s12},{s3}->{out}", pair, x3), ctx.out.shape)
