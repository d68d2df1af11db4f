"""Lowerings: views."""

import jax.numpy as jnp
import torch

from ipu_backend.compiler.registry import lowering

aten = torch.ops.aten


@lowering(aten.permute.default)
def permute(ctx, x, dims):
    return jnp.transpose(x, dims)


@lowering(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def view(ctx, x, shape):
    return jnp.reshape(x, ctx.out.shape)
