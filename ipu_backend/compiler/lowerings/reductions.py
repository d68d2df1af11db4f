"""Lowerings: reductions, scans, vector norms and the softmax family.

Half-precision inputs are accumulated in float32 and rounded once at the end, as torch's CPU
kernels do (a float16 sum of 4000 ones is 4000, not 2048).
"""

import functools
import math

import jax
import jax.numpy as jnp
import torch

from ipu_backend.compiler import backend
from ipu_backend.compiler.dtypes import jax_dtype
from ipu_backend.compiler.registry import lowering

aten = torch.ops.aten

_HALF = (jnp.float16, jnp.bfloat16)


def _axes(dim, ndim: int) -> tuple:
    """torch's ``dim`` argument as sorted non-negative axes; None or ``[]`` mean every axis.

    A 0-d tensor accepts dim 0 or -1 and reduces over nothing."""
    if ndim == 0:
        return ()
    if dim is None:
        dims = range(ndim)
    elif isinstance(dim, int):
        dims = (dim,)
    else:
        dims = dim or range(ndim)
    return tuple(sorted({d % ndim for d in dims}))


def _widen(x):
    """float16/bfloat16 carried as float32 while accumulating."""
    return x.astype(jnp.float32) if x.dtype in _HALF else x


def _accumulate_as(x, out_dtype):
    """``x`` as torch feeds a reduction whose output dtype is ``out_dtype``: each element cast to
    that dtype first (``sum(x, dtype=int32)`` truncates every element), then widened."""
    return _widen(x.astype(out_dtype))


def _out_dtype(ctx, index: int | None = None):
    meta = ctx.out if index is None else ctx.out[index]
    return jax_dtype(meta.dtype)


@lowering(aten.sum.dim_IntList)
def sum_(ctx, x, dim=None, keepdim=False, *, dtype=None):
    out = _out_dtype(ctx)
    return jnp.sum(_accumulate_as(x, out), axis=_axes(dim, x.ndim), keepdims=keepdim).astype(out)


@lowering(aten.mean.default, aten.mean.dim)
def mean(ctx, x, dim=None, keepdim=False, *, dtype=None):
    out = _out_dtype(ctx)
    return jnp.mean(_accumulate_as(x, out), axis=_axes(dim, x.ndim), keepdims=keepdim).astype(out)


@lowering(aten.prod.default, aten.prod.dim_int)
def prod(ctx, x, dim=None, keepdim=False, *, dtype=None):
    out = _out_dtype(ctx)
    return jnp.prod(_accumulate_as(x, out), axis=_axes(dim, x.ndim), keepdims=keepdim).astype(out)


