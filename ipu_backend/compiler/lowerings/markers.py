"""Lowerings: PopTorch's marker ops (``identity_loss``, compiler hints)."""

import jax.numpy as jnp

from ipu_backend.compiler.custom_ops import IDENTITY_LOSS
from ipu_backend.compiler.hints import HINT
from ipu_backend.compiler.registry import lowering


@lowering(IDENTITY_LOSS)
def identity_loss(ctx, x, reduction):
    if reduction == "sum":
        return jnp.sum(x)
    if reduction == "mean":
        return jnp.mean(x)
    return x


@lowering(HINT)
def hint(ctx, x, kind, value):
    """A Poplar planning hint (``compiler/hints.py``): the value itself."""
    return x
