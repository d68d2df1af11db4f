"""``nn.Transformer``'s modules, captured as torch eager computes them.

**Causal masks.** Given an attention mask but no ``is_causal``, torch's encoder and decoder test
whether the mask is the causal one (``_detect_is_causal_mask``, a Python ``bool`` of tensor data),
only to hand attention the hint instead of the mask: the same numbers. While a model is captured
the test answers no, and attention applies the mask itself.

**Padded positions.** In eval mode, given a ``src_key_padding_mask`` whose padding is at the end of each sequence and
not recording gradients (under ``torch.no_grad()``, or with nothing requiring them), torch eager
runs the encoder's layers on a nested tensor of the real tokens, pads the result with zeros and
then applies the encoder's final norm: padded positions come out as zeros (or the norm's bias).
torch.export takes the other path, which computes them like any position. While a model is
captured, such an encoder zeroes them after its layers and before its norm, where the mask's
padding is at the end of every row: a test of the data, as torch makes it at each call.

Whether the program records gradients is the executor's (:func:`recording_gradients`): an
inference program is compared with torch under ``no_grad``, as PopTorch's and Lightning's
evaluation run.
"""

import contextlib
import contextvars
from collections.abc import Callable

import torch
from torch.nn import TransformerEncoder
from torch.nn.modules import transformer

_TORCH_FORWARD = TransformerEncoder.forward
_TORCH_DETECT = transformer._detect_is_causal_mask
_RECORDS_GRADIENTS = contextvars.ContextVar("ipu_backend_records_gradients", default=True)


@contextlib.contextmanager
def recording_gradients(records: bool):
    """Within: the program being captured records gradients (a training program) or not."""
    token = _RECORDS_GRADIENTS.set(records)
    try:
        yield
    finally:
        _RECORDS_GRADIENTS.reset(token)


def install(capturing: Callable[[], bool]) -> None:
    """Put the stand-ins in place (once); ``capturing()`` tells whether this thread is capturing."""
    if TransformerEncoder.forward is not _TORCH_FORWARD:
        return

    def detect_is_causal_mask(mask, is_causal=None, size=None):
        if capturing() and is_causal is None and mask is not None:
            return False
        return _TORCH_DETECT(mask, is_causal, size)

    transformer._detect_is_causal_mask = detect_is_causal_mask

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        if capturing() and _pads_with_zeros(self, src, mask, src_key_padding_mask):
            return _zero_padded_forward(self, src, src_key_padding_mask, is_causal)
        return _TORCH_FORWARD(self, src, mask, src_key_padding_mask, is_causal)

    forward.__doc__ = _TORCH_FORWARD.__doc__
    TransformerEncoder.forward = forward


def _pads_with_zeros(encoder, src, mask, padding_mask) -> bool:
    """torch's choice of the nested-tensor path, but for the mask's alignment (a test of data)."""
    first = encoder.layers[0]
    if not (torch.backends.mha.get_fastpath_enabled() and getattr(encoder, "use_nested_tensor", False)
            and not first.training and src.dim() == 3 and padding_mask is not None and mask is None
            and not src.is_nested and not torch.is_autocast_enabled()):
        return False
    weights = (first.self_attn.in_proj_weight, first.self_attn.in_proj_bias, first.self_attn.out_proj.weight,
               first.self_attn.out_proj.bias, first.norm1.weight, first.norm1.bias, first.norm2.weight,
               first.norm2.bias, first.linear1.weight, first.linear1.bias, first.linear2.weight, first.linear2.bias)
    return not (_RECORDS_GRADIENTS.get() and any(t.requires_grad for t in (src, *weights)))


def _zero_padded_forward(encoder, src, padding_mask, is_causal):
    norm = encoder.norm              # a module, or a plain None
    if norm is not None:
        encoder._modules["norm"] = None
    try:
        output = _TORCH_FORWARD(encoder, src, None, padding_mask, is_causal)
    finally:
        if norm is not None:
            encoder._modules["norm"] = norm
    kept = padding_mask.logical_not()
    padded = ~kept[..., None]
    if getattr(encoder, "mask_check", True):
        counts = kept.sum(dim=1, keepdim=True)
        positions = torch.arange(kept.shape[1], device=kept.device)
        padded = padded & torch.eq(kept, positions < counts).all()     # every row's padding at its end
    output = output.masked_fill(padded, 0)
    return output if norm is None else norm(output)
