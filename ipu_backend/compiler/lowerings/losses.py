"""Lowerings: losses.

With torch's core-ATen decompositions every torch.nn.functional loss in everyday use
(cross_entropy with class indices or probabilities, weight, ignore_index and label_smoothing;
nll_loss; mse, l1, smooth_l1 and huber; binary_cross_entropy with and without logits; kl_div; and
the margin, soft-margin, Poisson and cosine-embedding losses) becomes log_softmax, gather, where,
reductions and elementwise ops, lowered by their own families. tests/compiler/test_ops_losses.py
checks those compositions against torch.

The CTC loss is captured whole (``compiler/fused_losses.py``) and lowered here: the forward
(alpha) recursion of Graves et al. in log space, one ``lax.scan`` step per time step. Its
gradient is torch's: torch's CTC backward returns ``exp(log_probs)`` minus the alignment
occupancy, which is the gradient of the loss with respect to the logits when ``log_probs`` is a
``log_softmax``; with respect to ``log_probs`` itself the true gradient lacks the first term.
The custom VJP adds it to JAX's gradient of the recursion, so that training follows torch
whatever produced ``log_probs``.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ipu_backend.compiler.fused_losses import CTC_LOSS
from ipu_backend.compiler.registry import lowering

_NEG_INF = -np.inf


def _logsumexp(*terms):
    """log(sum(exp(terms))), -inf where every term is -inf, with gradients free of NaN there
    (states no alignment reaches)."""
    stacked = jnp.stack(terms)
    top = jax.lax.stop_gradient(jnp.max(stacked, axis=0))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    total = jnp.sum(jnp.exp(stacked - top), axis=0)
    reached = total > 0
    return jnp.where(reached, top + jnp.log(jnp.where(reached, total, 1.0)), _NEG_INF)


def _padded_targets(targets, target_lengths):
    """Targets as ``[N, S]`` rows: given so, or cut from torch's concatenated 1-D form."""
    if targets.ndim == 2:
        return targets
    total = max(targets.shape[0], 1)
    starts = jnp.cumsum(target_lengths) - target_lengths
    positions = jnp.clip(starts[:, None] + jnp.arange(total)[None, :], 0, targets.shape[0] - 1)
    return targets[positions] if targets.shape[0] else jnp.zeros((len(target_lengths), 1), targets.dtype)


def _negative_log_likelihood(log_probs, labels, skip, input_lengths, target_lengths):
    """-log p(target | input) of each sample; ``labels`` the extended label sequences
    ``[N, 2S+1]`` (blanks around each target), ``skip`` where the transition from two states
    back is allowed."""
    steps = log_probs.shape[0]
    emissions = jnp.take_along_axis(
        log_probs, jnp.broadcast_to(labels[None], (steps,) + labels.shape), axis=2)   # [T, N, 2S+1]
    states = jnp.arange(labels.shape[1])
    alpha = jnp.where(states[None, :] <= 1, emissions[0], _NEG_INF)
    neg = jnp.full((labels.shape[0], 1), _NEG_INF, log_probs.dtype)

    def step(alpha, inputs):
        emission, t = inputs
        one_back = jnp.concatenate([neg, alpha[:, :-1]], axis=1)
        two_back = jnp.where(skip, jnp.concatenate([neg, neg, alpha[:, :-2]], axis=1), _NEG_INF)
        advanced = emission + _logsumexp(alpha, one_back, two_back)
        return jnp.where((t < input_lengths)[:, None], advanced, alpha), None

    alpha, _ = jax.lax.scan(step, alpha, (emissions[1:], jnp.arange(1, steps)))
    last = (2 * target_lengths)[:, None]
    end_blank = jnp.take_along_axis(alpha, last, axis=1)[:, 0]
    end_label = jnp.where(target_lengths > 0,
                          jnp.take_along_axis(alpha, jnp.maximum(last - 1, 0), axis=1)[:, 0], _NEG_INF)
    return -_logsumexp(end_blank, end_label)


def _torch_ctc(log_probs, labels, skip, input_lengths, target_lengths):
    """Each sample's negative log-likelihood, with torch's gradient (see the module docstring)."""
    def plain(log_probs):
        return _negative_log_likelihood(log_probs, labels, skip, input_lengths, target_lengths)

    def forward(log_probs):
        value, pullback = jax.vjp(plain, log_probs)
        return value, (pullback, log_probs, value)

    def backward(residuals, cotangent):
        pullback, log_probs, value = residuals
        (grad,) = pullback(cotangent)
        within = (jnp.arange(log_probs.shape[0])[:, None] < input_lengths[None, :])[:, :, None]
        grad = grad + jnp.where(within, jnp.exp(log_probs) * cotangent[None, :, None], 0.0)
        # torch's formula gives NaN where no alignment exists (an infinite loss) and the
        # gradient is asked for; zero_infinity has zeroed those losses' cotangents
        impossible = jnp.isinf(value)[None, :, None] & within & (cotangent != 0)[None, :, None]
        return (jnp.where(impossible, jnp.nan, grad),)

    nll = jax.custom_vjp(plain)
    nll.defvjp(forward, backward)
    return nll(log_probs)


@lowering(CTC_LOSS)
def ctc_loss(ctx, log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity):
    batched = log_probs.ndim == 3
    if not batched:
        log_probs, targets = log_probs[:, None], targets[None]
        input_lengths, target_lengths = jnp.reshape(input_lengths, (1,)), jnp.reshape(target_lengths, (1,))
    input_lengths, target_lengths = input_lengths.astype(jnp.int32), target_lengths.astype(jnp.int32)
    padded = _padded_targets(targets, target_lengths).astype(jnp.int32)
    labels = jnp.full((padded.shape[0], 2 * padded.shape[1] + 1), blank, jnp.int32)
    labels = labels.at[:, 1::2].set(jnp.clip(padded, 0, log_probs.shape[2] - 1))
    two_back = jnp.pad(labels, ((0, 0), (2, 0)), constant_values=blank)[:, :-2]
    skip = (labels != blank) & (labels != two_back)
    losses = _torch_ctc(log_probs, labels, skip, input_lengths, target_lengths)
    if zero_infinity:
        losses = jnp.where(jnp.isinf(losses), 0.0, losses)
    if reduction == "mean":
        return jnp.mean(losses / jnp.maximum(target_lengths, 1).astype(losses.dtype))
    if reduction == "sum":
        return jnp.sum(losses)
    return losses if batched else losses[0]
