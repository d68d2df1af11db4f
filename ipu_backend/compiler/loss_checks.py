"""torch losses whose argument checks are Python ``if``s on tensor values, captured with those
checks as run-time checks.

``F.gaussian_nll_loss`` (behind ``nn.GaussianNLLLoss``) refuses a variance with a negative entry
by testing ``torch.any(var < 0)`` in Python: a compiled program, traced once, cannot take that
branch. While a model is captured, in the capturing thread, a stand-in in ``torch.nn.functional``
computes the documented loss, ``0.5 * (log(max(var, eps)) + (input - target)^2 / max(var, eps))``
(plus ``0.5 * log(2 pi)`` with ``full``), with torch's checks of shapes, reduction and a float
variance made on the host as torch makes them, and the variance's sign as torch's other run-time
data checks are (``_assert_async``: the call raises after it, ``runtime_checks``). The variance is clamped
in place under ``torch.no_grad()``, as torch clamps it, so its gradient passes the clamp.
Anywhere else it is torch's own function.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

_TORCH_GAUSSIAN_NLL_LOSS = F.gaussian_nll_loss
_REDUCTIONS = ("none", "mean", "sum")


def install(capturing: Callable[[], bool]) -> None:
    """Put the stand-in for ``F.gaussian_nll_loss`` in place (once); ``capturing()`` tells
    whether this thread is capturing a model."""
    if F.gaussian_nll_loss is not _TORCH_GAUSSIAN_NLL_LOSS:
        return

    def gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):
        if not capturing():
            return _TORCH_GAUSSIAN_NLL_LOSS(input, target, var, full=full, eps=eps, reduction=reduction)
        return _gaussian_nll_loss(input, target, var, full, eps, reduction)

    gaussian_nll_loss.__doc__ = _TORCH_GAUSSIAN_NLL_LOSS.__doc__
    F.gaussian_nll_loss = gaussian_nll_loss


def _gaussian_nll_loss(input, target, var, full: bool, eps: float, reduction: str) -> torch.Tensor:
    if isinstance(var, float):
        if var < 0:
            raise ValueError("var has negative entry/entries")
        var = torch.full_like(input, var)
    else:
        torch._assert_async(torch.all(var >= 0), "var has negative entry/entries")
    if var.shape != input.shape:
        if var.shape == input.shape[:-1]:               # one variance per row of the last dimension
            var = var.unsqueeze(-1)
        elif var.ndim != input.ndim or sum(v for i, v in zip(input.shape, var.shape) if i != v) != 1:
            raise ValueError("var is of incorrect size")
    if reduction not in _REDUCTIONS:
        raise ValueError(reduction + " is not valid")
    var = var.clone()
    with torch.no_grad():
        var.clamp_(min=eps)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    if reduction == "mean":
        return loss.mean()
    return loss.sum() if reduction == "sum" else loss
