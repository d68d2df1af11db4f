"""Lowerings: convolution (direct and transposed, 1-D to 3-D) and pooling.

``aten.convolution`` has two algorithms with the same numbers, chosen by
``lowering_options(conv_algorithm=...)``: XLA's convolution, or im2col (static slices of the
padded input, then one matrix product). On the CPU im2col is the faster one, at a program's top
level (``"auto"``) and inside loops (``"in_loop"``, where a single-channel input keeps XLA's
convolution: see :func:`_conv_in_loop`); other backends get XLA's convolution for both.

Pooling whose windows tile the input reshapes it and reduces the window axes; other pooling
gathers each output's window into a trailing axis (static slices for strided windows,
static gathers for adaptive ones). Both reduce the way torch's CPU kernels do: max picks the
first maximum in row-major window order (or the last NaN), so its index output and its
gradient go where torch's do; averages add in window order and divide by torch's divisor.

Each op's computation is a jitted function of the input and its static configuration: inside
a program it is inlined; evaluated op by op (``jax.vjp`` outside ``jit``) it compiles once
rather than once per primitive.
"""

import functools
import inspect
import itertools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ipu_backend.compiler.lowering_options import current_options
from ipu_backend.compiler import backend
from ipu_backend.compiler.lowerings.linalg import accumulation_dtype, matrix_product
from ipu_backend.compiler.registry import lowering

aten = torch.ops.aten


