"""torch losses captured whole, as custom ops, where torch.export cannot trace their ATen form.

``torch.ctc_loss`` (behind ``F.ctc_loss`` and ``nn.CTCLoss``) runs ``aten._ctc_loss``, whose
second output's shape depends on the target lengths' values: torch.export refuses it. The first
capture puts a stand-in for ``torch.ctc_loss`` in torch's namespace (a module attribute, so that
capturing costs nothing per op, as a torch function mode would): while a model is captured, in
the capturing thread, it records one ``ipu_backend::ctc_loss`` op of static shape, lowered in
``lowerings/losses.py``; anywhere else it is torch's own function.
"""

from collections.abc import Callable

import torch

_REDUCTIONS = ("none", "mean", "sum")          # torch's at::Reduction codes, as torch.ctc_loss takes them


@torch.library.custom_op("ipu_backend::ctc_loss", mutates_args=())
def _ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
              target_lengths: torch.Tensor, blank: int, reduction: str, zero_infinity: bool) -> torch.Tensor:
    return _TORCH_CTC_LOSS(log_probs, targets, input_lengths, target_lengths, blank,
                           _REDUCTIONS.index(reduction), zero_infinity)


@_ctc_loss.register_fake
def _(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity):
    batched = log_probs.dim() == 3
    return log_probs.new_empty((log_probs.shape[1],) if reduction == "none" and batched else ())


CTC_LOSS = torch.ops.ipu_backend.ctc_loss.default
_TORCH_CTC_LOSS = torch.ctc_loss


def _lengths(lengths) -> torch.Tensor:
    return lengths if isinstance(lengths, torch.Tensor) else torch.as_tensor(lengths, dtype=torch.long)


def install(capturing: Callable[[], bool]) -> None:
    """Put the stand-in for ``torch.ctc_loss`` in place (once); ``capturing()`` tells whether
    this thread is capturing a model."""
    if torch.ctc_loss is not _TORCH_CTC_LOSS:
        return

    def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1,
                 zero_infinity=False):
        if not capturing():
            return _TORCH_CTC_LOSS(log_probs, targets, input_lengths, target_lengths, blank, reduction,
                                   zero_infinity)
        return _ctc_loss(log_probs, targets, _lengths(input_lengths), _lengths(target_lengths), blank,
                         _REDUCTIONS[reduction], zero_infinity)

    ctc_loss.__doc__ = _TORCH_CTC_LOSS.__doc__
    torch.ctc_loss = ctc_loss
