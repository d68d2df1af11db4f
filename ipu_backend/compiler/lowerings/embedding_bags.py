"""``F.embedding_bag`` / ``nn.EmbeddingBag``: the rows of a weight looked up by indices and reduced
per bag (sum, mean or max), without materialising the rows of each bag as torch's eager kernel
does not either. A 2-D input reaches the op flattened, its bags given as offsets; the bags are
data (offsets are a tensor), their count static."""

import jax
import jax.numpy as jnp
import torch

from ipu_backend.compiler.lowerings.views import looked_up_rows
from ipu_backend.compiler.registry import lowering
from ipu_backend.errors import Error

aten = torch.ops.aten
SUM, MEAN, MAX = 0, 1, 2


@lowering(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(ctx, weight, indices, offsets, scale_grad_by_freq=False, mode=SUM, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """Bag ``b`` holds the indices from ``offsets[b]`` to the next offset (the last to the end, or
    with ``include_last_offset`` to the offsets' extra last entry, which torch documents as the
    indices' count). As torch: entries equal to ``padding_idx``
    are left out (of a mean's count too), ``per_sample_weights`` scale the rows of a sum, an empty
    bag gives zeros. ``scale_grad_by_freq`` is refused (see below). An index outside ``[0, rows)`` gives a row of NaN, and the
    call raises as torch does (``index_bounds``). The op's other results (torch's
    bookkeeping for its backward) are zeros: the gradient comes from this function."""
    bags = ctx.out[0].shape[0]
    entries = jnp.arange(indices.shape[0])
    bag = jnp.searchsorted(offsets[:bags], entries, side="right", method="compare_all") - 1
    kept = bag >= 0
    if include_last_offset:
        kept &= entries < offsets[bags]
    if padding_idx >= 0:
        kept &= indices != padding_idx
    if scale_grad_by_freq:
        raise Error("embedding_bag(scale_grad_by_freq=True) is not lowered: torch's CPU kernel divides "
                    "each row's gradient by the count of another row (it does not follow its own "
                    "documentation), so no program can both follow the documentation and equal torch. "
                    "Use scale_grad_by_freq=False, or F.embedding(..., scale_grad_by_freq=True) and reduce the bags")
    rows = looked_up_rows(weight, indices)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None]
    segment = jnp.where(kept, bag, bags)              # left-out entries go to a bag dropped below
    sizes = jax.ops.segment_sum(kept.astype(jnp.int32), segment, num_segments=bags + 1)[:bags]
    if mode == MAX:
        lowest = jnp.array(-jnp.inf, rows.dtype)
        reduced = jax.ops.segment_max(jnp.where(kept[:, None], rows, lowest), segment, num_segments=bags + 1)[:bags]
        reduced = jnp.where((sizes > 0)[:, None], reduced, 0)
    else:
        reduced = jax.ops.segment_sum(rows, segment, num_segments=bags + 1)[:bags]
        if mode == MEAN:
            reduced = reduced / jnp.maximum(sizes, 1)[:, None].astype(rows.dtype)
    bookkeeping = [jnp.zeros(meta.shape, jnp.int32) for meta in ctx.out[1:]]
    return (reduced.astype(weight.dtype), *bookkeeping)
