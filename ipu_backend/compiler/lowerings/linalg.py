"""Lowerings: linalg."""

import jax.numpy as jnp
import torch

from ipu_backend.compiler.registry import lowering

aten = torch.ops.aten


@lowering(aten.addmm.default)
def addmm(ctx, bias, x, y, beta=1, alpha=1):
    return beta * bias + alpha * (x @ y) if (beta, alpha) != (1, 1) else bias + x @ y
