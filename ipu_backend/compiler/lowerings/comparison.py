"""Lowerings: comparisons, ``where`` and logical ops."""

import math

import jax.numpy as jnp
import torch

from ipu_backend.compiler.dtypes import jax_dtype
from ipu_backend.compiler.lowerings.reductions import softmax_values
from ipu_backend.compiler.registry import lowering

aten = torch.ops.aten


def _promoted_operands(ctx, x, y):
    """Both operands in the dtype torch compares in: their promotion, where a Python number only
    sets the category (so an int tensor compares with 2.5 as float, a float16 one with 0.1 in
    float16)."""
    metas = [arg.meta["val"] if isinstance(arg, torch.fx.Node) else arg for arg in ctx.node.args[:2]]
    dtype = jax_dtype(torch.result_type(*metas))
    return jnp.asarray(x, dtype), jnp.asarray(y, dtype)


def _comparison(fn):
    def rule(ctx, x, y):
        return fn(*_promoted_operands(ctx, x, y))
    rule.__name__ = rule.__qualname__ = fn.__name__
    return rule


for _ops, _fn in {
    (aten.eq.Tensor, aten.eq.Scalar): jnp.equal,
    (aten.ne.Tensor, aten.ne.Scalar): jnp.not_equal,
    (aten.lt.Tensor, aten.lt.Scalar): jnp.less,
    (aten.le.Tensor, aten.le.Scalar): jnp.less_equal,
    (aten.gt.Tensor, aten.gt.Scalar): jnp.greater,
    (aten.ge.Tensor, aten.ge.Scalar): jnp.greater_equal,
}.items():
    lowering(*_ops)(_comparison(_fn))


@lowering(aten.where.self)
def where(ctx, condition, x, y):
    dtype = jax_dtype(ctx.out.dtype)
    softmax_input = _safe_softmax_input(ctx.node)
    if softmax_input is not None and ctx.value_of(softmax_input[0]) is not None:
        return softmax_values(ctx.value_of(softmax_input[0]), softmax_input[1], dtype,
                              all_minus_inf_rows_to_zero=True)
    return jnp.where(condition, jnp.asarray(x, dtype), jnp.asarray(y, dtype))


def _safe_softmax_input(node):
    """``(scores node, dim)`` where ``node`` is torch's ``_safe_softmax`` decomposed (attention's
    softmax): ``where(~any(scores != -inf, dim), 0, softmax(scores, dim))``; else None. Lowered
    as one softmax whose all -inf rows are zero, the where's inputs are left unused."""
    condition, zeros, values = node.args

    def call(arg, op):
        return isinstance(arg, torch.fx.Node) and arg.target is op

    if not (call(values, aten._softmax.default) and call(zeros, aten.full_like.default)
            and zeros.args[1] == 0 and call(condition, aten.logical_not.default)):
        return None
    scores, dim = values.args[:2]
    found = condition.args[0]
    if not (call(found, aten.any.dim) and call(found.args[0], aten.logical_not.default)):
        return None
    finite = found.args[0].args[0]
    ndim = scores.meta["val"].ndim
    if not (call(finite, aten.eq.Scalar) and finite.args[0] is scores
            and finite.args[1] == -math.inf and found.args[1] % ndim == dim % ndim):
        return None
    return scores, dim


def _truth(x):
    """Nonzero (NaN included) is true, as in torch."""
    return x if x.dtype == jnp.bool_ else x != 0


@lowering(aten.logical_and.default)
def logical_and(ctx, x, y):
    return _truth(x) & _truth(y)


@lowering(aten.logical_or.default)
def logical_or(ctx, x, y):
    return _truth(x) | _truth(y)


@lowering(aten.logical_xor.default)
def logical_xor(ctx, x, y):
    return _truth(x) ^ _truth(y)


@lowering(aten.logical_not.default)
def logical_not(ctx, x):
    return ~_truth(x)
