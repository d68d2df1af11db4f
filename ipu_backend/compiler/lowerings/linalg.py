"""Lowerings: matrix products (mm, bmm, addmm, addmv, addbmm, _trilinear).

torch.matmul, F.linear, einsum, baddbmm, mv, dot, outer and addr decompose to these (or to
view/permute/mul/sum) before they reach us.
"""

import functools
import math
import string

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
import torch

from ipu_backend.compiler import axis_order
from ipu_backend.compiler import backend
from ipu_backend.compiler.registry import lowering

aten = torch.ops.aten

MATRIX_PRODUCT_NAME = "ipu_backend.matrix_product"
"""The ``checkpoint_name`` of :func:`matrix_product`'s results on the CPU, whose custom gradient
hides the product from JAX's policies for dots: recomputation that keeps matrix products
(PopTorch's Standard) keeps these by name."""


def accumulation_dtype(dtype):
    """float32 for half-precision floats (torch's CPU kernels accumulate and round once, in
    float32), else None: the inputs' own dtype."""
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        return jnp.float32
    return None


def einsum(subscripts, *operands, precision: lax.Precision | None = None):
    """``jnp.einsum`` at the float32 precision of the program's matrix products (full float32
    on the CPU, as torch's CPU numbers are; on a GPU as torch's settings say: see
    :func:`backend.float32_precision`) or at ``precision``, accumulating half precision in
    float32."""
    return jnp.einsum(subscripts, *operands,
                      precision=backend.float32_precision("matmul") if precision is None else precision,
                      preferred_element_type=accumulation_dtype(operands[0].dtype))


def matrix_product(a, b, *, b_transposed: bool = False, precision: lax.Precision | None = None):
    """``a @ b`` for 2-D operands (see :func:`einsum`) whose gradients, on the CPU, are products
    XLA:CPU gives its fast (YNNPACK) matrix kernel. That kernel takes a product only where the
    left operand is contracted on its last axis; JAX's gradient for ``b``, ``a.T @ g``,
    contracts ``a`` on its first and goes to an Eigen kernel. Here that gradient multiplies a
    transposed operand, materialized. ``b_transposed``: ``b`` is a transposed view (F.linear's
    weight), so ``b``'s gradient is computed transposed, ``g.T @ a``, and the view's own
    gradient transposes it back: XLA cancels the two transposes.
    Every product of a program takes this path (linear layers and im2col convolutions alike):
    a program mixing the two kernels runs slower than one using either."""
    if backend.on_cpu() and jnp.issubdtype(a.dtype, jnp.floating):
        return checkpoint_name(_cpu_matrix_product(a, b, b_transposed), MATRIX_PRODUCT_NAME)
    return einsum("ij,jk->ik", a, b, precision=precision)


def _matrix_dot(a, b, contracting, dtype):
    """``lax.dot_general`` of 2-D ``a`` and ``b`` contracting the axes ``contracting``, at full
    precision (it serves the CPU only), accumulating half precision in float32, rounded to
    ``dtype``."""
    product = lax.dot_general(a.astype(dtype), b.astype(dtype), (contracting, ((), ())),
                              precision=lax.Precision.HIGHEST,
                              preferred_element_type=accumulation_dtype(dtype))
    return product.astype(dtype)


