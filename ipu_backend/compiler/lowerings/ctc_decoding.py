"""Lowering: ``poptorch.ctc_beam_search_decoder`` (``compiler/ctc_decoding.py`` defines it) as a
prefix beam search of static shape, one ``lax.scan`` step per time step, vmapped over the batch.

The beams are arrays: ``beam_width`` prefixes of at most ``input_length`` labels (zero padded),
their lengths, and the log probabilities of their frames ending in a blank (``pb``) and in a
label (``pnb``). Each step makes ``beam_width x classes`` candidates: candidate ``(w, c)`` extends
beam ``w`` by class ``c``, and ``(w, blank)`` keeps beam ``w``. Live beams (probability above
zero) hold distinct prefixes, so the only candidates of non-zero probability that share a prefix
are a kept live beam ``v`` and the extension of the beam ``w`` that ``v`` extends by its last
label: that extension is added into ``v``'s candidate and dropped. ``lax.top_k`` (lower index first on ties) picks the next
beams, best first; steps at or past a batch element's length leave its beams as they are.
There is no gradient, as in PopTorch: a loss that depends on the path probabilities raises.
"""

import jax
import jax.numpy as jnp
from jax import lax

from ipu_backend.compiler.ctc_decoding import CTC_BEAM_SEARCH_DECODER
from ipu_backend.compiler.registry import lowering
from ipu_backend.errors import Error


def _initial_beams(input_length: int, beam_width: int):
    """Beam 0 is the empty prefix with probability one; the others have probability zero."""
    labels = jnp.zeros((beam_width, input_length), jnp.int32)
    prefix_lengths = jnp.zeros(beam_width, jnp.int32)
    pb = jnp.full(beam_width, -jnp.inf, jnp.float32).at[0].set(0.0)
    pnb = jnp.full(beam_width, -jnp.inf, jnp.float32)
    return labels, prefix_lengths, pb, pnb


def _step(beams, y, blank: int):
    """The beams after one time step of log probabilities ``y`` ``[classes]``."""
    labels, prefix_lengths, pb, pnb = beams
    beam_width, input_length = labels.shape
    classes = jnp.arange(y.shape[0])
    positions = jnp.arange(input_length)
    total = jnp.logaddexp(pb, pnb)
    has_last = prefix_lengths > 0
    last = jnp.where(has_last, labels[jnp.arange(beam_width), jnp.maximum(prefix_lengths - 1, 0)], -1)

    kept_pb = total + y[blank]
    kept_pnb = jnp.where(has_last, pnb + y[jnp.maximum(last, 0)], -jnp.inf)
    extended_pnb = jnp.where(classes == last[:, None], pb[:, None], total[:, None]) + y  # [w, c]

    # absorbs[v, w]: live beam v is beam w extended by v's last label.
    same_start = jnp.all((labels[:, None, :] == labels[None, :, :])
                         | (positions >= prefix_lengths[None, :, None]), axis=-1)
    absorbs = (total > -jnp.inf)[:, None] & (prefix_lengths[:, None] == prefix_lengths + 1) & same_start
    into_kept = jnp.where(absorbs, extended_pnb[:, jnp.maximum(last, 0)].T, -jnp.inf)
    kept_pnb = jnp.logaddexp(kept_pnb, jax.nn.logsumexp(into_kept, axis=1))
    absorbed = jnp.any(absorbs[:, :, None] & (last[:, None, None] == classes), axis=0)  # [w, c]
    extended_pnb = jnp.where(absorbed | (classes == blank), -jnp.inf, extended_pnb)

    scores = extended_pnb.at[:, blank].set(jnp.logaddexp(kept_pb, kept_pnb))
    _, best = lax.top_k(scores.reshape(-1), beam_width)
    parent, symbol = best // y.shape[0], best % y.shape[0]
    kept = symbol == blank
    parent_length = prefix_lengths[parent]
    written = ~kept[:, None] & (positions == parent_length[:, None])
    return (jnp.where(written, symbol[:, None], labels[parent]),
            parent_length + jnp.where(kept, 0, 1).astype(jnp.int32),
            jnp.where(kept, kept_pb[parent], -jnp.inf),
            jnp.where(kept, kept_pnb[parent], extended_pnb[parent, symbol]))


def _decode(log_probs, length, blank: int, beam_width: int, top_paths: int):
    """Probabilities, lengths and labels of the ``top_paths`` best beams of one batch element
    (``log_probs`` ``[input_length, classes]``)."""
    input_length = log_probs.shape[0]

    def body(beams, frame):
        t, y = frame
        stepped = _step(beams, y, blank)
        return jax.tree_util.tree_map(lambda new, old: jnp.where(t < length, new, old), stepped, beams), None

    beams = _initial_beams(input_length, beam_width)
    (labels, prefix_lengths, pb, pnb), _ = lax.scan(body, beams, (jnp.arange(input_length), log_probs))
    total = jnp.logaddexp(pb, pnb)[:top_paths]
    live = total > -jnp.inf
    return (total, jnp.where(live, prefix_lengths[:top_paths], 0),
            jnp.where(live[:, None], labels[:top_paths], 0))


@lowering(CTC_BEAM_SEARCH_DECODER)
def ctc_beam_search_decoder(ctx, probs, lengths, blank, beam_width, top_paths):
    @jax.custom_vjp
    def decoded(probs, lengths):
        steps = jnp.clip(lengths.astype(jnp.int32), 0, probs.shape[0])
        decode = jax.vmap(lambda x, n: _decode(x, n, blank, beam_width, top_paths), in_axes=(1, 0))
        path_probs, path_lengths, paths = decode(probs.astype(jnp.float32), steps)
        return path_probs.astype(probs.dtype), path_lengths, paths

    def forward(probs, lengths):
        return decoded(probs, lengths), None

    def backward(_, cotangents):
        raise Error("poptorch.ctc_beam_search_decoder has no gradient (as in PopTorch): its path "
                    "probabilities cannot be part of the loss; detach them or decode in an inferenceModel")

    decoded.defvjp(forward, backward)
    return decoded(probs, lengths)
