"""Lowerings: views, shape changes, indexing, gather/scatter, padding, sorting.

Only ops that survive torch's core-ATen decomposition are here. What the usual torch calls
become: reshape/flatten/unflatten/_unsafe_view -> view; transpose/t/movedim/swapaxes ->
permute; expand_as/broadcast_to -> expand; squeeze/unbind -> slice + squeeze.dims;
stack -> cat + view; split/chunk -> split_with_sizes; narrow/tensor_split -> slice;
tile -> repeat; index_add/index_copy/index_fill/``x[idx] = v`` -> index_put; roll ->
index_select; F.pad reflect/replicate -> index; circular -> slice_scatter + copy;
writes into views (``x[:, 1:] = v``, ``x.diagonal().add_(1)``) -> slice_scatter /
diagonal_scatter; detach and no-op views -> alias; argsort -> sort.
"""

import jax
import jax.numpy as jnp
from jax import lax
import torch

from ipu_backend.compiler.dtypes import jax_dtype
from ipu_backend.compiler.registry import lowering
from ipu_backend.errors import Error

aten = torch.ops.aten


def _dim(dim: int, ndim: int) -> int:
    """A torch dim (negative counts from the end; 0-d tensors accept 0 and -1) as 0..ndim-1."""
    return dim % max(ndim, 1)


def _along(dim: int, ndim: int, index) -> tuple:
    """An indexing tuple that applies ``index`` to dimension ``dim`` only."""
    return (slice(None),) * _dim(dim, ndim) + (index,)


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _input_meta(ctx, position: int = 0):
    """torch's fake tensor for the node's tensor argument at ``position``."""
    return ctx.node.args[position].meta["val"]


# --- shape changes and aliases ---------------------------------------------------------------

@lowering(aten.view.default, aten.squeeze.dims, aten.unsqueeze.default)
def reshape_to_torch_shape(ctx, x, *shape_args):
    """Row-major reshape to the shape torch computed (``-1``, dropped and added size-1 dims)."""
    return jnp.reshape(x, ctx.out.shape)


@lowering(aten.permute.default)
def permute(ctx, x, dims):
    return jnp.transpose(x, [_dim(d, x.ndim) for d in dims])


@lowering(aten.expand.default)
def expand(ctx, x, size, implicit=False):
    return jnp.broadcast_to(x, ctx.out.shape)


@lowering(aten.alias.default, aten.clone.default)
def identity(ctx, x, memory_format=None):
    """Memory formats and aliasing are layouts of one value; JAX arrays have no layout."""
    return x


@lowering(aten.detach.default)
def detach(ctx, x):
    """The value, with no gradient through it (torch's ``detach``)."""
    return lax.stop_gradient(x)


