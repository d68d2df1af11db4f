"""Run-time checks for the integer operations ``integer_ranges`` picks: an int64 result beyond
int32 (which wraps on the device), a float converted to int64 beyond int32, an integer division
by zero and an index outside its dimension (which torch refuses), each made while the program
runs (``runtime_checks``).

An int64 result is checked against the same operation in float32: where the int32 result is
right it lies within a few hundred of the float one, where it wrapped it lies at least 2**32
from torch's and so at least 2**31 from the float one (for any result below 2**55; above, the
float result itself is beyond int32). A matrix product or a scatter sums many terms, whose
rounding in float32 is bounded by the same sum of their magnitudes: it is checked with that
bound added, so that a result too close to tell also raises.
"""

import math

import jax.numpy as jnp
import torch

from ipu_backend.compiler.dtypes import INT32_MAX, INT32_MIN
from ipu_backend.compiler import index_bounds
from ipu_backend.compiler.integer_ranges import CONVERSION, DIVISION, INDEX, OVERFLOW
from ipu_backend.compiler.op_arguments import argument
from ipu_backend.compiler.lowerings import views
from ipu_backend.compiler.runtime_checks import report
from ipu_backend.errors import Error

aten = torch.ops.aten


def _float(value):
    return float(value) if isinstance(value, (bool, int, float)) else jnp.asarray(value, jnp.float32)


def _alpha(kwargs):
    return float(kwargs.get("alpha", 1))


def _axes(value, dims):
    return None if dims is None or len(dims) == 0 else tuple(d % max(jnp.ndim(value), 1) for d in dims)


_IN_FLOAT32 = {
    aten.add.Tensor: lambda a, b, **k: _float(a) + _alpha(k) * _float(b),
    aten.add.Scalar: lambda a, b, **k: _float(a) + _alpha(k) * _float(b),
    aten.sub.Tensor: lambda a, b, **k: _float(a) - _alpha(k) * _float(b),
    aten.sub.Scalar: lambda a, b, **k: _float(a) - _alpha(k) * _float(b),
    aten.rsub.Tensor: lambda a, b, **k: _float(b) - _alpha(k) * _float(a),
    aten.rsub.Scalar: lambda a, b, **k: _float(b) - _alpha(k) * _float(a),
    aten.mul.Tensor: lambda a, b: _float(a) * _float(b),
    aten.mul.Scalar: lambda a, b: _float(a) * _float(b),
    aten.neg.default: lambda a: -_float(a),
    aten.abs.default: lambda a: jnp.abs(_float(a)),
    aten.sum.default: lambda a, dtype=None: jnp.sum(_float(a)),
    aten.sum.dim_IntList: lambda a, dims, keepdim=False, dtype=None: jnp.sum(
        _float(a), axis=_axes(a, dims), keepdims=keepdim),
    aten.cumsum.default: lambda a, dim, dtype=None: jnp.cumsum(_float(a), axis=dim % max(jnp.ndim(a), 1)),
    aten.prod.default: lambda a, dtype=None: jnp.prod(_float(a)),
    aten.prod.dim_int: lambda a, dim, keepdim=False, dtype=None: jnp.prod(
        _float(a), axis=dim % max(jnp.ndim(a), 1), keepdims=keepdim),
    aten.cumprod.default: lambda a, dim, dtype=None: jnp.cumprod(_float(a), axis=dim % max(jnp.ndim(a), 1)),
    aten.__lshift__.Scalar: lambda a, b: _float(a) * 2.0 ** _float(b),
    aten.__lshift__.Tensor: lambda a, b: _float(a) * 2.0 ** _float(b),
    aten.bitwise_left_shift.Tensor: lambda a, b: _float(a) * 2.0 ** _float(b),
    aten.pow.Tensor_Scalar: lambda a, b: _float(a) ** _float(b),
    aten.pow.Tensor_Tensor: lambda a, b: _float(a) ** _float(b),
    aten.pow.Scalar: lambda a, b: _float(a) ** _float(b),
}
"""Each operation of ``integer_ranges.ARITHMETIC``, computed in float32."""


def _product(x, y):
    return x @ y


def _added_product(product):
    def added(bias, x, y, beta=1, alpha=1):
        return beta * bias + alpha * product(x, y)
    return added


def _scatter(x, dim, index, src, reduce="add"):
    return _scatter_reduce(x, dim, index, src, "prod" if reduce == "multiply" else "sum")


def _scatter_reduce(x, dim, index, src, reduce, include_self=True, dtype=jnp.float32):
    return views.scatter_reduced(x, views.scatter_updates(src, index, dtype),
                                 views.scatter_positions(index, dim),
                                 "sum" if reduce == "mean" else reduce, include_self)


def _index_put(x, indices, values, accumulate=False):
    return views.put_values(x, indices, values, accumulate, location=str)


def _index_count(x, indices, *rest) -> int:
    return math.prod(jnp.broadcast_shapes(*(i.shape for i in indices if i is not None)))