def _jit_with_static_keywords(fn):
    """``jax.jit(fn)`` with its keyword-only parameters (hashable configuration) static."""
    static = [p.name for p in inspect.signature(fn).parameters.values()
              if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return jax.jit(fn, static_argnames=static)


def _per_dim(value, n):
    """An int or a 1- or n-long list of ints, as an n-tuple (torch repeats a single value)."""
    if isinstance(value, int):
        return (value,) * n
    value = tuple(value)
    return value * n if len(value) == 1 else value


def _window_slices(x, first_axis, out_size, kernel, stride, dilation):
    """One strided slice of ``x`` per kernel offset, in row-major offset order: slice ``j``
    holds element ``j`` of every window along the axes from ``first_axis`` on."""
    slices = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        start, limit, strides = [0] * x.ndim, list(x.shape), [1] * x.ndim
        for axis, o, m, s, d in zip(itertools.count(first_axis), offset, out_size, stride,
                                    dilation):
            start[axis], limit[axis], strides[axis] = o * d, o * d + (m - 1) * s + 1, s
        slices.append(lax.slice(x, start, limit, strides))
    return slices


def _staged_windows(x, first_axis, out_size, kernel, stride, dilation):
    """Every window element of ``x`` (the axes from ``first_axis`` on spatial), stacked one
    spatial axis at a time, the last first: the slices along it are stacked, the slices of that
    along the axis before it stacked in front, and so on, giving (k_1, ..., k_n, *lead,
    *out_size), the offsets in row-major order. XLA:CPU fuses a concatenate of at most 8
    operands with what computes them, so each stage is one kernel, where one stack of all
    k_1···k_n slices (25 for 5×5) would be a kernel per slice and a copy of them all. The
    numbers are the same as one stack's."""
    stacked = x
    for stage, axis in enumerate(reversed(range(len(kernel)))):
        position = stage + first_axis + axis       # ``stage`` offset axes now lead
        stacked = jnp.stack(_window_slices(stacked, position, (out_size[axis],), (kernel[axis],),
                                           (stride[axis],), (dilation[axis],)))
    return stacked


# ---------------------------------------------------------------------------------------------
# Convolution


@lowering(aten.convolution.default)
def convolution(ctx, x, weight, bias, stride, padding, dilation, transposed, output_padding,
                groups):
    n = weight.ndim - 2
    stride, padding, dilation = _per_dim(stride, n), _per_dim(padding, n), _per_dim(dilation, n)
    kernel = weight.shape[2:]
    if transposed:
        weight = _transposed_weight_as_direct(weight, groups)
        pads = tuple((d * (k - 1) - p, d * (k - 1) - p + q) for k, p, d, q
                     in zip(kernel, padding, dilation, _per_dim(output_padding, n)))
        window_strides, input_dilation = (1,) * n, stride
    else:
        pads = tuple((p, p) for p in padding)
        window_strides, input_dilation = stride, (1,) * n
    direct = _CONV_ALGORITHMS[current_options().conv_algorithm]
    out = direct(x, weight, window_strides=window_strides, pads=pads,
                 input_dilation=input_dilation, kernel_dilation=dilation, groups=groups,
                 precision=backend.float32_precision("convolution"))
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape((-1,) + (1,) * n)
    return out.astype(x.dtype)


def _transposed_weight_as_direct(weight, groups):
    """A transposed convolution is the direct convolution, over the input dilated by the stride,
    of the spatially flipped kernel with input and output channels swapped within each group:
    torch's (in, out/groups, *k) weight becomes (out, in/groups, *k)."""
    in_channels, out_per_group, *kernel = weight.shape
    weight = weight.reshape(groups, in_channels // groups, out_per_group, *kernel)
    weight = jnp.swapaxes(weight, 1, 2).reshape(groups * out_per_group, in_channels // groups,
                                                *kernel)
    return jnp.flip(weight, axis=tuple(range(2, weight.ndim)))


def _conv_xla(x, weight, *, window_strides, pads, input_dilation, kernel_dilation, groups,
              precision):
    return lax.conv_general_dilated(
        x, weight, window_strides, pads, lhs_dilation=input_dilation,
        rhs_dilation=kernel_dilation, feature_group_count=groups,
        precision=precision, preferred_element_type=accumulation_dtype(x.dtype))


@_jit_with_static_keywords
def _conv_im2col(x, weight, *, window_strides, pads, input_dilation, kernel_dilation, groups,
                 precision):
    """Channel-major im2col: the input as (channels, batch, *spatial), padded (and dilated) once;
    one strided slice per kernel offset, stacked offset-major (:func:`_staged_windows`) into
    columns of shape (offsets · channels, batch · output positions); and the kernel, laid out
    to match, times the columns: one 2-D matrix product (batched over groups). Each offset's
    slice is copied whole, the products' long axis is the contiguous one, and the result is
    (out channels, batch, *spatial), which the spatial-minor ops around it read without a
    layout copy.
    Half precision is computed in float32, where its products are exact, so that the input's
    gradient, which sums one term per kernel offset, is rounded once, as torch's is."""
    dtype = accumulation_dtype(x.dtype) or x.dtype
    x = jnp.moveaxis(x.astype(dtype), 1, 0)
    strided = any(s > 1 for s in window_strides)
    if strided and np.prod(weight.shape[2:]) > 1:
        x = _gradient_computed_once(x)
    x = lax.pad(x, jnp.zeros((), dtype), [(0, 0, 0), (0, 0, 0)]
                + [(lo, hi, d - 1) for (lo, hi), d in zip(pads, input_dilation)])
    kernel = weight.shape[2:]
    out_size = tuple((size - d * (k - 1) - 1) // s + 1
                     for size, k, d, s in zip(x.shape[2:], kernel, kernel_dilation, window_strides))
    if strided:
        stacked = _staged_windows(x, 2, out_size, kernel, window_strides, kernel_dilation)
    else:
        stacked = _unit_stride_columns(x, x.shape, out_size, tuple(kernel), tuple(kernel_dilation))
    in_channels, batch = x.shape[:2]
    columns = stacked.reshape(-1, groups, in_channels // groups, batch * math.prod(out_size))
    out_channels = weight.shape[0]
    # (out, in/groups, *kernel) -> (groups, out/groups, offsets · in/groups), the columns' order
    weight = jnp.moveaxis(weight.astype(dtype), 1, -1).reshape(groups, out_channels // groups, -1)
    if groups == 1:
        out = matrix_product(weight[0], columns.reshape(-1, columns.shape[-1]), precision=precision)
    else:
        columns = jnp.swapaxes(columns, 0, 1).reshape(groups, -1, columns.shape[-1])
        out = jnp.matmul(weight, columns, precision=precision)
    return jnp.moveaxis(out.reshape(out_channels, batch, *out_size), 0, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _unit_stride_columns(x, shape, out_size, kernel, dilation):
    """im2col's columns for windows of stride 1 over ``x`` (of ``shape``): one slice per kernel
    offset, stacked (:func:`_staged_windows`). Their gradient adds each offset's slice of the
    incoming gradient in place into one buffer, offset after offset (a dynamic-update-slice
    each), where JAX's transpose of the slices pads each back to the input's size and XLA:CPU
    fuses the sum of the padded slices into one kernel testing every term's bounds per
    element, then recomputes it in each consumer unless something stops it; adding in place
    also costs less than stopping it with :func:`_gradient_computed_once`'s product."""
    return _staged_windows(x, 2, out_size, kernel, (1,) * len(kernel), dilation)


def _unit_stride_columns_fwd(x, shape, out_size, kernel, dilation):
    return _unit_stride_columns(x, shape, out_size, kernel, dilation), None


def _unit_stride_columns_bwd(shape, out_size, kernel, dilation, _, gradient):
    total = jnp.zeros(shape, gradient.dtype)
    for offset in itertools.product(*(range(k) for k in kernel)):
        start = (0, 0) + tuple(o * d for o, d in zip(offset, dilation))
        current = lax.dynamic_slice(total, start, shape[:2] + out_size)
        total = lax.dynamic_update_slice(total, current + gradient[offset], start)
    return (total,)


_unit_stride_columns.defvjp(_unit_stride_columns_fwd, _unit_stride_columns_bwd)


@jax.custom_vjp
def _gradient_computed_once(x):
    """The identity, whose gradient passes through a product with an identity matrix over
    blocks of the leading (channel) axis. For strided windows, the im2col input gradient is a
    sum of one padded slice per kernel offset, which XLA:CPU fuses into each of its consumers
    and recomputes per element read: four times under a 2×2 max pooling's gradient, again for
    the kernel gradient of the layer below. A matrix product is never fused into its
    consumers, so the sum is computed once. The blocks hold at most 16 channels, bounding the
    product's cost to 16 multiply-adds per element; the one difference it makes is that a
    non-finite gradient element turns the others of its block into NaN."""
    return x


def _gradient_computed_once_fwd(x):
    return x, None


def _gradient_computed_once_bwd(_, gradient):
    channels = gradient.shape[0]
    block = max(b for b in range(1, min(channels, 16) + 1) if channels % b == 0)
    if block == 1:
        return (gradient,)
    blocks = gradient.reshape(channels // block, block, -1)
    identity = jnp.eye(block, dtype=gradient.dtype)
    return (jnp.einsum("gcr,cd->gdr", blocks, identity,
                       precision=lax.Precision.HIGHEST).reshape(gradient.shape),)


_gradient_computed_once.defvjp(_gradient_computed_once_fwd, _gradient_computed_once_bwd)


def _conv_auto(x, weight, **config):
    """The convolution at a program's top level: im2col on the CPU, where XLA's convolution is
    an Eigen kernel slower than im2col, forward and backward, for every layer measured (see the
    performance guide); XLA's convolution elsewhere."""
    return (_conv_im2col if backend.on_cpu() else _conv_xla)(x, weight, **config)


def _conv_in_loop(x, weight, **config):
    """The convolution inside a loop on the CPU: im2col, except where the input has a single
    channel (a grayscale image's first layer). There XLA:CPU's in-loop convolution is not slow,
    and im2col's channel-major product would cost a layout change of the layer's output and of
    its gradient. With more input channels XLA's in-loop convolution is a generic loop,
    slower than im2col (figures in the performance guide). Other backends: XLA's
    convolution."""
    if x.shape[1] == 1 or not backend.on_cpu():
        return _conv_xla(x, weight, **config)
    return _conv_im2col(x, weight, **config)


_CONV_ALGORITHMS = {"auto": _conv_auto, "xla": _conv_xla, "im2col": _conv_im2col,
                    "in_loop": _conv_in_loop}


# ---------------------------------------------------------------------------------------------
# Pooling windows: taps (one array per window element, shaped like the output), and static
# (*out, K) tables of which window elements lie inside the input and their flat input index


def _strided_windows(x, out_size, kernel, stride, padding, dilation, pad_value):
    """Every window of a strided pooling, one static slice per kernel offset (row-major)."""
    n = len(kernel)
    lead = x.ndim - n
    high = [max(0, (m - 1) * s + d * (k - 1) + 1 - size - p) for m, s, d, k, size, p
            in zip(out_size, stride, dilation, kernel, x.shape[lead:], padding)]
    padded = lax.pad(x, jnp.asarray(pad_value, x.dtype),
                     [(0, 0, 0)] * lead + [(p, h, 0) for p, h in zip(padding, high)])
    taps = _window_slices(padded, lead, out_size, kernel, stride, dilation)
    positions = [np.arange(m)[:, None] * s + np.arange(k)[None, :] * d - p
                 for m, k, s, p, d in zip(out_size, kernel, stride, padding, dilation)]
    return taps, _window_tables(positions, x.shape[lead:])


def _adaptive_windows(x, out_size):
    """Every window of an adaptive pooling: output i covers [floor(i*n/m), ceil((i+1)*n/m)) of
    each dim. Windows are gathered at their longest length, shorter ones padded by repeating
    their last element (marked outside the input)."""
    n = len(out_size)
    lead = x.ndim - n
    in_size = x.shape[lead:]
    positions = []
    for axis, (size, m) in enumerate(zip(in_size, out_size)):
        starts = np.arange(m) * size // m
        ends = -(-(np.arange(1, m + 1) * size) // m)
        longest = int((ends - starts).max())
        window = starts[:, None] + np.arange(longest)[None, :]
        positions.append(np.where(window < ends[:, None], window, size))
        at = lead + 2 * axis  # dims before this one are already split into (out, window)
        x = jnp.take(x, np.minimum(window, ends[:, None] - 1).reshape(-1), axis=at)
        x = x.reshape(x.shape[:at] + (m, longest) + x.shape[at + 1:])
    x = jnp.transpose(x, [*range(lead), *range(lead, lead + 2 * n, 2),
                          *range(lead + 1, lead + 2 * n, 2)])
    x = x.reshape(x.shape[:lead + n] + (-1,))
    return [x[..., k] for k in range(x.shape[-1])], _window_tables(positions, in_size)


def _window_tables(positions, in_size):
    """Static (*out, K) tables from each dim's (out, window) input positions: is each window
    element inside the input, and its flat index (row-major over the spatial dims, as torch's
    pooling indices count)."""
    n = len(positions)
    valid = np.ones((), bool)
    flat = np.zeros((), np.int64)
    for axis, (pos, size) in enumerate(zip(positions, in_size)):
        shape = [1] * (2 * n)
        shape[axis], shape[n + axis] = pos.shape
        pos = pos.reshape(shape)
        valid = valid & (pos >= 0) & (pos < size)
        flat = flat * size + pos
    out_shape = valid.shape[:n]
    return valid.reshape(out_shape + (-1,)), flat.reshape(out_shape + (-1,))


def _lowest(dtype):
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _first_max(taps, valid, flat_index):
    """Max over the window and the flat index of torch's choice: the first maximum or, where
    the window holds NaN, the last NaN (torch's kernels take ``val > max || isnan(val)``).
    The value is an elementwise maximum of the taps (one fused pass; NaN propagates, as in
    torch); its gradient goes to torch's choice only, found in the derivative rule, so a
    forward pass that drops the indices never computes them."""
    lowest = _lowest(taps[0].dtype)
    taps = [tap if valid[..., k].all() else jnp.where(valid[..., k], tap, lowest)
            for k, tap in enumerate(taps)]

    @jax.custom_jvp
    def window_max(*taps):
        return functools.reduce(jnp.maximum, taps)

    @window_max.defjvp
    def window_max_jvp(primals, tangents):
        one_hot = _torch_choice(primals, valid)
        tangent = jnp.sum(jnp.where(one_hot, jnp.stack(tangents, axis=-1), 0), axis=-1)
        return window_max(*primals), tangent.astype(primals[0].dtype)

    indices = jnp.sum(jnp.where(_torch_choice(taps, valid), flat_index.astype(np.int32), 0),
                      axis=-1)
    return window_max(*taps), indices


def _torch_choice(taps, valid):
    """One-hot over the window's last axis: the element torch's max pooling picks."""
    patches = jnp.stack(taps, axis=-1)
    order = np.arange(len(taps))
    best = jnp.max(patches, axis=-1, keepdims=True)
    preference = jnp.where(valid & (patches == best), len(taps) - order, 0)
    if jnp.issubdtype(patches.dtype, jnp.floating):
        preference = jnp.where(valid & jnp.isnan(patches), len(taps) + order, preference)
    return jnp.argmax(preference, axis=-1)[..., None] == order


def _window_sum(taps, valid):
    """Sum over the window in row-major order, as torch's kernels add (in float32 for halves)."""
    dtype = accumulation_dtype(taps[0].dtype) or taps[0].dtype
    terms = [(tap if valid[..., k].all() else jnp.where(valid[..., k], tap, 0)).astype(dtype)
             for k, tap in enumerate(taps)]
    return functools.reduce(operator.add, terms)


# ---------------------------------------------------------------------------------------------
# Max and average pooling over strided windows


@_jit_with_static_keywords
def _max_pool(x, *, out_size, kernel, stride, padding, dilation):
    n = len(kernel)
    if (stride == kernel and not any(padding) and dilation == (1,) * n
            and all(m * k <= size for m, k, size in zip(out_size, kernel, x.shape[-n:]))):
        return _tiled_max_pool(x, out_size, kernel)
    taps, tables = _strided_windows(x, out_size, kernel, stride, padding, dilation,
                                    _lowest(x.dtype))
    return _first_max(taps, *tables)


def _tiled_max_pool(x, out_size, kernel):
    """Max pooling whose windows tile the input (stride = kernel, no padding, no dilation): the
    input reshaped to (*lead, out_1, k_1, out_2, k_2, ...) and transposed to (channels,
    k_1 · k_2 · ..., *other lead axes, *out_size), one contiguous slab per window position, so
    that the maximum, torch's choice (:func:`_slab_argmax`) and the gradient's select
    work elementwise on whole slabs instead of on strided windows interleaved with the rows.
    Channels (the last lead axis) go first so that the pooled output is channel-major, as an
    im2col convolution reading it wants (their transposes cancel), and its gradient arrives so.
    The transpose is one copy of the input, its gradient one copy back, which costs less than
    reducing window axes interleaved with the rows."""
    n = len(kernel)
    lead = x.ndim - n
    crop = x[(...,) + tuple(slice(0, m * k) for m, k in zip(out_size, kernel))]
    windows = crop.reshape(x.shape[:lead] + tuple(d for m, k in zip(out_size, kernel)
                                                  for d in (m, k)))
    window_axes = tuple(range(lead + 1, lead + 2 * n, 2))
    channels = (lead - 1,) if lead else ()
    others = tuple(a for a in range(windows.ndim) if a not in window_axes + channels)
    slabs = jnp.transpose(windows, channels + window_axes + others)
    axis = len(channels)
    slabs = slabs.reshape(slabs.shape[:axis] + (-1,) + slabs.shape[axis + n:])
    best, choice = _slab_max(slabs, axis), _slab_choice(lax.stop_gradient(slabs), axis)
    if channels:
        best, choice = jnp.moveaxis(best, 0, lead - 1), jnp.moveaxis(choice, 0, lead - 1)
    return best, _tiled_flat_index(choice, kernel, out_size, x.shape[lead:])


def _slab_choice(slabs, axis):
    """torch's choice in each window, as its row-major position in the window."""
    return _slab_argmax(slabs, axis)[1]


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _slab_max(slabs, axis):
    """The maximum over ``axis`` (the window positions); NaN propagates, as in torch."""
    return _slab_argmax(slabs, axis)[0]


@_slab_max.defjvp
def _slab_max_jvp(axis, primals, tangents):
    (slabs,), (tangent,) = primals, tangents
    best, choice = _slab_argmax(slabs, axis)
    chosen = jnp.expand_dims(choice, axis) == _positions(slabs.shape[axis], slabs.ndim, axis)
    return best, jnp.sum(jnp.where(chosen, tangent, 0), axis=axis)


def _positions(count, ndim, axis):
    """0 .. count-1 along ``axis`` of an ``ndim``-dimensional array (int32), broadcastable."""
    shape = [1] * ndim
    shape[axis] = count
    return np.arange(count, dtype=np.int32).reshape(shape)


def _slab_argmax(slabs, axis):
    """The maximum over ``axis`` and torch's choice there: the first maximum in row-major window
    order, or the last NaN (torch's kernels take ``val > max || isnan(val)``). One reduction of
    (value, position) pairs under that order: XLA computes it once, and the gradient's select
    compares each element's position with the choice, reading no other window element (XLA:CPU
    fuses cheap producers into each of their consumers, so a choice built elementwise from the
    window's elements is recomputed per element in every consumer of the gradient), and one
    reduction costs less than a maximum and a separate rank reduction."""
    floating = jnp.issubdtype(slabs.dtype, jnp.floating)

    def preferred(a, b):
        (a_value, a_position), (b_value, b_position) = a, b
        take_a = (a_value > b_value) | ((a_value == b_value) & (a_position < b_position))
        if floating:
            a_nan, b_nan = jnp.isnan(a_value), jnp.isnan(b_value)
            take_a = jnp.where(a_nan | b_nan, a_nan & (~b_nan | (a_position > b_position)), take_a)
        return jnp.where(take_a, a_value, b_value), jnp.where(take_a, a_position, b_position)

    positions = jnp.broadcast_to(_positions(slabs.shape[axis], slabs.ndim, axis), slabs.shape)
    start = (jnp.asarray(_lowest(slabs.dtype), slabs.dtype), np.int32(np.iinfo(np.int32).max))
    return lax.reduce((slabs, positions), start, preferred, (axis,))


def _tiled_flat_index(choice, kernel, out_size, in_size):
    """The flat input index (torch's indices output) of each window's chosen element: its
    window's first element plus the chosen position's offset."""
    positions = list(itertools.product(*(range(k) for k in kernel)))
    origin, offsets = np.zeros((), np.int64), np.zeros(len(positions), np.int64)
    for axis, (m, k, size) in enumerate(zip(out_size, kernel, in_size)):
        origin = origin[..., None] * size + np.arange(m) * k
        offsets = offsets * size + np.array([p[axis] for p in positions])
    index = jnp.broadcast_to(origin.astype(np.int32), choice.shape)
    for position, offset in enumerate(offsets):
        if offset:
            index = index + jnp.where(choice == position, np.int32(offset), np.int32(0))
    return index


def _max_pool_rule(n):
    def max_pool_with_indices(ctx, x, kernel_size, stride=(), padding=0, dilation=1,
                              ceil_mode=False):
        kernel = _per_dim(kernel_size, n)
        return _max_pool(x, out_size=tuple(ctx.out[0].shape[-n:]), kernel=kernel,
                         stride=_per_dim(stride, n) if stride else kernel,
                         padding=_per_dim(padding, n), dilation=_per_dim(dilation, n))
    return max_pool_with_indices


lowering(aten.max_pool2d_with_indices.default)(_max_pool_rule(2))
lowering(aten.max_pool3d_with_indices.default)(_max_pool_rule(3))


def _avg_pool_divisor(out_size, in_size, kernel, stride, padding, count_include_pad):
    """torch's divisor per output: the window clipped to the padded input (count_include_pad)
    or to the input itself."""
    divisor = np.ones((), np.int64)
    for m, size, k, s, p in zip(out_size, in_size, kernel, stride, padding):
        start = np.arange(m) * s - p
        end = np.minimum(start + k, size + p)
        if not count_include_pad:
            start, end = np.maximum(start, 0), np.minimum(end, size)
        divisor = np.multiply.outer(divisor, end - start)
    return divisor


@_jit_with_static_keywords
def _avg_pool(x, *, out_size, kernel, stride, padding, count_include_pad, divisor_override):
    n = len(kernel)
    taps, (valid, _) = _strided_windows(x, out_size, kernel, stride, padding, (1,) * n, 0)
    total = _window_sum(taps, valid)
    divisor = np.asarray(divisor_override or _avg_pool_divisor(
        out_size, x.shape[-n:], kernel, stride, padding, count_include_pad))
    if jnp.issubdtype(total.dtype, jnp.integer):
        return lax.div(total, jnp.asarray(divisor, total.dtype))  # truncates, as torch does
    return total / divisor.astype(np.float32)


def _avg_pool_rule(n):
    def avg_pool(ctx, x, kernel_size, stride=(), padding=0, ceil_mode=False,
                 count_include_pad=True, divisor_override=None):
        kernel = _per_dim(kernel_size, n)
        return _avg_pool(x, out_size=tuple(ctx.out.shape[-n:]), kernel=kernel,
                         stride=_per_dim(stride, n) if stride else kernel,
                         padding=_per_dim(padding, n), count_include_pad=count_include_pad,
                         divisor_override=divisor_override)
    return avg_pool


lowering(aten.avg_pool2d.default)(_avg_pool_rule(2))
lowering(aten.avg_pool3d.default)(_avg_pool_rule(3))


# ---------------------------------------------------------------------------------------------
# Adaptive pooling


@_jit_with_static_keywords
def _adaptive_avg_pool(x, *, out_size):
    """Window sums divided by each dim's window length in turn (torch's ``sum / kh / kw``)."""
    taps, (valid, _) = _adaptive_windows(x, out_size)
    result = _window_sum(taps, valid)
    n = len(out_size)
    for axis, (size, m) in enumerate(zip(x.shape[-n:], out_size)):
        lengths = -(-(np.arange(1, m + 1) * size) // m) - np.arange(m) * size // m
        result = result / lengths.astype(np.float32).reshape((-1,) + (1,) * (n - 1 - axis))
    return result


@_jit_with_static_keywords
def _adaptive_max_pool(x, *, out_size):
    taps, tables = _adaptive_windows(x, out_size)
    return _first_max(taps, *tables)


@lowering(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool(ctx, x, output_size):
    return _adaptive_avg_pool(x, out_size=tuple(output_size))


@lowering(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def adaptive_max_pool(ctx, x, output_size):
    return _adaptive_max_pool(x, out_size=tuple(output_size))
