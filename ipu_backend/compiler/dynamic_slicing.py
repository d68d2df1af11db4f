"""``poptorch.dynamic_slice`` / ``dynamic_update`` as torch custom ops: a slice whose start is a
tensor, read on the device, with a constant size.

As on an IPU, a start the slice would overrun is moved back into range (XLA's and Poplar's
dynamic slices clamp it): the slice always has ``size`` elements. The eager kernels below do the
same, so a model gives the same numbers run as plain torch and compiled.
"""

import torch


def _begin(start: torch.Tensor, length: int, size: int) -> int:
    return min(max(int(start.reshape(-1)[0]), 0), length - size)


def _stepped(dim: int, step: int) -> tuple:
    return (slice(None),) * dim + (slice(None, None, step),)


@torch.library.custom_op("ipu_backend::dynamic_slice", mutates_args=())
def _dynamic_slice(x: torch.Tensor, dim: int, start: torch.Tensor, size: int, step: int) -> torch.Tensor:
    begin = _begin(start, x.shape[dim], size)
    return x.narrow(dim, begin, size)[_stepped(dim, step)].clone()


@_dynamic_slice.register_fake
def _(x, dim, start, size, step):
    shape = list(x.shape)
    shape[dim] = -(-size // step)
    return x.new_empty(shape)


# The eager backward passes read the start only when they run: while a model is captured the
# start has no value, and the compiled program's gradients are JAX's.
def _slice_setup(ctx, inputs, output):
    x, ctx.dim, ctx.start, ctx.size, ctx.step = inputs
    ctx.shape = x.shape


def _slice_backward(ctx, grad):
    grad_x = grad.new_zeros(ctx.shape)
    begin = _begin(ctx.start, ctx.shape[ctx.dim], ctx.size)
    grad_x.narrow(ctx.dim, begin, ctx.size)[_stepped(ctx.dim, ctx.step)] = grad
    return grad_x, None, None, None, None


_dynamic_slice.register_autograd(_slice_backward, setup_context=_slice_setup)


@torch.library.custom_op("ipu_backend::dynamic_update", mutates_args=())
def _dynamic_update(x: torch.Tensor, src: torch.Tensor, dim: int, start: torch.Tensor,
                    size: int) -> torch.Tensor:
    out = x.clone()
    out.narrow(dim, _begin(start, x.shape[dim], size), size).copy_(src)
    return out


@_dynamic_update.register_fake
def _(x, src, dim, start, size):
    return torch.empty_like(x)


def _update_setup(ctx, inputs, output):
    _, _, ctx.dim, ctx.start, ctx.size = inputs


def _update_backward(ctx, grad):
    begin = _begin(ctx.start, grad.shape[ctx.dim], ctx.size)
    grad_x = grad.clone()
    grad_x.narrow(ctx.dim, begin, ctx.size).zero_()
    return grad_x, grad.narrow(ctx.dim, begin, ctx.size), None, None, None


_dynamic_update.register_autograd(_update_backward, setup_context=_update_setup)

DYNAMIC_SLICE = torch.ops.ipu_backend.dynamic_slice.default
DYNAMIC_UPDATE = torch.ops.ipu_backend.dynamic_update.default


def dynamic_slice(x: torch.Tensor, dim: int, start: torch.Tensor, size: int, step: int) -> torch.Tensor:
    return _dynamic_slice(x, dim % x.ndim, start, size, step)


def dynamic_update(x: torch.Tensor, src: torch.Tensor, dim: int, start: torch.Tensor, size: int) -> torch.Tensor:
    return _dynamic_update(x, src, dim % x.ndim, start, size)