_ADDED = (0, 1, 2, 3, 4)
"""An added product's values: bias, factors, beta and alpha."""
_SUMS_IN_FLOAT32 = {
    aten.mm.default: (_product, (0, 1), lambda x, y: x.shape[-1]),
    aten.bmm.default: (_product, (0, 1), lambda x, y: x.shape[-1]),
    aten.addmm.default: (_added_product(_product), _ADDED, lambda bias, x, *rest: x.shape[-1] + 1),
    aten.addmv.default: (_added_product(_product), _ADDED, lambda bias, x, *rest: x.shape[-1] + 1),
    aten.addbmm.default: (_added_product(lambda x, y: jnp.einsum("bij,bjk->ik", x, y)), _ADDED,
                          lambda bias, x, *rest: x.shape[0] * x.shape[-1] + 1),
    aten.scatter_add.default: (_scatter, (0, 3), lambda x, dim, index, *rest: index.size + 1),
    aten.scatter.reduce: (_scatter, (0, 3), lambda x, dim, index, *rest: index.size + 1),
    aten.scatter.value_reduce: (_scatter, (0, 3), lambda x, dim, index, *rest: index.size + 1),
    aten.scatter_reduce.two: (_scatter_reduce, (0, 3), lambda x, dim, index, *rest: index.size + 1),
    aten.index_put.default: (_index_put, (0, 2), lambda *args: _index_count(*args) + 1),
}
"""Each operation of ``integer_ranges.SUMS``: computed in float32, which of its arguments are
the values it sums (the rest are indices and settings), and at most how many terms it adds
into one element."""


def _sum_error(node, args, kwargs, result):
    """How far a summing operation's int32 value lies from its float32 estimate, plus the bound
    on that estimate's rounding. A mean scatter floor-divides a sum: its sum is what is checked."""
    compute, operands, count_terms = _SUMS_IN_FLOAT32[node.target]
    floats, magnitudes = list(args), list(args)
    for position in operands[:len(args)]:
        floats[position] = _float(args[position])
        magnitudes[position] = abs(floats[position])
    estimate = compute(*floats, **kwargs)
    absolute = {key: abs(value) if key in ("beta", "alpha") else value for key, value in kwargs.items()}
    bound = count_terms(*args) * 2.0 ** -23 * compute(*magnitudes, **absolute)
    if node.target is aten.scatter_reduce.two and argument(args, kwargs, 4, "reduce", None) == "mean":
        result = _scatter_reduce(*args, **kwargs, dtype=args[0].dtype)
    return jnp.abs(jnp.asarray(result, jnp.float32) - estimate) + bound


def check(kind: str, node: torch.fx.Node, location: str, args, kwargs, result) -> None:
    """Add to the program being traced the check ``kind`` of ``node``'s ``result``."""
    where = f"{node.target} at {location}"
    if kind == OVERFLOW:
        if node.target in _SUMS_IN_FLOAT32:
            error = _sum_error(node, args, kwargs, result)
        else:
            error = jnp.abs(jnp.asarray(result, jnp.float32) - _IN_FLOAT32[node.target](*args, **kwargs))
        report(jnp.any(~(error < 2.0 ** 31)),
               f"int64 overflow: {where} computed a value outside {_RANGE}: it wrapped, where torch's "
               "would not. Keep integer arithmetic within that range (reduce values, e.g. with a modulo, "
               "before they grow), or compute in floating point")
    elif kind == CONVERSION:
        truncated = jnp.trunc(jnp.asarray(args[0], jnp.float32))
        report(jnp.any(~((truncated >= INT32_MIN) & (truncated < 2.0 ** 31))),
               f"int64 conversion: {where} converted a float outside {_RANGE} (or a NaN) to int64: the "
               "value was lost, where torch keeps it. Clamp it first (torch.clamp) or keep it a float")
    elif kind == DIVISION:
        dividend, divisor = jnp.asarray(args[0]), jnp.asarray(args[1])
        report(jnp.any(divisor == 0),
               f"integer division by zero: {where} divided by 0, which torch refuses (RuntimeError: "
               "ZeroDivisionError) and the device answers with 0. Keep integer divisors nonzero, e.g. "
               "torch.where(d == 0, 1, d)")
        if node.meta["val"].dtype == torch.int64:
            report(jnp.any((dividend == INT32_MIN) & (divisor == -1)),
                   f"int64 overflow: {where} divided {INT32_MIN} by -1, a quotient outside {_RANGE}")
    elif kind == INDEX:
        checked = node.meta.get(index_bounds.HOST_CHECKED, ())
        for number, use in enumerate(index_bounds.index_uses(node, args)):
            if number in checked:
                continue
            index = jnp.asarray(use.index)
            report(jnp.any((index < use.low) | (index >= use.size)),
                   f"index out of range: {where} took an index computed on the device outside "
                   f"[{use.low}, {use.size - 1}], for dimension {use.dim} of size {use.size}, which torch "
                   "refuses (IndexError); the device read or wrote another element instead")
    else:
        raise Error(f"unknown integer check {kind!r}")


_RANGE = f"[{INT32_MIN}, {INT32_MAX}], the int32 range in which the device carries int64"
