"""Lowerings: counting (``bincount``), as torchmetrics' confusion counts use it.

To torch, ``bincount``'s length is data-dependent (``max(x) + 1`` or ``minlength``): torch.export
gives it an unbacked size, reads it back with ``sym_size`` and checks it with Python comparisons
and ``_assert_scalar``. A compiled program has static shapes, so a count has ``minlength`` bins:
values must lie in ``[0, minlength)`` (as torchmetrics' class indices do); those outside are not
counted. The symbolic-size nodes then evaluate to plain ints.
"""

import operator

import jax.numpy as jnp
import torch

from ipu_backend.compiler.dtypes import jax_dtype
from ipu_backend.compiler.registry import lowering
from ipu_backend.errors import Error

aten = torch.ops.aten


@lowering(aten.bincount.default)
def bincount(ctx, x, weights=None, minlength=0):
    if not minlength:
        raise Error("Bincount `minlength` must be specified and must be a constant. On the IPU MK2 "
                    f"platform the minimum length is also the maximum length. (torch.bincount at "
                    f"{ctx.location()}: its length would depend on the data, which a compiled program "
                    "cannot have; pass minlength=<number of bins>; values at or above it are not "
                    "counted.)")
    counts = jnp.zeros((minlength,), jax_dtype(ctx.out.dtype))
    ones = jnp.ones(x.shape, counts.dtype) if weights is None else weights.astype(counts.dtype)
    return counts.at[x].add(ones, mode="drop")


@lowering(aten.sym_size.int)
def sym_size(ctx, x, dim):
    return x.shape[dim]


@lowering(operator.eq, operator.ge, operator.le)
def size_comparison(ctx, a, b):
    return ctx.node.target(a, b)


@lowering(aten._assert_scalar.default)
def assert_scalar(ctx, condition, message):
    if not condition:
        raise Error(f"a size check failed at {ctx.location()}: {message}")
