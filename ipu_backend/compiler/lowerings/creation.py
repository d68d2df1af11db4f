"""Lowerings: tensor creation and dtype casts (clone, alias and copy live with the views).

Shapes and dtypes come from torch's output (``ctx.out``), so every creation op gets torch's
size and dtype rules (``arange``'s length included) for free.
"""

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ipu_backend.compiler.dtypes import jax_dtype
from ipu_backend.compiler.registry import lowering

aten = torch.ops.aten


def _out_dtype(ctx):
    return jax_dtype(ctx.out.dtype)


def _fill_value(value, dtype):
    """``value`` as ``dtype`` holds it. An integer beyond the carrier's range saturates, so that
    int64 sentinels such as ``torch.iinfo(torch.int64).min`` (int64 is carried as int32) keep
    their meaning of "smallest" or "largest"."""
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return min(max(int(value), int(info.min)), int(info.max))
    return value


@lowering(aten.full.default)
def full(ctx, size, fill_value, **_):
    dtype = _out_dtype(ctx)
    return jnp.full(ctx.out.shape, _fill_value(fill_value, dtype), dtype)


@lowering(aten.full_like.default)
def full_like(ctx, x, fill_value, **_):
    dtype = _out_dtype(ctx)
    return jnp.full(ctx.out.shape, _fill_value(fill_value, dtype), dtype)


@lowering(aten.scalar_tensor.default)
def scalar_tensor(ctx, value, **_):
    dtype = _out_dtype(ctx)
    return jnp.asarray(_fill_value(value, dtype), dtype)


@lowering(aten.empty.memory_format, aten.empty_strided.default, aten.new_empty_strided.default,
          aten.empty_permuted.default)
def empty(ctx, *_, **__):
    """Uninitialized memory in torch; zeros here, so that programs are deterministic."""
    return jnp.zeros(ctx.out.shape, _out_dtype(ctx))


@lowering(aten.arange.start_step)
def arange(ctx, start, end, step=1, **_):
    """torch's values, its length being the output's. An integer dtype truncates start and step
    to integers first, as torch does. A float range with integral start and step is computed
    exactly from an iota; any other is ``start + i * step`` evaluated in float64 and rounded
    once (torch's CPU accumulates in double), as a constant."""
    length, dtype = ctx.out.shape[0], _out_dtype(ctx)
    if jnp.issubdtype(dtype, jnp.integer):
        return int(start) + int(step) * lax.iota(dtype, length)
    if float(start).is_integer() and float(step).is_integer():
        return start + step * lax.iota(jnp.float32, length)
    return jnp.asarray(start + step * np.arange(length, dtype=np.float64), dtype)


def _float_to_int(x, dtype):
    """Truncate toward zero as torch does on x86: NaN, infinities and values beyond the 32-bit
    range become INT32_MIN (x86's "integer indefinite"); narrower types then keep the low bits
    (so -1.0 becomes 255 as uint8, as in torch)."""
    x = x.astype(jnp.float32)
    in_range = (x >= -(2.0 ** 31)) & (x < 2.0 ** 31)
    truncated = jnp.where(in_range, x, 0).astype(jnp.int32)
    return jnp.where(in_range, truncated, jnp.iinfo(jnp.int32).min).astype(dtype)


@lowering(aten._to_copy.default)
def to_copy(ctx, x, **_):
    """A dtype cast (``.to``, ``.float()``, ``.bool()``...); device and layout are ignored."""
    dtype = _out_dtype(ctx)
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(dtype, jnp.integer):
        return _float_to_int(x, dtype)
    return x.astype(dtype)


@lowering(aten._assert_tensor_metadata.default)
def assert_tensor_metadata(ctx, x, *_, **__):
    """``.to`` asserts its input's metadata, which export already checked; nothing to compute."""
    return None
