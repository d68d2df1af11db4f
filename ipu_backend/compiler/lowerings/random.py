"""Lowerings: random sampling and dropout.

Every draw comes from the node's own key (``ctx.key()``): deterministic for a given program key,
different from node to node. Values cannot equal torch's generator; distributions, shapes and
dtypes (``ctx.out``) do. Where torch treats a sampler as not differentiable in its parameters
(``normal``'s mean and std, ``bernoulli``'s probabilities: torch returns zero gradients), the
parameters pass through ``lax.stop_gradient`` so that JAX's gradients are torch's zeros too.
A ``generator`` argument cannot be honoured: the program's key drives all sampling.
"""

import jax
import jax.numpy as jnp
from jax import lax
import torch

from ipu_backend.compiler.dtypes import jax_dtype
from ipu_backend.compiler.registry import lowering

aten = torch.ops.aten


def _out_dtype(ctx):
    return jax_dtype(ctx.out.dtype)


def _opmath_dtype(dtype):
    """float32 for float16/bfloat16 (torch's CPU samplers compute in it), else ``dtype``."""
    return jnp.float32 if dtype in (jnp.float16, jnp.bfloat16) else dtype


def _uniform(ctx, low=0.0, high=1.0):
    """Uniform in ``[low, high)`` of torch's output shape, drawn in the output's float dtype."""
    return jax.random.uniform(ctx.key(), ctx.out.shape, _out_dtype(ctx), low, high)


def _standard_normal(ctx):
    """Standard normal draws of the output shape, in float32 (half-precision inverse CDFs lose
    the tails) for the interpreter to cast to the output dtype."""
    return jax.random.normal(ctx.key(), ctx.out.shape, jnp.float32)


@lowering(aten.rand.default, aten.rand.generator, aten.rand_like.default)
def rand(ctx, *args, **kwargs):
    return _uniform(ctx)


@lowering(aten.randn.default, aten.randn.generator, aten.randn_like.default)
def randn(ctx, *args, **kwargs):
    return _standard_normal(ctx)


def _randint(ctx, low, high):
    """Integers in ``[low, high)``, cast by the interpreter to torch's dtype (int64 or float)."""
    return jax.random.randint(ctx.key(), ctx.out.shape, low, high, jnp.int32)


@lowering(aten.randint.default)
def randint(ctx, high, size, **kwargs):
    return _randint(ctx, 0, high)


@lowering(aten.randint.low)
def randint_low(ctx, low, high, size, **kwargs):
    return _randint(ctx, low, high)


@lowering(aten.randint_like.default)
def randint_like(ctx, x, high, **kwargs):
    return _randint(ctx, 0, high)


@lowering(aten.randint_like.low_dtype)
def randint_like_low(ctx, x, low, high, **kwargs):
    return _randint(ctx, low, high)


@lowering(aten.uniform.default)
def uniform(ctx, x, low=0.0, high=1.0, generator=None):
    """``tensor.uniform_(low, high)``: ``x`` only gives shape and dtype."""
    return _uniform(ctx, low, high)


def _normal(ctx, mean, std):
    """``mean + std * z``; tensor parameters get no gradient, as in torch."""
    mean, std = lax.stop_gradient(mean), lax.stop_gradient(std)
    return mean + std * _standard_normal(ctx)


@lowering(aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor)
def normal(ctx, mean, std=1.0, generator=None):
    return _normal(ctx, mean, std)


@lowering(aten.normal.float_float)
def normal_float_float(ctx, mean, std, size, **kwargs):
    return _normal(ctx, mean, std)


@lowering(aten.normal_functional.default)
def normal_functional(ctx, x, mean=0.0, std=1.0, generator=None):
    """``tensor.normal_(mean, std)``: ``x`` only gives shape and dtype."""
    return _normal(ctx, mean, std)


