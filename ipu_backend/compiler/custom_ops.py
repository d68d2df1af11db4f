"""PopTorch's marker ops as torch custom ops, so that torch.export keeps them in the graph, and
the annotation a captured node carries of its block."""

import torch

from ipu_backend.errors import Error

REDUCTIONS = ("sum", "mean", "none")


def _reduce(x: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "sum":
        return x.sum()
    if reduction == "mean":
        return x.mean()
    return x.clone()


@torch.library.custom_op("ipu_backend::identity_loss", mutates_args=())
def _identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    return _reduce(x, reduction)


@_identity_loss.register_fake
def _(x, reduction):
    return x.new_empty(x.shape if reduction == "none" else ())


def _identity_loss_backward(ctx, grad):
    if ctx.reduction == "sum":
        return grad.expand(ctx.shape), None
    if ctx.reduction == "mean":
        return (grad / max(1, torch.Size(ctx.shape).numel())).expand(ctx.shape), None
    return grad, None


def _identity_loss_setup(ctx, inputs, output):
    ctx.shape, ctx.reduction = inputs[0].shape, inputs[1]


_identity_loss.register_autograd(_identity_loss_backward, setup_context=_identity_loss_setup)


def identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mark ``x`` (reduced by ``"sum"``, ``"mean"`` or ``"none"``) as the loss to minimise, as PopTorch."""
    if reduction not in REDUCTIONS:
        raise Error(f"identity_loss: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return _identity_loss(x, reduction)


IDENTITY_LOSS = torch.ops.ipu_backend.identity_loss.default


BLOCK_KEY = "ipu_block"
"""``node.meta["custom"][BLOCK_KEY]``: ``(user_id, ipu_id)`` of the block a captured node was
recorded in, or None when it was recorded outside every block (``ipu_backend.blocks`` sets it)."""

RECOMPUTATION_CHECKPOINT_NAME = "ipu_recomputation_checkpoint"
"""The name ``jax.ad_checkpoint.checkpoint_name`` gives checkpointed values in stage programs."""


@torch.library.custom_op("ipu_backend::recomputation_checkpoint", mutates_args=())
def recomputation_checkpoint(x: torch.Tensor) -> torch.Tensor:
    """A value a recomputed stage keeps between its forward and backward passes."""
    return x.clone()


@recomputation_checkpoint.register_fake
def _(x):
    return torch.empty_like(x)


recomputation_checkpoint.register_autograd(lambda ctx, grad: grad)
RECOMPUTATION_CHECKPOINT = torch.ops.ipu_backend.recomputation_checkpoint.default


@torch.library.custom_op("ipu_backend::no_grad_update", mutates_args=())
def _no_grad_update(source: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return value.clone()


@_no_grad_update.register_fake
def _(source, value):
    return torch.empty_like(value)


_no_grad_update.register_autograd(lambda ctx, grad: (grad, None))
NO_GRAD_UPDATE = torch.ops.ipu_backend.no_grad_update.default
"""``no_grad_update(source, value)``: ``value``, a tensor's new contents after an in-place change
made under ``torch.no_grad()``, whose gradient flows to ``source``, the tensor before the change:
torch records no operation for the change, so the tensor keeps its history (``clone`` then
``clamp_`` under ``no_grad`` passes the gradient through unchanged, as ``F.gaussian_nll_loss``
relies on)."""


@torch.library.custom_op("ipu_backend::unsupported_gradient", mutates_args=())
def _unsupported_gradient(x: torch.Tensor, reason: str) -> torch.Tensor:
    return x.clone()


@_unsupported_gradient.register_fake
def _(x, reason):
    return torch.empty_like(x)


UNSUPPORTED_GRADIENT = torch.ops.ipu_backend.unsupported_gradient.default
"""``unsupported_gradient(x, reason)``: ``x``, whose gradient the compiled program cannot compute
as torch would (the output of a ``torch.autograd.Function`` with a backward of its own): the
forward runs, and differentiating the program through it raises ``reason``."""
