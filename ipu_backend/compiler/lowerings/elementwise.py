"""Lowerings: elementwise."""

import jax.numpy as jnp
import torch

from ipu_backend.compiler.registry import lowering

aten = torch.ops.aten


@lowering(aten.add.Tensor, aten.add.Scalar)
def add(ctx, x, y, alpha=1):
    return x + y * alpha if alpha != 1 else x + y


@lowering(aten.mul.Tensor, aten.mul.Scalar)
def mul(ctx, x, y):
    return x * y


@lowering(aten.relu.default)
def relu(ctx, x):
    return jnp.maximum(x, 0)