@lowering(aten.exponential.default)
def exponential(ctx, x, rate=1.0, generator=None):
    """``tensor.exponential_(rate)`` (used by ``F.gumbel_softmax``): density ``rate * exp(-rate * v)``."""
    return jax.random.exponential(ctx.key(), ctx.out.shape, jnp.float32) / rate


@lowering(aten.bernoulli.p)
def bernoulli(ctx, x, p=0.5, generator=None):
    """1 with probability ``p``, else 0, in ``x``'s dtype."""
    return jax.random.uniform(ctx.key(), ctx.out.shape, jnp.float32) < p


@lowering(aten.bernoulli.Tensor)
def bernoulli_tensor(ctx, x, p, generator=None):
    """1 with probability ``p`` (broadcast to ``x``'s shape) per element, else 0."""
    p = lax.stop_gradient(p).astype(jnp.float32)
    return jax.random.uniform(ctx.key(), ctx.out.shape, jnp.float32) < p


@lowering(aten.native_dropout.default)
def native_dropout(ctx, x, p, train):
    """``(output, keep mask)``; torch drops only when ``train`` is False (None means train).

    torch forms ``x * mask * scale`` with ``scale = 1 / (1 - p)`` (0 for ``p == 1``), in float32
    for half inputs: kept elements become ``x * scale``, dropped ones ``x * 0`` (NaN for NaN or
    infinite ``x``, -0 for negative ``x``). Written as a select of those two products because XLA
    turns a product with a converted bool into a select that loses the NaN. JAX's gradient is
    then ``scale`` or 0 times the incoming one, torch's ``grad * mask * scale``.
    """
    if train is False:
        return x, jnp.ones(x.shape, jnp.bool_)
    keep = jax.random.uniform(ctx.key(), x.shape, jnp.float32) < 1.0 - p
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    wide = x.astype(_opmath_dtype(x.dtype))
    output = jnp.where(keep, wide * jnp.asarray(scale, wide.dtype), wide * jnp.asarray(0.0, wide.dtype))
    return output.astype(x.dtype), keep


@lowering(aten.rrelu_with_noise_functional.default)
def rrelu_with_noise(ctx, x, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    """Randomized leaky ReLU: ``(output, noise)``.

    Training: each element ``<= 0`` is multiplied by a slope drawn uniformly from
    ``[lower, upper)`` and the slopes (1 for positive elements) are the new noise; otherwise a
    leaky ReLU with slope ``(lower + upper) / 2`` that leaves ``noise`` as it was.
    """
    wide = x.astype(_opmath_dtype(x.dtype))
    if not training:
        return jnp.where(wide > 0, wide, wide * ((lower + upper) / 2)), noise
    slopes = jax.random.uniform(ctx.key(), x.shape, wide.dtype, lower, upper)
    slopes = jnp.where(wide <= 0, slopes, jnp.ones_like(slopes))
    return wide * slopes, slopes


@lowering(aten.randperm.default)
def randperm(ctx, n, **kwargs):
    return jax.random.permutation(ctx.key(), n).astype(jnp.int32)


@lowering(aten.multinomial.default)
def multinomial(ctx, weights, num_samples, replacement=False, generator=None):
    """Category indices drawn in proportion to the (unnormalized) ``weights`` of the last dim.

    Without replacement this is the Gumbel top-k trick: the ``num_samples`` largest
    ``log(weight) + Gumbel noise`` are a draw of distinct categories, in order. torch rejects
    asking for more samples than there are non-zero weights; a traced program cannot, and then
    fills the surplus with zero-weight categories.
    """
    logits = jnp.log(lax.stop_gradient(weights).astype(jnp.float32))
    key = ctx.key()
    if replacement:
        draws = jax.random.categorical(key, logits, axis=-1, shape=(num_samples,) + logits.shape[:-1])
        return jnp.moveaxis(draws, 0, -1)
    perturbed = logits + jax.random.gumbel(key, logits.shape, jnp.float32)
    return lax.top_k(perturbed, num_samples)[1]
