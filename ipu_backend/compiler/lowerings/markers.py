"""Lowerings: PopTorch's marker ops (``identity_loss``, ``recomputationCheckpoint``, compiler hints)."""

import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ipu_backend.compiler.custom_ops import IDENTITY_LOSS, RECOMPUTATION_CHECKPOINT, RECOMPUTATION_CHECKPOINT_NAME
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


@lowering(RECOMPUTATION_CHECKPOINT)
def recomputation_checkpoint(ctx, x):
    return checkpoint_name(x, RECOMPUTATION_CHECKPOINT_NAME)
