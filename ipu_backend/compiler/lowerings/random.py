"""Lowerings: random."""

import jax.numpy as jnp
import torch

from ipu_backend.compiler.registry import lowering

aten = torch.ops.aten
