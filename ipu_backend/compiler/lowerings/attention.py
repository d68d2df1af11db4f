"""Lowering: ``F.scaled_dot_product_attention`` kept whole, as JAX's fused attention.

torch's decomposition of ``aten.scaled_dot_product_attention`` (two batched products, a softmax
and its masks) is what a program gets on the CPU: XLA:CPU fuses it well, with torch's CPU
numbers. Where the op is kept whole at capture (:func:`~ipu_backend.compiler.attention_choice.kept_whole`), it lowers to
``jax.nn.dot_product_attention``: on an NVIDIA GPU, cuDNN's flash attention for float16 and
bfloat16 (forward and backward kernels that never hold the scores in memory), JAX's XLA
implementation elsewhere. The choice is ``lowering_options(attention=...)`` at capture:
``"auto"`` keeps the op whole on a GPU backend for half-precision inputs, ``"fused"`` wherever
the fused form applies (tests use it to check that form on the CPU), ``"decomposed"`` never.

The fused form applies without dropout (JAX's attention has none: a call with ``dropout_p > 0``
is decomposed, with its random mask), with no mask or a boolean one (True takes part, as in
torch), with the query, key and value of one dtype, equal head sizes and batch dims, and the
query's heads a multiple of the key's (grouped-query attention, ``enable_gqa``, each group of
query heads reading one key head, as torch's ``repeat_interleave``). Rows whose every key is
masked give zeros, as torch's do.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ipu_backend.compiler import backend
from ipu_backend.compiler.registry import lowering

aten = torch.ops.aten

def _as_btnh(x):
    """``(*batch, heads, length, size)`` as JAX's ``(batch, length, heads, size)``."""
    return jnp.swapaxes(jnp.reshape(x, (-1,) + x.shape[-3:]), 1, 2)


def _mask_bnts(mask, lead: tuple, heads: int):
    """torch's boolean mask, broadcastable to the scores ``(*lead, heads, length, keys)``, as a
    4-D ``(batch or 1, heads or 1, length, keys)``."""
    length, keys = mask.shape[-2:]
    mask = jnp.reshape(mask, (1,) * (len(lead) + 3 - mask.ndim) + mask.shape)
    if all(size == 1 for size in mask.shape[:len(lead)]):
        lead = (1,) * len(lead)
    mask_heads = 1 if mask.shape[-3] == 1 else heads
    mask = jnp.broadcast_to(mask, lead + (mask_heads,) + mask.shape[-2:])
    return jnp.reshape(mask, (-1, mask_heads) + mask.shape[-2:])


def _fused(query, key, value, mask, is_causal, scale, implementation):
    with jax.default_matmul_precision(backend.float32_precision("matmul").name.lower()):
        return jax.nn.dot_product_attention(query, key, value, mask=mask, is_causal=is_causal,
                                            scale=scale, implementation=implementation)


def _cudnn_or_xla(query, key, value, mask, is_causal, scale):
    """cuDNN's flash attention where JAX offers it for these inputs (an NVIDIA GPU, half
    precision, head sizes it supports), else JAX's XLA attention."""
    if not backend.on_cpu() and query.dtype in (jnp.float16, jnp.bfloat16):
        try:
            return _fused(query, key, value, mask, is_causal, scale, "cudnn")
        except (NotImplementedError, ValueError, RuntimeError):
            # JAX refuses what cuDNN does not support (head size, GPU, no cuDNN) while tracing
            pass
    return _fused(query, key, value, mask, is_causal, scale, "xla")


@lowering(aten.scaled_dot_product_attention.default)
def scaled_dot_product_attention(ctx, query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, *, scale=None, enable_gqa=False):
    if query.ndim == 3:                     # (batch, length, size): one head
        query, key, value = (x[:, None] for x in (query, key, value))
        attn_mask = attn_mask if attn_mask is None or attn_mask.ndim < 3 else attn_mask[:, None]
    lead, heads = query.shape[:-3], query.shape[-3]
    length, keys, size = query.shape[-2], key.shape[-2], query.shape[-1]
    scale = 1.0 / math.sqrt(size) if scale is None else float(scale)
    mask = None
    if attn_mask is not None:
        mask = _mask_bnts(jnp.broadcast_to(attn_mask, attn_mask.shape[:-2] + (length, keys)), lead, heads)
    if is_causal and length != keys:        # torch's causal mask is the top-left triangle
        mask = jnp.asarray(np.tril(np.ones((length, keys), bool)))[None, None]
        is_causal = False
    out = _cudnn_or_xla(_as_btnh(query), _as_btnh(key), _as_btnh(value), mask, is_causal, scale)
    if mask is not None:                    # rows with no key at all give zeros, as torch's
        attended = jnp.swapaxes(jnp.any(mask, axis=-1), 1, 2)[..., None]
        out = jnp.where(attended, out, jnp.zeros((), out.dtype))
    return jnp.reshape(jnp.swapaxes(out, 1, 2), ctx.out.shape)
