"""Lowerings: normalization (batch, layer, group and instance norm after decomposition).

Each rule follows torch's CPU kernels: statistics are computed in float32 for half-precision
inputs (torch's opmath type), the biased variance normalizes, and the output is formed the way
the kernel forms it (a per-channel scale and shift applied to ``x``) so that results agree to
the last few bits rather than only mathematically. Gradients come from JAX autodiff of these
forms, which equal torch's analytic backward formulas.
"""

import jax.numpy as jnp
from jax import lax
import torch

from ipu_backend.compiler.registry import lowering

aten = torch.ops.aten


def _opmath(x):
    """``x`` in the precision torch computes it in: float32 for float16/bfloat16."""
    if x is not None and x.dtype in (jnp.float16, jnp.bfloat16):
        return x.astype(jnp.float32)
    return x


def _per_channel(values, ndim: int):
    """A per-channel vector ``(C,)`` shaped to broadcast against ``(N, C, *)`` input."""
    return values.reshape((1, -1) + (1,) * (ndim - 2))


def _moments(x, axes):
    """Mean and biased variance over ``axes``, kept as size-1 dims."""
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    return mean, var


def _batch_norm_apply(x, mean, rstd, weight, bias):
    """torch's transform: ``alpha = rstd * weight``, ``beta = bias - mean * alpha``, ``x * alpha + beta``."""
    alpha = rstd if weight is None else rstd * _opmath(weight)
    beta = -mean * alpha if bias is None else _opmath(bias) - mean * alpha
    return _opmath(x) * _per_channel(alpha, x.ndim) + _per_channel(beta, x.ndim)


def _batch_norm_with_batch_stats(x, weight, bias, eps):
    """Normalize with this batch's statistics: ``(out, mean, rstd, biased var)``."""
    mean, var = _moments(_opmath(x), (0,) + tuple(range(2, x.ndim)))
    mean, var = mean.reshape(-1), var.reshape(-1)
    rstd = lax.rsqrt(var + eps)
    return _batch_norm_apply(x, mean, rstd, weight, bias), mean, rstd, var


def _batch_norm_with_running_stats(x, weight, bias, running_mean, running_var, eps):
    rstd = lax.rsqrt(_opmath(running_var) + eps)
    return _batch_norm_apply(x, _opmath(running_mean), rstd, weight, bias)


def _no_saved_stats(ctx):
    """The empty ``save_mean``/``save_rstd`` torch returns when it normalizes with running stats."""
    return tuple(jnp.zeros(ctx.out[i].shape, jnp.float32) for i in (1, 2))


@lowering(aten._native_batch_norm_legit_functional.default)
def batch_norm_functional(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    """Returns ``(out, save_mean, save_rstd, new running_mean, new running_var)``.

    In training the running variance moves towards the *unbiased* batch variance (``n / (n - 1)``
    times the biased one that normalizes), as torch does.
    """
    if not training:
        out = _batch_norm_with_running_stats(x, weight, bias, running_mean, running_var, eps)
        return (out, *_no_saved_stats(ctx), running_mean, running_var)
    out, mean, rstd, var = _batch_norm_with_batch_stats(x, weight, bias, eps)
    count = x.size // x.shape[1]
    unbiased_var = var * count / (count - 1)
    new_mean = (1 - momentum) * _opmath(running_mean) + momentum * mean
    new_var = (1 - momentum) * _opmath(running_var) + momentum * unbiased_var
    return out, mean, rstd, new_mean, new_var


@lowering(aten._native_batch_norm_legit_no_training.default)
def batch_norm_inference(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
    out = _batch_norm_with_running_stats(x, weight, bias, running_mean, running_var, eps)
    return (out, *_no_saved_stats(ctx))


@lowering(aten._native_batch_norm_legit.no_stats)
def batch_norm_without_running_stats(ctx, x, weight, bias, training, momentum, eps):
    """Batch statistics always (BatchNorm without running stats, InstanceNorm), whatever ``training``."""
    out, mean, rstd, _ = _batch_norm_with_batch_stats(x, weight, bias, eps)
    return out, mean, rstd


@lowering(aten.native_layer_norm.default)
def layer_norm(ctx, x, normalized_shape, weight, bias, eps):
    """Returns ``(out, mean, rstd)``, statistics shaped ``x.shape[:axis] + (1,) * len(normalized_shape)``.

    torch's kernel forms ``(x * rstd - mean * rstd) * weight + bias``.
    """
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf = _opmath(x)
    mean, var = _moments(xf, axes)
    rstd = lax.rsqrt(var + eps)
    out = xf * rstd + (-mean * rstd)
    if weight is not None:
        out = out * _opmath(weight)
    if bias is not None:
        out = out + _opmath(bias)
    return out, mean, rstd


@lowering(aten.native_group_norm.default)
def group_norm(ctx, x, weight, bias, batch, channels, spatial, groups, eps):
    """Returns ``(out, mean, rstd)`` with statistics of shape ``(N, groups)``.

    torch's kernel folds weight and bias into a per-(sample, channel) ``scale = rstd * weight``
    and ``shift = bias - mean * scale``, then forms ``x * scale + shift``.
    """
    xf = _opmath(x)
    grouped = xf.reshape(batch, groups, -1)
    mean, var = _moments(grouped, (2,))
    rstd = lax.rsqrt(var + eps)
    per_group = channels // groups
    scale = jnp.repeat(rstd[:, :, 0], per_group, axis=1)
    if weight is not None:
        scale = scale * _opmath(weight)
    shift = -scale * jnp.repeat(mean[:, :, 0], per_group, axis=1)
    if bias is not None:
        shift = shift + _opmath(bias)
    channel_shape = (batch, channels) + (1,) * (x.ndim - 2)
    out = xf * scale.reshape(channel_shape) + shift.reshape(channel_shape)
    return out, mean[:, :, 0], rstd[:, :, 0]