def _materialized_transpose(x):
    """``x.T`` as an array of its own: the barrier stops XLA folding the transpose back into the
    product that reads it."""
    return lax.optimization_barrier(x.T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cpu_matrix_product(a, b, b_transposed):
    return einsum("ij,jk->ik", a, b)


def _cpu_matrix_product_fwd(a, b, b_transposed):
    return _cpu_matrix_product(a, b, b_transposed), (a, b)


def _cpu_matrix_product_bwd(b_transposed, residuals, gradient):
    a, b = residuals
    a_gradient = _matrix_dot(gradient, b, ((1,), (1,)), a.dtype)
    if b_transposed:
        b_gradient = _matrix_dot(_materialized_transpose(gradient), a, ((1,), (0,)), b.dtype).T
    else:
        b_gradient = _matrix_dot(_materialized_transpose(a), gradient, ((1,), (0,)), b.dtype)
    return a_gradient, b_gradient


_cpu_matrix_product.defvjp(_cpu_matrix_product_fwd, _cpu_matrix_product_bwd)


def _scaled_sum(bias, product, beta, alpha):
    """``beta * bias + alpha * product``; beta == 0 ignores bias entirely, so NaN or inf in it
    do not propagate (torch's documented addmm/addmv/addbmm semantics), and alpha == 0 the
    product, as torch's CPU kernels do."""
    if alpha == 0:
        product = jnp.zeros_like(product)
    elif alpha != 1:
        product = alpha * product
    if beta == 0:
        return product
    bias = bias.astype(product.dtype)
    return product + (bias if beta == 1 else beta * bias)


def _rows_product(ctx, x, y):
    """``x @ y`` for 2-D ``x``. Where ``x`` is a view of a tensor of higher rank (``F.linear`` on
    N-D inputs decomposes so), its rows are multiplied as that tensor's first dim by the rest:
    the weight's gradient then contracts two dims, which XLA:CPU lays out for its fast matrix
    kernels."""
    first = 1 if ctx.node.target is aten.addmm.default else 0
    node = ctx.node.args[first]
    outer = 1
    if isinstance(node, torch.fx.Node) and node.target is aten.view.default \
            and node.args[0].meta["val"].ndim > 2:
        outer = node.args[0].meta["val"].shape[0]
    return _matrix_product(x, y, outer, _is_transposed_matrix(ctx.node.args[first + 1]))


def _is_transposed_matrix(node) -> bool:
    """Whether graph value ``node`` is a 2-D tensor's transposed view (F.linear's weight)."""
    return isinstance(node, torch.fx.Node) and node.target is aten.permute.default \
        and list(node.args[1]) == [1, 0]


def _matrix_product(x, y, outer: int, y_transposed: bool = False):
    """``x @ y`` with the rows of ``x`` taken as ``outer`` blocks where that divides them
    (see :func:`_rows_product`), else :func:`matrix_product`."""
    rows = x.shape[0]
    if 1 < outer < rows and rows % outer == 0:
        batched = jnp.reshape(x, (outer, rows // outer, x.shape[1]))
        return jnp.reshape(einsum("abj,jk->abk", batched, y), (rows, y.shape[1]))
    return matrix_product(x, y, b_transposed=y_transposed)


def _reordered_rows_product(ctx, index: int, y, finish=lambda product: product):
    """``finish(x @ y)`` for the operand ``x`` at ``ctx.node.args[index]`` (its dims: rows...,
    columns) where ``x`` is an earlier tensor's axes reordered by permutes, with the rows
    multiplied in another order and the product put back in torch's; None where no order is
    better. ``finish`` must act on each row alike (a bias along the columns).

    The order is the one a permute after the product asks for, so that XLA cancels the two
    reorderings (MultiheadAttention's output projection, computed sequence-first and turned
    batch-first); else the source's own order where the columns are its innermost axes, so that
    the rows are read where they lie and only the product is reordered (its input projection).
    """
    traced = axis_order.traced_back(ctx.node.args[index], ctx.value_of)
    if traced is None:
        return None
    source, axes = traced
    product_key = (math.inf,)
    out_axes = axis_order.Axes(axes.sizes + ((product_key, y.shape[-1]),),
                               axes.dims[:-1] + ((product_key,),))
    after = axis_order.downstream_order(ctx.node, out_axes)
    if after is not None:
        axes, out_axes = axes.refined_as(after), out_axes.refined_as(after)
    rows, columns = axis_order.flat(axes.dims[:-1]), list(axes.dims[-1])
    atoms = axes.source_order()
    if after is not None:
        order = [key for key in axis_order.flat(after.dims) if key in rows]
    elif columns and atoms[-len(columns):] == columns:
        order = [key for key in atoms if key in rows]
    else:
        return None
    if order == rows:
        return None
    size = axes.size
    lhs = axis_order.arranged(source, axes, order + columns, (
        axis_order.size_of(axes, order), axis_order.size_of(axes, columns)))
    product = finish(_matrix_product(lhs, y, size(order[0]),
                                     _is_transposed_matrix(ctx.node.args[index + 1])))
    product = jnp.reshape(product, [size(key) for key in order] + [y.shape[-1]])
    product = jnp.transpose(product, [order.index(key) for key in rows] + [len(order)])
    return jnp.reshape(product, ctx.out.shape)


@lowering(aten.mm.default)
def mm(ctx, x, y):
    reordered = _reordered_rows_product(ctx, 0, y)
    return _rows_product(ctx, x, y) if reordered is None else reordered


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
        reordered = _reordered_rows_product(ctx, 0, shared_y)
        return einsum("bij,jk->bik", x, shared_y) if reordered is None else reordered
    shared_x = _repeated_matrix(ctx, 0, x)
    if shared_x is not None:
        return einsum("ij,bjk->bik", shared_x, y)
    split_x, split_y = _batches_split(ctx, 0), _batches_split(ctx, 1)
    if split_x is not None and split_y is not None and split_x.shape[:-2] == split_y.shape[:-2]:
        return jnp.reshape(einsum("...ij,...jk->...ik", split_x, split_y), ctx.out.shape)
    return einsum("bij,bjk->bik", x, y)


def _batches_split(ctx, index: int):
    """The earlier tensor of shape ``(*batches, m, k)``, more than one batch dim, whose batches
    a bmm operand ``(prod(batches), m, k)`` merely merges (attention's ``(batch, heads)``), or
    None. Multiplied with those batch dims, the product needs no reshape between its batch
    forms, which XLA:CPU otherwise carries into every loop over it as extra index arithmetic."""
    node = ctx.node.args[index]
    matrix_shape = tuple(node.meta["val"].shape[1:])
    found = None
    while isinstance(node, torch.fx.Node) and node.target in _BATCH_PRESERVING \
            and tuple(node.meta["val"].shape[-2:]) == matrix_shape:
        source = node.args[0]
        if not isinstance(source, torch.fx.Node) or tuple(source.meta["val"].shape[-2:]) != matrix_shape:
            break
        if node.target is aten.expand.default \
                and tuple(node.meta["val"].shape) != tuple(source.meta["val"].shape):
            break
        if source.meta["val"].ndim > 3:
            found = source
        node = source
    return None if found is None else ctx.value_of(found)


_BATCH_PRESERVING = (aten.view.default, aten.expand.default, aten.clone.default, aten.alias.default)


@lowering(aten.addmm.default)
def addmm(ctx, bias, x, y, beta=1, alpha=1):
    if bias.ndim < 2 or bias.shape[0] == 1:
        reordered = _reordered_rows_product(
            ctx, 1, y, lambda product: _scaled_sum(bias, product, beta, alpha))
        if reordered is not None:
            return reordered
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