def _split_among_ties(choose):
    """An amax/amin whose gradient torch's way: ``grad * (x == result) / count``, the product
    taken before the division so that a NaN result (no element equal, count 0) gives NaN
    gradients for the whole slice even where XLA turns the product into a select."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
    def reduce(x, axes, keepdim):
        return choose(x, axis=axes, keepdims=keepdim)

    def forward(x, axes, keepdim):
        result = choose(x, axis=axes, keepdims=True)
        return (result if keepdim else jnp.squeeze(result, axes)), (x, result)

    def backward(axes, keepdim, residuals, grad):
        x, result = residuals
        grad = grad if keepdim else jnp.expand_dims(grad, axes)
        chosen = (x == result).astype(grad.dtype)
        return (grad * chosen / jnp.sum(chosen, axis=axes, keepdims=True),)

    reduce.defvjp(forward, backward)
    return reduce


_amax = _split_among_ties(jnp.max)
_amin = _split_among_ties(jnp.min)


@lowering(aten.amax.default)
def amax(ctx, x, dim=(), keepdim=False):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.max(x, axis=_axes(dim, x.ndim), keepdims=keepdim)
    return _amax(x, _axes(dim, x.ndim), keepdim)


@lowering(aten.amin.default)
def amin(ctx, x, dim=(), keepdim=False):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.min(x, axis=_axes(dim, x.ndim), keepdims=keepdim)
    return _amin(x, _axes(dim, x.ndim), keepdim)


def _evenly_distributed(choose):
    """A full reduction whose gradient torch spreads evenly over the elements equal to its result,
    a NaN result counting every NaN as equal (torch's ``evenly_distribute_backward``)."""

    @jax.custom_jvp
    def reduce(x):
        return choose(x)

    @reduce.defjvp
    def reduce_jvp(primals, tangents):
        (x,), (tangent,) = primals, tangents
        result = choose(x)
        chosen = (x == result) | (jnp.isnan(x) & jnp.isnan(result))
        share = jnp.sum(jnp.where(chosen, tangent, 0)) / jnp.sum(chosen).astype(tangent.dtype)
        return result, share

    return reduce


@lowering(aten.max.default)
def max_(ctx, x):
    return _evenly_distributed(jnp.max)(x)


@lowering(aten.min.default)
def min_(ctx, x):
    return _evenly_distributed(jnp.min)(x)


def _select_along(x, indices, axis, keepdim):
    """``(x at indices, indices)`` along ``axis``; the gradient reaches only the selected element."""
    values = jnp.take_along_axis(x, indices, axis)
    if not keepdim:
        values, indices = jnp.squeeze(values, axis), jnp.squeeze(indices, axis)
    return values, indices


def _value_and_index(x, dim, keepdim, arg_fn):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    axis = dim % x.ndim
    return _select_along(x, arg_fn(x, axis=axis, keepdims=True), axis, keepdim)


@lowering(aten.max.dim)
def max_dim(ctx, x, dim, keepdim=False):
    """The first index of the maximum (of the first NaN, if any), like torch on the CPU."""
    return _value_and_index(x, dim, keepdim, jnp.argmax)


@lowering(aten.min.dim)
def min_dim(ctx, x, dim, keepdim=False):
    return _value_and_index(x, dim, keepdim, jnp.argmin)


def _arg_reduce(ctx, x, dim, keepdim, arg_fn):
    if dim is None or x.ndim == 0:
        return jnp.reshape(arg_fn(jnp.ravel(x)), ctx.out.shape)
    return arg_fn(x, axis=dim % x.ndim, keepdims=keepdim)


@lowering(aten.argmax.default)
def argmax(ctx, x, dim=None, keepdim=False):
    return _arg_reduce(ctx, x, dim, keepdim, jnp.argmax)


@lowering(aten.argmin.default)
def argmin(ctx, x, dim=None, keepdim=False):
    return _arg_reduce(ctx, x, dim, keepdim, jnp.argmin)


def _var_and_mean(x, dim, correction, keepdim):
    """The variance and the mean over ``dim``, the variance differentiated as torch does
    (:func:`_torch_variance_slope`)."""
    axes = _axes(dim, x.ndim)
    wide = _widen(x)
    correction = 1 if correction is None else correction
    slope = _torch_variance_slope(x.shape, dim, axes, correction)
    mean_kept = jnp.mean(wide, axis=axes, keepdims=True)
    if slope is None:
        var = _variance(wide, mean_kept, axes, correction, keepdim)
    else:
        var = _variance_with_slope(wide, axes, correction, keepdim, slope)
    mean_out = mean_kept if keepdim else jnp.squeeze(mean_kept, axes)
    return var.astype(x.dtype), mean_out.astype(x.dtype)


def _variance(x, mean_kept, axes, correction, keepdim):
    """Two-pass variance around ``mean_kept`` divided by ``max(n - correction, 0)`` (so inf or
    NaN when that is 0)."""
    count = math.prod(x.shape[a] for a in axes)
    return jnp.sum(jnp.square(x - mean_kept), axis=axes, keepdims=keepdim) / max(count - correction, 0)


def _torch_variance_slope(shape, dim, axes, correction):
    """torch's ``var_backward`` as ``slope(x, mean)``, d var / d x, where it is not the variance's
    own derivative, else None. Over every element with no dims listed (or of a 0-d tensor) torch
    scales by ``2 / (n - correction)``, and where that divisor is not positive takes NaN where ``x``
    equals the mean, inf elsewhere. With dims listed, ``n`` is the product of their sizes (1 for an
    empty list, which still reduces every element), and the scale is used as it is: infinite for a
    correction of ``n``, negative beyond it."""
    count = math.prod(shape[a] for a in axes)
    if dim is None or not shape:
        if count > correction:
            return None
        return lambda x, mean: jnp.where(x == mean, jnp.nan, jnp.inf)
    listed = math.prod(shape[d] for d in dim)
    if listed == count and count > correction:
        return None
    scale = math.inf if listed == correction else 2 / (listed - correction)
    return lambda x, mean: scale * (x - mean)


def _variance_with_slope(x, axes, correction, keepdim, slope):
    """:func:`_variance`, whose derivative is ``slope(x, mean)``."""

    @jax.custom_jvp
    def variance(v):
        return _variance(v, jnp.mean(v, axis=axes, keepdims=True), axes, correction, keepdim)

    @variance.defjvp
    def variance_jvp(primals, tangents):
        (v,), (tangent,) = primals, tangents
        mean_kept = jnp.mean(v, axis=axes, keepdims=True)
        return (_variance(v, mean_kept, axes, correction, keepdim),
                jnp.sum(slope(v, mean_kept) * tangent, axis=axes, keepdims=keepdim))

    return variance(x)


@lowering(aten.var.correction)
def var(ctx, x, dim=None, *, correction=None, keepdim=False):
    return _var_and_mean(x, dim, correction, keepdim)[0]


@lowering(aten.var_mean.correction)
def var_mean(ctx, x, dim=None, *, correction=None, keepdim=False):
    return _var_and_mean(x, dim, correction, keepdim)


@jax.custom_jvp
def _deviation(variance):
    """``sqrt(variance)``, differentiated as torch differentiates ``std``: 0 where it is 0 (every
    element equal), where the square root's derivative would make it NaN."""
    return jnp.sqrt(variance)


@_deviation.defjvp
def _deviation_jvp(primals, tangents):
    (variance,), (tangent,) = primals, tangents
    deviation = jnp.sqrt(variance)
    zero = deviation == 0
    return deviation, jnp.where(zero, 0, tangent / (2 * jnp.where(zero, 1, deviation)))


@lowering(aten.std.correction)
def std(ctx, x, dim=None, *, correction=None, keepdim=False):
    return _deviation(_var_and_mean(x, dim, correction, keepdim)[0])


@lowering(aten.std_mean.correction)
def std_mean(ctx, x, dim=None, *, correction=None, keepdim=False):
    variance, mean_ = _var_and_mean(x, dim, correction, keepdim)
    return _deviation(variance), mean_


@lowering(aten.any.default, aten.any.dim, aten.any.dims)
def any_(ctx, x, dim=None, keepdim=False):
    return jnp.any(x != 0, axis=_axes(dim, x.ndim), keepdims=keepdim)


def _scan(x, dim, scan_fn):
    return x if x.ndim == 0 else scan_fn(x, axis=dim % x.ndim)


@lowering(aten.cumsum.default)
def cumsum(ctx, x, dim, *, dtype=None):
    out = _out_dtype(ctx)
    return _scan(_accumulate_as(x, out), dim, jnp.cumsum).astype(out)


@lowering(aten.cumprod.default)
def cumprod(ctx, x, dim, *, dtype=None):
    out = _out_dtype(ctx)
    return _scan(_accumulate_as(x, out), dim, jnp.cumprod).astype(out)


@lowering(aten.logcumsumexp.default)
def logcumsumexp(ctx, x, dim):
    return _scan(_widen(x), dim, _logcumsumexp).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _logcumsumexp(x, axis):
    return jax.lax.cumlogsumexp(x, axis=axis)


def _prefix_logsumexp(x, axis, reverse=False):
    """The parallel prefix scan JAX differentiates ``cumlogsumexp`` through: the values a training
    forward had before, and far faster on the CPU than the primitive's quadratic reduce-window."""
    return jax.lax.associative_scan(jnp.logaddexp, x, axis=axis, reverse=reverse)


def _logcumsumexp_forward(x, axis):
    result = _prefix_logsumexp(x, axis)
    return result, (x, result)


def _logcumsumexp_backward(axis, saved, grad):
    """torch's ``logcumsumexp_backward``: the positive and negative parts of the gradient, each
    summed in log space by a reversed logcumsumexp (one scan over both, stacked, which XLA runs
    far faster than two), the absent one as the dtype's lowest value. It is NaN at +inf and at a
    leading -inf, and 0 after a +inf, where JAX's derivative of the scan is finite, and wrong
    before a +inf too."""
    x, result = saved
    log_size = jnp.log(jnp.abs(grad))
    lowest = jnp.finfo(grad.dtype).min
    parts = jnp.stack([jnp.where(grad > 0, log_size, lowest), jnp.where(grad < 0, log_size, lowest)])
    summed = jnp.exp(_prefix_logsumexp(parts - result, axis + 1, reverse=True) + x)
    return (summed[0] - summed[1],)


_logcumsumexp.defvjp(_logcumsumexp_forward, _logcumsumexp_backward)


def _running_choice(x, dim, later_wins):
    """torch's cummax/cummin: ``(values, indices)`` where a later element replaces the running
    choice when it is NaN or ``later_wins(later, running)`` (>= or <=, so the last tie's index)."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    axis = dim % x.ndim

    def combine(earlier, later):
        (value_a, index_a), (value_b, index_b) = earlier, later
        take_b = jnp.isnan(value_b) | later_wins(value_b, value_a)
        return jnp.where(take_b, value_b, value_a), jnp.where(take_b, index_b, index_a)

    positions = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    _, indices = jax.lax.associative_scan(combine, (jax.lax.stop_gradient(x), positions), axis=axis)
    return jnp.take_along_axis(x, indices, axis), indices


@lowering(aten.cummax.default)
def cummax(ctx, x, dim):
    return _running_choice(x, dim, jnp.greater_equal)


@lowering(aten.cummin.default)
def cummin(ctx, x, dim):
    return _running_choice(x, dim, jnp.less_equal)


def _median_index(x, axis, ignore_nan):
    """Index along ``axis`` (kept) of torch's median: the lower middle of a stable sort, or the
    first NaN when NaNs propagate; with ``ignore_nan``, the lower middle of the non-NaN values.

    The sort keys are (is NaN, value) with -0.0 folded into 0.0, because XLA's total order would
    otherwise split NaNs by sign and put -0.0 before 0.0 where torch sees ties."""
    nan = jnp.isnan(x)
    value = jnp.where(nan | (x == 0), jnp.zeros_like(x), x)
    positions = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    _, _, order = jax.lax.sort((nan.astype(jnp.int32), value, positions), dimension=axis,
                               is_stable=True, num_keys=2)
    if ignore_nan:
        count = jnp.sum(~nan, axis=axis, keepdims=True)
        return jnp.take_along_axis(order, jnp.maximum(count - 1, 0) // 2, axis)
    size = x.shape[axis]
    middle = jax.lax.slice_in_dim(order, (size - 1) // 2, (size + 1) // 2, axis=axis)
    first_nan = jnp.argmax(nan, axis=axis, keepdims=True)
    return jnp.where(jnp.any(nan, axis=axis, keepdims=True), first_nan, middle)


def _median_value(x, ignore_nan):
    flat = jnp.ravel(x)
    return flat[_median_index(flat, 0, ignore_nan)[0]]


@lowering(aten.median.default)
def median(ctx, x):
    return _evenly_distributed(lambda v: _median_value(v, ignore_nan=False))(x)


@lowering(aten.nanmedian.default)
def nanmedian(ctx, x):
    return _evenly_distributed(lambda v: _median_value(v, ignore_nan=True))(x)


def _median_along(x, dim, keepdim, ignore_nan):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    axis = dim % x.ndim
    indices = _median_index(jax.lax.stop_gradient(x), axis, ignore_nan)
    return _select_along(x, indices, axis, keepdim)


@lowering(aten.median.dim)
def median_dim(ctx, x, dim, keepdim=False):
    return _median_along(x, dim, keepdim, ignore_nan=False)


@lowering(aten.nanmedian.dim)
def nanmedian_dim(ctx, x, dim, keepdim=False):
    return _median_along(x, dim, keepdim, ignore_nan=True)


def _norm(x, ord, axes):
    """The p-norm over ``axes`` (kept)."""
    size = jnp.abs(x)
    if ord == math.inf:
        return jnp.max(size, axis=axes, keepdims=True)
    if ord == -math.inf:
        return jnp.min(size, axis=axes, keepdims=True)
    if ord == 0:
        return jnp.sum(x != 0, axis=axes, keepdims=True).astype(x.dtype)
    if ord == 1:
        return jnp.sum(size, axis=axes, keepdims=True)
    if ord == 2:
        return jnp.sqrt(jnp.sum(jnp.square(size), axis=axes, keepdims=True))
    return jnp.sum(size ** ord, axis=axes, keepdims=True) ** (1 / ord)


def _norm_slope(x, norm, ord, axes):
    """d norm / d x as torch's ``norm_backward`` defines it, subgradients at 0 and ties included."""
    size = jnp.abs(x)
    if ord == 0:
        return jnp.zeros_like(x)
    if ord == 1:
        return jnp.sign(x)
    if ord == 2:
        return jnp.where(norm == 0, 0, x / norm)
    if math.isinf(ord):
        chosen = (size == norm) | jnp.isnan(size)
        return jnp.sign(x) * chosen / jnp.sum(chosen, axis=axes, keepdims=True).astype(x.dtype)
    if ord < 1:
        return jnp.sign(x) * jnp.where(x == 0, 0, size ** (ord - 1)) * norm ** (1 - ord)
    inverse = jnp.where(norm == 0, 0, 1 / norm ** (ord - 1))
    if ord < 2:
        return jnp.sign(x) * size ** (ord - 1) * inverse
    return x * size ** (ord - 2) * inverse


def _cdist_slope(x, norm, ord, axes):
    """torch's ``_cdist_backward``: as vector_norm's, except that at p=inf every element tied for
    the largest gets the whole gradient rather than an even share."""
    if ord == math.inf:
        return jnp.sign(x) * (jnp.abs(x) == norm)
    return _norm_slope(x, norm, ord, axes)


def _differentiable_norm(x, ord, axes, slope):
    """The p-norm over ``axes`` (kept) whose derivative is ``slope(x, norm, ord, axes)``."""

    @jax.custom_jvp
    def norm(v):
        return _norm(v, ord, axes)

    @norm.defjvp
    def norm_jvp(primals, tangents):
        (v,), (tangent,) = primals, tangents
        result = _norm(v, ord, axes)
        return result, jnp.sum(slope(v, result, ord, axes) * tangent, axis=axes, keepdims=True)

    return norm(x)


@lowering(aten.linalg_vector_norm.default)
def linalg_vector_norm(ctx, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    out = _out_dtype(ctx)
    axes = _axes(dim, x.ndim)
    result = _differentiable_norm(_accumulate_as(x, out), float(ord), axes, _norm_slope)
    return (result if keepdim else jnp.squeeze(result, axes)).astype(out)


@lowering(aten.dist.default)
def dist(ctx, x, y, p=2):
    """``vector_norm(x - y, p)`` over every element, with vector_norm's gradient."""
    difference = _widen(x) - _widen(y)
    axes = tuple(range(difference.ndim))
    return jnp.squeeze(_differentiable_norm(difference, float(p), axes, _norm_slope), axes)


@lowering(aten.cosine_similarity.default)
def cosine_similarity(ctx, x1, x2, dim=1, eps=1e-8):
    """torch's steps, kept whole (``capture._KEPT_WHOLE``): integers as the result's dtype, both
    broadcast, each divided by its 2-norm along ``dim`` floored at ``eps``, then the products summed,
    each step rounded to its dtype as the decomposed ops would be. torch floors the norms in place
    without autograd, so their gradient is the unfloored norm's (:func:`_floored`); decomposed, the
    floor is a clamp, whose gradient is 0 where a norm is below ``eps``."""
    out = _out_dtype(ctx)
    x1, x2 = jnp.broadcast_arrays(*(x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(out) for x in (x1, x2)))
    axis = dim % x1.ndim
    product = (_widen(_over_floored_norm(x1, axis, eps)) * _widen(_over_floored_norm(x2, axis, eps))).astype(out)
    return jnp.sum(_widen(product), axis=axis).astype(out)


def _over_floored_norm(x, axis, eps):
    norm = _differentiable_norm(_widen(x), 2.0, (axis,), _norm_slope).astype(x.dtype)
    return (_widen(x) / _widen(_floored(norm, jnp.asarray(eps, x.dtype)))).astype(x.dtype)


@jax.custom_jvp
def _floored(x, floor):
    return jnp.maximum(x, floor)


# Differentiated as ``x`` itself: torch's floor of the norms is made under no_grad.
_floored.defjvps(lambda dx, result, x, floor: dx, None)


@lowering(aten._cdist_forward.default)
def cdist(ctx, x1, x2, p, compute_mode=None):
    """p-norm distances between the rows of ``x1`` (..., P, M) and ``x2`` (..., R, M). The matmul
    form torch may pick for p=2 is composite (it reaches the graph as mm, sqrt, ...), so this op
    is always the direct form."""
    difference = _widen(x1)[..., :, None, :] - _widen(x2)[..., None, :, :]
    axis = difference.ndim - 1
    return jnp.squeeze(_differentiable_norm(difference, float(p), (axis,), _cdist_slope), axis)


@lowering(aten._euclidean_dist.default)
def euclidean_dist(ctx, x1, x2):
    """The matmul form of p=2 ``cdist`` (torch's pick for more than 25 rows, or by its
    ``compute_mode``): ``|x1|² - 2 x1·x2 + |x2|²`` as one product, clamped at 0, square-rooted, as
    torch computes it; its gradient is torch's ``_euclidean_dist_backward``, where a zero distance
    (a point and itself) passes none rather than the square root's NaN."""
    return _euclidean_distance(_widen(x1), _widen(x2))


@jax.custom_vjp
def _euclidean_distance(x1, x2):
    x1_norm = jnp.sum(x1 * x1, axis=-1, keepdims=True)
    x2_norm = jnp.sum(x2 * x2, axis=-1, keepdims=True)
    x1_ = jnp.concatenate([x1 * -2, x1_norm, jnp.ones_like(x1_norm)], axis=-1)
    x2_ = jnp.concatenate([x2, jnp.ones_like(x2_norm), x2_norm], axis=-1)
    squared = jnp.matmul(x1_, jnp.swapaxes(x2_, -1, -2), precision=backend.float32_precision("matmul"))
    return jnp.sqrt(jnp.maximum(squared, 0))


def _euclidean_distance_forward(x1, x2):
    result = _euclidean_distance(x1, x2)
    return result, (x1, x2, result)


def _euclidean_distance_backward(saved, gradient):
    x1, x2, result = saved
    precision = backend.float32_precision("matmul")
    ratio = jnp.where(result == 0, 0, gradient / jnp.where(result == 0, 1, result))
    return (x1 * jnp.sum(ratio, axis=-1, keepdims=True) - jnp.matmul(ratio, x2, precision=precision),
            x2 * jnp.sum(ratio, axis=-2)[..., None] - jnp.matmul(jnp.swapaxes(ratio, -1, -2), x1, precision=precision))


_euclidean_distance.defvjp(_euclidean_distance_forward, _euclidean_distance_backward)


def _shifted(x, axis):
    """``x`` minus its maximum along ``axis``: exp cannot overflow; the shift carries no gradient
    because softmax does not depend on it."""
    wide = _widen(x)
    return wide - jax.lax.stop_gradient(jnp.max(wide, axis=axis, keepdims=True))


def softmax_values(x, dim, out_dtype, all_minus_inf_rows_to_zero=False):
    """``exp(x - max) / sum`` along ``dim``. With ``all_minus_inf_rows_to_zero`` a row of only
    -inf gives zeros (and zero gradients) instead of NaN, as torch's ``_safe_softmax`` in
    attention does: only such rows' shift and total change, so every other row keeps softmax's
    numbers, and the computation stays the one chain XLA:CPU fuses with attention's products."""
    axes = _axes(dim, x.ndim)
    if not all_minus_inf_rows_to_zero:
        exps = jnp.exp(_shifted(x, axes))
        return (exps / jnp.sum(exps, axis=axes, keepdims=True)).astype(out_dtype)
    wide = _widen(x)
    peak = jax.lax.stop_gradient(jnp.max(wide, axis=axes, keepdims=True))
    exps = jnp.exp(wide - jnp.where(peak == -jnp.inf, jnp.zeros((), peak.dtype), peak))
    total = jnp.sum(exps, axis=axes, keepdims=True)  # >= 1 (the maximum's term) unless all -inf
    return (exps / jnp.where(total == 0, jnp.ones((), total.dtype), total)).astype(out_dtype)


@lowering(aten._softmax.default)
def softmax(ctx, x, dim, half_to_float=False):
    return softmax_values(x, dim, _out_dtype(ctx))


@lowering(aten._log_softmax.default)
def log_softmax(ctx, x, dim, half_to_float=False):
    axes = _axes(dim, x.ndim)
    shifted = _shifted(x, axes)
    log_total = jnp.log(jnp.sum(jnp.exp(shifted), axis=axes, keepdims=True))
    return (shifted - log_total).astype(_out_dtype(ctx))
