"""Lowerings: ``poptorch.dynamic_slice`` / ``dynamic_update`` (``compiler/dynamic_slicing.py``)
as XLA's dynamic slices, whose start is clamped into range as on an IPU."""

import jax.numpy as jnp
from jax import lax

from ipu_backend.compiler.dynamic_slicing import DYNAMIC_SLICE, DYNAMIC_UPDATE
from ipu_backend.compiler.registry import lowering


def _start(start):
    return jnp.reshape(start, (-1,))[0]


@lowering(DYNAMIC_SLICE)
def dynamic_slice(ctx, x, dim, start, size, step):
    window = lax.dynamic_slice_in_dim(x, _start(start), size, axis=dim)
    return lax.slice_in_dim(window, 0, size, stride=step, axis=dim)


@lowering(DYNAMIC_UPDATE)
def dynamic_update(ctx, x, src, dim, start, size):
    return lax.dynamic_update_slice_in_dim(x, src.astype(x.dtype), _start(start), axis=dim)
