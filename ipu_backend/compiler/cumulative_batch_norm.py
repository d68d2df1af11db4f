"""Batch norms with ``momentum=None`` (a cumulative moving average), captured.

In training, torch's batch norm with ``momentum=None`` weighs each batch's statistics by
``1 / num_batches_tracked``, a Python ``float`` of the buffer: a compiled program, traced once,
cannot read it. While a model is captured, in the capturing thread, such a module's forward is a
stand-in that counts ``num_batches_tracked`` up in place, normalizes with the batch's statistics
(``F.batch_norm`` without running statistics) and updates the running mean and the unbiased
running variance under ``torch.no_grad()`` with the weight ``1 / num_batches_tracked`` as a
tensor, as torch's kernel updates them. Every other batch norm, and every one anywhere else, runs
torch's own forward.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

_TORCH_FORWARD = _BatchNorm.forward


def install(capturing: Callable[[], bool]) -> None:
    """Put the stand-in in place (once); ``capturing()`` tells whether this thread is capturing."""
    if _BatchNorm.forward is not _TORCH_FORWARD:
        return

    def forward(self, input):
        if capturing() and self.momentum is None and self.training and self.track_running_stats:
            return _cumulative_forward(self, input)
        return _TORCH_FORWARD(self, input)

    forward.__doc__ = _TORCH_FORWARD.__doc__
    _BatchNorm.forward = forward


def _cumulative_forward(module: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
    module._check_input_dim(input)
    with torch.no_grad():
        module.num_batches_tracked.add_(1)
    output = F.batch_norm(input, None, None, module.weight, module.bias, True, 0.0, module.eps)
    with torch.no_grad():
        dims = [0, *range(2, input.dim())]
        weight = 1.0 / module.num_batches_tracked
        mean = input.mean(dims)
        variance = input.var(dims, correction=1)
        module.running_mean.copy_(weight * mean + (1 - weight) * module.running_mean)
        module.running_var.copy_(weight * variance + (1 - weight) * module.running_var)
    return output
