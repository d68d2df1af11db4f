"""Lowerings: PopTorch's marker ops (``identity_loss``, ``recomputationCheckpoint``, compiler
hints), the in-place changes made under ``torch.no_grad()`` (``no_grad_update``) and the values
whose gradient cannot be taken (``unsupported_gradient``)."""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ipu_backend.compiler.custom_ops import (
    IDENTITY_LOSS,
    NO_GRAD_UPDATE,
    RECOMPUTATION_CHECKPOINT,
    RECOMPUTATION_CHECKPOINT_NAME,
    UNSUPPORTED_GRADIENT,
)
from ipu_backend.compiler.hints import HINT
from ipu_backend.compiler.registry import lowering
from ipu_backend.errors import Error


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


@lowering(NO_GRAD_UPDATE)
def no_grad_update(ctx, source, value):
    return _value_with_gradient_of(source, value)


@jax.custom_vjp
def _value_with_gradient_of(source, value):
    """``value`` exactly, its gradient flowing to ``source`` (``value`` takes none)."""
    return value


def _forward(source, value):
    return value, None


def _backward(_, gradient):
    return gradient, jnp.zeros_like(gradient)


_value_with_gradient_of.defvjp(_forward, _backward)


@lowering(UNSUPPORTED_GRADIENT)
def unsupported_gradient(ctx, x, reason):
    @jax.custom_vjp
    def forward_only(value):
        return value

    def refuse(_, gradient):
        raise Error(reason)

    forward_only.defvjp(lambda value: (value, None), refuse)
    return forward_only(x)
