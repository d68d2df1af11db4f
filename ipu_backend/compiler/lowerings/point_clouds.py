"""Lowerings: ``poptorch.fps`` and ``poptorch.nearest`` (``compiler/point_clouds.py``).

``fps`` samples every segment at once: the segments are laid side by side, padded to the
longest, and one ``lax.fori_loop`` takes one point from each per trip. Distances are torch's:
squared in the points' dtype, summed in float32 for half points. ``nearest`` compares every
pair of points. Neither has a gradient: the points pass through ``lax.stop_gradient``.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_backend.compiler.point_clouds import FPS, NEAREST, sample_counts
from ipu_backend.compiler.registry import lowering

_HALF = (jnp.float16, jnp.bfloat16)


def _sum_of_squares(differences):
    """Squares rounded to the points' dtype, summed as torch sums them (float32 for half)."""
    squares = differences * differences
    if squares.dtype in _HALF:
        return jnp.sum(squares.astype(jnp.float32), axis=-1).astype(squares.dtype)
    return jnp.sum(squares, axis=-1)


@lowering(FPS)
def fps(ctx, src, ptr, ratio, random_start):
    counts = sample_counts(ptr, ratio, ctx.node.args[0].meta["val"].dtype)
    segments = [(begin, end - begin, count)
                for begin, end, count in zip(ptr, ptr[1:], counts) if count > 0]
    if not segments:
        return jnp.zeros((0,), jnp.int32)
    begins, sizes, counts = (np.array(column) for column in zip(*segments))
    longest, most = int(sizes.max()), int(counts.max())
    columns = np.arange(longest)
    rows = begins[:, None] + np.minimum(columns, sizes[:, None] - 1)      # padding repeats a point
    points = lax.stop_gradient(src)[rows]                                 # (segments, longest, D)
    valid = jnp.asarray(columns < sizes[:, None])
    segment = jnp.arange(len(segments))

    def distances_from(picked):
        return _sum_of_squares(points - points[segment, picked][:, None, :])

    def masked(distance):
        return jnp.where(valid, distance, -jnp.inf)

    if random_start:
        first = jax.random.randint(ctx.key(), (len(segments),), 0, jnp.asarray(sizes))
    else:
        first = jnp.zeros((len(segments),), jnp.int32)
    picks = jnp.zeros((len(segments), most), jnp.int32).at[:, 0].set(first)

    def take_farthest(step, state):
        distance, picks = state
        farthest = jnp.argmax(distance, axis=1).astype(jnp.int32)
        return (masked(jnp.minimum(distance, distances_from(farthest))),
                picks.at[:, step].set(farthest))

    _, picks = lax.fori_loop(1, most, take_farthest, (masked(distances_from(first)), picks))
    taken = np.concatenate([segment_index * most + np.arange(count)
                            for segment_index, count in enumerate(counts)])
    return (picks + jnp.asarray(begins, jnp.int32)[:, None]).reshape(-1)[taken]


def _rescaled_with_batches(x, y, batch_x, batch_y):
    """As torch_cluster's CPU ``nearest``: points moved and scaled together into [0, 1], each
    given one more coordinate, ``2 * D * batch``, that keeps other batches' points farther."""
    low = jnp.minimum(x.min(), y.min())
    x, y = x - low, y - low
    high = jnp.maximum(x.max(), y.max())
    x, y = x / high, y / high
    scale = 2 * x.shape[1]
    return (jnp.concatenate([x, scale * batch_x.astype(x.dtype)[:, None]], axis=1),
            jnp.concatenate([y, scale * batch_y.astype(y.dtype)[:, None]], axis=1))


@lowering(NEAREST)
def nearest(ctx, x, y, batch_x, batch_y):
    x, y = lax.stop_gradient(x), lax.stop_gradient(y)
    if batch_x is not None:
        x, y = _rescaled_with_batches(x, y, batch_x, batch_y)
    wide = jnp.float32 if x.dtype in _HALF else x.dtype
    differences = x.astype(wide)[:, None, :] - y.astype(wide)[None, :, :]
    return jnp.argmin(jnp.sum(differences * differences, axis=-1), axis=1)