@lowering(aten.view.dtype)
def view_dtype(ctx, x, dtype):
    """Reinterpret the bits, as torch does: the last dim scales by the ratio of item sizes."""
    source = _input_meta(ctx).dtype
    if {source, dtype} & {torch.int64, torch.float64, torch.bool}:
        raise Error(f"x.view({dtype}) of a {source} tensor at {ctx.location()} reinterprets the "
                    "bits of a type emulated IPUs do not hold as torch does (64-bit types are "
                    "carried as 32-bit); use x.to(dtype) to convert values instead")
    if source.itemsize < dtype.itemsize:
        x = jnp.reshape(x, x.shape[:-1] + (-1, dtype.itemsize // source.itemsize))
    return jnp.reshape(lax.bitcast_convert_type(x, jax_dtype(dtype)), ctx.out.shape)


@lowering(aten.repeat.default)
def repeat(ctx, x, repeats):
    return jnp.tile(x, repeats)


@lowering(aten.flip.default)
def flip(ctx, x, dims):
    return jnp.flip(x, [_dim(d, x.ndim) for d in dims]) if dims else x


@lowering(aten.cat.default)
def cat(ctx, tensors, dim=0):
    """Concatenate in torch's result dtype. Like torch, 1-d empty tensors are skipped whatever
    the rank of the others (a legacy torch allowance)."""
    dtype = jax_dtype(ctx.out.dtype)
    parts = [t.astype(dtype) for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not parts:
        return jnp.zeros(ctx.out.shape, dtype)
    return jnp.concatenate(parts, axis=_dim(dim, parts[0].ndim))


@lowering(aten.split_with_sizes.default)
def split_with_sizes(ctx, x, split_sizes, dim=0):
    dim = _dim(dim, x.ndim)
    starts = [sum(split_sizes[:i]) for i in range(len(split_sizes))]
    return [lax.slice_in_dim(x, start, start + size, axis=dim)
            for start, size in zip(starts, split_sizes)]


@lowering(aten.slice.Tensor)
def slice_tensor(ctx, x, dim=0, start=None, end=None, step=1):
    """Python slice semantics, as torch: negative bounds wrap, out-of-range bounds clamp."""
    return x[_along(dim, x.ndim, slice(start, end, step))]


@lowering(aten.select.int)
def select(ctx, x, dim, index):
    """A static slice. Where every user of ``x`` selects along the same dim (``unbind``, or
    MultiheadAttention's q, k, v taken from one projection), they share one split of ``x``, so
    the gradient is one concatenation rather than a zero-padded copy of ``x`` per select."""
    dim = _dim(dim, x.ndim)
    index = index % x.shape[dim]
    if not _unbound(ctx.node.args[0], dim):
        return lax.index_in_dim(x, index, axis=dim, keepdims=False)
    parts = ctx.once(("unbind", ctx.node.args[0], dim),
                     lambda: lax.split(x, (1,) * x.shape[dim], axis=dim))
    return jnp.squeeze(parts[index], dim)


def _unbound(source, dim: int) -> bool:
    """Whether ``source`` is only read by ``select`` nodes along ``dim``, more than one."""
    users = list(source.users)
    ndim = source.meta["val"].ndim
    return len(users) > 1 and all(
        user.target is aten.select.int and user.args[0] is source and _dim(user.args[1], ndim) == dim
        for user in users)


@lowering(aten.diagonal.default)
def diagonal(ctx, x, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(x, offset, _dim(dim1, x.ndim), _dim(dim2, x.ndim))


@lowering(aten.unfold.default)
def unfold(ctx, x, dimension, size, step):
    """Windows of ``size`` every ``step`` along ``dimension``; the window is the new last dim."""
    if x.ndim == 0:
        return jnp.reshape(x, ctx.out.shape)
    dim = _dim(dimension, x.ndim)
    count = ctx.out.shape[dim]
    windows = jnp.arange(count)[:, None] * step + jnp.arange(size)[None, :]
    return jnp.moveaxis(jnp.take(x, windows, axis=dim), dim + 1, -1)


@lowering(aten.constant_pad_nd.default)
def constant_pad_nd(ctx, x, pad, value=0):
    """``pad`` lists (before, after) pairs from the last dim backwards; negative entries crop."""
    pairs = [(0, 0)] * (x.ndim - len(pad) // 2)
    pairs += [(pad[2 * i], pad[2 * i + 1]) for i in reversed(range(len(pad) // 2))]
    return lax.pad(x, jnp.asarray(value, x.dtype), [(low, high, 0) for low, high in pairs])


# --- writes into views (functionalized in-place updates) ---------------------------------------

@lowering(aten.copy.default)
def copy(ctx, x, src, non_blocking=False):
    """``x.copy_(src)`` as a value: ``src`` broadcast to x's shape, in x's dtype."""
    return jnp.broadcast_to(src.astype(x.dtype), x.shape)


@lowering(aten.slice_scatter.default)
def slice_scatter(ctx, x, src, dim=0, start=None, end=None, step=1):
    return x.at[_along(dim, x.ndim, slice(start, end, step))].set(src.astype(x.dtype))


@lowering(aten.diagonal_scatter.default)
def diagonal_scatter(ctx, x, src, offset=0, dim1=0, dim2=1):
    dim1, dim2 = _dim(dim1, x.ndim), _dim(dim2, x.ndim)
    moved = jnp.moveaxis(x, (dim1, dim2), (-2, -1))
    steps = jnp.arange(src.shape[-1])
    rows, cols = steps + max(-offset, 0), steps + max(offset, 0)
    moved = moved.at[..., rows, cols].set(src.astype(x.dtype))
    return jnp.moveaxis(moved, (-2, -1), (dim1, dim2))


# --- advanced indexing -----------------------------------------------------------------------

def _is_mask(index) -> bool:
    return index is not None and index.dtype in (jnp.bool_, jnp.uint8)


def _integer_index(indices) -> tuple:
    """aten's index list (None: the whole dim) as a JAX indexing tuple; numpy's rules for where
    the broadcast index dims go are torch's."""
    return tuple(slice(None) if i is None else i for i in indices)


def boolean_mask_error(location: str) -> Error:
    """``x[mask]`` keeps as many elements as the mask has True values: a shape known only from
    the data, which a compiled program cannot have."""
    return Error(f"x[mask] with a boolean mask (aten.index.Tensor) at {location} gives a tensor "
                 "whose size depends on the data, which a compiled IPU program cannot hold. Keep "
                 "the shape fixed instead: torch.where(mask, x, 0) or x.masked_fill(~mask, 0), "
                 "then reduce (a masked mean is that sum over mask.sum()); or take a fixed number "
                 "of elements with torch.topk or torch.gather")


@lowering(aten.index.Tensor)
def index(ctx, x, indices):
    """Integer advanced indexing (compilation rejects boolean masks before tracing; a mask can
    still arrive here from a graph evaluated without that check)."""
    if any(_is_mask(i) for i in indices):
        raise boolean_mask_error(ctx.location())
    return x[_integer_index(indices)]


@lowering(aten.index_put.default)
def index_put(ctx, x, indices, values, accumulate=False):
    return put_values(x, indices, values, accumulate, ctx.location)


def put_values(x, indices, values, accumulate: bool, location):
    """``x[indices] = values`` (or ``+=`` with accumulate, where duplicate indices sum);
    ``location()`` names the source line in an error."""
    values = values.astype(x.dtype)
    if any(_is_mask(i) for i in indices):
        return _masked_put(location, x, indices, values, accumulate)
    target = x.at[_integer_index(indices)]
    return target.add(values) if accumulate else target.set(values)


def _masked_put(location, x, indices, values, accumulate):
    """``x[..., mask, ...] = values`` without a data-dependent shape: the k-th True position
    of the mask (row-major) takes ``values``' k-th row along the masked dim, or its only row
    when that dim broadcasts."""
    masks = [i for i in indices if _is_mask(i)]
    if len(masks) > 1 or any(i is not None and not _is_mask(i) for i in indices):
        raise Error(f"x[index] = value at {location()} combines a boolean mask with other "
                    "index tensors; use one mask (combine masks with &), or torch.where")
    mask = masks[0].astype(bool)
    before = next(p for p, i in enumerate(indices) if i is not None)
    after = x.shape[before + mask.ndim:]
    rows = values.shape[-len(after) - 1] if values.ndim > len(after) else 1
    values = jnp.broadcast_to(values, x.shape[:before] + (rows,) + after)
    rank = jnp.reshape(jnp.cumsum(mask.reshape(-1)) - 1, mask.shape)
    spread = jnp.take(values, jnp.clip(rank, 0, rows - 1), axis=before)
    where = jnp.reshape(mask, (1,) * before + mask.shape + (1,) * len(after))
    return jnp.where(where, x + spread if accumulate else spread, x)


@lowering(aten.index_select.default)
def index_select(ctx, x, dim, index):
    if x.ndim == 0:
        return jnp.reshape(x, ctx.out.shape)
    return jnp.take(x, jnp.reshape(index, -1), axis=_dim(dim, x.ndim))


@lowering(aten.masked_scatter.default)
def masked_scatter(ctx, x, mask, source):
    """The k-th True position of the (broadcast) mask, row-major, takes ``source``'s k-th
    element."""
    x = jnp.broadcast_to(x, ctx.out.shape)
    mask = jnp.broadcast_to(mask, ctx.out.shape)
    if source.size == 0:
        return x
    rank = jnp.reshape(jnp.cumsum(mask.reshape(-1)) - 1, mask.shape)
    taken = jnp.take(source.reshape(-1), jnp.clip(rank, 0, source.size - 1)).astype(x.dtype)
    return jnp.where(mask, taken, x)


def looked_up_rows(weight, indices):
    """The rows of ``weight`` at ``indices``; an index outside ``[0, rows)``, negative ones
    included, reads a row of NaN (and the call raises as torch does: ``index_bounds``)."""
    return jnp.take(weight, jnp.where(indices < 0, weight.shape[0], indices), axis=0, mode="fill")


@lowering(aten.embedding.default)
def embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """Rows of ``weight``. As torch, rows looked up at ``padding_idx`` pass no gradient, and
    with ``scale_grad_by_freq`` each row's gradient is divided by its count in ``indices``. An
    index outside ``[0, rows)``, negative ones included, gives a row of NaN, and the call raises
    as torch does (``index_bounds``)."""
    rows = looked_up_rows(weight, indices)
    if scale_grad_by_freq:
        counts = jnp.zeros(weight.shape[0], weight.dtype).at[indices].add(1)
        scale = (1 / counts[indices])[..., None]
        rows = lax.stop_gradient(rows) + (rows - lax.stop_gradient(rows)) * scale
    if padding_idx >= 0:
        rows = jnp.where((indices == padding_idx)[..., None], lax.stop_gradient(rows), rows)
    return rows


@lowering(aten.repeat_interleave.Tensor)
def repeat_interleave(ctx, repeats, output_size=None):
    """``i`` repeated ``repeats[i]`` times. The length must be static: ``output_size`` gives it."""
    if not isinstance(ctx.out.shape[0], int):
        raise Error(f"torch.repeat_interleave at {ctx.location()} repeats by a tensor without output_size: "
                    "the result's length would be the sum of the repeats' values, which a compiled program "
                    "cannot have. Pass output_size=<the sum of repeats>")
    return jnp.repeat(jnp.arange(repeats.shape[0]), repeats, total_repeat_length=ctx.out.shape[0])


# --- gather and scatter along a dim ------------------------------------------------------------

def scatter_positions(index, dim: int) -> tuple:
    """Where gather reads and scatter writes: for each element of ``index``, its own position
    with the coordinate along ``dim`` replaced by its value."""
    dim = _dim(dim, index.ndim)
    return tuple(index if d == dim else lax.broadcasted_iota(jnp.int32, index.shape, d)
                 for d in range(index.ndim))


def scatter_updates(src, index, dtype):
    """The part of ``src`` a scatter uses (``src`` may be larger than ``index``), or a scalar."""
    if isinstance(src, jnp.ndarray):
        return src[tuple(slice(0, n) for n in index.shape)].astype(dtype)
    return jnp.asarray(src, dtype)


COMPARISON_GATHER_LIMIT = 1024
"""Gathers reading at most this many elements of ``x`` per output row (``x.size(dim)`` times
``index.size(dim)``) compare instead of index: see :func:`_gather_by_comparison`."""


@lowering(aten.gather.default)
def gather(ctx, x, dim, index, sparse_grad=False):
    if x.ndim and x.dtype != jnp.bool_:
        dim = _dim(dim, x.ndim)
        if x.shape[dim] * index.shape[dim] <= COMPARISON_GATHER_LIMIT:
            return _gather_by_comparison(x, dim, index)
    return x[scatter_positions(index, dim)]


def _gather_by_comparison(x, dim: int, index):
    """``gather`` along a short ``dim`` (a loss picking each sample's class) as a sum over that
    dim of ``x`` where the position equals the index: one elementwise-and-reduce pass that XLA
    fuses with its neighbours, and whose gradient is a select rather than a scatter into zeros.
    On XLA:CPU an index gather and its scatter gradient are separate kernels of a few
    microseconds each, which is most of a small model's step. The sum has one term, so it is
    exact (an out-of-range index, an error in torch, gives 0 here)."""
    x = x[tuple(slice(None) if d == dim else slice(0, n) for d, n in enumerate(index.shape))]
    choices_shape = (1,) * (dim + 1) + (x.shape[dim],) + (1,) * (x.ndim - dim - 1)
    choices = lax.broadcasted_iota(index.dtype, choices_shape, dim + 1)
    chosen = jnp.expand_dims(index, dim + 1) == choices
    return jnp.sum(jnp.where(chosen, jnp.expand_dims(x, dim), 0), axis=dim + 1, dtype=x.dtype)


@lowering(aten.scatter.src, aten.scatter.value)
def scatter(ctx, x, dim, index, src):
    return x.at[scatter_positions(index, dim)].set(scatter_updates(src, index, x.dtype))


@lowering(aten.scatter_add.default)
def scatter_add(ctx, x, dim, index, src):
    return x.at[scatter_positions(index, dim)].add(scatter_updates(src, index, x.dtype))


@lowering(aten.scatter.reduce, aten.scatter.value_reduce)
def scatter_with_reduce(ctx, x, dim, index, src, reduce):
    """The deprecated ``scatter(..., reduce="add"|"multiply")`` (torch has no gradient for it)."""
    target = x.at[scatter_positions(index, dim)]
    updates = scatter_updates(src, index, x.dtype)
    return target.add(updates) if reduce == "add" else target.multiply(updates)


def _reduce_identity(reduce: str, dtype):
    if reduce in ("sum", "mean"):
        return jnp.zeros((), dtype)
    if reduce == "prod":
        return jnp.ones((), dtype)
    info = jnp.finfo(dtype) if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype)
    extreme = (-jnp.inf, info.min) if reduce == "amax" else (jnp.inf, info.max)
    return jnp.asarray(extreme[0] if jnp.issubdtype(dtype, jnp.inexact) else extreme[1], dtype)


def scatter_reduced(x, src, positions, reduce, include_self):
    """scatter_reduce's value (no gradient rule of its own for prod/amax/amin)."""
    if not include_self:
        x = x.at[positions].set(_reduce_identity(reduce, x.dtype))
    target = x.at[positions]
    return {"sum": target.add, "mean": target.add, "prod": target.multiply,
            "amax": target.max, "amin": target.min}[reduce](src)


@lowering(aten.scatter_reduce.two)
def scatter_reduce(ctx, x, dim, index, src, reduce, include_self=True):
    positions = scatter_positions(index, dim)
    src = scatter_updates(src, index, x.dtype)
    if reduce == "mean":
        return _scatter_mean(x, src, positions, include_self)
    if reduce in ("prod", "amax", "amin") and _is_float(x):
        return _scatter_with_torch_gradient(x, src, positions, reduce, include_self)
    return scatter_reduced(x, src, positions, reduce, include_self)


@lowering(aten.index_reduce.default)
def index_reduce(ctx, x, dim, index, source, reduce, include_self=True):
    """``x.index_reduce_(dim, index, source, reduce)``: the ``i``-th slice of ``source`` along
    ``dim`` reduced into slice ``index[i]`` of ``x``, i.e. ``scatter_reduce`` with the index
    spread over ``source``'s shape (its values and gradients, torch's for index_reduce too)."""
    if x.ndim == 0:
        return scatter_reduce(ctx, x, 0, index, source, reduce, include_self)
    dim = _dim(dim, x.ndim)
    along = [1] * source.ndim
    along[dim] = -1
    return scatter_reduce(ctx, x, dim, jnp.broadcast_to(index.reshape(along), source.shape), source, reduce,
                          include_self)


def _scatter_mean(x, src, positions, include_self):
    """Sum over the contributions over their count; integers floor-divide, as torch."""
    total = scatter_reduced(x, src, positions, "sum", include_self)
    count = jnp.full(x.shape, int(include_self), x.dtype).at[positions].add(jnp.ones((), x.dtype))
    count = jnp.maximum(count, jnp.ones((), x.dtype))
    return total / count if _is_float(x) else jnp.floor_divide(total, count)


def _scatter_with_torch_gradient(x, src, positions, reduce, include_self):
    """prod/amax/amin with torch's derivatives: for amax/amin the gradient is shared equally by
    every contribution equal to the result (self counted in that share even when include_self
    is False); for prod each contribution gets the product of the others. Without include_self
    the scattered-to positions of ``x`` get none."""

    @jax.custom_jvp
    def reduced(x, src):
        return scatter_reduced(x, src, positions, reduce, include_self)

    @reduced.defjvp
    def reduced_jvp(primals, tangents):
        x, src = primals
        result = reduced(x, src)
        weight_self, weight_src = (_prod_weights if reduce == "prod" else _extremum_weights)(
            x, src, result, positions, include_self)
        if not include_self:
            weight_self = weight_self.at[positions].set(0)
        x_dot, src_dot = tangents
        return result, weight_self * x_dot + jnp.zeros_like(x).at[positions].add(weight_src * src_dot)

    return reduced(x, src)


def _extremum_weights(x, src, result, positions, include_self):
    self_is_result = (x == result).astype(x.dtype)
    src_is_result = (src == result[positions]).astype(x.dtype)
    share = self_is_result.at[positions].add(src_is_result)
    return self_is_result / share, src_is_result / share[positions]


def _prod_weights(x, src, result, positions, include_self):
    """Products of the other contributions, dividing out nonzero ones and recomputing the
    product without a zero where there is exactly one (torch's formula)."""
    nonzero_self = jnp.where(x == 0, 1, x)
    weight_self = scatter_reduced(nonzero_self, src, positions, "prod", include_self) / nonzero_self
    src_zero = src == 0
    zeros_at_target = jnp.zeros(x.shape, jnp.int32).at[positions].add(src_zero.astype(jnp.int32))
    single_zero = src_zero & (zeros_at_target[positions] == 1)
    without_zero = scatter_reduced(x, jnp.where(single_zero, 1, src), positions, "prod", include_self)
    weight_src = jnp.where(single_zero, without_zero[positions],
                           result[positions] / jnp.where(src_zero, 1, src))
    return weight_self, weight_src


# --- sorting ---------------------------------------------------------------------------------

def _sort_keys(x, descending: bool) -> tuple:
    """Keys whose stable ascending order is torch's order: NaN above every number, -0.0 equal
    to 0.0, and descending as ascending on order-reversed keys."""
    if _is_float(x):
        nan = jnp.isnan(x)
        number = jnp.where(nan | (x == 0), jnp.zeros((), x.dtype), -x if descending else x)
        return (jnp.logical_xor(nan, descending).astype(jnp.uint8), number)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    return (~x if descending else x,)


def _stable_sort(x, dim: int, descending: bool):
    """(values, indices) along ``dim``; equal elements keep their order, as torch's stable sort."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    dim = _dim(dim, x.ndim)
    keys = _sort_keys(x, descending)
    order = lax.broadcasted_iota(jnp.int32, x.shape, dim)
    indices = lax.sort((*keys, order), dimension=dim, is_stable=True, num_keys=len(keys))[-1]
    return jnp.take_along_axis(x, indices, axis=dim), indices


@lowering(aten.sort.default)
def sort(ctx, x, dim=-1, descending=False):
    """Stable. torch's default sort leaves the order of equal elements unspecified (its CPU
    kernel is stable on rows of up to 16 elements, introsort beyond); values always agree."""
    return _stable_sort(x, dim, descending)


@lowering(aten.sort.stable)
def sort_stable(ctx, x, *, stable=None, dim=-1, descending=False):
    return _stable_sort(x, dim, descending)


@lowering(aten.topk.default)
def topk(ctx, x, k, dim=-1, largest=True, sorted=True):
    """The first ``k`` of a stable sort (NaN counts as largest, as torch), always sorted.
    torch's CPU topk orders equal elements, and everything when sorted=False, as its partial
    sort leaves them (unspecified); here equal elements come lowest index first."""
    values, indices = _stable_sort(x, dim, descending=largest)
    if x.ndim == 0:
        return values, indices
    dim = _dim(dim, x.ndim)
    return lax.slice_in_dim(values, 0, k, axis=dim), lax.slice_in_dim(indices, 0, k, axis=dim)


@lowering(aten.kthvalue.default)
def kthvalue(ctx, x, k, dim=-1, keepdim=False):
    """The ``k``-th smallest along ``dim`` (1-based) and its index, from a stable sort: of equal
    elements the lowest index (torch's CPU kernel leaves which one unspecified)."""
    values, indices = _stable_sort(x, dim, descending=False)
    if x.ndim == 0:
        return values, indices
    dim = _dim(dim, x.ndim)
    return tuple(lax.index_in_dim(a, k - 1, axis=dim, keepdims=keepdim) for a in (values, indices))


@lowering(aten.searchsorted.Tensor)
def searchsorted(ctx, sorted_sequence, values, *, out_int32=False, right=False, side=None, sorter=None):
    """For each value, where it would go in ``sorted_sequence``'s last axis to keep it sorted:
    before equal entries (``side="left"``) or after them (``right=True`` / ``side="right"``).
    A 1-D sequence serves every value; otherwise its leading axes match the values' ones."""
    if sorter is not None:
        sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter, axis=-1)
    return _torch_binary_search(sorted_sequence, values, right=(side or ("right" if right else "left")) == "right")


@lowering(aten.bucketize.Tensor)
def bucketize(ctx, x, boundaries, *, out_int32=False, right=False):
    """The bucket of each element of ``x`` (any shape, 0-d too) among the 1-D ``boundaries``."""
    return _torch_binary_search(boundaries, x, right=right)


def _torch_binary_search(sequence, values, right: bool):
    """torch's binary search, probe for probe, compared in the promoted dtype: the first position
    whose entry is not below (``right``: not at or below) the value. So a NaN value goes past
    the end, and a sequence that is not sorted gives torch's answer too (its result is the
    probes', not a count of smaller entries)."""
    dtype = jnp.promote_types(sequence.dtype, values.dtype)
    sequence, values = sequence.astype(dtype), values.astype(dtype)
    n = sequence.shape[-1]
    start = jnp.zeros(values.shape, jnp.int32)
    end = jnp.full(values.shape, n, jnp.int32)
    for _ in range(n.bit_length()):          # each probe at least halves every open range
        open_range = start < end
        mid = start + (end - start) // 2
        probe = sequence[jnp.minimum(mid, n - 1)] if sequence.ndim == 1 else \
            jnp.take_along_axis(sequence, jnp.minimum(mid, n - 1), axis=-1)
        after = ~(probe > values) if right else ~(probe >= values)
        start = jnp.where(open_range & after, mid + 1, start)
        end = jnp.where(open_range & ~after, mid, end)
    return start
