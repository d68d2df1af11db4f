"""Whether the capture keeps a ``scaled_dot_product_attention`` call whole (for the fused
lowering in ``lowerings/attention.py``) or lets torch decompose it: decided at capture, from
``lowering_options(attention=...)``, the backend and the call's arguments."""

import torch

from ipu_backend.compiler import backend
from ipu_backend.compiler.op_arguments import argument
from ipu_backend.compiler.lowering_options import current_options

HALF = (torch.float16, torch.bfloat16)


def kept_whole(query, key, value, *args, **kwargs) -> bool:
    """Whether the capture keeps this ``scaled_dot_product_attention`` call whole (its arguments
    are torch's, the tensors fake ones); else it is decomposed."""
    mode = current_options().attention
    if mode == "decomposed" or (mode == "auto" and (backend.on_cpu() or query.dtype not in HALF)):
        return False
    mask = argument(args, kwargs, 0, "attn_mask", None)
    dropout = argument(args, kwargs, 1, "dropout_p", 0.0)
    gqa = argument(args, kwargs, 4, "enable_gqa", False)
    tensors = (query, key, value)
    if not isinstance(dropout, (int, float)) or dropout != 0 or any(
            not isinstance(t, torch.Tensor) or t.ndim < 3 or t.ndim != query.ndim for t in tensors):
        return False
    if len({t.dtype for t in tensors}) != 1 or not query.dtype.is_floating_point:
        return False
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool):
        return False
    heads = [t.shape[-3] if t.ndim > 3 else 1 for t in tensors]
    batch = [t.shape[:-3] if t.ndim > 3 else t.shape[:-2] for t in tensors]
    return (batch[0] == batch[1] == batch[2]
            and query.shape[-1] == key.shape[-1] == value.shape[-1]
            and key.shape[-2] == value.shape[-2] and heads[1] == heads[2]
            and (heads[0] == heads[1] or (gqa and heads[0] % heads[1] == 0)))
